"""Turning a shard specification into a sorted, de-duplicated list of shard URLs.

A specification is one string or a list of strings; each is a local path, a glob
(``data/*.tar``) or a brace pattern (``shards/{000000..000999}.tar``, webdataset's notation).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable
from pathlib import Path

import braceexpand

from core.errors import ShardSpecError
from core.storage import GLOB_CHARS, s3_matches


def expand_shards(spec: str | Iterable[str], s3_endpoint_url: str | None = None) -> list[str]:
    """Expand brace patterns and globs into an ordered list of shard paths.

    Raises ShardSpecError naming the pattern when a pattern matches no file. A brace pattern
    whose expansions are explicit paths is kept as given even when a file is missing: a missing
    shard is reported by the job as a failed shard, never silently skipped.
    """
    patterns = [spec] if isinstance(spec, str) else list(spec)
    if not patterns:
        raise ShardSpecError("no shard pattern given")
    urls: list[str] = []
    for pattern in patterns:
        for expanded in braceexpand.braceexpand(pattern):
            objects = s3_matches(expanded, s3_endpoint_url)
            if objects is not None:
                if not objects:
                    raise ShardSpecError(f"shard pattern {expanded!r} matches no object")
                urls.extend(objects)
            elif GLOB_CHARS.search(expanded):
                matches = sorted(glob.glob(expanded))
                if not matches:
                    raise ShardSpecError(f"shard pattern {expanded!r} matches no file")
                urls.extend(matches)
            elif os.path.isdir(expanded):
                matches = sorted(str(p) for p in Path(expanded).glob("*.tar"))
                if not matches:
                    raise ShardSpecError(f"shard directory {expanded!r} holds no .tar file")
                urls.extend(matches)
            else:
                urls.append(expanded)
    seen: set[str] = set()
    unique = [u for u in urls if not (u in seen or seen.add(u))]
    return unique


def shard_name(url: str) -> str:
    """The shard's name: its file name without ``.tar`` (``/data/000012.tar`` -> ``000012``)."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return name[: -len(".tar")] if name.endswith(".tar") else name


def shard_ids(urls: list[str]) -> dict[str, int]:
    """A stable integer id per shard, used as the high bits of row ids.

    Shards named by a number (``000012.tar``, the img2dataset layout) use that number, so the id
    does not depend on which other shards are in the job; otherwise the position in the sorted list.
    """
    names = [shard_name(u) for u in urls]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise ShardSpecError(f"shards share a name {dupes}: keys '<shard>/<key>' would collide")
    if all(n.isdigit() for n in names):
        return {u: int(n) for u, n in zip(urls, names)}
    return {u: i for i, u in enumerate(sorted(urls))}
