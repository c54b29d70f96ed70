"""A setting: a dataclass field that carries its own help text, so that a flag, a settings file
and the docs take the words from one place (cli/spec_flags.py builds ``needle serve``'s flags
from them; webapi/spec_toml.py writes them as comments of ``--print-config``)."""

from __future__ import annotations

import dataclasses
from typing import Any


def setting(default: Any, help: str) -> Any:
    """A frozen dataclass field of ``default`` (an immutable value) described by ``help``."""
    return dataclasses.field(default=default, metadata={"help": help})


def help_of(config: type, name: str) -> str:
    """The help text of ``config``'s field ``name`` ("" where it declares none)."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    if name not in fields:
        raise KeyError(f"{config.__qualname__} has no field {name!r}")
    return str(fields[name].metadata.get("help", ""))
