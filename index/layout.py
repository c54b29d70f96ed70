"""The names of an index's files and directories (docs/schema.md), shared by the build steps
(index/build*.py), the loader (index/search.py) and shard staging (shards/staging.py); and the one
check of an index's layout that every reader makes (``check_layout``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from index.errors import OldIndexLayoutError

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


def shard_name(number: int) -> str:
    return f"shard_{number:03d}"


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
