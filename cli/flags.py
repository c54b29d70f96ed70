"""Command-line flags from a frozen config dataclass, so that each setting is written once: in the
dataclass, with its type, its default and its comment.

``add_config_flags(parser, "package.module:Config")`` adds one flag per field: ``--local-top-k`` for
``local_top_k``, its type and default from the field, its help from the field's comment (the
project's convention: one comment per field, trailing it or in the lines just above it). A ``bool``
field that defaults to False is a ``--flag``, one that defaults to True a ``--flag/--no-flag`` pair;
a ``tuple[X, ...]`` field takes a comma-separated list; fields of other types (nested configs) are
left out. ``overrides`` keeps a command's own spelling: ``{"num_workers": {"flag": "--workers"}}``,
and any other ``add_argument`` keyword (``choices``, ``metavar``, ``default``, ``action``, ...).

The class is read from its module's source without importing the module, so that ``needle <cmd>
--help`` imports no stage (and no torch); a class object is read with ``inspect.getsource``.
``config_from_args(Config, args)`` builds the config from the parsed flags: a flag left at a default
that could not be read from the source (one computed or imported there), or at None for a field
that cannot be None, leaves the field at the dataclass's own default.

``needle serve``'s flags, and the re-ranking and file flags it shares with ``needle query`` and
``needle eval map``, are not made here: cli/spec_flags.py declares them in a table, their help in
the fields (core.settings), so that a TOML file can set them too.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib.util
import inspect
import io
import operator
import re
import textwrap
import tokenize
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
_SCALARS: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}
_METAVARS = {int: "N,N,...", float: "X,X,...", str: "S,S,..."}
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.LShift: operator.lshift,
}  # arithmetic in defaults, e.g. 16 << 20


class _Unset:
    """The default of a flag whose field default is not a literal: the dataclass's own applies."""

    def __repr__(self) -> str:
        return "the config's default"


UNSET: Any = _Unset()


@dataclasses.dataclass(frozen=True)
class FieldFlag:
    """One config field as a flag."""

    name: str
    kind: str  # "bool", "scalar" or "tuple"
    type: type  # the value's type (a tuple's element type)
    length: int | None  # a fixed-length tuple's length; None: any
    optional: bool  # the field may be None
    default: Any  # UNSET where the source's default is not a literal (or there is none)
    required: bool  # the field has no default
    help: str  # the field's comment


# --- reading the class ---------------------------------------------------------------------------
def field_flags(config: type | str) -> list[FieldFlag]:
    """The flag-able fields of ``config`` (a dataclass, or ``"module:Class"`` read from source), in order."""
    if isinstance(config, str):
        module, _, name = config.partition(":")
        spec = importlib.util.find_spec(module)  # imports the parent package only
        if spec is None or spec.origin is None:
            raise ValueError(f"no module {module} (config {config})")
        return _parse(Path(spec.origin).read_text(encoding="utf-8"), name)
    source_file = inspect.getsourcefile(config)
    module_text = Path(source_file).read_text(encoding="utf-8") if source_file else ""
    return _parse_class(inspect.getsource(config), module_text)


@functools.lru_cache(maxsize=64)
def _parse(module_text: str, name: str) -> list[FieldFlag]:
    lines = module_text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if re.match(rf"class {name}\b", line)), None)
    if start is None:
        raise ValueError(f"no top-level class {name} in the module")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip() and not lines[i][0].isspace()), len(lines))
    return _parse_class("".join(lines[start:end]), module_text)


def _parse_class(class_source: str, module_text: str) -> list[FieldFlag]:
    class_source = textwrap.dedent(class_source)
    body = ast.parse(class_source).body[0].body
    comments = _comments(class_source)
    statements = [(node.lineno, node.end_lineno, isinstance(node, ast.AnnAssign)) for node in body]
    flags = []
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        parsed = _annotation(node.annotation)
        if parsed is None:
            continue
        kind, value_type, length, optional = parsed
        default = _default(node.value, module_text) if node.value is not None else UNSET
        help_text = _help(i, statements, comments)
        flags.append(
            FieldFlag(node.target.id, kind, value_type, length, optional, default, node.value is None, help_text)
        )
    return flags


def _comments(source: str) -> dict[int, tuple[str, bool]]:
    """line -> (comment text, whether the line holds only the comment)."""
    found = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            alone = not tok.line[: tok.start[1]].strip()
            found[tok.start[0]] = (tok.string.lstrip("#").strip(), alone)
    return found


def _help(i: int, statements: list[tuple[int, int, bool]], comments: dict[int, tuple[str, bool]]) -> str:
    """The comment of field ``i``: its trailing comment, with the comment-only lines that follow it
    when the next statement is a field with a trailing comment of its own (a continuation); without
    a trailing comment, the comment-only lines just above it."""

    def trailing(k: int) -> list[str]:
        first, last, is_field = statements[k]
        return [comments[n][0] for n in range(first, last + 1) if is_field and n in comments and not comments[n][1]]

    def alone_between(a: int, b: int) -> list[str]:
        return [comments[n][0] for n in range(a + 1, b) if n in comments and comments[n][1]]

    own = trailing(i)
    if own:
        if i + 1 < len(statements) and trailing(i + 1):
            own += alone_between(statements[i][1], statements[i + 1][0])
        return " ".join(own)
    previous_end = statements[i - 1][1] if i else 0
    return " ".join(alone_between(previous_end, statements[i][0]))


def _annotation(node: ast.expr) -> tuple[str, type, int | None, bool] | None:
    """(kind, value type, tuple length, optional) of a field's annotation; None: not a flag."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
        node = ast.parse(node.value, mode="eval").body
    members, optional = [], False
    pending = [node]
    while pending:
        part = pending.pop()
        if isinstance(part, ast.BinOp) and isinstance(part.op, ast.BitOr):
            pending += [part.right, part.left]
        elif isinstance(part, ast.Constant) and part.value is None:
            optional = True
        elif isinstance(part, ast.Subscript) and isinstance(part.value, ast.Name) and part.value.id == "Optional":
            optional = True
            pending.append(part.slice)
        else:
            members.append(part)
    if len(members) != 1:
        return None
    (node,) = members
    if isinstance(node, ast.Name) and node.id in _SCALARS:
        return ("bool" if node.id == "bool" else "scalar"), _SCALARS[node.id], None, optional
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "tuple":
        elements = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if len(elements) == 2 and isinstance(elements[1], ast.Constant) and elements[1].value is Ellipsis:
            elements, length = elements[:1], None
        else:
            length = len(elements)
        names = {e.id if isinstance(e, ast.Name) else None for e in elements}
        if len(names) == 1 and names <= {"int", "float", "str"}:  # one element type
            return "tuple", _SCALARS[names.pop()], length, optional
    return None


def _default(node: ast.expr, module_text: str) -> Any:
    """The field's default where the source states it: a literal, arithmetic on literals, or a
    module-level constant of the same module assigned such a value; UNSET otherwise."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "field":
        given = {k.arg: k.value for k in node.keywords}
        return _default(given["default"], module_text) if "default" in given else UNSET
    try:
        return _constant(node, module_text)
    except ValueError:
        return UNSET


def _module_constant(name: str, module_text: str) -> ast.expr:
    """The value expression of the module-level assignment to ``name`` (the first, over its lines)."""
    match = re.search(rf"^{name}\s*(:[^=\n]+)?=", module_text, re.MULTILINE)
    if match is None:
        raise ValueError(name)
    lines = module_text[match.start() :].splitlines(keepends=True)
    for end in range(1, min(len(lines), 50) + 1):
        try:
            statement = ast.parse("".join(lines[:end])).body[0]
        except SyntaxError:
            continue
        if isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None:
            return statement.value
        break
    raise ValueError(name)


def _constant(node: ast.expr, module_text: str) -> Any:
    if isinstance(node, ast.Name):
        return _constant(_module_constant(node.id, module_text), module_text)
    if isinstance(node, ast.Tuple):
        return tuple(_constant(e, module_text) for e in node.elts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_constant(node.operand, module_text)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _constant(node.left, module_text), _constant(node.right, module_text)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (left, right)):
            return _OPERATORS[type(node.op)](left, right)
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        raise ValueError(ast.dump(node)) from None


def source_constant(reference: str) -> Any:
    """The literal value of a module-level constant, ``"package.module:NAME"``, read from the
    module's source without importing it (for ``choices`` kept beside the code that checks them)."""
    module, _, name = reference.partition(":")
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"no module {module} (constant {reference})")
    text = Path(spec.origin).read_text(encoding="utf-8")
    return _constant(_module_constant(name, text), text)


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


def _key(config: type | str) -> str:
    name = config if isinstance(config, str) else f"{config.__module__}:{config.__qualname__}"
    return f"_config_flags[{name}]"


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    config: type | str,
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
        raise ValueError(f"{config}: no flag-able fields {unknown}")
    mapping = dict(parser.get_default(_key(config)) or {})  # field -> (dest, whether None means "not given")
    for name in names:
        if name in skip:
            continue
        f = flags[name]
        extra = dict(overrides.get(name, {}))
        option = extra.pop("flag", "--" + name.replace("_", "-"))
        dest = option.lstrip("-").replace("-", "_")
        kwargs: dict[str, Any] = {"dest": dest, "default": f.default, "help": f.help.replace("%", "%%") or None}
        if f.required:
            kwargs["required"] = True
        if f.kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction if f.default is True else "store_true"
        elif f.kind == "tuple":
            kwargs["type"] = comma_list(f.type, f.length)
            kwargs["metavar"] = _METAVARS[f.type]
        else:
            kwargs["type"] = f.type
        kwargs.update(extra)
        parser.add_argument(option, **kwargs)
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
        if name in given or value is UNSET or (value is None and none_is_unset):
            continue
        kwargs[name] = tuple(value) if isinstance(value, list) else value
    return config(**kwargs, **given)
