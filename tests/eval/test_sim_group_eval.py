"""The grouped evaluation (eval/groups.py): pool retrieval, k-means, pair-clustering ARI and odd-one-out,
each against a brute-force reference, ARI against scikit-learn."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from eval.groups import (
    GroupEvalConfig,
    GroupEvalError,
    adjusted_rand_index,
    evaluate_groups,
    group_pairs,
    kmeans,
    odd_one_out,
    odd_one_out_choices,
    pair_clustering_ari,
    pool_retrieval,
    sample_odd_trials,
)
from eval.metrics import average_precision_at_k


@pytest.mark.parametrize("seed", range(30))
def test_ari_matches_sklearn(seed):
    from sklearn.metrics import adjusted_rand_score

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 25))
    truth = rng.integers(0, int(rng.integers(1, 6)), size=n)
    pred = rng.integers(0, int(rng.integers(1, 6)), size=n)
    if seed % 5 == 0:
        pred = truth.copy()  # perfect agreement, relabelled below
    pred = pred * 7 + 3  # label values themselves must not matter
    assert adjusted_rand_index(truth, pred) == pytest.approx(adjusted_rand_score(truth, pred), abs=1e-12)


@pytest.mark.parametrize(
    "truth, pred",
    [
        ([0, 0, 0, 0], [1, 1, 1, 1]),  # one cluster both
        ([0, 1, 2, 3], [3, 2, 1, 0]),  # all apart both
        ([0, 0, 0, 0], [0, 1, 2, 3]),  # one cluster against all apart
        ([0, 0, 1, 1], [0, 1, 0, 1]),  # the worst 2+2 split
        ([0], [5]),
        (["a", "a", "b"], ["x", "y", "y"]),
    ],
)
def test_ari_degenerate_cases_match_sklearn(truth, pred):
    from sklearn.metrics import adjusted_rand_score

    assert adjusted_rand_index(truth, pred) == pytest.approx(adjusted_rand_score(truth, pred), abs=1e-12)


def brute_force_pool(sim: np.ndarray, labels: list) -> tuple[float, float, int]:
    n = len(labels)
    top1, aps = [], []
    for q in range(n):
        positives = {j for j in range(n) if j != q and labels[j] == labels[q]}
        if not positives:
            continue
        ranking = sorted((j for j in range(n) if j != q), key=lambda j: (-sim[q, j], j))
        top1.append(ranking[0] in positives)
        aps.append(average_precision_at_k(ranking, positives, n))
    return 100.0 * float(np.mean(top1)), 100.0 * float(np.mean(aps)), len(aps)


@pytest.mark.parametrize("seed", range(15))
def test_pool_retrieval_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 30))
    labels = [f"g{v}" for v in rng.integers(0, max(1, n // 2), size=n)]
    labels[0] = labels[1]  # at least one query
    labels.append("singleton")  # a negative only
    n += 1
    # Coarse similarities make ties, which go to the lower index.
    sim = rng.integers(0, 4, size=(n, n)).astype(float) if seed % 2 else rng.normal(size=(n, n))
    sim = (sim + sim.T) / 2
    got = pool_retrieval(sim, labels)
    top1, mean_ap, queries = brute_force_pool(sim, labels)
    assert got["top1"] == pytest.approx(top1, abs=1e-9)
    assert got["map"] == pytest.approx(mean_ap, abs=1e-9)
    assert got["queries"] == queries and got["pool"] == n


def test_pool_retrieval_errors():
    with pytest.raises(GroupEvalError, match="no group holds two"):
        pool_retrieval(np.eye(3), ["a", "b", "c"])
    with pytest.raises(GroupEvalError, match="shape"):
        pool_retrieval(np.eye(3), ["a", "a"])


@pytest.mark.parametrize("seed", range(10))
def test_kmeans_is_a_lloyd_fixed_point(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(int(rng.integers(2, 20)), 3))
    labels, inertia = kmeans(x, 2, seed=seed, restarts=3)
    centres = np.stack([x[labels == c].mean(axis=0) for c in range(2)])  # both clusters non-empty
    d2 = ((x[:, None] - centres[None]) ** 2).sum(-1)
    assert np.array_equal(d2.argmin(axis=1), labels)
    assert inertia == pytest.approx(d2.min(axis=1).sum())


def brute_force_best_split(x: np.ndarray) -> float:
    best = np.inf
    for bits in itertools.product([0, 1], repeat=len(x) - 1):
        labels = np.array((0, *bits))
        if labels.min() == labels.max():
            continue
        best = min(best, sum(((x[labels == c] - x[labels == c].mean(axis=0)) ** 2).sum() for c in (0, 1)))
    return best


@pytest.mark.parametrize("seed", range(8))
def test_kmeans_finds_the_optimal_two_split(seed):
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.normal(size=(4, 3)), rng.normal(size=(4, 3)) + 1.5])
    _, inertia = kmeans(x, 2, seed=seed, restarts=10)
    assert inertia == pytest.approx(brute_force_best_split(x), rel=1e-9)


def test_kmeans_seeded_and_checked():
    x = np.random.default_rng(0).normal(size=(12, 4))
    assert np.array_equal(kmeans(x, 2, seed=3)[0], kmeans(x, 2, seed=3)[0])
    assert kmeans(np.ones((3, 2)), 2, seed=0)[1] == 0.0  # duplicates: still two clusters, zero inertia
    with pytest.raises(GroupEvalError):
        kmeans(x[:1], 2)


def blobs(sizes: list[int], dim: int = 6, spread: float = 0.05, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    rng = np.random.default_rng(seed)
    centres = np.eye(dim)[: len(sizes)]
    x = np.concatenate([c + spread * rng.normal(size=(s, dim)) for c, s in zip(centres, sizes)])
    return x, [f"g{i}" for i, s in enumerate(sizes) for _ in range(s)]


def test_pair_ari_on_separated_groups_and_counts():
    x, labels = blobs([2, 3, 2, 4, 1])
    result = pair_clustering_ari(x, labels, GroupEvalConfig())
    assert result == {"ari": 1.0, "pairs": 6, "perfect_splits": 6}  # 4 groups of >= 2: C(4, 2) pairs
    # Random descriptors: clearly below a perfect split.
    noise = np.random.default_rng(1).normal(size=x.shape)
    assert pair_clustering_ari(noise, labels, GroupEvalConfig())["ari"] < 0.9


def test_group_pairs_sample_is_seeded_subset():
    labels = [g for g in range(10) for _ in range(2)]
    everything = group_pairs(labels, 2, 1000, 0)
    assert len(everything) == 45
    sample = group_pairs(labels, 2, 10, 5)
    assert len(sample) == 10 and set(sample) <= set(everything)
    assert sample == group_pairs(labels, 2, 10, 5) and sample != group_pairs(labels, 2, 10, 6)


def test_odd_trials_are_valid_and_choices_match_a_loop():
    rng = np.random.default_rng(0)
    labels = ["a"] * 4 + ["b"] * 3 + ["c"] * 2 + ["d"]
    shown, odd_at = sample_odd_trials(labels, 200, 3, seed=1)
    assert shown.shape == (200, 4)
    for items, odd in zip(shown, odd_at):
        groups = [labels[i] for i in items]
        majority = [g for k, g in enumerate(groups) if k != odd]
        assert len(set(items)) == 4 and len(set(majority)) == 1 and groups[odd] != majority[0]
        assert majority[0] in ("a", "b")  # only groups of >= 3 images hold the three
    assert set(odd_at) == {0, 1, 2, 3}  # the odd image lands everywhere
    sim = rng.integers(0, 3, size=(10, 10)).astype(float)  # ties go to the first position
    sim = (sim + sim.T) / 2
    choices = odd_one_out_choices(sim, shown)
    for items, choice in zip(shown, choices):
        means = [np.mean([sim[i, j] for j in items if j != i]) for i in items]
        assert choice == min(range(4), key=lambda k: (means[k], k))


def test_odd_one_out_accuracy_and_empty_case():
    x, labels = blobs([3, 4, 2, 1])
    result = odd_one_out(x @ x.T, labels, GroupEvalConfig(odd_trials=100))
    assert result["accuracy"] == 100.0 and result["trials"] == 100 and result["eligible_groups"] == 2
    x, labels = blobs([2, 2])
    assert odd_one_out(x @ x.T, labels, GroupEvalConfig())["accuracy"] is None


def test_evaluate_groups_perfect_and_seeded():
    x, labels = blobs([3, 2, 4, 2])
    report = evaluate_groups(x, labels, GroupEvalConfig(odd_trials=50))
    assert (report["top1"], report["map"], report["ari"], report["odd_one_out"]) == (100.0, 100.0, 1.0, 100.0)
    assert report["counts"]["queries"] == 11 and report["counts"]["ari_pairs"] == 6
    noise = np.random.default_rng(0).normal(size=(11, 6))
    conf = GroupEvalConfig(odd_trials=50, seed=4)
    assert evaluate_groups(noise, labels, conf) == evaluate_groups(noise, labels, conf)
    with pytest.raises(GroupEvalError):
        evaluate_groups(noise, labels[:-1])
