"""A segment's delete set: the row ids a generation has deleted from it, and how searches skip them.

A generation (index/generations.py) records, per segment, the rows deleted from it since the
segment was written: a sorted ``.npy`` of int64 row ids, written once and never changed (a later
delete writes a new file for the next generation). A search skips them inside FAISS, through an
``IDSelector`` in the call's ``SearchParameters`` (so a shard still returns k results while k live
rows remain: no over-fetch that a burst of deletes could exhaust); an exact scan drops them before
it ranks. ``needle index compact`` rewrites a segment without them, and its set is empty again.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import numpy as np

from index.errors import IndexFileError


class DeleteSetError(IndexFileError):
    """A delete-set file that is missing, unreadable, or not a sorted set of row ids."""


class DeleteSet:
    """Sorted unique row ids deleted from one segment; ``indexed``: how many had a vector in its
    FAISS index (rows whose image failed were never in it)."""

    def __init__(self, rows: np.ndarray, indexed: int):
        self.rows = np.asarray(rows, np.int64)
        self.indexed = int(indexed)

    @staticmethod
    def empty() -> DeleteSet:
        return DeleteSet(np.zeros(0, np.int64), 0)

    def __len__(self) -> int:
        return len(self.rows)

    def contains(self, I: np.ndarray | np.integer | int) -> np.ndarray:
        """Whether each row id (any shape) is deleted; -1 padding is not."""
        I = np.asarray(I, np.int64)
        if not len(self.rows):
            return np.zeros(I.shape, bool)
        at = np.minimum(np.searchsorted(self.rows, I), len(self.rows) - 1)
        return self.rows[at] == I

    @cached_property
    def selector(self) -> Any:
        """A FAISS selector of the rows not deleted (None: nothing deleted). Made once; the batch
        it negates is kept beside it (FAISS holds bare pointers)."""
        if not len(self.rows):
            return None
        import faiss

        batch = faiss.IDSelectorBatch(self.rows)
        selector: Any = faiss.IDSelectorNot(batch)
        selector.referenced_objects = [batch]
        return selector


def read_delete_set(source: Any, indexed: int, label: str) -> DeleteSet:
    """The delete set in ``source`` (a local ``.npy`` path, or its bytes as a file object), checked
    sorted and unique; ``label`` names it in errors (its file and segment)."""
    try:
        rows = np.load(source, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DeleteSetError(f"cannot read the delete set {label}: {exc}") from exc
    if rows.dtype != np.int64 or rows.ndim != 1 or (len(rows) > 1 and not (np.diff(rows) > 0).all()):
        raise DeleteSetError(f"the delete set {label} is not a sorted set of int64 row ids")
    return DeleteSet(rows, indexed)


def merge_rows(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """The sorted union of two sets of row ids."""
    return np.union1d(np.asarray(old, np.int64), np.asarray(new, np.int64)).astype(np.int64)
