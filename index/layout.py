"""The names of an index's files and directories (docs/schema.md), shared by the build steps
(index/build*.py), the loader (index/search.py) and shard staging (shards/staging.py)."""

from __future__ import annotations

INDEX_FILE = "index.faiss"
IDS_FILE = "ids.arrow"
VECTORS_FILE = "vectors.f16.npy"
INFOS_FILE = "index_infos.json"
SHARD_INFOS_FILE = "shard_infos.json"
TRAINED_FILE = "trained.faiss"
LAYOUT_SHARDS = "shard-directories"  # index_infos.json "layout" of indexes built as shard directories


def shard_name(number: int) -> str:
    return f"shard_{number:03d}"
