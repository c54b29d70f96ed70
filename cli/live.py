"""``needle index add``, ``delete`` and ``compact``: changing an index as generations
(docs/live_index.md). Each prints what changed as JSON (the new generation's ``change``: its
``"generation"`` is null where nothing changed). ``--wait-for URL`` returns only once the server
at URL answers ``/health`` with that generation or a newer one: then the change is visible there
(under ``needle serve --ray`` that generation is the one every Serve replica serves: webapi/health.py).
``info`` and ``keys`` read what it holds now (index/live/inspect.py)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from cli.flags import add_config_flags, config_from_args
from core.errors import NeedleInputError
from core.quoting import short_repr
from index.live.config import AddConfig, CompactConfig, DeleteConfig, InspectConfig

log = logging.getLogger("needle")


class WaitTimeout(NeedleInputError):
    """The server given to ``--wait-for`` did not serve the new generation in time."""


class OtherIndexError(NeedleInputError):
    """The server given to ``--wait-for`` serves another index than the one changed."""


def served_state(url: str, timeout: float = 5.0) -> dict[str, Any] | None:
    """The ``/health`` answer of ``url`` (its ``generation`` and ``index_id``), or None where it
    cannot be asked."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as answer:
            body = json.loads(answer.read())
    except (OSError, ValueError, urllib.error.URLError):
        return None
    return body if isinstance(body, dict) and isinstance(body.get("generation"), int) else None


def wait_for(url: str, generation: int, timeout: float, index_id: str | None, poll: float = 0.1) -> float:
    """Seconds until the server at ``url`` serves ``generation`` (or a newer one) of the index
    whose ``index_id`` is given; OtherIndexError at once where it serves another index, WaitTimeout
    after ``timeout``. An index built before index ids (None) is known by its generation only."""
    start = time.monotonic()
    seen = None
    while time.monotonic() - start < timeout:
        state = served_state(url)
        if state is not None:
            if index_id is not None and state.get("index_id") != index_id:
                raise OtherIndexError(
                    f"--wait-for {url}: it serves index {short_repr(state.get('index_id'))}, not this one "
                    f"({index_id}, in --index's index_infos.json): give the URL of a server of this index"
                )
            seen = state["generation"]
            if seen >= generation:
                return time.monotonic() - start
        time.sleep(poll)
    raise WaitTimeout(
        f"--wait-for {url}: it serves generation {seen} after {timeout:g} s, not {generation} "
        "(is it serving this index, with --reload-interval?)"
    )


def index_id_of(args: argparse.Namespace) -> str | None:
    """The ``index_id`` of ``--index`` (None: built before index ids; logged: its server is then
    known by the generation it reports only)."""
    from core.location import location_of
    from index.live.generations import read_infos_at

    index_id = read_infos_at(location_of(args.index, getattr(args, "s3_endpoint_url", None))).fields.get("index_id")
    if index_id is None:
        log.warning("%s was built before index ids: --wait-for cannot check which index %s serves", args.index,
                    args.wait_for)  # fmt: skip
    return index_id


def report(change: dict[str, Any], args: argparse.Namespace) -> int:
    """Print ``change`` as JSON after waiting for ``--wait-for`` where a generation was published."""
    if args.wait_for and change.get("generation") is not None:
        waited = wait_for(args.wait_for, int(change["generation"]), args.wait_timeout, index_id_of(args))
        change["visible_after_s"] = round(waited, 3)
    json.dump(change, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


def _add(args: argparse.Namespace) -> int:
    from index.live.add_rows import main

    conf = config_from_args(AddConfig, args)
    run_parts = None
    if args.ray:
        from cluster.connect import connect_ray
        from cluster.index_job import ray_part_runner

        connect_ray(args.address)
        run_parts = ray_part_runner()
    change = (
        main(conf, args.descriptors, args.index, run_parts) if run_parts else main(conf, args.descriptors, args.index)
    )
    return report(change, args)


def _delete(args: argparse.Namespace) -> int:
    from index.live.delete_rows import main, read_keys

    return report(main(config_from_args(DeleteConfig, args), read_keys(args.keys), args.index), args)


def _compact(args: argparse.Namespace) -> int:
    from index.live.compact import main

    run_shards = None
    if args.ray:
        from cluster.connect import connect_ray
        from cluster.index_job import ray_shard_reencoder

        connect_ray(args.address)
        run_shards = ray_shard_reencoder()
    return report(main(config_from_args(CompactConfig, args), args.index, run_shards), args)


def _info(args: argparse.Namespace) -> int:
    from core.location import location_of
    from index.live.inspect import index_info

    conf = config_from_args(InspectConfig, args)
    json.dump(index_info(location_of(args.index, conf.s3_endpoint_url)), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


def _keys(args: argparse.Namespace) -> int:
    from core.location import location_of
    from index.live.inspect import live_keys

    conf = config_from_args(InspectConfig, args)
    try:
        for key in live_keys(location_of(args.index, conf.s3_endpoint_url)):
            sys.stdout.write(key + "\n")  # one at a time: a 100M-key index is never held whole
        sys.stdout.flush()
    except BrokenPipeError:  # `needle index keys ... | head`: the reader has what it wanted
        sys.stdout = None  # type: ignore[assignment]  # no flush of the closed pipe at exit
    return 0


def add_wait_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--index", required=True, help="the index directory or s3:// prefix to change")
    p.add_argument("--wait-for", metavar="URL", help="return once the server at URL serves the new generation")
    p.add_argument("--wait-timeout", type=float, default=60.0, help="seconds --wait-for waits before failing")


def add_live_parsers(isub: argparse._SubParsersAction) -> None:
    """``index add``, ``index delete``, ``index compact``."""
    p = isub.add_parser("add", help="add the rows of descriptor Parquet files the index does not hold yet")
    add_wait_flags(p)
    p.add_argument("--descriptors", required=True, nargs="+", help="directories, files or s3:// prefixes of Parquet")
    add_config_flags(p, AddConfig)
    p.add_argument("--ray", action="store_true", help="encode the new segments as Ray tasks")
    p.add_argument("--address", help="Ray cluster for --ray (default: $RAY_ADDRESS, else a local instance)")
    p.set_defaults(func=_add)

    p = isub.add_parser("delete", help="delete keys (one per line) from the index")
    add_wait_flags(p)
    p.add_argument("--keys", required=True, help="file of keys, one per line; - reads standard input")
    add_config_flags(p, DeleteConfig)
    p.set_defaults(func=_delete)

    p = isub.add_parser("compact", help="rewrite segments without deleted rows, merge small ones, drop old generations")
    add_wait_flags(p)
    add_config_flags(p, CompactConfig)
    p.add_argument("--ray", action="store_true", help="a retrain re-encodes its shards as Ray tasks (on this node)")
    p.add_argument("--address", help="Ray cluster for --ray (default: $RAY_ADDRESS, else a local instance)")
    p.set_defaults(func=_compact)

    p = isub.add_parser("info", help="the index's state as JSON: generation, rows, segments per shard, drift, bytes")
    p.add_argument("--index", required=True, help="the index directory or s3:// prefix")
    add_config_flags(p, InspectConfig)
    p.set_defaults(func=_info)

    p = isub.add_parser("keys", help="the keys of the index's live rows, one per line")
    p.add_argument("--index", required=True, help="the index directory or s3:// prefix")
    add_config_flags(p, InspectConfig)
    p.set_defaults(func=_keys)
