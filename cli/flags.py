"""Command-line flags from a frozen config dataclass, so that each setting is written once: in the
dataclass, with its type, its default and its help (``core.settings.setting(default, help)``).

``add_config_flags(parser, Config)`` adds one flag per field: ``--local-top-k`` for
``local_top_k``, its type from the field's resolved annotation, its default from the field, its
help from the field's metadata. A ``bool`` field that defaults to False is a ``--flag``, one that
defaults to True a ``--flag/--no-flag`` pair; a ``tuple[X, ...]`` field takes a comma-separated
list; fields of other types (nested configs) are left out. ``overrides`` keeps a command's own
spelling: ``{"num_workers": {"flag": "--workers"}}``, and any other ``add_argument`` keyword
(``choices``, ``metavar``, ``default``, ``action``, ...).

The configs live in torch-free modules (``ingest.config``, ``index.build.config``, ...), so that
``needle <cmd> --help`` imports no stage (and no torch). ``config_from_args(Config, args)``
builds the config from the parsed flags: a flag left at None for a field that cannot be None
leaves the field at the dataclass's own default.

``needle serve``'s flags, and the re-ranking and file flags it shares with ``needle query`` and
``needle eval map``, are not made here: cli/spec_flags.py declares them in a table, their help in
the fields too (core.settings), so that a TOML file can set them as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")
_SCALARS = (int, float, str)
_METAVARS = {int: "N,N,...", float: "X,X,...", str: "S,S,..."}


@dataclasses.dataclass(frozen=True)
class FieldFlag:
    """One config field as a flag."""

    name: str
    kind: str  # "bool", "scalar" or "tuple"
    type: type  # the value's type (a tuple's element type)
    length: int | None  # a fixed-length tuple's length; None: any
    optional: bool  # the field may be None
    default: Any  # the field's default (a default_factory's value)
    required: bool  # the field has no default
    help: str  # the field's declared help ("" where it declares none)


# --- reading the class ---------------------------------------------------------------------------
def field_flags(config: type) -> list[FieldFlag]:
    """The flag-able fields of the dataclass ``config``, in order."""
    hints = _field_types(config)
    flags = []
    for f in dataclasses.fields(config):
        parsed = _kind(hints[f.name])
        if parsed is None:
            continue
        kind, value_type, length, optional = parsed
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        help_text = str(f.metadata.get("help", ""))
        flags.append(FieldFlag(f.name, kind, value_type, length, optional, default, required, help_text))
    return flags


def _field_types(config: type) -> dict[str, Any]:
    """Each field's type, resolved as ``typing.get_type_hints`` does; None for a field whose
    annotation names a type its module imports only for type checking (a nested stage config,
    kept out of the torch-free config module: never a flag)."""
    try:
        return typing.get_type_hints(config)
    except NameError:
        pass
    resolved: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        alone = type(config.__name__, (), {"__annotations__": {f.name: f.type}, "__module__": config.__module__})
        try:
            resolved[f.name] = typing.get_type_hints(alone)[f.name]
        except NameError:
            resolved[f.name] = None
    return resolved


def _kind(hint: Any) -> tuple[str, type, int | None, bool] | None:
    """(kind, value type, tuple length, optional) of a field's resolved type; None: not a flag."""
    members: tuple[Any, ...] = (hint,)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = typing.get_args(hint)
    optional = type(None) in members
    members = tuple(m for m in members if m is not type(None))
    if len(members) != 1:
        return None
    (member,) = members
    if member is bool:
        return "bool", bool, None, optional
    if member in _SCALARS:
        return "scalar", member, None, optional
    if typing.get_origin(member) is tuple:
        elements = typing.get_args(member)
        length: int | None = len(elements)
        if len(elements) == 2 and elements[1] is Ellipsis:
            elements, length = elements[:1], None
        if len(set(elements)) == 1 and elements[0] in _SCALARS:  # one element type
            return "tuple", elements[0], length, optional
    return None


# --- flags ---------------------------------------------------------------------------------------
def comma_list(value_type: type, length: int | None = None) -> Callable[[str], tuple[Any, ...]]:
    """An argparse ``type``: ``"a, b,c"`` as a tuple of ``value_type`` (empty items dropped)."""

    def parse(text: str) -> tuple[Any, ...]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        try:
            values = tuple(value_type(item) for item in items)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {value_type.__name__} values, got {text!r}"
            ) from None
        if not values or (length is not None and len(values) != length):
            count = f"{length}" if length is not None else "one or more"
            raise argparse.ArgumentTypeError(f"expected {count} comma-separated values, got {text!r}")
        return values

    parse.__name__ = f"comma-separated {value_type.__name__} list"  # argparse names the type in its errors
    return parse


def _key(config: type) -> str:
    return f"_config_flags[{config.__module__}:{config.__qualname__}]"


def _argument(f: FieldFlag) -> dict[str, Any]:
    """``add_argument`` keywords of ``f``: from its type, default and help."""
    kwargs: dict[str, Any] = {"default": f.default, "help": f.help.replace("%", "%%") or None}
    if f.required:
        kwargs["required"] = True
    if f.kind == "bool":
        kwargs["action"] = argparse.BooleanOptionalAction if f.default is True else "store_true"
    elif f.kind == "tuple":
        kwargs["type"] = comma_list(f.type, f.length)
        kwargs["metavar"] = _METAVARS[f.type]
    else:
        kwargs["type"] = f.type
    return kwargs


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    config: type,
    *,
    only: tuple[str, ...] | None = None,
    skip: tuple[str, ...] = (),
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[str]:
    """Add the flags of ``config``'s fields (``only`` these, less ``skip``) to ``parser`` (or one of
    its argument groups); returns their dests. ``overrides``: per field, ``"flag"`` (the option
    string, whose name becomes the dest) and ``add_argument`` keywords replacing the derived ones."""
    overrides = dict(overrides or {})
    flags = {f.name: f for f in field_flags(config)}
    names = list(only) if only is not None else list(flags)
    unknown = [n for n in [*names, *skip, *overrides] if n not in flags]
    if unknown:
        raise ValueError(f"{config.__qualname__}: no flag-able fields {unknown}")
    mapping = dict(parser.get_default(_key(config)) or {})  # field -> (dest, whether None means "not given")
    for name in names:
        if name in skip:
            continue
        f = flags[name]
        extra = dict(overrides.get(name, {}))
        option = extra.pop("flag", "--" + name.replace("_", "-"))
        dest = option.lstrip("-").replace("-", "_")
        parser.add_argument(option, dest=dest, **{**_argument(f), **extra})
        mapping[name] = (dest, not f.optional)
    parser.set_defaults(**{_key(config): mapping})
    return [dest for dest, _ in mapping.values()]


def config_from_args(config: type[T], args: argparse.Namespace, **given: Any) -> T:
    """``config`` from the flags ``add_config_flags`` added for it, and ``given`` fields (which win)."""
    mapping = vars(args).get(_key(config))
    if mapping is None:
        raise ValueError(f"no flags of {config.__qualname__} were parsed")
    kwargs = {}
    for name, (dest, none_is_unset) in mapping.items():
        value = getattr(args, dest)
        if name in given or (value is None and none_is_unset):
            continue
        kwargs[name] = tuple(value) if isinstance(value, list) else value
    return config(**kwargs, **given)
