"""How far rows added to an index drift from what its quantizer was trained on.

``needle index add`` encodes new rows with the build's coarse quantizer and PQ, never retrained.
While new rows look like the old ones that costs nothing; when they do not (a new source, a new
kind of photo), they fall far from every centroid and pile into a few lists, and recall and speed
both suffer. Two figures, each the new rows' against a sample of the rows the index was built on:

- ``error_ratio``: mean squared distance to the nearest centroid (the coarse quantisation error);
- ``top_share_ratio``: the share of rows in the most loaded 1 % of lists (by that set's own
  assignments).

Past ``error_ratio`` or ``top_share_ratio`` thresholds, ``rebuild_recommended`` is true and the
command says so with the figures (docs/live_index.md: when a retrain pays).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

TOP_LISTS = 0.01  # the most loaded 1 % of lists


def coarse_assign(index: Any, x: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(list of each row, squared distance to its centroid) under ``index``'s coarse quantizer,
    after its pre-transform (OPQ) if any; None for an index without lists (flat)."""
    import faiss

    try:
        ivf = faiss.extract_index_ivf(index)
    except RuntimeError:
        return None
    x = np.ascontiguousarray(x, np.float32)
    outer: Any = faiss.downcast_index(index)
    if isinstance(outer, faiss.IndexPreTransform):
        chain: Any = outer.chain  # a SWIG vector (its stub says list)
        for i in range(chain.size()):
            x = chain.at(i).apply(x)
    flat = faiss.downcast_index(ivf.quantizer)
    if isinstance(flat, faiss.IndexFlat) and flat.metric_type in (faiss.METRIC_INNER_PRODUCT, faiss.METRIC_L2):
        table = faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d).reshape(flat.ntotal, flat.d)
        lists = nearest_rows(x, table, inner_product=flat.metric_type == faiss.METRIC_INNER_PRODUCT)
    else:  # a graph (HNSW) or other quantizer: its own search
        lists = ivf.quantizer.search(x, 1)[1][:, 0]
    centroids = ivf.quantizer.reconstruct_batch(lists)
    return lists, ((x - centroids) ** 2).sum(1)


def nearest_rows(x: np.ndarray, table: np.ndarray, inner_product: bool, block: int = 2048) -> np.ndarray:
    """Each row of ``x``'s nearest row of ``table`` (largest inner product, or smallest L2
    distance): a flat quantizer's assignment as one matrix product per block. FAISS's own flat
    search took 3-4x the CPU time of numpy's product at 2,000 x 4,096 x 512 on one thread
    (0.6-0.7 s against 0.16-0.2 s): the add's drift report pays this once per add."""
    bias = None if inner_product else -0.5 * (table**2).sum(1)  # argmax of x.c - |c|^2/2 = argmin of |x - c|^2
    out = np.empty(len(x), np.int64)
    for start in range(0, len(x), block):
        scores = x[start : start + block] @ table.T
        if bias is not None:
            scores += bias
        out[start : start + block] = scores.argmax(1)
    return out


def top_share(lists: np.ndarray, nlist: int) -> float:
    """The share of rows in the most loaded ``TOP_LISTS`` of ``nlist`` lists."""
    counts = np.sort(np.bincount(lists, minlength=nlist))[::-1]
    top = max(1, round(nlist * TOP_LISTS))
    return float(counts[:top].sum() / max(1, len(lists)))


@dataclass(frozen=True)
class CoarseStats:
    """Rows under a coarse quantizer (``generations/trained_drift.json`` holds the build's)."""

    rows: int  # rows measured
    mean_error: float  # their mean squared distance to the nearest centroid
    top_share: float  # their share in their fullest TOP_LISTS of lists
    top_lists: int  # how many lists that is

    @staticmethod
    def from_json(record: Mapping[str, Any]) -> CoarseStats:
        return CoarseStats(int(record["rows"]), record["mean_error"], record["top_share"], int(record["top_lists"]))

    def to_json(self) -> dict[str, object]:
        """The record ``trained_drift.json`` holds (keys in the order the first add wrote them)."""
        return {
            "rows": self.rows,
            "mean_error": self.mean_error,
            "top_share": self.top_share,
            "top_lists": self.top_lists,
        }


def coarse_stats(index: Any, x: np.ndarray) -> CoarseStats | None:
    """Rows ``x`` under ``index``'s coarse quantizer; None for a flat index or no rows."""
    import faiss

    assigned = coarse_assign(index, x)
    if assigned is None or not len(x):
        return None
    nlist = int(faiss.extract_index_ivf(index).nlist)
    return CoarseStats(
        len(x), float(assigned[1].mean()), top_share(assigned[0], nlist), max(1, round(nlist * TOP_LISTS))
    )


def drift_report(
    new: CoarseStats | None, trained: CoarseStats | None, error_limit: float, share_limit: float
) -> dict[str, Any] | None:
    """The drift of the new rows' ``coarse_stats`` against those of a sample of the build's rows
    (None: a flat index)."""
    if new is None or trained is None:
        return None
    error_ratio = new.mean_error / max(trained.mean_error, 1e-12)
    share_ratio = new.top_share / max(trained.top_share, 1e-12)
    report = {
        "rows": new.rows,
        "trained_sample": trained.rows,
        "mean_error_new": round(new.mean_error, 6),
        "mean_error_trained": round(trained.mean_error, 6),
        "error_ratio": round(error_ratio, 4),
        "top_lists": new.top_lists,
        "top_share_new": round(new.top_share, 4),
        "top_share_trained": round(trained.top_share, 4),
        "top_share_ratio": round(share_ratio, 4),
        "limits": {"error_ratio": error_limit, "top_share_ratio": share_limit},
    }
    report["rebuild_recommended"] = bool(error_ratio > error_limit or share_ratio > share_limit)
    return report


def sample_positions(rows: int, size: int, seed: int = 0) -> np.ndarray:
    """Up to ``size`` distinct positions of ``rows``, ascending (reads in order)."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(rows, size=min(size, rows), replace=False)) if rows else np.zeros(0, np.int64)
