"""Ground truth and scoring of bench/streaming.py, as the streaming track counts them.

Per search step: the exact k nearest live rows of every query (L2; the rows are unit vectors, so
the order is the inner product's too), and recall@k = |found ∩ truth| / k where the truth past rank k
is extended by ties: a live row within ``TIE`` of the k-th distance counts. Distances are taken in
float64 from the float16 rows for the truth and the answers alike, so a tie is never lost to
rounding in one of them.
"""

from __future__ import annotations

import numpy as np

TIE = 1e-6  # the track's tolerance on the L2 distance


def exact_distances(queries: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """L2 distances, float64, of query i to rows[i, j] (rows: (Q, m, d))."""
    diff = rows.astype(np.float64) - queries.astype(np.float64)[:, None, :]
    return np.sqrt((diff * diff).sum(axis=2))


def kth_distance(data: np.ndarray, live_rows: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """The exact k-th nearest distance among ``data[live_rows]`` per query (inf where fewer live rows).
    FAISS's flat scan finds 2k candidates; their distances are then recomputed in float64."""
    import faiss

    if len(live_rows) < k:
        return np.full(len(queries), np.inf)
    flat = faiss.IndexFlatL2(data.shape[1])
    for start in range(0, len(live_rows), 200_000):  # gathered in parts: float32 of 1M rows is big
        flat.add(np.ascontiguousarray(data[live_rows[start : start + 200_000]], dtype=np.float32))
    _, near = flat.search(np.ascontiguousarray(queries, dtype=np.float32), min(2 * k, len(live_rows)))
    exact = exact_distances(queries, data[live_rows[near]])
    return np.sort(exact, axis=1)[:, k - 1]


def score(
    found: np.ndarray, vec_of_tag: np.ndarray, data: np.ndarray, queries: np.ndarray, kth: np.ndarray, k: int
) -> tuple[float, int]:
    """(mean recall@k over queries, results naming a tag not live at the step). ``found``: (Q, k)
    tags, -1 where an answer had fewer results; a tag repeated in one answer counts once."""
    found = np.asarray(found, np.int64)[:, :k]
    valid = (found >= 0) & (found < len(vec_of_tag))
    rows = np.where(valid, vec_of_tag[np.clip(found, 0, len(vec_of_tag) - 1)], -1)
    deleted = int((valid & (rows < 0)).sum() + (found >= len(vec_of_tag)).sum())
    live = rows >= 0
    dist = exact_distances(queries, data[np.where(live, rows, 0)])
    hit = live & (dist <= kth[:, None] + TIE)
    # the same tag twice in one answer counts once: keep the first of each
    order = np.sort(np.where(hit, found, -1), axis=1)
    distinct = (order >= 0) & np.concatenate([np.ones((len(order), 1), bool), order[:, 1:] != order[:, :-1]], axis=1)
    live_count = int((vec_of_tag >= 0).sum())
    return float(distinct.sum(axis=1).mean() / max(1, min(k, live_count))), deleted
