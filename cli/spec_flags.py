"""The flags of ``needle serve``, and the re-ranking and file flags ``needle query`` and ``needle
eval map`` share with it, declared once in tables: each flag's name, the spec setting it sets
(webapi.spec.ServeSpec, by dotted path), its ``--help`` group and any argparse options beyond
those its field gives. The field gives the type, the default and the help (core.settings), so
nothing is read from source text.

Every flag defaults to argparse.SUPPRESS: a flag left out sets nothing, so that a setting of
``--config FILE`` (or the spec's default) stands unless the flag is given."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rerank.config import DEVICES, METHODS
from webapi.spec import TRANSPORTS, ServeSpec, sections

EVERYDAY = "everyday"  # the group listed first, beside --help: no title of its own


@dataclass(frozen=True)
class Flag:
    """One flag and the spec setting it sets."""

    option: str  # the flag, e.g. "--max-k-total"
    path: str  # the setting: "section.field" of ServeSpec ("index" for a top-level one)
    group: str  # the --help group it is listed in (a key of GROUPS)
    extra: Mapping[str, Any] = field(default_factory=dict)  # add_argument keywords beyond the field's own

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")


# --help group titles, in the order they are listed
GROUPS = {
    EVERYDAY: "",
    "listen": "listening: Host names, Ray Serve",
    "shards": "shards in Ray actors (--ray-shards)",
    "reload": "following new generations of the index",
    "files": "files the index was built with, when not at their recorded paths (same SHA-256 required)",
    "page": "web page (/)",
    "request": "limits of one request: what it may ask (docs/serving.md)",
    "connection": "limits of the connections: slow and many clients (docs/serving.md)",
    "rerank": "re-ranking with local tokens (index built from --locals descriptors)",
}

RERANK_FLAGS = (
    Flag("--rerank", "rerank.method", "rerank", {"choices": METHODS}),
    Flag("--shortlist", "rerank.shortlist", "rerank"),
    Flag("--ames", "rerank.ames", "rerank"),
    Flag("--rerank-lambda", "rerank.lam", "rerank"),
    Flag("--rerank-gamma", "rerank.gamma", "rerank"),
    Flag("--rerank-chamfer", "rerank.chamfer_weight", "rerank"),
    Flag("--max-hamming", "rerank.max_hamming", "rerank"),
    Flag("--mutual", "rerank.mutual", "rerank"),
    Flag("--asymmetric", "rerank.asymmetric", "rerank"),
    Flag("--rerank-qe", "rerank.qe_top", "rerank", {"metavar": "TOP"}),
    Flag("--rerank-qe-min-inliers", "rerank.qe_min_inliers", "rerank"),
    Flag("--rerank-qe-alpha", "rerank.qe_alpha", "rerank"),
    Flag("--glue-top", "rerank.glue_top", "rerank", {"metavar": "N"}),
    Flag("--glue-weight", "rerank.glue_weight", "rerank"),
    Flag("--glue-cap", "rerank.glue_cap", "rerank"),
    Flag("--device", "rerank.device", "rerank", {"choices": DEVICES}),
)

FILE_FLAGS = tuple(
    Flag("--" + name.replace("_", "-"), f"files.{name}", "files")
    for name in ("weights", "local_weights", "itq", "detector_weights", "adapter")
)

_LIMITS = tuple(
    Flag("--" + f.name.replace("_", "-"), f"{section}.{f.name}", section)
    for section in ("request", "connection")
    for f in dataclasses.fields(sections()[section])
)

SERVE_FLAGS = (
    Flag("--index", "index", EVERYDAY),
    Flag("--host", "listen.host", EVERYDAY),
    Flag("--port", "listen.port", EVERYDAY),
    Flag("--ray", "listen.ray", "listen"),
    Flag("--replicas", "listen.replicas", "listen"),
    Flag("--address", "listen.address", "listen"),
    Flag("--allow-host", "listen.allow_hosts", "listen", {"metavar": "NAME"}),
    Flag("--ray-shards", "shards.ray", "shards"),
    Flag("--shard-replicas", "shards.replicas", "shards"),
    Flag("--shard-concurrency", "shards.concurrency", "shards"),
    Flag("--shards-per-actor", "shards.per_actor", "shards"),
    Flag("--shard-cpus", "shards.cpus", "shards"),
    Flag("--shard-timeout", "shards.timeout", "shards"),
    Flag("--shard-transport", "shards.transport", "shards", {"choices": TRANSPORTS}),
    Flag("--cache-dir", "shards.cache_dir", "shards"),
    Flag("--s3-endpoint-url", "shards.s3_endpoint_url", "shards"),
    Flag("--stage-local", "shards.stage_local", "shards"),
    Flag("--reload-interval", "reload.interval", "reload"),
    *FILE_FLAGS,
    Flag("--report", "page.report", "page"),
    Flag("--scaling-plot", "page.scaling_plot", "page"),
    Flag("--shard-dir", "page.shard_dirs", "page"),
    Flag("--max-upload-mb", "page.max_upload_mb", "page"),
    *_LIMITS,
    *RERANK_FLAGS,
)
EVERYDAY_IN_SERVE = ("--rerank",)  # re-ranking on or off: listed with the everyday flags of `needle serve`


# --- building the parser -------------------------------------------------------------------------
def setting_field(path: str) -> tuple[dataclasses.Field, Any]:
    """The dataclass field of the setting at ``path`` and its type."""
    section, _, name = path.rpartition(".")
    config = sections()[section] if section else ServeSpec
    fields = {f.name: f for f in dataclasses.fields(config)}
    return fields[name], typing.get_type_hints(config)[name]


def _argument(flag: Flag) -> dict[str, Any]:
    """``add_argument`` keywords of ``flag``: from its field's type, default and help, then ``extra``."""
    setting, hint = setting_field(flag.path)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType)  # X | None
    kind = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
    kwargs: dict[str, Any] = {"dest": flag.dest, "default": argparse.SUPPRESS}
    kwargs["help"] = str(setting.metadata.get("help", "")).replace("%", "%%") or None
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if setting.default is True else "store_true"
    elif typing.get_origin(kind) is tuple:
        kwargs.update(action="append", type=str)  # the flag given again for each value
    else:
        kwargs["type"] = kind
    return {**kwargs, **flag.extra}


def add_flags(
    parser: argparse.ArgumentParser, flags: Sequence[Flag], everyday: tuple[str, ...] = ()
) -> dict[str, argparse._ArgumentGroup]:
    """``flags`` on ``parser``: the EVERYDAY ones (and those named in ``everyday``) among its main
    options, the others in their groups, in GROUPS' order; returns the groups made."""
    groups: dict[str, Any] = {}
    for name, title in GROUPS.items():
        members = [f for f in flags if (EVERYDAY if f.option in everyday else f.group) == name]
        for flag in members:
            if name != EVERYDAY and name not in groups:
                groups[name] = parser.add_argument_group(title)
            target = parser if name == EVERYDAY else groups[name]
            target.add_argument(flag.option, **_argument(flag))
    return groups


def given_settings(args: argparse.Namespace, flags: Sequence[Flag]) -> dict[str, Any]:
    """The settings the flags given on the command line set, by path (lists as tuples)."""
    given = {}
    for flag in flags:
        if hasattr(args, flag.dest):
            value = getattr(args, flag.dest)
            given[flag.path] = tuple(value) if isinstance(value, list) else value
    return given


def _section(args: argparse.Namespace, flags: Sequence[Flag], section: str) -> Any:
    values = {path.partition(".")[2]: value for path, value in given_settings(args, flags).items()}
    return sections()[section](**values)


def rerank_options(args: argparse.Namespace) -> Any:
    """The re-ranking flags as rerank.options.RerankOptions."""
    return _section(args, RERANK_FLAGS, "rerank")


def query_files(args: argparse.Namespace) -> Any:
    """The file flags as query.recorded.QueryFiles."""
    return _section(args, FILE_FLAGS, "files")


def serve_spec(args: argparse.Namespace) -> ServeSpec:
    """``needle serve``'s spec: ``--config``'s file (or the defaults) with the flags given on top."""
    from webapi.spec_toml import read_spec, with_settings

    base = read_spec(args.config) if getattr(args, "config", None) else ServeSpec()
    return with_settings(base, given_settings(args, SERVE_FLAGS))


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """``needle serve``'s flags: the everyday ones first (index, host, port, re-ranking on or off,
    the settings file), then each concern's group."""
    first = [f for f in SERVE_FLAGS if f.group == EVERYDAY or f.option in EVERYDAY_IN_SERVE]
    add_flags(parser, first, EVERYDAY_IN_SERVE)
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file of settings (docs/serving.md: serve.toml); the flags given override it",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective settings (--config's, then the flags') as TOML, usable as --config, and exit",
    )
    add_flags(parser, [f for f in SERVE_FLAGS if f not in first])
