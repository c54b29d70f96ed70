"""mAP@k exactly as the ILIAS benchmark defines it.

AP@k of one query = (1 / min(k, npos)) * sum over ranks i <= k that hold a positive of precision@i,
where npos is the number of positives in the whole database (not only those in the top k).
mAP@k = mean AP@k over queries, times 100.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence

import numpy as np

from core.errors import NeedleInputError


def average_precision_at_k(ranking: Sequence[Hashable], positives: Collection[Hashable], k: int) -> float:
    """AP@k (in [0, 1]) of one ranked list of database ids against its set of positive ids."""
    if k < 1:
        raise NeedleInputError(f"k must be >= 1, got {k}")
    positives = set(positives)
    if not positives:
        raise NeedleInputError("a query without positives has no AP; leave it out of the evaluation")
    hits = 0
    total = 0.0
    for rank, item in enumerate(ranking[:k], start=1):
        if item in positives:
            hits += 1
            total += hits / rank
    return total / min(k, len(positives))


def recall_at_k(ranking: Sequence[Hashable], positives: Collection[Hashable], k: int) -> float:
    """Positives in the top k over all positives (in [0, 1]): ILIAS's "oracle", the mAP@k a perfect
    re-ranking of the top k would reach is at most this."""
    positives = set(positives)
    if not positives:
        raise NeedleInputError("a query without positives has no recall; leave it out of the evaluation")
    return sum(1 for item in ranking[:k] if item in positives) / len(positives)


def rank_by_score(scores: np.ndarray) -> np.ndarray:
    """Column indices of each row by descending score; ties go to the lower column index."""
    return np.argsort(-np.asarray(scores), axis=1, kind="stable")


def map_at_k(scores: np.ndarray, positives: Sequence[Collection[int]], k: int) -> float:
    """mAP@k x 100 from an (nq, ndb) score matrix and, per query, its positive column indices."""
    scores = np.asarray(scores)
    if scores.ndim != 2:
        raise NeedleInputError(f"scores must be an (nq, ndb) array, got shape {scores.shape}")
    if len(positives) != scores.shape[0]:
        raise NeedleInputError(f"{len(positives)} positive sets for {scores.shape[0]} queries")
    for q, pos in enumerate(positives):
        bad = [p for p in pos if not 0 <= p < scores.shape[1]]
        if bad:
            raise NeedleInputError(f"query {q}: positive columns {bad[:5]} outside [0, {scores.shape[1]})")
    ranks = rank_by_score(scores)[:, :k]
    aps = [average_precision_at_k(ranks[q].tolist(), positives[q], k) for q in range(len(positives))]
    return 100.0 * float(np.mean(aps))


def mean_average_precision(
    rankings: Sequence[Sequence[Hashable]], positives: Sequence[Collection[Hashable]], k: int
) -> float:
    """mAP@k x 100 from precomputed rankings (e.g. an index's top-k keys) and positive id sets."""
    if len(rankings) != len(positives):
        raise NeedleInputError(f"{len(rankings)} rankings for {len(positives)} positive sets")
    if not rankings:
        raise NeedleInputError("no queries to evaluate")
    return 100.0 * float(np.mean([average_precision_at_k(r, p, k) for r, p in zip(rankings, positives)]))


def ilias_oracle(ranking: Sequence[Hashable], positives: Collection[Hashable], k: int) -> float:
    """The oracle, in [0, 1]: the AP@k a perfect re-ranking of the top k would reach, its positives
    first: hits / min(k, |positives|). It is ILIAS's figure (hits / len(list) × k / |positives|)
    wherever the benchmark computes it, a list of k results and at most k positives; on a database
    smaller than k ILIAS's formula grows past 1 (840.3 for k = 1000 on 120 images), so it is not
    used: the recall (hits / |positives|) is what a perfect order cannot change, this is its AP."""
    positives = set(positives)
    if not positives:
        raise NeedleInputError("a query without positives has no oracle; leave it out of the evaluation")
    hits = sum(1 for item in ranking[:k] if item in positives)
    return hits / min(k, len(positives))


def binned_ap(
    ranking: Sequence[Hashable],
    positives: Collection[Hashable],
    value_of: dict[Hashable, float],
    bins: Sequence[tuple[float, float]],
    k: int,
) -> dict[str, float]:
    """AP@k per bin of a per-positive attribute (ILIAS's scale and clutter breakdowns): for the bin
    [low, high), the positives outside it are removed from the ranking and from the ground truth;
    bins holding none of this query's positives are left out. Positives without a value belong to
    no bin."""
    positives = set(positives)
    out = {}
    for low, high in bins:
        inside = {p for p in positives if p in value_of and low <= value_of[p] < high}
        if not inside:
            continue
        outside = positives - inside
        kept = [item for item in ranking if item not in outside]
        out[f"{low}-{high}"] = average_precision_at_k(kept, inside, k)
    return out
