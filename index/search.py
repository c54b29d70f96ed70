"""Loading a built index directory and searching it in this process: ``load_index`` -> ``SearchIndex``.

``search(xq, k) -> (D, I)``: scores (inner product = cosine) and Parquet ``row`` ids, best first,
-1 where fewer than k results exist; each shard's shortlist re-scored exactly and merged as the
coordinator of shards served elsewhere merges them (index/build/merge.py), so both answer alike.

The shards (index/shard.py) are searched one by one in this process; shards/shard_actor.py runs
the same ``Shard`` code for one shard directory where it is served. Rows are addressed by a
*position* (0..N-1, the shards' rows in order): a position (or a row id, through the small table
of Parquet shard ids) is routed to the shard that owns it (index/shard_files.py's views).

``SearchIndex`` answers what the query path asks of any index (query/index_protocol.py ``Index``),
as the coordinator (shards/coordinator.py) does: in one process every shard is here, so a request
never misses one and there are no replicas to report on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from core.errors import NeedleInputError
from core.location import LocalLocation
from core.quoting import short_repr
from core.tokens import LocalTokens
from index.build.merge import checked_queries, inner_products_at, merge_shortlists, shortlist_size, trim_to_shortlist
from index.errors import IndexFileError, UnknownKeyError
from index.generation import GenerationView, Segment
from index.gpu.engine import check_device
from index.images import ImageSource
from index.layout import INFOS_FILE, SHARD_INFOS_FILE
from index.live.deletes import segment_deletes
from index.live.generations import read_view
from index.live.row_map import RowMap, row_map_of
from index.live.segment_merge import MergedSegments, grouped_candidates, merged_groups
from index.locals import LocalStore
from index.shard import Shard, is_valid_descriptor, make_shard, warm_coarse
from index.shard_files import (
    ShardedKeys,
    ShardedVectors,
    ShardFiles,
    ShardLayout,
    open_shard_files,
)


class StoredTokensScorer(Protocol):
    """What scores shortlists against an index's stored local tokens: rerank.rerank.Reranker
    (index/ stands below rerank/, so the re-ranking itself is passed in)."""

    def scores_of_stored(
        self, store: LocalStore, positions: list[np.ndarray], queries: Sequence[LocalTokens]
    ) -> list[Any]: ...

    def glue_of_stored(self, store: LocalStore, positions: np.ndarray, query: LocalTokens) -> np.ndarray: ...


@dataclass(frozen=True)
class WholeRequest:
    """One request's scope in this process: every shard is here, none is ever missing."""

    partial: bool = False
    missing: frozenset[str] = frozenset()


@dataclass
class SearchIndex:
    shards: list[Shard]  # one unless the directory is sharded; empty when the shards live in Ray actors
    ids: Any  # pyarrow Table (row, key, status) of every Parquet row in file order, memory-mapped
    vectors: np.ndarray | ShardedVectors  # (N, d) float16, memory-mapped (over shard directories: each shard's)
    infos: dict[str, Any]  # index_infos.json (a generation's: GenerationView.as_infos), as Index.infos reports it
    path: Path
    keys: ShardedKeys  # the shards' key lookup files
    layout: ShardLayout  # the shard directories (segments) of the generation opened
    view: GenerationView  # the generation opened
    merge_small: bool = True  # search a living index's small segments as one FAISS index (index/live/segment_merge.py)

    @property
    def d(self) -> int:
        return int(self.vectors.shape[1])

    @property
    def ntotal(self) -> int:
        """Vectors a search can return (less those deleted in the generation read)."""
        if not self.shards:  # shards served elsewhere (Ray actors): trust the checked infos
            return int(self.infos.get("live_ntotal", self.infos["ntotal"]))
        return int(sum(s.ntotal for s in self.shards))

    @property
    def generation(self) -> int:
        """The generation this index answers from (0: as built)."""
        return int(self.infos.get("generation", 0))

    @property
    def is_exact(self) -> bool:
        return self.infos.get("kind") == "flat"

    def check_queries(self, xq: np.ndarray, k: int) -> np.ndarray:
        return checked_queries(xq, k, self.d)

    def shortlist_size(self, k: int, refine: bool = True, refine_factor: int | None = None) -> int:
        return shortlist_size(k, self.infos, self.ntotal, refine, refine_factor)

    def search_shards(
        self, xq: np.ndarray, kk: int, nprobe: int | None, refine: bool
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Every part's ``(D_index, I, D_exact)`` members of the ``kk`` best candidates among all
        shards (a part: a segment, or a group of small ones searched as one, index/live/segment_merge.py):
        only those are re-scored (kk rows per query, not kk per shard). cluster/serve.py asks its
        Ray actors instead."""
        found = grouped_candidates(self.shards, self.merged_segments, xq, kk, nprobe)
        # a segment without a candidate adds nothing to the merge: no trimming, no re-scoring of it
        found = [(part, (D, I)) for part, (D, I) in found if I.size and I.max() >= 0] or found[:1]
        parts = trim_to_shortlist([f for _, f in found], kk) if len(found) > 1 else [f for _, f in found]
        return [(D, I, part.exact_scores(xq, D, I, refine)) for (part, _), (D, I) in zip(found, parts)]

    @cached_property
    def merged_segments(self) -> list[MergedSegments]:
        """The small segments searched as one FAISS index per coarse stage (none unless ``merge_small``)."""
        return merged_groups(self.shards) if self.merge_small and len(self.shards) > 2 else []

    def search(
        self, xq: np.ndarray, k: int, nprobe: int | None = None, refine: bool = True, refine_factor: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(nq, d) queries -> (D, I): (nq, k) scores and row ids, best first.

        ``nprobe`` and ``refine_factor`` override the build's defaults for this search.
        """
        xq = self.check_queries(xq, k)
        k = min(k, self.ntotal)  # past the live rows: the rows there are (FAISS pads, the answer does not)
        if k == 0:  # every row deleted: an empty answer, no shard asked
            return np.zeros((len(xq), 0), np.float32), np.zeros((len(xq), 0), np.int64)
        kk = self.shortlist_size(k, refine, refine_factor)
        return merge_shortlists(self.search_shards(xq, kk, nprobe or self.default_nprobe, refine), kk, k)

    @property
    def default_nprobe(self) -> int | None:
        """The generation's served nprobe (the build's, or a retrain's chosen for its recall target:
        index/build/tune.py); None where it records none (each segment's own)."""
        value = self.infos.get("nprobe")
        return int(value) if value is not None else None

    @cached_property
    def row_map(self) -> RowMap:
        return self.layout.row_map

    @cached_property
    def local_store(self) -> LocalStore | None:
        """The rows' binary local tokens by position (None: the index was built without them); over
        shard directories, one store whose segments are the shards' own files, each at its shard's
        first position."""
        return self.layout.local_store(self.path, self.infos)

    def positions_of_rows(self, I: np.ndarray) -> np.ndarray:
        """Row ids -> positions in ids/vectors (-1 stays -1)."""
        return self.row_map.positions(I)

    # --- keys: read from the memory-mapped id table, only the pages a lookup touches ----------
    @cached_property
    def rows(self) -> np.ndarray:
        """(N,) int64 row ids in file order (copied into memory on first use)."""
        return self.ids["row"].to_numpy()

    def position_of(self, key: str) -> int:
        position = self.keys.position_of(key)  # the shards' key files: O(log n) pages each
        if position < 0:
            raise UnknownKeyError(f"key {short_repr(key)} is not in the index at {self.path}")
        return position

    def vector_of(self, key: str) -> np.ndarray:
        position = self.position_of(key)
        vector = np.asarray(self.vectors[position], dtype=np.float32)
        if not is_valid_descriptor(vector, self.ids["status"][position].as_py()):
            raise UnknownKeyError(
                f"key {short_repr(key)} has no valid descriptor in {self.path} (its image failed or was rejected)"
            )
        return vector

    @property
    def has_locals(self) -> bool:
        """Whether the index was built with local tokens (re-ranking needs them)."""
        return bool(self.infos.get("locals"))

    def stored_tokens(self) -> LocalStore:
        """The local store, or NeedleInputError where the index was built without local tokens."""
        store = self.local_store
        if store is None:
            raise NeedleInputError(
                f"index {self.path} has no local tokens: ingest with --locals and rebuild it to re-rank"
            )
        return store

    def tokens_of_key(self, key: str) -> LocalTokens:
        """The stored local tokens of ``key``."""
        return self.stored_tokens().tokens(self.position_of(key))

    def vectors_of_rows(self, I: np.ndarray) -> np.ndarray:
        """The float32 vectors of row ids (nq, k) -> (nq, k, d), zeros for the -1 padding."""
        positions = self.positions_of_rows(np.atleast_2d(I))
        vectors = np.asarray(self.vectors[positions.clip(0)], dtype=np.float32)
        return np.where((positions >= 0)[..., None], vectors, 0.0).astype(np.float32)

    def rescore(self, xq: np.ndarray, I: np.ndarray) -> np.ndarray:
        """Exact inner products (nq, C) of (nq, d) queries with their rows ``I`` (nq, C) against the
        rows' float16 vectors, -inf for the -1 padding (as ``Shard.rescore``): re-ranking's second
        scoring of a shortlist by an expanded query."""
        xq = self.check_queries(xq, 1)
        I = np.atleast_2d(np.asarray(I, np.int64))
        if len(I) != len(xq):
            raise NeedleInputError(f"{len(xq)} queries but rows for {len(I)}")
        return inner_products_at(self.vectors, self.positions_of_rows(I), xq)

    def keys_of(self, I: np.ndarray) -> list[list[str | None]]:
        """Row ids (nq, k) -> keys, None for the -1 padding."""
        I = np.atleast_2d(I)
        positions = self.positions_of_rows(I)
        flat = self.keys.keys_at(positions)
        return [flat[i * I.shape[1] : (i + 1) * I.shape[1]] for i in range(I.shape[0])]

    # --- the rest of query/index_protocol.py's Index: trivial where every shard is here --------
    def score_shortlists(
        self,
        reranker: StoredTokensScorer,
        shortlists: list[np.ndarray],
        s_global: list[np.ndarray],
        tokens: Sequence[LocalTokens],
        k: int,
        evidence: bool = True,
    ) -> list[Any]:
        """``Index.score_shortlists``: the members' tokens gathered from this index's local store
        (every query's evidence made only when asked for: ``k`` and ``evidence`` change nothing here)."""
        positions = [self.positions_of_rows(rows) for rows in shortlists]
        return reranker.scores_of_stored(self.stored_tokens(), positions, tokens)

    def glue_matches(self, reranker: StoredTokensScorer, rows: np.ndarray, query: LocalTokens) -> np.ndarray:
        """``Index.glue_matches``: the second verification of ``rows`` against this index's local store."""
        return reranker.glue_of_stored(self.stored_tokens(), self.positions_of_rows(np.asarray(rows)), query)

    @contextmanager
    def request(self, partial: bool = False) -> Iterator[WholeRequest]:
        """``Index.request``: no shard can be missing here."""
        yield WholeRequest(partial)

    def pinned(self) -> AbstractContextManager[SearchIndex]:
        """``Index.pinned``: this index is one generation, never changed once open."""
        return nullcontext(self)

    def prefetch_keys(self, keys: list[str], with_tokens: bool = False) -> None:
        """``Index.prefetch_keys``: nothing to fetch ahead, every key is looked up here when asked."""

    def health(self, timeout: float | None = None) -> dict[str, Any]:
        """``Index.health``: no replicas to report on (the /health body adds nothing)."""
        return {}

    def warm(self) -> None:
        """Work a first request would otherwise do: compare the segments' coarse stages (which
        of them share one assignment: index/coarse.py) and load the re-scoring."""
        warm_coarse(self.shards)
        self.merged_segments  # noqa: B018 (made now, by the generation's opening, not by a request)
        for shard in self.shards[:1]:  # one loads the re-scoring for all (torch)
            shard.warm()

    def source_files(self) -> list[dict[str, Any]]:
        """The Parquet files every shard (segment) recorded in its infos, with the tar each was
        ingested from where recorded."""
        return [entry for infos in self.layout.shard_infos for entry in infos.get("files", []) or []]

    def thumbnail(self, key: str, px: int, tar_dirs: tuple[str, ...] = ()) -> bytes:
        """``Index.thumbnail``: read from the key's source tar here (``index.images.ImageSource``,
        one per ``tar_dirs``, kept: it holds the tars' member offsets)."""
        return self._image_sources.setdefault(tar_dirs, ImageSource(self, tar_dirs)).thumbnail(key, px)

    @cached_property
    def _image_sources(self) -> dict[tuple[str, ...], ImageSource]:
        return {}


def load_index(
    path: str | Path,
    mmap: bool = True,
    with_shards: bool = True,
    device: str = "auto",
    generation: int | None = None,
    served: SearchIndex | None = None,
) -> SearchIndex:
    """Open an index directory at its newest generation (or ``generation``), checking that its
    files exist and agree (never a wrong answer).

    ``with_shards=False`` skips the FAISS files (a coordinator whose shards live in Ray actors);
    ``device``: where flat shards scan (see ``Shard.device``); ``served``: an earlier generation
    of the same index, open in this process, whose unchanged segments are taken over rather than
    opened again (``reused_segments``). A directory that is no index, or one built before shard
    directories (index.errors.OldIndexLayoutError), is refused by ``read_infos_at``, naming
    ``needle index build`` as the fix.
    """
    check_device(device)
    path = Path(path)
    view = read_view(LocalLocation(path), number=generation)
    return load_shard_directories(path, view, mmap, with_shards, device, reused_segments(served, path, device))


def load_shard_directories(
    path: Path,
    view: GenerationView,
    mmap: bool = True,
    with_shards: bool = True,
    device: str = "auto",
    reused: dict[str, tuple[Segment, Shard]] | None = None,
) -> SearchIndex:
    """An index of shard directories (a generation's segments: index.generation.GenerationView):
    each opened and checked by itself with its delete set, then checked against the generation's
    counts; positions run over the shards in order. ``reused``: segments already open in this
    process (``reused_segments``), taken over where their files are the ones this generation names."""
    entries = view.segments
    if not entries:
        raise IndexFileError(f"index {path}: {INFOS_FILE} lists no shards")
    reused = reused or {}
    opened: list[ShardFiles] = []
    kept: list[Shard | None] = []  # a segment served already whose delete set is the same file: its Shard whole
    for entry in entries:
        directory = path / entry.name
        if not directory.is_dir():
            raise IndexFileError(f"index shard {entry.name} ({directory}): the directory is missing")
        old = reused.get(entry.name)
        if old is not None and with_shards and same_segment_files(old, directory, entry):
            old_entry, shard = old
            opened.append(shard.files)
            # its search params and coarse comparisons kept; a new delete set: a new Shard over its files
            kept.append(shard if old_entry.deleted == entry.deleted else None)
        else:
            opened.append(open_shard_files(directory, entry, with_index=with_shards, mmap=mmap))
            kept.append(None)
    rows = sum(o.rows for o in opened)
    ntotal = sum(int(o.infos["ntotal"]) for o in opened)
    if rows != view.rows or ntotal != view.ntotal:
        raise IndexFileError(
            f"index {path} is inconsistent: its shards hold {rows} rows, {ntotal} vectors; {INFOS_FILE} says "
            f"{view.rows}, {view.ntotal}"
        )
    if any(o.infos.get("dim") != view.infos.fields.get("dim") for o in opened):
        raise IndexFileError(f"index {path}: shards of other dimensions than d={view.infos.fields.get('dim')}")
    bases = np.cumsum([0] + [o.rows for o in opened[:-1]]).astype(np.int64)
    location = LocalLocation(path)
    deletes = [shard.deletes if shard is not None else segment_deletes(location, e) for shard, e in zip(kept, entries)]
    shards = (
        [shard if shard is not None else make_shard(o, device, d) for o, d, shard in zip(opened, deletes, kept)]
        if with_shards
        else []
    )
    ids = pa.concat_tables([o.ids for o in opened])  # zero copy: the shards' mapped tables as chunks
    maps = [row_map_of(o.infos, o.ids) for o in opened]
    layout = ShardLayout([o.directory.name for o in opened], bases, [o.infos for o in opened], maps)
    vectors = ShardedVectors([o.vectors for o in opened], bases)

    def deleted(shard: int, position: int) -> bool:
        return bool(len(deletes[shard])) and bool(deletes[shard].contains(opened[shard].ids["row"][position].as_py()))

    keys = ShardedKeys([o.keys for o in opened], bases, deleted)
    return SearchIndex(shards, ids, vectors, view.as_infos(), path, keys, layout, view)


def reused_segments(served: SearchIndex | None, path: Path, device: str) -> dict[str, tuple[Segment, Shard]]:
    """{segment name: (its entry in ``served``'s generation, its open Shard)} of an index open in
    this process at ``path`` with its shards (nothing otherwise). Segment directories are written
    once under a name never used again (index/live/writer.py), so a later generation that names
    one names the same files: serving it again costs no reading, no mapping and no FAISS load."""
    if served is None or not served.shards or Path(served.path) != path:
        return {}
    entries = served.view.segments
    if len(entries) != len(served.shards):
        return {}
    return {
        e.name: (e, shard)
        for e, shard in zip(entries, served.shards)
        if shard.files.index is not None and shard.device == device
    }


def same_segment_files(old: tuple[Segment, Shard], directory: Path, entry: Segment) -> bool:
    """Whether the open segment ``old`` is the one ``entry`` names: the same counts, and the same
    ``shard_infos.json`` (its files' sizes and SHA-256) on disk now."""
    old_entry, shard = old
    if (old_entry.rows, old_entry.ntotal) != (entry.rows, entry.ntotal):
        return False
    try:
        return json.loads((directory / SHARD_INFOS_FILE).read_text()) == shard.files.infos
    except (OSError, ValueError):
        return False  # opened afresh: open_shard_files names what is wrong
