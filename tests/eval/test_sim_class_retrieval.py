"""The class-level retrieval metrics MAP@R and R-Precision (eval/class_retrieval.py), against a
brute-force reference written from their definitions."""

from __future__ import annotations

import numpy as np
import pytest

from core.errors import NeedleInputError
from eval.class_retrieval import class_retrieval_from_embeddings, class_retrieval_per_query, class_retrieval_scores


def brute_force_class_retrieval(scores: np.ndarray, labels: list, per_query: bool = False):
    """Musgrave et al.'s definitions, one query at a time, written out."""
    n = len(labels)
    maps, rps, queries = [], [], []
    for q in range(n):
        others = sorted((j for j in range(n) if j != q), key=lambda j: (-scores[q, j], j))
        r = sum(1 for j in others if labels[j] == labels[q])
        if r == 0:
            continue
        correct = [labels[j] == labels[q] for j in others[:r]]
        precision_terms = [sum(correct[: i + 1]) / (i + 1) if correct[i] else 0.0 for i in range(r)]
        maps.append(sum(precision_terms) / r)
        rps.append(sum(correct) / r)
        queries.append(q)
    if per_query:
        return maps, rps, queries
    return 100 * float(np.mean(maps)), 100 * float(np.mean(rps)), len(maps)


@pytest.mark.parametrize("seed", range(6))
def test_class_retrieval_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 40))
    labels = [f"c{v}" for v in rng.integers(0, max(2, n // 3), n)]
    labels[0] = labels[1]  # at least one label with two images
    scores = rng.integers(0, 4, (n, n)).astype(float) if seed % 2 else rng.normal(size=(n, n))  # odd seeds: many ties
    got = class_retrieval_scores(scores, labels)
    want_map, want_rp, want_q = brute_force_class_retrieval(scores, labels)
    assert got["queries"] == want_q
    assert got["map_at_r"] == pytest.approx(want_map, abs=1e-9)
    assert got["r_precision"] == pytest.approx(want_rp, abs=1e-9)
    maps, rps, queries = class_retrieval_per_query(scores, labels)
    want = brute_force_class_retrieval(scores, labels, per_query=True)
    np.testing.assert_allclose(maps, want[0], atol=1e-12)
    np.testing.assert_allclose(rps, want[1], atol=1e-12)
    assert queries.tolist() == want[2]


def test_class_retrieval_hand_computed():
    # Query 0 (label a, R = 2) ranks 2 (a), 3 (b), 1 (a): MAP@R = (1/1 + 0) / 2, R-Precision = 1/2.
    labels = ["a", "a", "a", "b", "b", "z"]
    scores = np.zeros((6, 6))
    scores[0] = [9, 1, 5, 3, 0, -1]
    scores[1] = [5, 9, 4, 0, 0, -1]  # 0 (a), 2 (a): perfect
    scores[2] = [0, 1, 9, 5, 0, -1]  # 3 (b), 1 (a), 0 (a): terms 0 + 1/2 -> MAP@R 1/4, RP 1/2
    scores[3] = [0, 0, 0, 9, 1, -1]  # 4 (b) first, then ties to index order: perfect
    scores[4] = [0, 0, 1, 0, 9, -1]  # 2 (a) then 0, 1, 3 tie -> 0 (a): MAP@R 0, RP 0
    got = class_retrieval_scores(scores, labels)
    assert got["queries"] == 5  # the lone "z" is a reference only
    assert got["map_at_r"] == pytest.approx(100 * (0.5 + 1 + 0.25 + 1 + 0) / 5)
    assert got["r_precision"] == pytest.approx(100 * (0.5 + 1 + 0.5 + 1 + 0) / 5)


def test_class_retrieval_from_embeddings_and_errors():
    x = np.eye(4)[[0, 0, 1, 1]] + 0.01 * np.arange(4)[:, None]
    assert class_retrieval_from_embeddings(x, [1, 1, 2, 2])["map_at_r"] == pytest.approx(100.0)
    with pytest.raises(NeedleInputError, match="no label has two images"):
        class_retrieval_scores(np.zeros((3, 3)), ["a", "b", "c"])
    with pytest.raises(NeedleInputError, match="labels for"):
        class_retrieval_scores(np.zeros((3, 3)), ["a", "a"])
    with pytest.raises(NeedleInputError, match="square"):
        class_retrieval_scores(np.zeros((3, 4)), ["a", "a", "b"])
    with pytest.raises(NeedleInputError, match="NaN"):
        class_retrieval_scores(np.full((2, 2), np.nan), ["a", "a"])
