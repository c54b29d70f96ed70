import numpy as np
import pytest

from core.errors import NeedleInputError
from eval.metrics import average_precision_at_k, map_at_k, mean_average_precision


def brute_force_map(scores: np.ndarray, positives, k: int) -> float:
    """The ILIAS definition written out directly: sort by (-score, column), walk the top k."""
    aps = []
    for q in range(scores.shape[0]):
        order = sorted(range(scores.shape[1]), key=lambda j: (-scores[q, j], j))[:k]
        hits, total = 0, 0.0
        for i, j in enumerate(order, start=1):
            if j in positives[q]:
                hits += 1
                total += hits / i
        aps.append(total / min(k, len(positives[q])))
    return 100.0 * sum(aps) / len(aps)


@pytest.mark.parametrize("seed", range(20))
def test_map_at_k_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    nq, ndb = rng.integers(1, 8), rng.integers(5, 60)
    # Coarse scores create many ties, which must go to the lower column index.
    scores = rng.integers(0, 6, size=(nq, ndb)).astype(np.float32) if seed % 2 else rng.normal(size=(nq, ndb))
    positives = [set(rng.choice(ndb, size=rng.integers(1, ndb), replace=False).tolist()) for _ in range(nq)]
    k = int(rng.integers(1, ndb + 5))
    assert map_at_k(scores, positives, k) == pytest.approx(brute_force_map(scores, positives, k), abs=1e-9)


def test_ap_hand_computed():
    # positives at ranks 1 and 3 of 3 total positives, k=10: (1/1 + 2/3) / min(10, 3)
    assert average_precision_at_k(["a", "x", "b", "y"], {"a", "b", "c"}, 10) == pytest.approx((1 + 2 / 3) / 3)
    # k=2 cuts the second hit and the normaliser is min(k, npos) = 2
    assert average_precision_at_k(["a", "x", "b"], {"a", "b", "c"}, 2) == pytest.approx(1 / 2)


def test_ties_broken_by_lower_column():
    scores = np.array([[1.0, 1.0, 1.0]])
    assert map_at_k(scores, [{0}], 1) == 100.0
    assert map_at_k(scores, [{2}], 1) == 0.0


def test_rankings_and_scores_agree():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(4, 30))
    positives = [{1, 5}, {2}, {7, 8, 9}, {0}]
    rankings = [list(np.argsort(-s, kind="stable")) for s in scores]
    assert mean_average_precision(rankings, positives, 10) == pytest.approx(map_at_k(scores, positives, 10))


def test_bad_inputs_are_named():
    with pytest.raises(NeedleInputError, match="without positives"):
        map_at_k(np.zeros((1, 3)), [set()], 5)
    with pytest.raises(NeedleInputError, match="outside"):
        map_at_k(np.zeros((1, 3)), [{3}], 5)
    with pytest.raises(NeedleInputError, match=r"\(nq, ndb\)"):
        map_at_k(np.zeros(3), [{1}], 5)


def test_oracle_is_a_perfect_reranking_ap_even_past_the_database():
    """Issue 57, item 5: ``--k 1000`` on 120 images reported ``oracle_at_1000: 840.3``."""
    from eval.metrics import average_precision_at_k, ilias_oracle

    ranking = [f"db{i}" for i in range(120)]  # the whole database: shorter than k
    positives = ["db5", "db50", "db119", "elsewhere"]
    for k in (1000, 120, 60, 2):
        oracle = ilias_oracle(ranking, positives, k)
        found = [p for p in ranking[:k] if p in positives]
        best = found + [r for r in ranking[:k] if r not in positives]  # the positives first
        assert 0.0 <= oracle <= 1.0 and oracle == pytest.approx(average_precision_at_k(best, positives, k))
    assert ilias_oracle(ranking, positives, 1000) == pytest.approx(3 / 4)
    # Where ILIAS computes it (k results, at most k positives) it is the benchmark's hits / k x k / |gt|.
    assert ilias_oracle(ranking, positives, 60) == pytest.approx(2 / 60 * 60 / 4)
