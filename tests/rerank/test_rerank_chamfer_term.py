"""SP's Chamfer term in the ensemble (rerank/ensemble.py, issue 37): written out candidate by
candidate, and the Chamfer similarities SP's local scores carry are the Chamfer method's own."""

from __future__ import annotations

import numpy as np
import pytest

from core.errors import NeedleInputError
from rerank.ensemble import EnsembleConfig, ValidationQuery, combine, mean_ap
from rerank.rerank import RerankConfig, Reranker, no_local_scores, with_kind_defaults
from tests.support.rerank_tokens import random_shortlist, realish


def test_chamfer_term_equals_a_plain_loop():
    rng = np.random.default_rng(3)
    for _ in range(20):
        raw, has, s_global = random_shortlist(rng, 200)
        c = len(raw)
        chamfer = rng.uniform(-0.2, 0.6, c)
        conf = EnsembleConfig(lam=0.4, inlier_cap=30, chamfer_weight=0.3)
        want = []
        for i in range(c):
            local = min(float(raw[i]), 30) / 30
            mixed = 0.4 * s_global[i] + 0.6 * local + 0.3 * max(float(chamfer[i]), 0.0)
            want.append(mixed if has[i] else s_global[i])
        np.testing.assert_allclose(combine("sp", s_global, raw, has, conf, chamfer), want, rtol=0, atol=1e-12)
        # other methods have no Chamfer term: the weight does not touch them
        ames = combine("ames", s_global, raw, has, conf, chamfer)
        np.testing.assert_allclose(ames, combine("ames", s_global, raw, has, EnsembleConfig(lam=0.4)))


def test_chamfer_term_needs_the_similarities_and_a_weight_in_range():
    with pytest.raises(NeedleInputError, match="chamfer_weight"):
        EnsembleConfig(chamfer_weight=1.5)
    with pytest.raises(NeedleInputError, match="chamfer_weight"):
        EnsembleConfig(chamfer_weight=-0.1)
    ones = np.ones(4)
    with pytest.raises(NeedleInputError, match="Chamfer similarities"):
        combine("sp", ones, ones, ones.astype(bool), EnsembleConfig(chamfer_weight=0.3))
    with pytest.raises(NeedleInputError, match="shape"):
        combine("sp", ones, ones, ones.astype(bool), EnsembleConfig(chamfer_weight=0.3), np.ones(3))
    # no weight: nothing needed
    combine("sp", ones, ones, ones.astype(bool), EnsembleConfig(chamfer_weight=0.0))


@pytest.mark.parametrize("seed", [0, 1])
def test_sp_local_scores_carry_the_chamfer_methods_similarities(seed):
    """One Hamming pass serves both: SP's ``chamfer`` is exactly what method "chamfer" scores with
    the same (asymmetric) distances, candidates without tokens at 0."""
    query, batch = realish(seed, C=60, Q=80, T=40, empty=(3,))
    sp = Reranker(RerankConfig()).local_scores(query, batch)
    chamfer = Reranker(RerankConfig(method="chamfer")).local_scores(query, batch).raw
    np.testing.assert_array_equal(sp.chamfer, chamfer)
    assert sp.chamfer[3] == 0.0 and (sp.chamfer[sp.has_locals] != 0).all()
    # the re-ranker's order uses it: a weight changes the final scores by w * max(0, chamfer)
    rows, s_global = np.arange(len(chamfer)), np.linspace(1, 0, len(chamfer))
    with_term = Reranker(RerankConfig(ensemble=EnsembleConfig(chamfer_weight=0.5))).order(rows, s_global, sp)[1]
    without = Reranker(RerankConfig(ensemble=EnsembleConfig(chamfer_weight=0.0))).order(rows, s_global, sp)[1]
    expected = np.where(sp.has_locals, 0.5 * np.maximum(chamfer, 0), 0.0)
    np.testing.assert_allclose(with_term - without, expected, rtol=0, atol=1e-12)


def test_the_term_is_the_token_kinds_own_unless_set():
    """ALIKED's held-out choice (0.3) where left open; kinds not measured with it, and an index
    whose kind is not known, get none; a value set is kept whatever the kind."""
    assert with_kind_defaults(RerankConfig(), "aliked").ensemble.chamfer_weight == 0.3
    assert with_kind_defaults(RerankConfig(), "cnn").ensemble.chamfer_weight == 0.0
    assert with_kind_defaults(RerankConfig(), None).ensemble.chamfer_weight == 0.0
    mine = RerankConfig(ensemble=EnsembleConfig(chamfer_weight=0.15))
    assert with_kind_defaults(mine, "aliked").ensemble.chamfer_weight == 0.15
    assert with_kind_defaults(mine, "cnn").ensemble.chamfer_weight == 0.15
    assert Reranker(RerankConfig(), "aliked").conf.ensemble.chamfer_weight == 0.3
    # left open outside any kind: the ensemble adds nothing (the plain SP ensemble)
    ones = np.ones(3)
    np.testing.assert_array_equal(
        combine("sp", ones, ones, ones.astype(bool), EnsembleConfig()),
        combine("sp", ones, ones, ones.astype(bool), EnsembleConfig(chamfer_weight=0.0)),
    )


def test_a_query_without_tokens_keeps_the_global_order_with_the_term_on():
    local = no_local_scores(5)
    s_global = np.array([0.9, 0.1, 0.5, 0.3, 0.7])
    reranker = Reranker(RerankConfig(ensemble=EnsembleConfig(chamfer_weight=0.3)))
    order, scores = reranker.order(np.arange(5), s_global, local)
    np.testing.assert_array_equal(scores, s_global)
    np.testing.assert_array_equal(order, [0, 4, 2, 3, 1])


def test_validation_map_scores_the_term():
    """A positive SP cannot verify (no inliers) but whose tokens resemble the query's rises with
    the term, in the validation mAP the grid search maximises."""
    q = ValidationQuery(
        rows=np.arange(3),
        s_global=np.array([0.9, 0.8, 0.7]),
        raw_local=np.zeros(3),
        has_locals=np.ones(3, bool),
        positive=np.array([False, False, True]),
        n_positives=1,
        chamfer=np.array([0.1, 0.1, 0.6]),
    )
    assert mean_ap([q], "sp", EnsembleConfig(lam=0.5, chamfer_weight=0.0), 1000) == pytest.approx(100 / 3)
    assert mean_ap([q], "sp", EnsembleConfig(lam=0.5, chamfer_weight=0.3), 1000) == pytest.approx(100.0)
