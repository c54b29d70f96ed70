"""Keys of a writer's parent generation: where a key lives (segment, position, row), live rows only.

``needle index add`` checks that none of its new keys is already there; ``needle index delete``
finds the rows of the keys it deletes. Both take keys by the hundred thousand (a takedown list,
a day's tars), so every step is vectorised: per segment one Arrow hash lookup of the asked keys
over its key files (or, for a few keys against a large segment, a binary search each: O(log n)
pages), its row ids, delete set and descriptors read as arrays, the vectors of the found rows in
one gather (S3: a few ranged reads). A key per Python step made a delete of 800k keys take 108 s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from index.keys import KeyStore
from index.layout import IDS_FILE
from index.live.deletes import DeleteSet
from index.live.writer import ID_FILES, Writer
from index.shard_files import read_ids
from ingest.descriptors import valid_descriptors

# A segment is searched key by key (a binary search each, ~0.15 ms) while keys x this < its rows;
# past that one Arrow pass over its key bytes (~0.1 us a row) is cheaper.
BINARY_SEARCH_RATIO = 1000


@dataclass(frozen=True)
class Found:
    """The live rows of the asked keys the parent holds, one per key, by ascending key number."""

    key: np.ndarray  # (m,) int64: the key's index in the list asked
    segment: np.ndarray  # (m,) int64: its segment's index in the parent's segments
    position: np.ndarray  # (m,) int64: the row's position in that segment
    row: np.ndarray  # (m,) int64: its Parquet row id

    def __len__(self) -> int:
        return len(self.key)

    def missing(self, asked: int) -> np.ndarray:
        """The indices of the asked keys not found (ascending)."""
        absent = np.ones(asked, bool)
        absent[self.key] = False
        return np.flatnonzero(absent)


class ParentKeys:
    def __init__(self, writer: Writer):
        self.entries = writer.parent.segments
        self.stores, self.rows, self.statuses, self.deletes = [], [], [], []
        for entry in self.entries:
            directory = writer.segment_dir(entry.name, ID_FILES)
            ids = read_ids(directory / IDS_FILE)
            self.stores.append(KeyStore(directory))
            self.rows.append(ids["row"].to_numpy().astype(np.int64, copy=False))
            self.statuses.append(ids["status"])
            self.deletes.append(DeleteSet(writer.deleted_rows(entry), 0))

    def find_many(self, keys: list[str]) -> Found:
        """The live row of each of ``keys`` the parent holds (absent and deleted keys left out);
        where a key has several live rows, the first segment's, then the lowest position's."""
        asked = pa.array(keys, pa.large_string())
        parts = []
        for number, store in enumerate(self.stores):
            key, position = lookup(store, keys, asked)
            row = self.rows[number][position]
            live = ~self.deletes[number].contains(row)
            parts.append((key[live], np.full(int(live.sum()), number, np.int64), position[live], row[live]))
        empty = [np.zeros(0, np.int64)]
        key, segment, position, row = (np.concatenate([p[i] for p in parts] or empty) for i in range(4))
        # the first (segment, position) of each key: np.unique's return_index is the first occurrence
        key, first = np.unique(key, return_index=True)
        return Found(key.astype(np.int64), segment[first], position[first], row[first])

    def deletes_of(self, writer: Writer, found: Found) -> dict[int, tuple[np.ndarray, int]]:
        """Segment number -> (the rows of ``found`` in it, sorted, how many of them have a vector
        in its FAISS index: ingest.descriptors.valid_descriptors): what a delete set grows by."""
        out: dict[int, tuple[np.ndarray, int]] = {}
        for number in np.unique(found.segment).tolist():
            mine = found.segment == number
            positions = found.position[mine]
            vectors = writer.vectors_at(self.entries[number].name, positions)
            statuses = self.statuses[number].take(pa.array(positions)).to_numpy(zero_copy_only=False)
            indexed = int(valid_descriptors(vectors, statuses).sum())
            out[number] = (np.sort(found.row[mine]), indexed)
        return out


def lookup(store: KeyStore, keys: list[str], asked: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(key index, position) of every position of ``store`` holding one of ``keys`` (``asked``:
    the same keys as an Arrow array), by ascending position (a binary search finds a key's first
    position only)."""
    if len(keys) * BINARY_SEARCH_RATIO < len(store):
        found = [(i, store.position_of(key)) for i, key in enumerate(keys)]
        pairs = np.array([pair for pair in found if pair[1] >= 0] or np.zeros((0, 2)), np.int64).reshape(-1, 2)
        pairs = pairs[np.argsort(pairs[:, 1], kind="stable")]
        return pairs[:, 0], pairs[:, 1]
    column = pa.LargeStringArray.from_buffers(
        len(store), pa.py_buffer(np.ascontiguousarray(store.offsets)), pa.py_buffer(store.data)
    )
    at = pc.index_in(column, value_set=asked)  # per position: its key's index in ``asked``, or null
    hits = np.flatnonzero(at.is_valid().to_numpy(zero_copy_only=False))
    return at.take(pa.array(hits)).to_numpy().astype(np.int64), hits.astype(np.int64)
