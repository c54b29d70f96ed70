"""Class-level retrieval metrics of Musgrave et al., "A Metric Learning Reality Check" (ECCV 2020).

Every labelled image queries all the other images (the references). For a query whose label has
R other images among the references:

- R-Precision = r / R, where r is the number of references of the query's label among the R
  nearest ones;
- MAP@R = (1 / R) * sum over ranks i = 1..R of P(i), where P(i) is the precision at i when the
  i-th nearest reference has the query's label, and 0 otherwise.

Both are averaged over the queries (every query counts once; no per-class averaging), and
queries whose label has no other image (R = 0, "lone" queries) are left out, as in the paper's
code. Reported times 100, like the ILIAS metrics in :mod:`eval.metrics`. Ranks follow descending
similarity; equal similarities go to the lower reference index (deterministic).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from core.errors import NeedleInputError


def _check(scores: np.ndarray, labels: Sequence[Hashable]) -> np.ndarray:
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2 or scores.shape[0] != scores.shape[1]:
        raise NeedleInputError(f"scores must be a square (n, n) similarity matrix, got shape {scores.shape}")
    if len(labels) != scores.shape[0]:
        raise NeedleInputError(f"{len(labels)} labels for {scores.shape[0]} images")
    if not np.isfinite(scores).all():
        raise NeedleInputError("scores hold NaN or infinite values")
    return scores


def label_ids(labels: Sequence[Hashable]) -> np.ndarray:
    """Labels as dense integer ids (first-seen order), so any hashable label works."""
    ids: dict[Hashable, int] = {}
    return np.asarray([ids.setdefault(label, len(ids)) for label in labels], dtype=np.int64)


def class_retrieval_per_query(
    scores: np.ndarray, labels: Sequence[Hashable]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per query with R >= 1: (MAP@R, R-Precision, query index), each (q,), in [0, 1]; from an
    (n, n) similarity matrix (the diagonal is ignored) and the n images' labels."""
    scores = _check(scores, labels)
    ids = label_ids(labels)
    n = len(ids)
    r = np.bincount(ids)[ids] - 1  # references of the query's label, the query itself excluded
    keep = r > 0
    if not keep.any():
        raise NeedleInputError("no label has two images: MAP@R and R-Precision need R >= 1 for some query")
    ranked = _rank_others(scores)[keep]  # (q, n - 1) reference indices, nearest first
    hits = ids[ranked] == ids[keep][:, None]  # (q, n - 1): is the i-th nearest of the query's label
    r_q = r[keep]
    within_r = np.arange(n - 1)[None, :] < r_q[:, None]  # ranks 1..R of each query
    hits_r = hits & within_r
    precision_at_i = np.cumsum(hits_r, axis=1) / np.arange(1, n)[None, :]
    return (precision_at_i * hits_r).sum(1) / r_q, hits_r.sum(1) / r_q, np.flatnonzero(keep)


def class_retrieval_scores(scores: np.ndarray, labels: Sequence[Hashable]) -> dict[str, float | int]:
    """MAP@R and R-Precision (x 100) of each image querying the others, from an (n, n) similarity
    matrix (the diagonal is ignored) and the n images' labels.

    Returns ``{"map_at_r", "r_precision", "queries"}`` (queries: images with R >= 1). Raises
    NeedleInputError when no image has another of its label.
    """
    map_at_r, r_precision, queries = class_retrieval_per_query(scores, labels)
    return {
        "map_at_r": 100.0 * float(map_at_r.mean()),
        "r_precision": 100.0 * float(r_precision.mean()),
        "queries": len(queries),
    }


def _rank_others(scores: np.ndarray) -> np.ndarray:
    """(n, n - 1): per row, the other columns by descending score, ties to the lower column."""
    n = scores.shape[0]
    order = np.argsort(-scores, axis=1, kind="stable")
    others = order[order != np.arange(n)[:, None]]  # drop each row's own column, keep the order
    return others.reshape(n, n - 1)


def class_retrieval_from_embeddings(embeddings: np.ndarray, labels: Sequence[Hashable]) -> dict[str, float | int]:
    """:func:`class_retrieval_scores` with inner-product similarity (cosine for L2-normalised
    embeddings) of an (n, d) array."""
    x = np.asarray(embeddings, dtype=np.float64)
    if x.ndim != 2:
        raise NeedleInputError(f"embeddings must be an (n, d) array, got shape {x.shape}")
    return class_retrieval_scores(x @ x.T, labels)
