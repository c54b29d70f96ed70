"""Keys of a writer's parent generation: where a key lives (segment, position, row), live rows only.

``needle index add`` checks that none of its new keys is already there; ``needle index delete``
finds the rows of the keys it deletes. Each lookup is a binary search in a segment's key files
(index/keys.py), O(log n) pages per segment: nothing reads a whole key column.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from index.keys import KeyStore
from index.layout import IDS_FILE
from index.live.deletes import DeleteSet
from index.live.writer import ID_FILES, Writer
from index.shard import is_valid_descriptor
from index.shard_files import read_ids


@dataclass(frozen=True)
class KeyRow:
    segment: int  # index into the parent's segments (index.generation.Generation.segments)
    position: int  # the row's position in its segment
    row: int  # its Parquet row id


class ParentKeys:
    def __init__(self, writer: Writer):
        self.entries = writer.parent.segments
        self.stores, self.ids, self.deletes = [], [], []
        for entry in self.entries:
            directory = writer.segment_dir(entry.name, ID_FILES)
            self.stores.append(KeyStore(directory))
            self.ids.append(read_ids(directory / IDS_FILE))
            self.deletes.append(DeleteSet(writer.deleted_rows(entry), 0))

    def find_many(self, keys: list[str]) -> dict[str, KeyRow]:
        """The live row of each of ``keys`` the parent holds (absent and deleted keys left out)."""
        found: dict[str, KeyRow] = {}
        for number, store in enumerate(self.stores):
            for key, positions in store.positions_of(keys).items():
                for position in positions:
                    row = int(self.ids[number]["row"][position].as_py())
                    if key not in found and not self.deletes[number].contains(np.int64(row)):
                        found[key] = KeyRow(number, position, row)
        return found

    def deletes_of(self, writer: Writer, found: list[KeyRow]) -> dict[int, tuple[np.ndarray, int]]:
        """Segment number -> (the rows of ``found`` in it, how many of them have a vector in its
        FAISS index): what a delete set grows by."""
        out: dict[int, tuple[np.ndarray, int]] = {}
        for at in found:
            rows, indexed = out.get(at.segment, (np.zeros(0, np.int64), 0))
            vector = np.asarray(writer.row_vector(self.entries[at.segment].name, at.position), np.float32)
            status = self.ids[at.segment]["status"][at.position].as_py()
            out[at.segment] = (np.append(rows, at.row), indexed + int(is_valid_descriptor(vector, status)))
        return out
