"""Query expansion over the verified top of a re-ranked shortlist, held to a plain loop."""

from __future__ import annotations

import numpy as np
import pytest

from core.errors import NeedleInputError
from rerank.expand import ExpansionConfig, expanded_query, expanded_scores


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def loop_expansion(query, vectors, order, inliers, conf):
    """α-QE written out result by result."""
    total = [float(v) for v in query]
    used = 0
    for position in range(min(conf.top, len(order))):
        c = int(order[position])
        if inliers[c] < conf.min_inliers:
            continue
        similarity = sum(float(a) * float(b) for a, b in zip(query, vectors[c]))
        weight = max(0.0, similarity) ** conf.alpha
        total = [t + weight * float(v) for t, v in zip(total, vectors[c])]
        used += 1
    if not used:
        return None
    norm = sum(t * t for t in total) ** 0.5
    return np.array([t / norm for t in total])


@pytest.mark.parametrize(
    "conf",
    [
        ExpansionConfig(top=1, min_inliers=1),
        ExpansionConfig(top=3, min_inliers=8, alpha=0.0),
        ExpansionConfig(top=5, min_inliers=5, alpha=3.0),
        ExpansionConfig(top=50, min_inliers=20, alpha=1.0),
    ],
)
def test_expansion_equals_the_loop(conf: ExpansionConfig) -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        C, d = int(rng.integers(1, 40)), 16
        vectors = unit(rng.normal(size=(C, d)))
        query = unit(rng.normal(size=d) + 2 * vectors[0])  # similar to some, opposed to others (weight 0)
        order = rng.permutation(C)
        inliers = rng.integers(0, 30, C)
        got = expanded_query(query, vectors, order, inliers, conf)
        want = loop_expansion(query, vectors, order, inliers, conf)
        if want is None:
            assert got is None and expanded_scores(query, vectors, order, inliers, conf) is None
            continue
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(expanded_scores(query, vectors, order, inliers, conf), vectors @ want, atol=1e-12)


def test_off_unverified_and_bad_inputs() -> None:
    rng = np.random.default_rng(1)
    vectors = unit(rng.normal(size=(5, 8)))
    query = unit(rng.normal(size=8))
    order = np.arange(5)
    assert expanded_query(query, vectors, order, np.full(5, 99), ExpansionConfig()) is None  # top=0: off
    assert expanded_query(query, vectors, order, np.full(5, 7), ExpansionConfig(top=5, min_inliers=8)) is None
    # a verified result below the looked-at top is not used
    inliers = np.array([0, 0, 0, 0, 50])
    assert expanded_query(query, vectors, order, inliers, ExpansionConfig(top=4, min_inliers=1)) is None
    with pytest.raises(NeedleInputError, match="top"):
        ExpansionConfig(top=-1)
    with pytest.raises(NeedleInputError, match="alpha"):
        ExpansionConfig(alpha=-1.0)
    with pytest.raises(NeedleInputError, match="fit"):
        expanded_query(query[:4], vectors, order, inliers, ExpansionConfig(top=1))
    with pytest.raises(NeedleInputError, match="cover"):
        expanded_query(query, vectors, order[:3], inliers, ExpansionConfig(top=1))
