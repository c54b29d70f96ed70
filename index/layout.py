"""The names of an index's files and directories (docs/schema.md), shared by the build steps
(index/build*.py), the loader (index/search.py) and shard staging (shards/staging.py); and the one
check of an index's layout that every reader makes (``check_layout``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from core.quoting import short_repr
from index.errors import IndexFileError, OldIndexLayoutError

INDEX_FILE = "index.faiss"
IDS_FILE = "ids.arrow"
VECTORS_FILE = "vectors.f16.npy"
INFOS_FILE = "index_infos.json"
SHARD_INFOS_FILE = "shard_infos.json"
TRAINED_FILE = "trained.faiss"
LAYOUT_SHARDS = "shard-directories"  # index_infos.json "layout" of indexes built as shard directories
# what a living index adds (index/live/generations.py, index/live/writer.py use the same names;
# tests/index/live/test_build_over_living.py holds them equal): named here for the build's check
LIVING_FILES = ("generations", "CURRENT.json")  # its generations' folder, its pointer
WRITER_LOCK = "writer.lock"  # in the generations' folder: a writer's lock (left by one that found nothing to do)


# Every name an index's records give a file or directory (index_infos.json, a manifest, a
# segment's shard_infos.json) matches one of these: relative, one or two plain components, never
# ``..``, an absolute path or a character a shell or a URL reads otherwise. Names are read from
# storage, so nothing joins one to a path before it passed here (docs/security.md).
SEGMENT_NAME = re.compile(r"shard_\d{3,9}|seg_\d{6,12}_s\d{3,9}_[0-9a-f]{1,64}")  # build / writer segments
DELETE_FILE_NAME = re.compile(r"deletes/(\d{6,12})_(" + SEGMENT_NAME.pattern + r")_[0-9a-f]{1,64}\.npy")
SEGMENT_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # a file inside a segment directory


def shard_name(number: int) -> str:
    return f"shard_{number:03d}"


def check_segment_name(name: str, source: str) -> str:
    """``name`` where it is a segment's directory name (``shard_NNN`` or
    ``seg_<generation>_s<shard>_<token>``), else IndexFileError naming ``source``."""
    if not SEGMENT_NAME.fullmatch(name):
        raise IndexFileError(f"{source}: {short_repr(name)} is not a segment name (shard_NNN or seg_NNNNNN_sNNN_<hex>)")
    return name


def check_delete_file_name(name: str, source: str, segment: str | None = None) -> str:
    """``name`` where it is a delete set's file name (``deletes/<generation>_<segment>_<token>.npy``,
    of ``segment`` where given), else IndexFileError naming ``source``."""
    match = DELETE_FILE_NAME.fullmatch(name)
    if match is None or (segment is not None and match.group(2) != segment):
        of = f" of segment {segment}" if segment is not None else ""
        raise IndexFileError(f"{source}: {short_repr(name)} is not a delete set's file name{of}")
    return name


def check_segment_file_name(name: object, source: str) -> str:
    """``name`` where it is a plain file name inside a segment directory (no ``/``, not ``..``),
    else IndexFileError naming ``source``."""
    if not isinstance(name, str) or not SEGMENT_FILE_NAME.fullmatch(name) or name.startswith(".."):
        raise IndexFileError(f"{source}: {short_repr(name)} is not a file name inside a segment")
    return name


def listed_files(infos: Mapping[str, Any], source: str) -> dict[str, Mapping[str, Any]]:
    """The files a segment's ``shard_infos.json`` (read from ``source``) lists in ``checksums``,
    each a plain file name with its recorded size and SHA-256; IndexFileError naming ``source``
    otherwise (the names are joined to local paths by the loader, the writers and staging)."""
    checksums = infos.get("checksums")
    if not isinstance(checksums, dict) or not checksums:
        raise IndexFileError(f"{source}: field 'checksums' lists no files")
    for name, recorded in checksums.items():
        check_segment_file_name(name, f"{source} field 'checksums'")
        size = recorded.get("bytes") if isinstance(recorded, dict) else None
        digest = recorded.get("sha256") if isinstance(recorded, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or not isinstance(digest, str):
            raise IndexFileError(f"{source}: field 'checksums' records {short_repr(recorded)} for {name}")
    return checksums


def written_for(name: str) -> int:
    """The generation a segment or delete-set name was written for (0: the build's ``shard_NNN``)."""
    match = re.match(r"(?:deletes/)?seg_(\d+)_|deletes/(\d+)_", name)
    if match is None:
        return 0
    return int(match.group(1) or match.group(2))


def check_layout(record: Mapping[str, Any], source: str) -> None:
    """Refuse the ``index_infos.json`` record ``record`` (the file ``source``) of an index built
    before shard directories (OldIndexLayoutError, naming the index and the command that rebuilds
    it from the descriptors it records)."""
    if record.get("layout") == LAYOUT_SHARDS:
        return
    index = source.removesuffix(f"/{INFOS_FILE}")
    recorded = record.get("descriptors")
    names = [recorded] if isinstance(recorded, str) else recorded if isinstance(recorded, list) else []
    known = bool(names) and all(isinstance(name, str) for name in names)
    descriptors = " ".join(names) if known else "<its descriptor directories>"
    raise OldIndexLayoutError(
        f"index {index} was built before shard directories (its {INFOS_FILE} has no "
        f'"layout": "{LAYOUT_SHARDS}"), a layout needle no longer reads: rebuild it with '
        f"`needle index build --descriptors {descriptors} --out {index}`"
    )
