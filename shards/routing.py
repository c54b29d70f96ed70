"""Which index shard owns a row id, and a block of row ids grouped by owner: how the coordinator
routes key lookups, vector lookups and re-scoring to the shards that hold the rows.

A row id is ``(Parquet shard id << 32) | offset`` (ingest/descriptors.py) and each Parquet file
lives in exactly one index shard, so the routing holds one entry per Parquet file, never one per
row. Few numpy calls per lookup: on the 2-core box the coordinator's own bookkeeping runs cold
(its caches taken by the shards' processes), where each numpy call cost ~10 us of a ~2 ms key
lookup (``bench/sharded_serving.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ingest.descriptors import ROW_SHARD_SHIFT

DENSE_SLACK = 4  # a lookup table while it has at most this many slots per Parquet file (+ DENSE_MIN)
DENSE_MIN = 4096


class RowRouter:
    """The owners of the Parquet files of an index's ``infos`` (its top-level index_infos.json)."""

    def __init__(self, infos: dict[str, Any]):
        owner = sorted((int(p), s) for s, e in enumerate(infos["shards"]) for p in e.get("parquet_shard_ids", []))
        self.shards = len(infos["shards"])
        self.parquet_ids = np.array([p for p, _ in owner], np.int64)  # sorted
        self.parquet_owner = np.array([s for _, s in owner], np.int64)  # the shard of each
        # Parquet ids are numbered 0, 1, ... by the ingest: then a table indexed by id (its last
        # slot -1, for the padding and ids past the table); sparse ids keep the binary search.
        span = int(self.parquet_ids[-1]) + 1 if len(owner) else 0
        dense = not owner or (int(self.parquet_ids[0]) >= 0 and span <= DENSE_SLACK * len(owner) + DENSE_MIN)
        self.table: np.ndarray | None = None
        if dense:
            self.table = np.full(span + 1, -1, np.int64)
            self.table[self.parquet_ids] = self.parquet_owner

    def shard_of_rows(self, rows: np.ndarray) -> np.ndarray:
        """The index shard of each row id (same shape; -1 for the padding and unknown rows)."""
        rows = np.asarray(rows, np.int64)
        parquet = rows >> ROW_SHARD_SHIFT
        if self.table is not None:  # negative ids read as huge: past the table, its -1 slot
            return self.table[np.minimum(parquet.view(np.uint64), len(self.table) - 1)]
        if not len(self.parquet_ids):
            return np.full(rows.shape, -1, np.int64)
        at = np.minimum(np.searchsorted(self.parquet_ids, parquet), len(self.parquet_ids) - 1)
        known = (rows >= 0) & (self.parquet_ids[at] == parquet)
        return np.where(known, self.parquet_owner[at], -1)

    def grouped(self, owners: np.ndarray) -> tuple[np.ndarray, dict[int, tuple[int, int]]]:
        """``(order, {shard: (lo, hi)})`` of 1-D ``owners`` (-1: asked of none): the places of
        shard s's rows are ``order[lo:hi]``, in their original order; shards owning none are left
        out."""
        order = np.argsort(owners, kind="stable")
        ends = np.cumsum(np.bincount(owners + 1, minlength=self.shards + 1)).tolist()
        return order, {s: (ends[s], ends[s + 1]) for s in range(self.shards) if ends[s + 1] > ends[s]}
