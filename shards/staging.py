"""Staging a shard directory onto this node's local disk before a shard actor serves it, and
reading an index's top-level infos from an ``s3://`` prefix or a path.

A shard actor never reads its shard where it was built: it copies every file its
``shard_infos.json`` lists from the source (``s3://bucket/prefix/shard_NNN/...`` or a path this
node can read) into a cache directory on its own disk, checks each file's size and SHA-256
against ``shard_infos.json``, and writes ``shard_infos.json`` there last. A cached copy whose files
match their checksums is reused file by file (a restarted actor landing on a node that staged the
shard before fetches nothing). The cache directory (``{node}`` in it becomes the Ray node id) is
``<tmp>/needle-shard-cache`` by default; each source gets its own subdirectory (a hash of its
URL), so two indexes with the same shard names never share files. A lock file serialises the
replicas of one shard staging on the same node. ``copy_local=False`` serves a path source where it
lies instead (one machine, or a filesystem every node sees: no copy, sizes checked on opening).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.atomic import atomic_path, write_json_atomic
from core.hashing import file_sha256
from core.location import Location, location_of
from core.storage import StorageError, canonical_url
from index.errors import IndexFileError
from index.generation import Segment, parse_json_object
from index.layout import INFOS_FILE, SHARD_INFOS_FILE, check_segment_name, listed_files
from index.live.deletes import DeleteSet, segment_deletes

log = logging.getLogger(__name__)

DEFAULT_CACHE = "needle-shard-cache"  # under the node's temporary directory


@dataclass(frozen=True)
class StageConfig:
    cache_dir: str | None = (
        None  # local directory for staged shards ("{node}": this node's id); None: <tmp>/needle-shard-cache
    )
    endpoint_url: str | None = None  # S3-compatible endpoint for s3:// sources (None: AWS)
    copy_local: bool = (
        True  # copy a path source to the cache too; False: open it where it lies (a filesystem every node sees)
    )


def source_location(source: str | Path, endpoint_url: str | None) -> Location:
    """The index location ``source`` (see core.storage.canonical_url) with its S3 endpoint."""
    return location_of(canonical_url(source), endpoint_url)


def read_source_bytes(source: Location, relative: str) -> bytes:
    """The bytes of ``relative`` under an index location, or IndexFileError naming it."""
    try:
        return source.read_required(relative)
    except StorageError as exc:
        raise IndexFileError(str(exc)) from exc


def read_json(source: Location, relative: str) -> dict[str, Any]:
    """The JSON object of ``relative`` under an index location, or IndexFileError naming it."""
    return dict(parse_json_object(read_source_bytes(source, relative), f"{source.url}/{relative}"))


def read_index_infos(
    source: str | Path, endpoint_url: str | None = None, generation: int | None = None
) -> dict[str, Any]:
    """A generation (default: the newest) of an index of shard directories as the top-level infos
    (index.generation.GenerationView.as_infos: all a coordinator reads). Reading it validates it:
    its shards (segments) are listed with their rows, vectors and bytes, and add up to its counts."""
    from index.live.generations import read_view

    # read_view reads index_infos.json first (read_infos_at): no index, or one built before shard
    # directories, is refused there with the command that builds one
    return read_view(source_location(source, endpoint_url), number=generation).as_infos()


def read_delete_set_of(source: str, entry: dict[str, Any], endpoint_url: str | None) -> DeleteSet:
    """The delete set a generation records for shard (segment) ``entry`` (its record in
    ``read_index_infos``; empty where none), read from the index location: a small file, never staged."""
    if not entry.get("deleted"):
        return DeleteSet.empty()
    url = canonical_url(source)
    return segment_deletes(source_location(url, endpoint_url), Segment.from_json(entry, f"{url}/{INFOS_FILE}"))


def cache_root(cache_dir: str | None, node: str) -> Path:
    """This node's cache directory (``{node}`` replaced by the node's id)."""
    if cache_dir is None:
        return Path(tempfile.gettempdir()) / DEFAULT_CACHE
    return Path(cache_dir.replace("{node}", node))


def source_directory(root: Path, source: str) -> Path:
    """The cache subdirectory of one index location."""
    return root / hashlib.sha256(source.encode()).hexdigest()[:16]


@contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (replicas of one shard on one node stage in turn)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch_file(source: Location, relative: str, target: Path) -> None:
    """Copy ``relative`` under an index location to ``target`` (atomically: never half a file)."""
    with atomic_path(target) as tmp:
        source.download(relative, tmp)


def matches(path: Path, recorded: dict[str, Any]) -> bool:
    return (
        path.is_file() and path.stat().st_size == recorded.get("bytes") and file_sha256(path) == recorded.get("sha256")
    )


@dataclass(frozen=True)
class Staged:
    directory: Path  # the staged shard directory on this node
    fetched: int  # files copied from the source
    reused: int  # files already in the cache with matching checksums
    bytes_fetched: int


def stage_shard(
    source: str, name: str, conf: StageConfig, node: str = "local", entry: dict[str, Any] | None = None
) -> Staged:
    """Copy shard directory ``name`` of the index at ``source`` to this node's cache (files whose
    cached copy matches its checksum are kept), verify every file's SHA-256 against the source's
    ``shard_infos.json``, and write that last; ``entry``: the top-level infos' record of the
    shard, which must agree. IndexFileError naming the shard and file on any mismatch."""
    location = source_location(source, conf.endpoint_url)
    source = location.url
    check_segment_name(name, f"index {source}")  # joined to the cache directory below: never a path
    infos = read_json(location, f"{name}/{SHARD_INFOS_FILE}")
    checksums = listed_files(infos, f"index shard {name} of {source}: {SHARD_INFOS_FILE}")
    if entry is not None and (entry.get("rows"), entry.get("ntotal")) != (infos.get("rows"), infos.get("ntotal")):
        raise IndexFileError(
            f"index shard {name} of {source}: {SHARD_INFOS_FILE} says {infos.get('rows')} rows, "
            f"{infos.get('ntotal')} vectors; {INFOS_FILE} says {entry.get('rows')}, {entry.get('ntotal')}"
        )
    if not conf.copy_local and location.local_root is not None:  # served in place: open_shard checks sizes
        return Staged(location.local_root / name, 0, len(checksums), 0)
    directory = source_directory(cache_root(conf.cache_dir, node), source) / name
    fetched = reused = nbytes = 0
    with locked(directory):
        cached = directory / SHARD_INFOS_FILE
        if cached.is_file() and json.loads(cached.read_text()) != infos:
            cached.unlink()  # another build of the index: its files are checked one by one below
        for file, recorded in sorted(checksums.items()):
            target = directory / file
            if matches(target, recorded):
                reused += 1
                continue
            fetch_file(location, f"{name}/{file}", target)
            if not matches(target, recorded):
                target.unlink(missing_ok=True)
                raise IndexFileError(
                    f"index shard {name} of {source}: {file} does not match its size and SHA-256 in {SHARD_INFOS_FILE}"
                )
            fetched += 1
            nbytes += int(recorded["bytes"])
        write_json_atomic(infos, cached)
    log.info(
        "staged %s/%s in %s: %d files fetched (%d bytes), %d reused", source, name, directory, fetched, nbytes, reused
    )
    return Staged(directory, fetched, reused, nbytes)
