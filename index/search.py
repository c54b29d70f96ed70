"""Loading a built index directory and searching it.

``search(xq, k) -> (D, I)``: scores (inner product = cosine) and Parquet ``row`` ids, best first,
-1 where fewer than k results exist. IVF-PQ results are re-scored exactly: each index file
(``Shard``) takes its ``refine_factor * k`` best candidates by PQ score (ties to the lower row
id) and scores them against the memory-mapped float16 vectors of its rows; the coordinator keeps
the ``refine_factor * k`` best of all shards' candidates by PQ score (the shortlist a single index
would take: each shard's list holds its members of it) and returns the top k of their exact
scores. So a sharded index answers exactly like a single index over the same data, while the
re-scoring runs in the shards, in parallel, next to their vectors.

An index is one self-contained directory per shard (``shard_000/`` ...: its FAISS index, ids,
float16 vectors, key files and local tokens, at shard-local positions, and ``shard_infos.json``),
listed by the top-level ``index_infos.json``; directories built before that layout (files at the
top, ``shard_*.faiss``) still load. The shards are searched one by one in this process;
cluster/serve.py runs the same ``Shard.search`` in one Ray actor per shard, each opening its
shard directory by itself (``open_shard``). Rows are addressed by a *position* (0..N-1, the
shards' rows in order): a position (or a row id, through the small table of Parquet shard ids)
is routed to the shard that owns it; nothing concatenates the shards' keys, vectors or tokens.

A flat (exact) shard is searched by its FAISS index on the CPU, unless a GPU backend is present
(faiss-gpu, or torch with CUDA: index/gpu.py) and the search is large enough to pay for copying
the vectors to the GPU: at least ``GPU_EXACT_MIN_QUERIES`` queries over at least
``GPU_EXACT_MIN_VECTORS`` vectors. Then it scans its rows of the memory-mapped float16 vectors in
chunks with ``index.gpu.exact_search`` (the ILIAS baseline). ``device`` ("auto" | "cpu" | "cuda")
overrides the choice; "cuda" scans on the GPU at any size.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc

from core.errors import NeedleInputError
from index.build import (
    DEFAULT_QUANTIZER_EF,
    IDS_FILE,
    INDEX_FILE,
    INFOS_FILE,
    LAYOUT_SHARDS,
    SHARD_INFOS_FILE,
    VECTORS_FILE,
    hnsw_quantizer,
)
from index.gpu import check_device, chunks_at, exact_search, gpu_backend_available
from index.keys import KeyFileError, KeyStore, has_key_files
from index.locals import LocalStore, LocalStoreError, open_local_store
from ingest.descriptors import ROW_SHARD_SHIFT, STATUS_OK

log = logging.getLogger(__name__)

# A flat shard scans on the GPU from this many vectors and queries on ("auto"). Below them the
# CPU's FAISS scan is cheap (the auto plan is flat only below 100k vectors), and a batch of few
# queries is bound on both sides by reading the vectors once (RAM for the CPU, the host-to-GPU
# copy of the float16 vectors for the GPU), so the GPU's arithmetic does not pay for the copy.
GPU_EXACT_MIN_VECTORS = 100_000
GPU_EXACT_MIN_QUERIES = 64


class IndexFileError(NeedleInputError):
    """An index directory that is missing a file, or whose files disagree with each other."""


class UnknownKeyError(NeedleInputError):
    """A key that is not in the index."""


def read_faiss(path: Path, mmap: bool = True) -> Any:
    import faiss

    if not path.is_file():
        raise IndexFileError(f"index file {path} does not exist")
    try:
        # Memory-mapped inverted lists where FAISS supports it: shards load instantly and share pages.
        return faiss.read_index(str(path), faiss.IO_FLAG_MMAP if mmap else 0)
    except RuntimeError:
        try:
            return faiss.read_index(str(path))
        except RuntimeError as exc:
            raise IndexFileError(f"cannot read {path}: {str(exc).splitlines()[0]}") from exc


def tie_margin(kk: int) -> int:
    """Extra candidates asked of FAISS: PQ scores tie often (fast-scan quantises its lookup
    tables), and which of a tied group FAISS keeps at its cut-off depends on the data's split;
    cutting later in a deterministic order makes a shard's shortlist hold every candidate a
    single index over the same data would take from it."""
    return max(16, kk // 2)


def float16_inner_products(block: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``block @ x`` for a float16 (n, d) block and a float32 (d,) vector, in float32, each row's
    score independent of the other rows in the block.

    Through torch: its SIMD float16 conversion is ~20x faster than numpy's (1.8 ms vs 0.09 ms for
    2000 x 512, which dominated re-scoring), and keeping the product in torch too avoids handing
    the cores back and forth between torch's and numpy's BLAS thread pools (that cost ~8 ms here).
    A product and a sum along each row, not ``torch.mv``: mv's blocked kernel rounds a row's last
    bit by its place in the block, and which rows are re-scored together depends on how the index
    is sharded and served; the sum reduces every row alike (tests/test_index_shards.py).
    """
    import torch

    return (torch.from_numpy(np.ascontiguousarray(block)).float() * torch.from_numpy(x)).sum(1).numpy()


def inner_products_at(vectors: Any, positions: np.ndarray, xq: np.ndarray) -> np.ndarray:
    """(nq, C) inner products of each query ``xq[q]`` with the float16 rows ``vectors[positions[q]]``
    (-inf where a position is -1), each query's rows read in ascending order: sequential reads of
    the map."""
    D = np.full(positions.shape, -np.inf, dtype=np.float32)
    for q in range(len(xq)):
        valid = np.flatnonzero(positions[q] >= 0)
        reads = valid[np.argsort(positions[q, valid])]
        D[q, reads] = float16_inner_products(np.asarray(vectors[positions[q, reads]]), xq[q])
    return D


def search_params(index: Any, nprobe: int, quantizer_ef: int | None = None) -> Any | None:
    """FAISS search parameters for one call (None for a flat index): ``nprobe`` lists visited per
    query, and for an HNSW coarse quantizer a graph depth of ``quantizer_ef`` (the build's) and
    never fewer than the lists wanted. They travel with the call, leaving the index untouched: a
    server's request threads share one index, and a setting made on it could be read by another
    request's search."""
    import faiss

    try:
        ivf = faiss.extract_index_ivf(index)
    except RuntimeError:
        return None
    # Never more than the lists there are: beyond them a fast-scan IVF with residual codes
    # returned unrelated rows (FAISS 1.15, probing 64 of 32 lists), where nlist probes are exact.
    params = faiss.SearchParametersIVF(nprobe=min(nprobe, ivf.nlist))
    if hnsw_quantizer(index) is not None:
        graph = faiss.SearchParametersHNSW(efSearch=max(quantizer_ef or DEFAULT_QUANTIZER_EF, nprobe))
        params.quantizer_params = graph
        params.referenced_objects = [graph]  # FAISS keeps a bare pointer: the Python object must outlive the call
    return params


def offset_table(infos: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(first position, shard id) of every Parquet shard id, sorted by shard id."""
    items = sorted((int(s), int(o)) for s, o in infos["shard_offsets"].items())
    return np.array([o for _, o in items], np.int64), np.array([s for s, _ in items], np.int64)


def positions_of_rows(I: np.ndarray, offsets: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Row ids -> positions in ids/vectors (from each shard's offset; -1 stays -1)."""
    first, shard_ids = offsets
    index = np.searchsorted(shard_ids, I >> ROW_SHARD_SHIFT).clip(0, len(shard_ids) - 1)
    return np.where(I >= 0, first[index] + (I & ((1 << ROW_SHARD_SHIFT) - 1)), -1)


def top_order(D: np.ndarray, I: np.ndarray, k: int) -> np.ndarray:
    """Each row's first k positions by descending score, ties to the lower row id, -1 padding last."""
    D = np.where(I < 0, -np.inf, D)
    if not len(D):
        return np.zeros((0, k), np.int64)
    return np.stack([np.lexsort((I[q], -D[q]))[:k] for q in range(len(D))])


def sort_by_score(D: np.ndarray, I: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's top k by descending score, ties to the lower row id, -1 padding last."""
    order = top_order(D, I, k)
    return np.take_along_axis(np.where(I < 0, -np.inf, D), order, 1), np.take_along_axis(I, order, 1)


def merge_shortlists(
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], kk: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The answer of a sharded search from every shard's ``(D_index, I, D_exact)`` shortlist: the
    ``kk`` best candidates by index score (the shortlist a single index over all rows would take:
    every shard's list holds its members), then the top k of their exact scores (ties to the
    lower row id), so shards and a single index agree. The one merge of the in-process index and
    of the Ray coordinator (shards/coordinator.py)."""
    D_index, I, D_exact = (np.concatenate([part[i] for part in parts], axis=1) for i in range(3))
    order = top_order(D_index, I, kk)
    return sort_by_score(np.take_along_axis(D_exact, order, 1), np.take_along_axis(I, order, 1), k)


def trim_to_shortlist(parts: list[tuple[np.ndarray, np.ndarray]], kk: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Several shards' ``(D_index, I)`` candidates with only their members of the ``kk`` best by
    index score among them all (ties to the lower row id, as ``merge_shortlists``); the others
    become padding (I -1, score -inf), and each part keeps the width of its widest row. A
    candidate outside the kk best of some shards is outside the kk best of all shards, so
    ``merge_shortlists`` gives the same answer from the trimmed parts, and only their members
    need exact scores and keys: kk rows per query, however many shards answered (the in-process
    index, and shards served together by one actor: shards/shard_group.py)."""
    D_index = np.concatenate([p[0] for p in parts], axis=1)
    I = np.concatenate([p[1] for p in parts], axis=1)
    keep = np.zeros(I.shape, bool)
    np.put_along_axis(keep, top_order(D_index, I, kk), True, 1)
    keep &= I >= 0
    out, start = [], 0
    for D, rows in parts:
        kept = keep[:, start : start + rows.shape[1]]
        start += rows.shape[1]
        width = int(kept.sum(1).max(initial=0))
        # each row's kept columns first, in their order; padding after
        order = np.argsort(~kept, axis=1, kind="stable")[:, :width]
        valid = np.take_along_axis(kept, order, 1)
        out.append(
            (
                np.where(valid, np.take_along_axis(D, order, 1), -np.inf).astype(D.dtype),
                np.where(valid, np.take_along_axis(rows, order, 1), -1),
            )
        )
    return out


@dataclass
class Shard:
    """One FAISS index file and the float16 vectors of its rows: searched in this process or in a
    Ray actor (cluster/serve.py), with the same code."""

    index: Any  # FAISS index, ids = Parquet row ids
    vectors: np.ndarray  # (N, d) float16 memory map of the directory's vectors (this shard reads its rows)
    offsets: tuple[np.ndarray, np.ndarray]  # offset_table of the directory
    exact: bool  # a flat index: its scores need no re-scoring
    nprobe: int  # default lists visited
    quantizer_ef: int | None  # HNSW coarse quantizer depth recorded by the build
    device: str = "auto"  # flat shards on a GPU: large searches when one is present (auto), never (cpu), always (cuda)
    files: ShardFiles | None = None  # a shard directory's own files (None: a shard of an old single directory)

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    def positions_of_rows(self, I: np.ndarray) -> np.ndarray:
        """Row ids of this shard -> its own positions (-1 stays -1)."""
        return positions_of_rows(I, self.offsets)

    def keys_of(self, I: np.ndarray) -> list[list[str | None]]:
        """Row ids (nq, k) of this shard -> keys from its own key files, None for the -1 padding."""
        if self.files is None:
            raise IndexFileError("a shard of an index built before shard directories has no key files of its own")
        I = np.atleast_2d(I)
        flat = self.files.keys.keys_at(self.positions_of_rows(I))
        return [flat[i * I.shape[1] : (i + 1) * I.shape[1]] for i in range(I.shape[0])]

    def position_of(self, key: str) -> int:
        """The shard-local position of ``key`` from this shard's own key files (O(log n)), or -1."""
        if self.files is None:
            raise IndexFileError("a shard of an index built before shard directories has no key files of its own")
        return self.files.keys.position_of(key)

    def vector_at(self, position: int) -> np.ndarray | None:
        """The float32 vector at a shard-local position, or None where its row has no valid descriptor."""
        if self.files is None:
            raise IndexFileError("a shard of an index built before shard directories has no id table of its own")
        vector = np.asarray(self.vectors[position], dtype=np.float32)
        return vector if is_valid_descriptor(vector, self.files.ids["status"][position].as_py()) else None

    @cached_property
    def local_store(self) -> LocalStore | None:
        """This shard directory's local tokens, by its own positions (None: built without them)."""
        if self.files is None:
            raise IndexFileError("a shard of an index built before shard directories has no local store of its own")
        return open_local_store(self.files.directory, self.files.infos)

    @cached_property
    def gpu_present(self) -> bool:
        return gpu_backend_available()

    def scans_on_gpu(self, nq: int) -> bool:
        """Whether a flat shard answers ``nq`` queries by scanning its vectors with
        ``exact_search`` on a GPU instead of searching its FAISS index on the CPU."""
        if not self.exact or self.device == "cpu":
            return False
        if self.device == "cuda":
            return True
        return nq >= GPU_EXACT_MIN_QUERIES and self.ntotal >= GPU_EXACT_MIN_VECTORS and self.gpu_present

    @cached_property
    def scan_layout(self) -> tuple[np.ndarray, np.ndarray]:
        """(positions in the vectors file, row ids) of this flat shard's vectors, ascending: the
        rows its FAISS index holds (rows whose image failed or was rejected are not in it)."""
        import faiss

        index = faiss.downcast_index(self.index)
        if not hasattr(index, "id_map"):
            raise IndexFileError(f"a flat shard of {type(index).__name__} has no id map to scan its vectors by")
        rows = faiss.vector_to_array(index.id_map).astype(np.int64)
        positions = positions_of_rows(rows, self.offsets)
        order = np.argsort(positions, kind="stable")
        return positions[order], rows[order]

    def scan(
        self, xq: np.ndarray, kk: int, device: str = "cuda", backend: str | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Exact (D, I) of this flat shard from its float16 vectors with ``exact_search`` (on a
        GPU by default, or NeedleInputError), ties to the lower row id."""
        positions, rows = self.scan_layout
        D, I = exact_search(xq, chunks_at(self.vectors, positions), kk, "ip", device, backend)
        return D, np.where(I >= 0, rows[I.clip(0)], -1)

    def candidates(self, xq: np.ndarray, kk: int, nprobe: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """This shard's best ``kk`` candidates for (nq, d) float32 queries by index score:
        ``(D_index, I)``, ties to the lower row id, -inf/-1 padding last."""
        if self.scans_on_gpu(len(xq)):
            return sort_by_score(*self.scan(xq, kk), kk)  # -inf for the -1 padding, as below
        D, I = self.index.search(xq, min(kk + tie_margin(kk), max(1, self.ntotal)), params=self.params(nprobe))
        return sort_by_score(D, I, kk)  # a cut that does not depend on FAISS's order among ties

    def params(self, nprobe: int | None) -> Any | None:
        """``search_params`` for ``nprobe`` (None: this shard's default), made once per value: a
        query's search asks for them once per shard, and making them (SWIG objects) cost about half
        as much as sorting its candidates (profiled). Read-only once made: request threads share them."""
        nprobe = nprobe or self.nprobe
        if nprobe not in self._params:
            self._params[nprobe] = search_params(self.index, nprobe, self.quantizer_ef)
        return self._params[nprobe]

    @cached_property
    def _params(self) -> dict[int, Any]:
        return {}

    @cached_property
    def vector_rows(self) -> np.ndarray:
        """The vectors as a plain ndarray over the same map: indexing an np.memmap makes a memmap
        object per read (its bookkeeping was ~10 % of re-scoring a shard's 200 candidates)."""
        return self.vectors.view(np.ndarray)

    def exact_scores(self, xq: np.ndarray, D: np.ndarray, I: np.ndarray, refine: bool = True) -> np.ndarray:
        """The exact scores of candidates ``I`` of this shard (-1 padding: -inf): inner products
        with their float16 vectors for IVF-PQ with ``refine``, otherwise their index scores ``D``."""
        return self.rescore(xq, I) if refine and not self.exact else D

    def search(
        self, xq: np.ndarray, kk: int, nprobe: int | None = None, refine: bool = True
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This shard's shortlist for (nq, d) float32 queries: ``(D_index, I, D_exact)``, its best
        ``kk`` candidates by index score (ties to the lower row id) with their exact scores."""
        D, I = self.candidates(xq, kk, nprobe)
        return D, I, self.exact_scores(xq, D, I, refine)

    def rescore(self, xq: np.ndarray, I: np.ndarray) -> np.ndarray:
        """Exact inner products of the candidates against their float16 vectors (-inf for -1)."""
        return inner_products_at(self.vector_rows, positions_of_rows(I, self.offsets), xq)


@dataclass
class SearchIndex:
    shards: list[Shard]  # one unless the directory is sharded; empty when the shards live in Ray actors
    ids: Any  # pyarrow Table (row, key, status) of every Parquet row in file order, memory-mapped
    vectors: np.ndarray  # (N, d) float16, memory-mapped
    infos: dict[str, Any]  # index_infos.json
    path: Path
    keys: KeyStore | ShardedKeys | None = None  # the key lookup files; None for an index built before them (scans)
    layout: ShardLayout | None = None  # the shard directories (None: an index built before them, files at the top)

    @property
    def d(self) -> int:
        return int(self.vectors.shape[1])

    @property
    def ntotal(self) -> int:
        if not self.shards:  # shards served elsewhere (Ray actors): trust the checked infos
            return int(self.infos["ntotal"])
        return int(sum(s.ntotal for s in self.shards))

    @property
    def is_exact(self) -> bool:
        return self.infos.get("kind") == "flat"

    def check_queries(self, xq: np.ndarray, k: int) -> np.ndarray:
        xq = np.ascontiguousarray(np.atleast_2d(xq), dtype=np.float32)
        if xq.ndim != 2 or xq.shape[1] != self.d:
            raise NeedleInputError(f"query vectors have shape {xq.shape}, the index expects (nq, {self.d})")
        if k < 1:
            raise NeedleInputError(f"k must be >= 1, got {k}")
        if not np.isfinite(xq).all():
            raise NeedleInputError("query vectors contain NaN or inf")
        return xq

    def shortlist_size(self, k: int, refine: bool = True, refine_factor: int | None = None) -> int:
        """Candidates each shard takes from its index: ``refine_factor`` (default: the build's) times k."""
        if refine_factor is not None and (
            not isinstance(refine_factor, int) or isinstance(refine_factor, bool) or refine_factor < 1
        ):
            raise NeedleInputError(f"refine_factor must be an integer >= 1, got {refine_factor!r}")
        factor = (
            1 if self.is_exact or not refine else (refine_factor or max(1, int(self.infos.get("refine_factor", 2))))
        )
        return min(k * factor, self.ntotal)

    def search_shards(
        self, xq: np.ndarray, kk: int, nprobe: int | None, refine: bool
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Every shard's ``(D_index, I, D_exact)`` members of the ``kk`` best candidates among all
        shards: only those are re-scored (kk rows per query, not kk per shard). cluster/serve.py
        asks its Ray actors instead."""
        found = [shard.candidates(xq, kk, nprobe) for shard in self.shards]
        if len(found) > 1:
            found = trim_to_shortlist(found, kk)
        return [(D, I, shard.exact_scores(xq, D, I, refine)) for shard, (D, I) in zip(self.shards, found)]

    def search(
        self, xq: np.ndarray, k: int, nprobe: int | None = None, refine: bool = True, refine_factor: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(nq, d) queries -> (D, I): (nq, k) scores and row ids, best first.

        ``nprobe`` and ``refine_factor`` override the build's defaults for this search.
        """
        xq = self.check_queries(xq, k)
        k = min(k, self.ntotal)
        kk = self.shortlist_size(k, refine, refine_factor)
        return merge_shortlists(self.search_shards(xq, kk, nprobe, refine), kk, k)

    @cached_property
    def offsets(self) -> tuple[np.ndarray, np.ndarray]:
        return self.layout.offsets if self.layout is not None else offset_table(self.infos)

    @cached_property
    def local_store(self) -> LocalStore | None:
        """The rows' binary local tokens by position (None: the index was built without them); over
        shard directories, one store whose segments are the shards' own files, each at its shard's
        first position."""
        if self.layout is not None:
            return self.layout.local_store(self.path, self.infos)
        return open_local_store(self.path, self.infos)

    def positions_of_rows(self, I: np.ndarray) -> np.ndarray:
        """Row ids -> positions in ids/vectors (-1 stays -1)."""
        return positions_of_rows(I, self.offsets)

    # --- keys: read from the memory-mapped id table, only the pages a lookup touches ----------
    @cached_property
    def rows(self) -> np.ndarray:
        """(N,) int64 row ids in file order (copied into memory on first use)."""
        return self.ids["row"].to_numpy()

    def position_of(self, key: str) -> int:
        # The key files answer in O(log n) pages; an index built before them scans the mapped key
        # column (~0.1 s per 10M keys).
        position = self.keys.position_of(key) if self.keys is not None else pc.index(self.ids["key"], key).as_py()
        if position < 0:
            raise UnknownKeyError(f"key {key!r} is not in the index at {self.path}")
        return position

    def vector_of(self, key: str) -> np.ndarray:
        position = self.position_of(key)
        vector = np.asarray(self.vectors[position], dtype=np.float32)
        if not is_valid_descriptor(vector, self.ids["status"][position].as_py()):
            raise UnknownKeyError(
                f"key {key!r} has no valid descriptor in {self.path} (its image failed or was rejected)"
            )
        return vector

    @property
    def has_locals(self) -> bool:
        """Whether the index was built with local tokens (re-ranking needs them)."""
        return bool(self.infos.get("locals"))

    def tokens_of_key(self, key: str) -> Any:
        """The stored local tokens (core.tokens.LocalTokens) of ``key``."""
        store = self.local_store
        if store is None:
            raise NeedleInputError(
                f"index {self.path} has no local tokens: ingest with --locals and rebuild it to re-rank"
            )
        return store.tokens(self.position_of(key))

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
        if self.keys is not None:
            flat = self.keys.keys_at(positions)
        else:  # an index built before the key files: a take over the whole chunked column
            keys = self.ids["key"].take(pa.array(positions.clip(0).reshape(-1))).to_pylist()
            flat = [k if v else None for k, v in zip(keys, (positions >= 0).reshape(-1))]
        return [flat[i * I.shape[1] : (i + 1) * I.shape[1]] for i in range(I.shape[0])]


def is_valid_descriptor(vector: np.ndarray, status: str | None) -> bool:
    """Whether a stored row's vector can be a query: its image was read (``status`` ok) and its
    descriptor is finite and not all zeros."""
    return status == STATUS_OK and bool(np.isfinite(vector).all()) and bool(vector.any())


def map_vectors(path: Path) -> np.ndarray:
    """The float16 refine vectors, memory-mapped for random access: without readahead a cold
    2000-row shortlist read 4-5x faster here (0.13-0.2 s instead of 0.64-0.87 s from this disk)."""
    import mmap

    vectors = np.load(path, mmap_mode="r")
    if hasattr(mmap, "MADV_RANDOM") and getattr(vectors, "_mmap", None) is not None:
        vectors._mmap.madvise(mmap.MADV_RANDOM)
    return vectors


def read_infos_and_vectors(path: Path) -> tuple[dict[str, Any], np.ndarray]:
    """``index_infos.json`` and the mapped vectors of an index directory, or IndexFileError."""
    try:
        return json.loads((path / INFOS_FILE).read_text()), map_vectors(path / VECTORS_FILE)
    except Exception as exc:  # numpy and json each raise their own types for corrupt files
        raise IndexFileError(f"cannot read index files in {path}: {type(exc).__name__}: {exc}") from exc


def read_ids(path: Path) -> Any:
    """The id table, memory-mapped (zero copy)."""
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all()


def load_index(path: str | Path, mmap: bool = True, with_shards: bool = True, device: str = "auto") -> SearchIndex:
    """Open an index directory, checking that its files exist and agree (never a wrong answer).

    ``with_shards=False`` skips the FAISS files (a coordinator whose shards live in Ray actors);
    ``device``: where flat shards scan (see ``Shard.device``).
    """
    check_device(device)
    path = Path(path)
    if (path / INFOS_FILE).is_file():
        infos = read_infos(path)
        if infos.get("layout") == LAYOUT_SHARDS:
            return load_shard_directories(path, infos, mmap, with_shards, device)
    for name in (IDS_FILE, VECTORS_FILE, INFOS_FILE):
        if not (path / name).is_file():
            raise IndexFileError(f"index directory {path} has no {name}")
    infos, vectors = read_infos_and_vectors(path)
    try:
        ids = read_ids(path / IDS_FILE)
    except Exception as exc:  # pyarrow raises its own types for corrupt files
        raise IndexFileError(f"cannot read index files in {path}: {type(exc).__name__}: {exc}") from exc
    names = infos.get("index_files", ["index.faiss"])
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise IndexFileError(f"index directory {path} has no {', '.join(missing)}")
    faiss_indexes = [read_faiss(path / name, mmap) for name in names] if with_shards else []
    rows = ids.num_rows
    ntotal = sum(s.ntotal for s in faiss_indexes) if with_shards else infos.get("ntotal")
    if rows != len(vectors) or rows != infos.get("rows") or ntotal != infos.get("ntotal"):
        raise IndexFileError(
            f"index {path} is inconsistent: {ntotal} vectors in the index files (infos: {infos.get('ntotal')}), "
            f"{rows} ids in {IDS_FILE}, {len(vectors)} rows in {VECTORS_FILE} (infos: {infos.get('rows')})"
        )
    if vectors.ndim != 2 or vectors.shape[1] != infos.get("dim") or any(s.d != vectors.shape[1] for s in faiss_indexes):
        raise IndexFileError(f"index {path}: {VECTORS_FILE} has shape {vectors.shape}, the index d={infos.get('dim')}")
    shards = [make_shard(index, vectors, infos, device) for index in faiss_indexes]
    keys = KeyStore(path) if has_key_files(path) else None
    if keys is not None and len(keys) != rows:
        raise IndexFileError(f"index {path} is inconsistent: {len(keys)} keys in its key files, {rows} in {IDS_FILE}")
    if keys is None:
        log.warning(
            "index %s has no key files (built before them): key lookups scan the key column; rebuild "
            "the index to answer them in O(log n)",
            path,
        )
    return SearchIndex(shards, ids, vectors, infos, path, keys)


def make_shard(
    index: Any, vectors: np.ndarray, infos: dict[str, Any], device: str = "auto", files: ShardFiles | None = None
) -> Shard:
    """A shard over ``vectors`` whose positions ``infos["shard_offsets"]`` gives (the old
    directory's infos, or a shard directory's ``shard_infos.json``)."""
    return Shard(
        index,
        vectors,
        offset_table(infos),
        infos.get("kind") == "flat",
        int(infos.get("nprobe", 64)),
        infos.get("quantizer_ef"),
        device,
        files,
    )


def open_shard(path: str | Path, name: str, device: str = "auto") -> Shard:
    """One shard of an index, with its own memory maps (a Ray shard actor's view): the shard
    directory ``path / name`` by itself (nothing outside it is read), or for an index built
    before shard directories, its FAISS file ``name`` and the directory's shared files."""
    path = Path(path)
    device = check_device(device)
    if (path / name).is_dir():
        files = open_shard_files(path / name)
        return make_shard(files.index, files.vectors, files.infos, device, files)
    infos, vectors = read_infos_and_vectors(path)
    return make_shard(read_faiss(path / name), vectors, infos, device)


def read_infos(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / INFOS_FILE).read_text())
    except Exception as exc:
        raise IndexFileError(f"cannot read {path / INFOS_FILE}: {type(exc).__name__}: {exc}") from exc


@dataclass
class ShardFiles:
    """A shard directory's own files, opened (memory-mapped) and checked against its ``shard_infos.json``."""

    directory: Path
    infos: dict[str, Any]  # shard_infos.json
    ids: Any  # pyarrow Table (row, key, status) of its rows, memory-mapped
    vectors: np.ndarray  # (rows, d) float16 memory map, shard-local positions
    keys: KeyStore
    index: Any | None  # FAISS index (None: not loaded)

    @property
    def rows(self) -> int:
        return int(self.infos["rows"])


def shard_error(directory: Path, message: str) -> IndexFileError:
    return IndexFileError(f"index shard {directory.name} ({directory}): {message}")


def open_shard_files(
    directory: Path | str, entry: dict[str, Any] | None = None, with_index: bool = True, mmap: bool = True
) -> ShardFiles:
    """Open a shard directory's files, checking that each file its ``shard_infos.json`` lists is
    there with its recorded size and that they agree (rows, vectors, keys, index size);
    ``entry``: the top-level infos' record of this shard, which must agree too. Any failure is an
    IndexFileError naming the shard and the file. (The SHA-256 of each file is checked by
    ``verify_shard``, which reads every byte.)"""
    directory = Path(directory)
    infos_path = directory / SHARD_INFOS_FILE
    if not infos_path.is_file():
        raise shard_error(directory, f"no {SHARD_INFOS_FILE}")
    try:
        infos = json.loads(infos_path.read_text())
        checksums = dict(infos["checksums"])
    except Exception as exc:
        raise shard_error(directory, f"cannot read {SHARD_INFOS_FILE}: {type(exc).__name__}: {exc}") from exc
    for name, recorded in checksums.items():
        file = directory / name
        if not file.is_file():
            raise shard_error(directory, f"{name} is missing")
        size = file.stat().st_size
        if size != recorded.get("bytes"):
            raise shard_error(directory, f"{name} has {size} bytes, {SHARD_INFOS_FILE} says {recorded.get('bytes')}")
    if entry is not None and (entry.get("rows") != infos.get("rows") or entry.get("ntotal") != infos.get("ntotal")):
        raise shard_error(
            directory,
            f"{SHARD_INFOS_FILE} says {infos.get('rows')} rows, {infos.get('ntotal')} vectors; the index's "
            f"{INFOS_FILE} says {entry.get('rows')}, {entry.get('ntotal')}",
        )
    reading = VECTORS_FILE
    try:
        vectors = map_vectors(directory / VECTORS_FILE)
        reading = IDS_FILE
        ids = read_ids(directory / IDS_FILE)
        reading = "its key files"
        keys = KeyStore(directory)
    except (KeyFileError, Exception) as exc:  # numpy, pyarrow and the key files each raise their own types
        raise shard_error(directory, f"cannot read {reading}: {type(exc).__name__}: {exc}") from exc
    index = None
    if with_index:
        try:
            index = read_faiss(directory / INDEX_FILE, mmap)
        except IndexFileError as exc:
            raise shard_error(directory, str(exc)) from exc
    rows = infos.get("rows")
    if not (ids.num_rows == len(vectors) == len(keys) == rows):
        raise shard_error(
            directory,
            f"inconsistent: {ids.num_rows} ids in {IDS_FILE}, {len(vectors)} rows in {VECTORS_FILE}, "
            f"{len(keys)} keys in its key files, {rows} rows in {SHARD_INFOS_FILE}",
        )
    if vectors.ndim != 2 or vectors.shape[1] != infos.get("dim") or (index is not None and index.d != infos.get("dim")):
        raise shard_error(
            directory, f"{VECTORS_FILE} has shape {vectors.shape}, {SHARD_INFOS_FILE} says d={infos.get('dim')}"
        )
    if index is not None and index.ntotal != infos.get("ntotal"):
        raise shard_error(
            directory,
            f"inconsistent: {index.ntotal} vectors in {INDEX_FILE}, {infos.get('ntotal')} in {SHARD_INFOS_FILE}",
        )
    return ShardFiles(directory, infos, ids, vectors, keys, index)


def verify_shard(directory: Path | str) -> dict[str, Any]:
    """Open a shard directory (``open_shard_files``) and check every file's SHA-256 against its
    ``shard_infos.json``; returns those infos, or IndexFileError naming the shard and the file."""
    from core.hashing import file_sha256

    files = open_shard_files(directory, with_index=False)
    for name, recorded in files.infos["checksums"].items():
        if file_sha256(files.directory / name) != recorded.get("sha256"):
            raise shard_error(files.directory, f"{name} does not match its SHA-256 in {SHARD_INFOS_FILE}")
    return files.infos


class ShardedVectors:
    """The float16 vectors of every position, read from the shard that holds it: indexing with a
    position, an array of positions or a slice gathers only those rows (never a concatenation)."""

    def __init__(self, arrays: list[np.ndarray], bases: np.ndarray):
        self.arrays = arrays
        self.bases = bases  # first position of each shard
        self.dtype = np.dtype(np.float16)
        self.shape = (int(sum(len(a) for a in arrays)), int(arrays[0].shape[1]) if arrays else 0)
        self.ndim = 2

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> np.ndarray:
        n, d = self.shape
        if isinstance(key, (int, np.integer)):
            position = int(key) + (n if key < 0 else 0)
            if not 0 <= position < n:
                raise IndexError(f"position {int(key)} is outside the {n} rows")
            shard = int(np.searchsorted(self.bases, position, side="right")) - 1
            return self.arrays[shard][position - self.bases[shard]]
        positions = np.arange(n)[key] if isinstance(key, slice) else np.asarray(key)
        if positions.dtype == bool:
            positions = np.flatnonzero(positions)
        flat = positions.reshape(-1).astype(np.int64)
        flat = np.where(flat < 0, flat + n, flat)
        if len(flat) and (flat.min() < 0 or flat.max() >= n):
            raise IndexError(f"positions outside the {n} rows")
        out = np.empty((len(flat), d), self.dtype)
        shard_of = np.searchsorted(self.bases, flat, side="right") - 1
        for shard in np.unique(shard_of):
            take = np.flatnonzero(shard_of == shard)
            local = flat[take] - self.bases[shard]
            order = np.argsort(local, kind="stable")  # ascending: sequential reads of the map
            out[take[order]] = self.arrays[shard][local[order]]
        return out.reshape((*positions.shape, d))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)


class ShardedKeys:
    """``keys_at(positions)`` and ``position_of(key)`` over the shards' own key files (index/keys.py)."""

    def __init__(self, stores: list[KeyStore], bases: np.ndarray):
        self.stores = stores
        self.bases = bases

    def __len__(self) -> int:
        return int(sum(len(s) for s in self.stores))

    def keys_at(self, positions: np.ndarray) -> list[str | None]:
        flat = np.asarray(positions, dtype=np.int64).reshape(-1)
        keys: list[str | None] = [None] * len(flat)
        valid = np.flatnonzero(flat >= 0)
        shard_of = np.searchsorted(self.bases, flat[valid], side="right") - 1
        for shard in np.unique(shard_of):
            take = valid[shard_of == shard]
            for i, key in zip(take, self.stores[shard].keys_at(flat[take] - self.bases[shard])):
                keys[i] = key
        return keys

    def position_of(self, key: str) -> int:
        """The position of ``key`` (a binary search in each shard's key files), or -1."""
        for base, store in zip(self.bases, self.stores):
            position = store.position_of(key)
            if position >= 0:
                return int(base) + position
        return -1


@dataclass
class ShardLayout:
    """The shard directories of an index: names, first positions, their shard_infos.json."""

    names: list[str]
    bases: np.ndarray  # (shards,) first position of each shard
    shard_infos: list[dict[str, Any]]

    @cached_property
    def offsets(self) -> tuple[np.ndarray, np.ndarray]:
        """(first position, Parquet shard id) of every Parquet file, sorted by shard id: a row id's
        Parquet shard id routes it to its index shard and position (one entry per Parquet file)."""
        items = sorted(
            (int(shard_id), int(base) + int(offset))
            for base, infos in zip(self.bases, self.shard_infos)
            for shard_id, offset in infos["shard_offsets"].items()
        )
        return np.array([o for _, o in items], np.int64), np.array([s for s, _ in items], np.int64)

    def local_store(self, path: Path, infos: dict[str, Any]) -> LocalStore | None:
        if not infos.get("locals"):
            return None
        segments = []
        for name, base, shard in zip(self.names, self.bases, self.shard_infos):
            if not shard.get("locals"):
                raise LocalStoreError(f"index shard {name} of {path} lists no local segments")
            for segment in shard["locals"]["segments"]:
                segments.append(
                    {
                        **segment,
                        "tokens": f"{name}/{segment['tokens']}",
                        "offsets": f"{name}/{segment['offsets']}",
                        "start": int(base) + int(segment["start"]),
                    }
                )
        return LocalStore(path, {**infos["locals"], "segments": segments})


def shard_names(infos: dict[str, Any]) -> list[str]:
    """What ``open_shard`` takes for each shard: shard directories, or an old directory's FAISS files."""
    if infos.get("layout") == LAYOUT_SHARDS:
        return [entry["name"] for entry in infos["shards"]]
    return list(infos.get("index_files", [INDEX_FILE]))


def index_file_paths(path: Path | str, infos: dict[str, Any]) -> list[Path]:
    """The FAISS index files of an index directory, in shard order."""
    path = Path(path)
    if infos.get("layout") == LAYOUT_SHARDS:
        return [path / name / INDEX_FILE for name in shard_names(infos)]
    return [path / name for name in shard_names(infos)]


def load_shard_directories(
    path: Path, infos: dict[str, Any], mmap: bool = True, with_shards: bool = True, device: str = "auto"
) -> SearchIndex:
    """An index of shard directories: each opened and checked by itself, then checked against the
    top-level infos; positions run over the shards in order."""
    entries = infos.get("shards") or []
    if not entries:
        raise IndexFileError(f"index {path}: {INFOS_FILE} lists no shards")
    opened = []
    for entry in entries:
        directory = path / entry["name"]
        if not directory.is_dir():
            raise IndexFileError(f"index shard {entry['name']} ({directory}): the directory is missing")
        opened.append(open_shard_files(directory, entry, with_index=with_shards, mmap=mmap))
    rows = sum(o.rows for o in opened)
    ntotal = sum(int(o.infos["ntotal"]) for o in opened)
    if rows != infos.get("rows") or ntotal != infos.get("ntotal"):
        raise IndexFileError(
            f"index {path} is inconsistent: its shards hold {rows} rows, {ntotal} vectors; {INFOS_FILE} says "
            f"{infos.get('rows')}, {infos.get('ntotal')}"
        )
    if any(o.infos.get("dim") != infos.get("dim") for o in opened):
        raise IndexFileError(f"index {path}: shards of other dimensions than d={infos.get('dim')}")
    bases = np.cumsum([0] + [o.rows for o in opened[:-1]]).astype(np.int64)
    shards = [make_shard(o.index, o.vectors, o.infos, device, o) for o in opened] if with_shards else []
    ids = pa.concat_tables([o.ids for o in opened])  # zero copy: the shards' mapped tables as chunks
    layout = ShardLayout([o.directory.name for o in opened], bases, [o.infos for o in opened])
    vectors = ShardedVectors([o.vectors for o in opened], bases)
    keys = ShardedKeys([o.keys for o in opened], bases)
    return SearchIndex(shards, ids, vectors, infos, path, keys, layout)
