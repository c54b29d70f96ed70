"""``needle serve``'s spec (webapi.spec.ServeSpec) as a TOML file: read with the standard
library's ``tomllib`` (``--config serve.toml``), written by ``--print-config``, so that what one
prints another reads back to an equal spec.

A file holds ``index`` at the top and one table per section (``[listen]``, ``[request]``, ...);
every key is optional (left out: the default). A key the spec does not know, or a value of the
wrong type, is a core.errors.SettingsFileError naming the file and the key
(``serve.toml: request.max_k_total: expected an integer``), never ignored. TOML has no null: a
setting that is None is left out of the file (``--print-config`` writes it as a comment)."""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from core.errors import SettingsFileError
from webapi.spec import ServeSpec, sections

_NONE = type(None)


# --- reading -------------------------------------------------------------------------------------
def read_spec(path: str | Path) -> ServeSpec:
    """The spec in the TOML file at ``path`` (defaults for what it leaves out)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsFileError(str(path), "", f"cannot read it ({exc.strerror or exc})") from None
    return spec_from_toml(text, str(path))


def spec_from_toml(text: str, source: str = "serve.toml") -> ServeSpec:
    """The spec of TOML ``text`` (``source``: the file's name, for errors)."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsFileError(source, "", f"not TOML: {exc}") from None
    tables = sections()
    top, parts = {}, {}
    for key, value in document.items():
        if key in tables:
            if not isinstance(value, dict):
                raise SettingsFileError(source, key, f"expected a table ([{key}])")
            parts[key] = tables[key](**_values(tables[key], value, source, key + "."))
        else:
            top[key] = value
    return ServeSpec(**_values(ServeSpec, top, source, "", tuple(tables)), **parts)


def _values(
    config: type, table: dict[str, Any], source: str, prefix: str, tables: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``table``'s values for ``config``'s scalar fields, each checked against the field's type
    (``tables``: the section names also allowed where ``table`` is the file's top level)."""
    hints = typing.get_type_hints(config)
    known = [f.name for f in dataclasses.fields(config) if not dataclasses.is_dataclass(hints[f.name])]
    values = {}
    for key, value in table.items():
        if key not in known:
            names = ", ".join([*known, *(f"[{t}]" for t in tables)])
            raise SettingsFileError(source, prefix + key, f"unknown key (known: {names})")
        values[key] = _checked(hints[key], value, source, prefix + key)
    return values


def _checked(hint: Any, value: Any, source: str, key: str) -> Any:
    """``value`` as the field type ``hint`` takes it, or a SettingsFileError naming ``key``."""
    members = [m for m in typing.get_args(hint) if m is not _NONE] if _is_union(hint) else [hint]
    (kind,) = members  # the spec's fields are one type each, maybe optional
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, str):
        return value
    if typing.get_origin(kind) is tuple and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise SettingsFileError(source, key, f"expected {_NAMES.get(kind, 'a list of strings')}, got {value!r}")


_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


# --- writing -------------------------------------------------------------------------------------
def spec_to_toml(spec: ServeSpec) -> str:
    """``spec`` as TOML that ``spec_from_toml`` reads back to an equal spec: every setting with its
    help as a comment; one that is None written as a comment (TOML has no null)."""
    lines = ["# needle serve --config FILE: flags given on the command line override these", ""]
    lines += _table_lines(spec)
    for name in sections():
        lines += ["", f"[{name}]", *_table_lines(getattr(spec, name))]
    return "\n".join(lines) + "\n"


def _table_lines(config: Any) -> list[str]:
    lines = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            continue
        help_text = str(f.metadata.get("help", ""))
        lines += textwrap.wrap(help_text, 98, initial_indent="# ", subsequent_indent="# ")
        lines.append(f"# {f.name} = (unset)" if value is None else f"{f.name} = {toml_value(value)}")
    return lines


def toml_value(value: Any) -> str:
    """One TOML value: a boolean, integer, float, string or list of strings."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON's string escapes are TOML's basic string's
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML value for {value!r}")


# --- overriding ----------------------------------------------------------------------------------
def with_settings(spec: ServeSpec, given: dict[str, Any]) -> ServeSpec:
    """``spec`` with the settings ``given`` by dotted path (``{"listen.port": 9000, "index": "i"}``)."""
    by_section: dict[str, dict[str, Any]] = {}
    for path, value in given.items():
        section, _, name = path.rpartition(".")
        by_section.setdefault(section, {})[name] = value
    top = by_section.pop("", {})
    parts = {name: dataclasses.replace(getattr(spec, name), **values) for name, values in by_section.items()}
    return dataclasses.replace(spec, **top, **parts)
