"""A segment's delete set: the row ids a generation has deleted from it, and how searches skip them.

A generation (index/live/generations.py) records, per segment, the rows deleted from it since the
segment was written: a sorted ``.npy`` of int64 row ids, written once and never changed (a later
delete writes a new file for the next generation). A search skips them inside FAISS, through an
``IDSelector`` in the call's ``SearchParameters`` (so a shard still returns k results while k live
rows remain); an exact scan drops them before it ranks. ``needle index compact`` rewrites a
segment without them, and its set is empty again.

The selector is not free: FAISS asks it about every code a fast-scan search keeps, and with 90k
deleted rows of 1M it made the scan of a 250k-row segment ~2x slower (bench/generation_cost.py). So a
search asks FAISS for a few more candidates than it wants, without the selector, and drops the
deleted ones itself (``search_live``); a query for which too few live ones remain (deletes
gathered around it) is searched again with the selector. The answer is the selector's either way.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from index.errors import IndexFileError
from index.generation import Segment

if TYPE_CHECKING:
    from core.location import Location

# Past this share of a segment's rows deleted, searches use the selector at once: an over-fetch
# would have to ask for many times what it wants.
OVERFETCH_MAX_SHARE = 0.5
OVERFETCH_MARGIN = 1.25  # asked: wanted / (1 - share deleted) times this, plus OVERFETCH_EXTRA
OVERFETCH_EXTRA = 32


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

    def share_of(self, stored: int) -> float:
        """The share of a segment's ``stored`` FAISS codes that are deleted."""
        return self.indexed / max(1, stored)

    def past_overfetch(self, stored: int) -> bool:
        """Whether so much of a segment of ``stored`` codes is deleted that an over-fetch would ask
        for many times what it wants (OVERFETCH_MAX_SHARE, read when called)."""
        return self.share_of(stored) > OVERFETCH_MAX_SHARE

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


# search(k, rows, skip_deleted): (D, I) of the queries ``rows`` (None: all), k per query
Search = Callable[[int, "np.ndarray | None", bool], tuple[np.ndarray, np.ndarray]]


def search_live(search: Search, wanted: int, stored: int, deletes: DeleteSet) -> tuple[np.ndarray, np.ndarray]:
    """The ``wanted`` best live candidates per query of a segment holding ``stored`` codes, as
    ``search(wanted, None, True)`` (FAISS's selector) finds them: ``(D, I)`` in FAISS's order,
    deleted rows as -inf/-1 padding (``sort_by_score`` puts it last); a row may hold more than
    ``wanted`` live ones.

    Asks ``search`` for more than ``wanted`` without the selector and drops the deleted rows. A
    query keeps that answer where at least ``wanted`` live rows remain (the best live ones: every
    row above them was asked for) or FAISS found fewer than it was asked (its probed lists ran out:
    it returned every row they hold); the others are searched again with the selector."""
    if not len(deletes):
        return search(wanted, None, False)
    if deletes.past_overfetch(stored):
        return search(wanted, None, True)
    share = deletes.share_of(stored)
    asked = min(max(1, stored), int(np.ceil(wanted / (1.0 - share) * OVERFETCH_MARGIN)) + OVERFETCH_EXTRA)
    D, I = search(asked, None, False)
    ran_out = I[:, -1] < 0  # FAISS found fewer than asked: every row of the probed lists is here
    live = (I >= 0) & ~deletes.contains(I)
    D, I = np.where(live, D, -np.inf).astype(np.float32), np.where(live, I, -1)  # deleted: padding
    again = np.flatnonzero((live.sum(1) < wanted) & ~ran_out)
    if len(again):
        D[again], I[again] = -np.inf, -1
        D[again, :wanted], I[again, :wanted] = search(wanted, again, True)
    return D, I


def segment_deletes(location: Location, segment: Segment) -> DeleteSet:
    """The delete set a generation records for ``segment`` (empty where it records none), read
    from the index location (a small file: read whole, never staged). Every reader of a
    segment's delete set comes here: the loader, a Ray shard actor, a writer."""
    if segment.deleted is None:
        return DeleteSet.empty()
    label = f"{location.url}/{segment.deleted.file} (segment {segment.name})"
    data = location.read_bytes(segment.deleted.file)
    if data is None:
        raise DeleteSetError(f"cannot read the delete set {label}: it is missing")
    deletes = read_delete_set(io.BytesIO(data), segment.deleted.indexed, label)
    if len(deletes) != segment.deleted.rows:
        recorded = segment.deleted.rows
        raise DeleteSetError(f"the delete set {label} holds {len(deletes)} rows, its manifest says {recorded}")
    return deletes


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
