"""A living index's small segments searched as one FAISS index.

Every ``needle index add`` leaves each shard a new small segment beside its large one, until
``needle index compact`` merges them. Searched by itself, each segment costs every query its own
FAISS call (the lookup tables of every probed list, a heap of the shortlist's candidates) and its
own sorting, trimming and re-scoring: ~0.3 ms per segment and query at 300k x 512
(bench/segment_cost.py), whatever its size. So when a generation is opened, the small segments of
one coarse stage (index/coarse.py: encoded with one trained quantizer and PQ) are copied into one
in-memory IVF index (FAISS's ``merge_from``: their codes and row ids, no re-encoding), searched in
one call. The members' deleted rows are removed from that copy, so its search skips nothing.

In this process (``SearchIndex``) the group is one part of the search: its candidates are trimmed
and re-scored together (each row's float16 vector read from the member that owns it: a table over
Parquet file ids, a file's rows being in one segment). A shard group serving Ray actors
(shards/shard_group.py) splits them back by member, which answers for its own rows. Keys and
tokens stay per segment.

The answer is the one of each segment searched alone: the merged index holds the same codes under
the same quantizer, so every candidate has the same score, and the group's best ``kk`` by score
(ties to the lower row id, as ``Shard.candidates`` cuts) hold each member's members of the best
``kk`` among all segments (tests/index/live/test_segment_merge.py).

"Small": under ``SMALL_SHARE`` of the largest segment of its coarse stage, as compaction's
``merge_below`` chooses what to rewrite. The large segments are searched by themselves: copying
them at every generation would cost what they hold.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from index.build.merge import inner_products_read, kept_columns, sort_by_score, tie_margin
from index.coarse import CoarseAssignment, CoarseStage, assign, coarse_stage, search_assigned
from index.errors import IndexFileError
from index.layout import INDEX_FILE
from index.live.deletes import DeleteSet, search_live
from index.live.row_map import row_column
from index.shard import Shard, cached_params, coarse_classes, shared_assignments
from index.shard_files import read_faiss
from ingest.descriptors import ROW_SHARD_SHIFT

log = logging.getLogger(__name__)
SMALL_SHARE = 0.25  # a segment under this share of its coarse stage's largest is searched merged


@dataclass
class MergedSegments:
    """Small segments of one coarse stage as one FAISS index: ``candidates`` gives each member's
    part of the group's best ``kk``, as each member's own ``Shard.candidates`` would."""

    members: list[int]  # positions of the merged segments among the index's shards
    shards: list[Shard]  # those segments
    stage: CoarseStage  # the members' pre-transforms, and the merged IVF index (their codes, their row ids)
    owners: np.ndarray  # Parquet file id -> the member holding its rows (-1: none)
    deletes: DeleteSet  # the members' deleted rows together
    holds: Any = None  # the FAISS object owning ``stage`` (an OPQ wrapper frees its IVF index with it)
    _params: dict[tuple[int, bool], Any] = field(default_factory=dict)  # (nprobe, skip deleted) -> made once

    @property
    def ntotal(self) -> int:
        return int(sum(s.ntotal for s in self.shards))

    def params(self, nprobe: int | None, skip_deleted: bool = False) -> Any:
        """The members' search parameters (nprobe, the HNSW depth), with the union of their deletes
        where ``skip_deleted``."""
        first = self.shards[0]
        return cached_params(
            self._params, self.stage.ivf, nprobe or first.nprobe, first.quantizer_ef, self.deletes, skip_deleted
        )

    def candidates(
        self, xq: np.ndarray, kk: int, nprobe: int | None, assigned: CoarseAssignment | None = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each member's ``(D_index, I)``: its candidates among the group's ``kk`` best by index
        score, best first, each as wide as its widest query (-inf/-1 padding)."""
        return self.split(*self.best(xq, kk, nprobe, assigned))

    def best(
        self, xq: np.ndarray, kk: int, nprobe: int | None, assigned: CoarseAssignment | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The group's ``kk`` best candidates by index score, ``(D_index, I)`` as one segment's
        ``Shard.candidates`` (ties to the lower row id, -inf/-1 padding last)."""
        if assigned is None:
            assigned = assign(self.stage, xq, self.params(nprobe))
        wanted = min(kk + tie_margin(kk), max(1, self.ntotal))

        def search(k: int, rows: np.ndarray | None, skip_deleted: bool) -> tuple[np.ndarray, np.ndarray]:
            part = assigned if rows is None else assigned.rows(rows)
            return search_assigned(self.stage, part, k, self.params(nprobe, skip_deleted))

        return sort_by_score(*search_live(search, wanted, int(self.stage.ivf.ntotal), self.deletes), kk)

    def owner_of(self, I: np.ndarray) -> np.ndarray:
        """The member holding each row id of the merged index (-1 for the -1 padding)."""
        files = np.minimum(np.where(I >= 0, I >> ROW_SHARD_SHIFT, 0), len(self.owners) - 1)
        return np.where(I >= 0, self.owners[files], -1)  # every row of the merged index is a member's

    def exact_scores(self, xq: np.ndarray, D: np.ndarray, I: np.ndarray, refine: bool = True) -> np.ndarray:
        """``Shard.exact_scores`` of the group's candidates ``I``: each row's float16 vector read from
        its member, all of a query's re-scored in one product (each row's score as its member's own:
        ``float16_inner_products`` scores every row by itself)."""
        if not refine or self.shards[0].exact:
            return D
        owner = self.owner_of(I)
        read_order = np.where(owner >= 0, I, -1)  # by row id: a Parquet file's rows together
        return inner_products_read(lambda q, cols: self.vectors_of(I[q, cols], owner[q, cols]), read_order, xq)

    def vectors_of(self, rows: np.ndarray, owner: np.ndarray) -> np.ndarray:
        """The float16 vectors of ``rows``, each read from its ``owner`` member."""
        block = np.empty((len(rows), self.shards[0].vectors.shape[1]), np.float16)
        for member in np.unique(owner):
            at = owner == member
            shard = self.shards[member]
            positions = shard.positions_of_rows(rows[at])
            if (positions < 0).any():  # every row of the merged index is its owner's: never a silent wrong vector
                bad = int(rows[at][positions < 0][0])
                raise IndexFileError(f"row {bad} of the merged segments is not in {shard.files.directory}")
            block[at] = shard.vector_rows[positions]
        return block

    def split(self, D: np.ndarray, I: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(D, I)`` of the group as one ``(D, I)`` per member, each row's order kept."""
        owner = self.owner_of(I)
        out = []
        for member in range(len(self.members)):
            mine = owner == member
            if len(I) == 1:  # one query (a server's request): no sort needed
                out.append((D[mine][None, :], I[mine][None, :]))
            else:
                out.append(kept_columns(D, I, mine))
        return out


def merged_groups(shards: list[Shard], small_share: float = SMALL_SHARE) -> list[MergedSegments]:
    """The groups of at least two small segments worth searching as one, per coarse stage (none
    where FAISS cannot merge them or a Parquet file's rows lie in two of them: those segments are
    searched by themselves, as before)."""
    groups = []
    for same in coarse_classes(shards):
        largest = max(int(shards[i].index.ntotal) for i in same)
        small = [i for i in same if shards[i].index.ntotal < small_share * largest]
        if len(small) < 2:
            continue
        try:
            groups.append(merge_segments(small, [shards[i] for i in small]))
        except (RuntimeError, ValueError, IndexFileError) as exc:  # searched one by one: the same answers, slower
            log.warning("segments %s not merged for search: %s", [shards[i].files.directory.name for i in small], exc)
    return groups


def merge_segments(members: list[int], shards: list[Shard]) -> MergedSegments:
    """One in-memory IVF index of ``shards``' codes and row ids: each segment's FAISS file read
    again into memory (theirs stay as served: FAISS's ``merge_from`` empties its source, and
    memory-mapped lists cannot be copied), merged into the first one's."""
    copies = [read_faiss(s.files.directory / INDEX_FILE, mmap=False) for s in shards]
    stages = [coarse_stage(c) for c in copies]
    if any(stage is None for stage in stages):
        raise ValueError("a segment that is not an IVF index")
    merged = stages[0].ivf  # type: ignore[union-attr]
    for stage in stages[1:]:
        merged.merge_from(stage.ivf, 0)  # type: ignore[union-attr]
    stage = CoarseStage(stages[0].chain, merged)  # type: ignore[union-attr]
    return MergedSegments(members, shards, stage, owners_of(shards), without_deleted(merged, shards), copies[0])


def without_deleted(merged: Any, shards: list[Shard]) -> DeleteSet:
    """Remove the members' deleted rows from the merged copy (it is ours), so that its searches
    skip nothing (index/live/deletes.py: the skipping costs every search); the delete set still to skip:
    empty, or the members' own where FAISS cannot remove from this kind of index."""
    import faiss

    deleted = np.sort(np.concatenate([s.deletes.rows for s in shards]))
    if not len(deleted):
        return DeleteSet.empty()
    try:
        merged.remove_ids(faiss.IDSelectorBatch(deleted))
    except RuntimeError as exc:
        log.info("deleted rows kept in merged segments, skipped at search: %s", exc)
        return DeleteSet(deleted, sum(s.deletes.indexed for s in shards))
    return DeleteSet.empty()


def owners_of(shards: list[Shard]) -> np.ndarray:
    """Parquet file id -> which of ``shards`` holds that file's rows (-1: none of them)."""
    files = [np.unique(row_column(s.files.ids) >> ROW_SHARD_SHIFT) for s in shards]
    size = int(max((int(f.max()) + 1 for f in files if len(f)), default=0))
    owners = np.full(size, -1, np.int32)
    for member, ids in enumerate(files):
        if (owners[ids] >= 0).any():
            raise ValueError(f"Parquet files {sorted(set(ids[owners[ids] >= 0].tolist()))[:5]} in two segments")
        owners[ids] = member
    return owners


def grouped_candidates(
    shards: list[Shard], groups: list[MergedSegments], xq: np.ndarray, kk: int, nprobe: int | None
) -> list[tuple[Shard | MergedSegments, tuple[np.ndarray, np.ndarray]]]:
    """The ``(D_index, I)`` candidates of each group (one search) and of each shard in none
    (``Shard.candidates``), with what re-scores them (``exact_scores``): a group is one part, so
    trimming, re-scoring and merging pay once for all its members. The shards of one coarse stage
    assign the queries once."""
    assigned = shared_assignments(shards, xq, nprobe)
    grouped = {member for group in groups for member in group.members}
    parts: list[tuple[Shard | MergedSegments, tuple[np.ndarray, np.ndarray]]] = [
        (group, group.best(xq, kk, nprobe, assigned[group.members[0]])) for group in groups
    ]
    for i, (shard, assignment) in enumerate(zip(shards, assigned)):
        if i not in grouped:
            parts.append((shard, shard.candidates(xq, kk, nprobe, assignment)))
    return parts
