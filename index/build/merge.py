"""Searching and merging shortlists: the arithmetic every way of serving an index shares.

``search(xq, k) -> (D, I)``: scores (inner product = cosine) and Parquet ``row`` ids, best first,
-1 where fewer than k results exist. IVF-PQ results are re-scored exactly: each index file
(``index.shard.Shard``) takes its ``refine_factor * k`` best candidates by PQ score (ties to the
lower row id) and scores them against the memory-mapped float16 vectors of its rows; the
coordinator keeps the ``refine_factor * k`` best of all shards' candidates by PQ score (the
shortlist a single index would take: each shard's list holds its members of it) and returns the
top k of their exact scores. So a sharded index answers exactly like a single index over the same
data, while the re-scoring runs in the shards, in parallel, next to their vectors. The merge
(``merge_shortlists``, ``trim_to_shortlist``) is the one of the in-process index
(index/search.py) and of the coordinator of shards served elsewhere (shards/coordinator.py).

Rows are addressed by a *position* (0..N-1, the shards' rows in order); a row id maps to its
position through the small table of Parquet shard ids (index/live/row_map.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from core.errors import NeedleInputError
from core.quoting import short_repr
from index.build.train import DEFAULT_QUANTIZER_EF, hnsw_quantizer

# Rows re-scored in one product: a query's shortlist of 640k rows at d=768 was two float32 copies of
# ~2 GB each; in chunks of 16k rows the copies take ~100 MB whatever the shortlist (each row's
# score is independent of the others in its block: float16_inner_products).
RESCORE_CHUNK = 16_384


def checked_queries(xq: np.ndarray, k: int, d: int) -> np.ndarray:
    """(nq, d) float32 C-contiguous queries, or NeedleInputError naming what is wrong with ``xq`` or ``k``."""
    xq = np.ascontiguousarray(np.atleast_2d(xq), dtype=np.float32)
    if xq.ndim != 2 or xq.shape[1] != d:
        raise NeedleInputError(f"query vectors have shape {xq.shape}, the index expects (nq, {d})")
    if k < 1:
        raise NeedleInputError(f"k must be >= 1, got {k}")
    if not np.isfinite(xq).all():
        raise NeedleInputError("query vectors contain NaN or inf")
    return xq


def shortlist_size(
    k: int, infos: dict[str, Any], ntotal: int, refine: bool = True, refine_factor: int | None = None
) -> int:
    """Candidates each shard takes from its index: ``refine_factor`` (default: the build's, in
    ``infos``) times k; k itself for a flat index or without ``refine``."""
    if refine_factor is not None and (
        not isinstance(refine_factor, int) or isinstance(refine_factor, bool) or refine_factor < 1
    ):
        raise NeedleInputError(f"refine_factor must be an integer >= 1, got {short_repr(refine_factor)}")
    exact = infos.get("kind") == "flat"
    factor = 1 if exact or not refine else (refine_factor or max(1, int(infos.get("refine_factor", 2))))
    return min(k * factor, ntotal)


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
    is sharded and served; the sum reduces every row alike (tests/index/test_index_shards.py).
    """
    import torch

    return (torch.from_numpy(np.ascontiguousarray(block)).float() * torch.from_numpy(x)).sum(1).numpy()


def inner_products_at(vectors: Any, positions: np.ndarray, xq: np.ndarray) -> np.ndarray:
    """(nq, C) inner products of each query ``xq[q]`` with the float16 rows ``vectors[positions[q]]``
    (-inf where a position is -1), each query's rows read in ascending order: sequential reads of
    the map."""
    return inner_products_read(lambda q, cols: np.asarray(vectors[positions[q, cols]]), positions, xq)


def inner_products_read(read: Callable[[int, np.ndarray], np.ndarray], order: np.ndarray, xq: np.ndarray) -> np.ndarray:
    """(nq, C) inner products of each query ``xq[q]`` with the float16 rows ``read(q, cols)`` gives
    for its columns ``cols``, read in ascending ``order`` (-1: no row there, -inf) and in chunks of
    at most RESCORE_CHUNK rows (memory bounded by the chunk, not the shortlist)."""
    D = np.full(order.shape, -np.inf, dtype=np.float32)
    for q in range(len(xq)):
        valid = np.flatnonzero(order[q] >= 0)
        reads = valid[np.argsort(order[q, valid])]
        for start in range(0, len(reads), RESCORE_CHUNK):
            chunk = reads[start : start + RESCORE_CHUNK]
            D[q, chunk] = float16_inner_products(read(q, chunk), xq[q])
    return D


def search_params(index: Any, nprobe: int, quantizer_ef: int | None = None) -> Any | None:
    """FAISS search parameters for one call (None for a flat index): ``nprobe`` lists visited per
    query, and for an HNSW coarse quantizer a graph depth of ``quantizer_ef`` (the build's) and
    never fewer than the lists wanted. They travel with the call, leaving the index untouched: a
    server's request threads share one index, and a setting made on it could be read by another
    request's search."""
    import faiss as swig

    faiss: Any = swig  # its bundled (SWIG) stubs lack the Python layer's keyword arguments and SearchParametersHNSW
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


def top_order(D: np.ndarray, I: np.ndarray, k: int) -> np.ndarray:
    """Each row's first k positions by descending score, ties to the lower row id, -1 padding last."""
    D = np.where(I < 0, -np.inf, D)
    if not len(D):
        return np.zeros((0, k), np.int64)
    return np.lexsort((I, -D), axis=-1)[:, :k]  # row by row in one call (a Python loop was ~8 % of a search)


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
        out.append(kept_columns(D, rows, keep[:, start : start + rows.shape[1]]))
        start += rows.shape[1]
    return out


def kept_columns(D: np.ndarray, I: np.ndarray, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(D, I)`` with only the columns ``kept`` (bool, same shape): each row's kept columns first,
    in their order, padding (-inf/-1) after, as wide as the widest row."""
    width = int(kept.sum(1).max(initial=0))
    order = np.argsort(~kept, axis=1, kind="stable")[:, :width]
    valid = np.take_along_axis(kept, order, 1)
    return (
        np.where(valid, np.take_along_axis(D, order, 1), -np.inf).astype(D.dtype),
        np.where(valid, np.take_along_axis(I, order, 1), -1),
    )
