"""Row ids -> positions: where a Parquet row lives in a shard's (or segment's) files.

A row id is ``(Parquet shard id << 32) | offset in its Parquet file`` (ingest/descriptors.py). How
a segment lays out its rows decides how a row id finds its position:

- ``DenseRows``: every row of each of its Parquet files, in file order (what ``needle index build``
  and ``needle index add`` write): position = the file's first position + the row's offset.
- ``SortedRows``: only some rows of its files, ascending by row id (what ``needle index compact``
  writes, without the deleted rows): position = a binary search in the segment's row column
  (memory-mapped; O(log n) pages per lookup, nothing loaded whole).
- ``RoutedRows``: the rows of several segments viewed as one run of positions (one process's view
  of a whole generation): a row's Parquet shard id names its segment (each Parquet file lives in
  exactly one segment), whose own map places it after the segment's first position.

Every map answers -1 for -1 (FAISS's padding).
Searches are clamped with ``np.minimum``, not ``clip`` (searchsorted is never negative, and ``clip``
costs ~10 us a call in numpy's Python layer: a key lookup makes one per shard).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from ingest.descriptors import ROW_SHARD_SHIFT

ROW_OFFSET_MASK = (1 << ROW_SHARD_SHIFT) - 1


class RowMap(Protocol):
    def positions(self, I: np.ndarray) -> np.ndarray:
        """Row ids (any shape) -> positions (same shape); -1 stays -1."""
        ...


class DenseRows:
    """Each Parquet file's rows whole and in order, from its first position (``shard_offsets``)."""

    def __init__(self, shard_offsets: Mapping[str, int]):
        items = sorted((int(s), int(o)) for s, o in shard_offsets.items())
        self.first = np.array([o for _, o in items], np.int64)
        self.shard_ids = np.array([s for s, _ in items], np.int64)

    def positions(self, I: np.ndarray) -> np.ndarray:
        I = np.asarray(I, np.int64)
        if not len(self.shard_ids):
            return np.full(I.shape, -1, np.int64)
        index = np.minimum(np.searchsorted(self.shard_ids, I >> ROW_SHARD_SHIFT), len(self.shard_ids) - 1)
        return np.where(I >= 0, self.first[index] + (I & ROW_OFFSET_MASK), -1)


class SortedRows:
    """Rows held in ascending row id order (some rows of a file may be absent): a binary search."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows  # (n,) int64 ascending, the segment's ``row`` column (memory-mapped)

    def positions(self, I: np.ndarray) -> np.ndarray:
        I = np.asarray(I, np.int64)
        n = len(self.rows)
        if not n:
            return np.full(I.shape, -1, np.int64)
        at = np.minimum(np.searchsorted(self.rows, I), n - 1)
        found = (I >= 0) & (np.asarray(self.rows[at]) == I)
        return np.where(found, at, -1)


class RoutedRows:
    """Several segments' maps as one run of positions: segment ``s`` starts at ``bases[s]``."""

    def __init__(self, maps: list[RowMap], bases: np.ndarray, parquet_ids: list[list[int]]):
        self.maps = maps
        self.bases = np.asarray(bases, np.int64)
        pairs = sorted((int(pid), s) for s, ids in enumerate(parquet_ids) for pid in ids)
        self.route_ids = np.array([p for p, _ in pairs], np.int64)  # Parquet shard ids, sorted
        self.route_segments = np.array([s for _, s in pairs], np.int64)  # the segment holding each

    def positions(self, I: np.ndarray) -> np.ndarray:
        I = np.asarray(I, np.int64)
        out = np.full(I.shape, -1, np.int64)
        if not len(self.route_ids):
            return out
        at = np.minimum(np.searchsorted(self.route_ids, I >> ROW_SHARD_SHIFT), len(self.route_ids) - 1)
        known = (I >= 0) & (self.route_ids[at] == (I >> ROW_SHARD_SHIFT))
        segment = np.where(known, self.route_segments[at], -1)
        for s in np.unique(segment[segment >= 0]):
            take = segment == s
            local = self.maps[int(s)].positions(I[take])
            out[take] = np.where(local >= 0, local + self.bases[s], -1)
        return out


def row_map_of(infos: dict[str, Any], ids: Any = None) -> RowMap:
    """The map of a shard directory (or segment) from its ``shard_infos.json``: sorted rows where it
    records ``"row_order": "sorted"`` (its ``ids`` table's ``row`` column), else dense files."""
    if infos.get("row_order") == "sorted":
        if ids is None:
            raise ValueError("a segment of sorted rows needs its id table to place rows")
        return SortedRows(row_column(ids))
    return DenseRows(infos["shard_offsets"])


def row_column(ids: Any) -> np.ndarray:
    """An id table's ``row`` column as one int64 array: zero copy where the table is one chunk."""
    column = ids["row"]
    if column.num_chunks == 1:
        return column.chunk(0).to_numpy(zero_copy_only=False)
    return column.to_numpy()
