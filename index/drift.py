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
    _, lists = ivf.quantizer.search(x, 1)
    lists = lists[:, 0]
    centroids = ivf.quantizer.reconstruct_batch(lists)
    return lists, ((x - centroids) ** 2).sum(1)


def top_share(lists: np.ndarray, nlist: int) -> float:
    """The share of rows in the most loaded ``TOP_LISTS`` of ``nlist`` lists."""
    counts = np.sort(np.bincount(lists, minlength=nlist))[::-1]
    top = max(1, round(nlist * TOP_LISTS))
    return float(counts[:top].sum() / max(1, len(lists)))


def drift_report(
    index: Any, new: np.ndarray, trained: np.ndarray, error_limit: float, share_limit: float
) -> dict[str, Any] | None:
    """The drift of rows ``new`` against a sample ``trained`` of the build's rows (None: a flat index)."""
    import faiss

    got_new, got_old = coarse_assign(index, new), coarse_assign(index, trained)
    if got_new is None or got_old is None or not len(new) or not len(trained):
        return None
    nlist = int(faiss.extract_index_ivf(index).nlist)
    error_new, error_old = float(got_new[1].mean()), float(got_old[1].mean())
    share_new, share_old = top_share(got_new[0], nlist), top_share(got_old[0], nlist)
    error_ratio = error_new / max(error_old, 1e-12)
    share_ratio = share_new / max(share_old, 1e-12)
    report = {
        "rows": len(new),
        "trained_sample": len(trained),
        "mean_error_new": round(error_new, 6),
        "mean_error_trained": round(error_old, 6),
        "error_ratio": round(error_ratio, 4),
        "top_lists": max(1, round(nlist * TOP_LISTS)),
        "top_share_new": round(share_new, 4),
        "top_share_trained": round(share_old, 4),
        "top_share_ratio": round(share_ratio, 4),
        "limits": {"error_ratio": error_limit, "top_share_ratio": share_limit},
    }
    report["rebuild_recommended"] = bool(error_ratio > error_limit or share_ratio > share_limit)
    return report


def sample_positions(rows: int, size: int, seed: int = 0) -> np.ndarray:
    """Up to ``size`` distinct positions of ``rows``, ascending (reads in order)."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(rows, size=min(size, rows), replace=False)) if rows else np.zeros(0, np.int64)
