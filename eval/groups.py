"""Grouped evaluation of image descriptors: how well a similarity separates instance groups.

Images come with a group label (images of one group show the same instance). Four measures, all on
cosine similarity of the descriptors (they are L2-normalised here):

- **top-1** (pool retrieval): every image whose group holds at least one other image is a query;
  it ranks every other image of the evaluated set (all groups, singletons and distractors too: a
  group of one is a negative for every query and never a query itself). top-1 = share of queries
  whose nearest neighbour (self excluded; ties to the lower index) is of their group, x 100.
- **mAP** (same queries and rankings): AP of one query = mean over its positives (the other images
  of its group) of precision at the positive's rank, over the full ranking (no cut-off), x 100.
- **ARI** (K=2 clustering): for each pair of groups that both hold at least ``min_cluster_group``
  images, k-means with K=2 (k-means++ seeding, ``kmeans_restarts`` restarts, the lowest inertia
  kept) on the two groups' descriptors; the adjusted Rand index of the found split against the true
  one; the mean over pairs. All pairs when there are at most ``max_pairs``, else a seeded sample.
- **odd-one-out**: a trial is ``odd_group_size`` (3) images of one group (drawn uniformly among the
  groups that have that many) plus one image of any other group (a distractor, when given, is a
  group of one), in a seeded random order; the model picks the image of lowest mean similarity to
  the other three; accuracy x 100 (chance: 25).

Everything is deterministic for a seed and reports its counts (queries, pairs, trials, eligible
groups) next to the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from core.errors import NeedleInputError
from eval import kmeans as kmeans_lib
from eval.kmeans import KMeansConfig


class GroupEvalError(NeedleInputError):
    """Descriptors and labels that cannot be evaluated (shapes, too few groups)."""


@dataclass(frozen=True)
class GroupEvalConfig:
    seed: int = 0  # seeds the pair sample, the k-means restarts and the odd-one-out trials
    max_pairs: int = 2000  # group pairs clustered for the ARI (all of them when there are fewer)
    min_cluster_group: int = 2  # a group joins the ARI pairs only with at least this many images
    kmeans_restarts: int = 10  # k-means++ restarts per pair; the lowest inertia is kept
    kmeans_max_iter: int = 100  # Lloyd iterations per restart (it stops earlier when stable)
    odd_trials: int = 1000  # odd-one-out trials
    odd_group_size: int = 3  # images of the majority group in a trial (plus one odd image)

    def __post_init__(self) -> None:
        if self.max_pairs < 1 or self.kmeans_restarts < 1 or self.kmeans_max_iter < 1 or self.odd_trials < 0:
            raise GroupEvalError(
                f"max_pairs, kmeans_restarts, kmeans_max_iter must be >= 1 and odd_trials >= 0: {self}"
            )
        if self.min_cluster_group < 1 or self.odd_group_size < 2:
            raise GroupEvalError(f"min_cluster_group must be >= 1 and odd_group_size >= 2: {self}")


def _label_ids(labels: Sequence[Any]) -> np.ndarray:
    """Labels of any hashable kind -> int ids (first-seen order does not matter for any measure)."""
    _, ids = np.unique(np.asarray([str(label) for label in labels]), return_inverse=True)
    return ids.astype(np.int64)


def _normalised(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise GroupEvalError(f"descriptors must be an (n, d) array, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise GroupEvalError("descriptors hold NaN or infinite values")
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def cosine_similarity(x: np.ndarray) -> np.ndarray:
    """(n, n) cosine similarities of the rows of ``x``."""
    x = _normalised(x)
    return x @ x.T


# --- pool retrieval: top-1 and mAP --------------------------------------------------------------


def pool_rankings(sim: np.ndarray) -> np.ndarray:
    """(n, n-1): each row's other images by descending similarity, ties to the lower index."""
    sim = np.asarray(sim, dtype=np.float64)
    n = sim.shape[0]
    masked = sim.copy()
    # Self goes last (-inf) and is cut off; a stable sort keeps ties in index order.
    np.fill_diagonal(masked, -np.inf)
    return np.argsort(-masked, axis=1, kind="stable")[:, : n - 1]


def pool_retrieval(sim: np.ndarray, labels: Sequence[Any]) -> dict[str, Any]:
    """top-1 and mAP (x 100) of every image with a positive against the pool of all others."""
    sim = np.asarray(sim, dtype=np.float64)
    ids = _label_ids(labels)
    n = len(ids)
    if sim.shape != (n, n):
        raise GroupEvalError(f"similarity matrix of shape {sim.shape} for {n} labels")
    sizes = np.bincount(ids)
    queries = np.flatnonzero(sizes[ids] >= 2)
    if len(queries) == 0:
        raise GroupEvalError("no group holds two images: nothing to retrieve")
    order = pool_rankings(sim)[queries]
    hits = ids[order] == ids[queries, None]  # (q, n-1) relevance in rank order
    ranks = np.arange(1, n, dtype=np.float64)
    precision = np.cumsum(hits, axis=1) / ranks
    ap = (precision * hits).sum(axis=1) / hits.sum(axis=1)
    return {
        "top1": 100.0 * float(hits[:, 0].mean()),
        "map": 100.0 * float(ap.mean()),
        "queries": len(queries),
        "pool": int(n),
    }


# --- ARI of K=2 k-means over group pairs --------------------------------------------------------


def adjusted_rand_index(truth: Sequence[Any], pred: Sequence[Any]) -> float:
    """Hubert and Arabie's adjusted Rand index of two labelings of the same items.

    ARI = (sum_ij C(n_ij, 2) - E) / ((A + B) / 2 - E), with n_ij the contingency table, A and B the
    sums of C(row total, 2) and C(column total, 2), E = A B / C(n, 2). When the denominator is 0
    (both labelings put everything in one cluster, or everything apart), they agree: 1.0.
    """
    t, p = _label_ids(truth), _label_ids(pred)
    if len(t) != len(p):
        raise GroupEvalError(f"labelings of different lengths: {len(t)} and {len(p)}")
    table = np.zeros((t.max(initial=-1) + 1, p.max(initial=-1) + 1), dtype=np.int64)
    np.add.at(table, (t, p), 1)

    def pairs(counts: np.ndarray) -> float:
        counts = counts.astype(np.float64)
        return float((counts * (counts - 1) / 2).sum())

    index, a, b = pairs(table), pairs(table.sum(axis=1)), pairs(table.sum(axis=0))
    total = len(t) * (len(t) - 1) / 2
    expected = a * b / total if total > 0 else 0.0
    maximum = (a + b) / 2
    if maximum == expected:
        return 1.0
    return (index - expected) / (maximum - expected)


def kmeans(x: np.ndarray, k: int, seed: int = 0, restarts: int = 10, max_iter: int = 100) -> tuple[np.ndarray, float]:
    """Lloyd's k-means with k-means++ seeding (eval/kmeans.py; exact distances, an emptied
    cluster's centre moved onto the worst-served point): (labels (n,), inertia) of the best of
    ``restarts``."""
    conf = KMeansConfig(
        restarts=restarts, max_iter=max_iter, distances="direct", empty="move_centre", coincident_draw="choice"
    )
    result = kmeans_lib.kmeans(x, k, seed, conf, error=GroupEvalError)
    return result.labels, result.inertia


def group_pairs(labels: Sequence[Any], min_size: int, max_pairs: int, seed: int) -> list[tuple[int, int]]:
    """Pairs (a < b) of group ids that both have ``min_size`` images: all, or a seeded sample."""
    ids = _label_ids(labels)
    eligible = np.flatnonzero(np.bincount(ids) >= min_size)
    pairs = [(int(a), int(b)) for i, a in enumerate(eligible) for b in eligible[i + 1 :]]
    if len(pairs) > max_pairs:
        keep = np.sort(np.random.default_rng(seed).choice(len(pairs), size=max_pairs, replace=False))
        pairs = [pairs[i] for i in keep]
    return pairs


def pair_clustering_ari(x: np.ndarray, labels: Sequence[Any], conf: GroupEvalConfig) -> dict[str, Any]:
    """Mean ARI of K=2 k-means on the images of each pair of groups, against the true split."""
    x = _normalised(x)
    ids = _label_ids(labels)
    pairs = group_pairs(labels, conf.min_cluster_group, conf.max_pairs, conf.seed)
    if not pairs:
        return {"ari": None, "pairs": 0, "perfect_splits": 0}
    seeds = np.random.SeedSequence(conf.seed).generate_state(len(pairs))
    scores = []
    for (a, b), seed in zip(pairs, seeds):
        members = np.flatnonzero((ids == a) | (ids == b))
        found, _ = kmeans(x[members], 2, int(seed), conf.kmeans_restarts, conf.kmeans_max_iter)
        scores.append(adjusted_rand_index(ids[members], found))
    scores = np.asarray(scores)
    return {"ari": float(scores.mean()), "pairs": len(pairs), "perfect_splits": int((scores >= 1.0 - 1e-12).sum())}


# --- odd-one-out -------------------------------------------------------------------------------


def sample_odd_trials(
    labels: Sequence[Any], trials: int, group_size: int = 3, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(trials, group_size + 1) image indices in shown order, and each trial's odd position."""
    ids = _label_ids(labels)
    eligible = np.flatnonzero(np.bincount(ids) >= group_size)
    if trials == 0 or len(eligible) == 0 or len(np.unique(ids)) < 2:
        return np.zeros((0, group_size + 1), dtype=np.int64), np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng(seed)
    shown, odd_at = [], []
    for _ in range(trials):
        group = eligible[rng.integers(len(eligible))]
        same = rng.choice(np.flatnonzero(ids == group), size=group_size, replace=False)
        others = np.flatnonzero(ids != group)
        items = np.append(same, others[rng.integers(len(others))])
        order = rng.permutation(group_size + 1)  # where the odd image lands is random
        shown.append(items[order])
        odd_at.append(int(np.flatnonzero(order == group_size)[0]))
    return np.asarray(shown, dtype=np.int64), np.asarray(odd_at, dtype=np.int64)


def odd_one_out_choices(sim: np.ndarray, shown: np.ndarray) -> np.ndarray:
    """Per trial, the position of the image with the lowest mean similarity to the others (ties to
    the first position)."""
    sim = np.asarray(sim, dtype=np.float64)
    block = sim[shown[:, :, None], shown[:, None, :]]  # (t, m, m)
    m = shown.shape[1]
    off_diagonal = block.sum(axis=2) - np.diagonal(block, axis1=1, axis2=2)
    return (off_diagonal / (m - 1)).argmin(axis=1)


def odd_one_out(sim: np.ndarray, labels: Sequence[Any], conf: GroupEvalConfig) -> dict[str, Any]:
    ids = _label_ids(labels)
    eligible = int((np.bincount(ids) >= conf.odd_group_size).sum())
    shown, odd_at = sample_odd_trials(labels, conf.odd_trials, conf.odd_group_size, conf.seed)
    if len(shown) == 0:
        return {"accuracy": None, "trials": 0, "eligible_groups": eligible, "chance": 100.0 / (conf.odd_group_size + 1)}
    correct = odd_one_out_choices(sim, shown) == odd_at
    return {
        "accuracy": 100.0 * float(correct.mean()),
        "trials": len(shown),
        "eligible_groups": eligible,
        "chance": 100.0 / (conf.odd_group_size + 1),
    }


def evaluate_groups(x: np.ndarray, labels: Sequence[Any], conf: GroupEvalConfig = GroupEvalConfig()) -> dict[str, Any]:
    """All four measures of descriptors ``x`` (n, d) with group ``labels`` (n,)."""
    x = _normalised(x)
    if len(labels) != len(x):
        raise GroupEvalError(f"{len(labels)} labels for {len(x)} descriptors")
    sim = x @ x.T
    retrieval = pool_retrieval(sim, labels)
    ari = pair_clustering_ari(x, labels, conf)
    odd = odd_one_out(sim, labels, conf)
    return {
        "top1": retrieval["top1"],
        "map": retrieval["map"],
        "ari": ari["ari"],
        "odd_one_out": odd["accuracy"],
        "counts": {
            "images": len(x),
            "groups": len(np.unique(_label_ids(labels))),
            "queries": retrieval["queries"],
            "ari_pairs": ari["pairs"],
            "ari_perfect_splits": ari["perfect_splits"],
            "odd_trials": odd["trials"],
            "odd_eligible_groups": odd["eligible_groups"],
        },
        "config": asdict(conf),
    }
