"""bench/rerank_sources.py: leave-one-source-out selection of re-ranking settings (issue 37) on tiny
hand-made per-query AP tables, and the AP table's re-ranking arithmetic on a tiny shortlist."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from rerank.ensemble import ValidationQuery, ap_of_order

_spec = importlib.util.spec_from_file_location(
    "bench_rerank_sources", Path(__file__).resolve().parents[2] / "bench" / "rerank_sources.py"
)
rs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rs)

# Sources: A has 3 queries, B and C 2 each (unequal sizes: pooled per query != mean of sources).
SOURCES = ["A", "A", "A", "B", "B", "C", "C"]
TABLE = np.array(
    [
        [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5],  # 0: fair everywhere (best in-sample overall)
        [1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.1],  # 1: best on A only
        [0.0, 0.0, 0.0, 0.7, 0.7, 0.6, 0.6],  # 2: best on B and C, useless on A
    ]
)


def test_a_setting_best_only_on_the_held_out_source_is_not_chosen_for_it():
    chosen, per_query = rs.held_out(TABLE, SOURCES)
    # A's fold sees B and C only: setting 2 (0.65) beats 0 (0.5) and 1 (0.1); 1 is never chosen for A
    assert chosen["A"] == 2
    # B's fold: A and C pooled per query, 1: (3 x 1.0 + 2 x 0.1) / 5 = 0.64 > 0 (0.5) > 2 (0.24)
    assert chosen["B"] == 1 and chosen["C"] == 1
    np.testing.assert_allclose(per_query, [0.0, 0.0, 0.0, 0.1, 0.1, 0.1, 0.1])


def test_pooled_arithmetic_and_report():
    global_aps = np.full(7, 0.3)
    report = rs.source_report(
        [
            {"tokens": "t", "max_hamming": 28, "pair_seeds": 8, "floor": 0.0, "chamfer": 0.0, "qe": None, "lam": lam}
            for lam in (0, 1, 2)
        ],
        TABLE,
        global_aps,
        SOURCES,
        default_row=0,
    )
    pooled = 100 * np.mean([0.0, 0.0, 0.0, 0.1, 0.1, 0.1, 0.1])  # per query, not the mean of source means
    assert report["map_at_1k_source_held_out"] == pytest.approx(round(pooled, 2))
    assert report["gain_source_held_out"] == pytest.approx(round(pooled - 30.0, 2))
    assert report["gain_source_held_out_mean_of_sources"] == pytest.approx(round(np.mean([-30, -20, -20]), 2))
    a = report["by_source_held_out"]["A"]
    assert (a["queries"], a["global"], a["held_out"], a["gain"]) == (3, 30.0, 0.0, -30.0)
    assert a["chosen"].endswith("lam=2") and a["validation_map"] == 65.0
    assert report["worst_source_held_out"] == {"source": "A", "gain": -30.0}
    assert report["defaults_in_sample"]["map_at_1k"] == 50.0  # row 0 over every query
    # the consensus is what most folds chose (1, by B and C), not the in-sample best (0)
    assert report["consensus_setting"]["folds_choosing_it"] == 2
    assert report["consensus_setting"]["setting"].endswith("lam=1")
    assert report["best_in_sample"].endswith("lam=0")


def test_ties_go_to_the_first_row_and_one_source_is_refused():
    table = np.array([[0.4, 0.6, 0.5], [0.6, 0.4, 0.5]])
    chosen, _ = rs.held_out(table, ["A", "B", "C"])
    assert chosen == {"A": 0, "B": 1, "C": 0}  # C's fold: both rows 0.5 on A and B, the first wins
    with pytest.raises(ValueError):
        rs.held_out(table, ["A", "A", "A"])


def test_consensus_breaks_equal_counts_by_pooled_map():
    table = np.array([[0.2, 0.2], [0.9, 0.9], [0.5, 0.5]])
    assert rs.consensus({"A": 0, "B": 1, "C": 2}, table) == 1


def _query(positive, s_global, inliers, chamfer=None):
    n = len(positive)
    return ValidationQuery(
        np.arange(n),
        np.asarray(s_global, float),
        np.asarray(inliers, float),
        np.ones(n, bool),
        np.asarray(positive),
        int(np.sum(positive)),
        np.zeros(n) if chamfer is None else np.asarray(chamfer, float),
    )


def test_query_aps_reranks_by_inliers_and_expands():
    # global order puts the two positives last; they have the inliers
    q = _query([False, False, True, True], [0.9, 0.8, 0.7, 0.6], [0, 0, 40, 30])
    qe_grid = (None, (1, 10, 0.0))
    vectors = [(np.array([1.0, 0.0]), np.array([[1.0, 0.0], [0.9, 0.436], [0.0, 1.0], [0.1, 0.995]]))]
    aps = rs.query_aps([q], vectors, floor=0.0, lam=1.0, qe_grid=qe_grid)
    assert aps[0, 0] == pytest.approx(ap_of_order(np.array([False, False, True, True]), 2, 1000))
    aps = rs.query_aps([q], vectors, floor=0.0, lam=0.0, qe_grid=qe_grid)
    assert aps[0, 0] == pytest.approx(1.0)  # local order: both positives first
    assert aps[1, 0] == pytest.approx(1.0)  # expanded with the top result, same inliers: still first
    settings, table = rs.ap_table({("image", 28, 8): [q]}, vectors, (0.0,), qe_grid, (0.0, 1.0))
    assert table.shape == (4, 1) and [s["lam"] for s in settings] == [0.0, 0.0, 1.0, 1.0]
    assert rs.find_row(settings, {"lam": 1.0, "qe": [1, 10, 0.0]}) == 3


def test_query_aps_expansion_equals_the_query_paths_arithmetic():
    from rerank.ensemble import EnsembleConfig, combine, rerank_order
    from rerank.expand import ExpansionConfig, expanded_scores

    rng = np.random.default_rng(0)
    n = 50
    vecs = rng.normal(size=(n, 8))
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    query = vecs[0] + 0.1 * rng.normal(size=8)
    query /= np.linalg.norm(query)
    positive = np.zeros(n, bool)
    positive[[3, 7, 20]] = True
    # Chamfer similarities, some below 0 (the ensemble clips them)
    q = _query(positive, vecs @ query, rng.integers(0, 30, n), rng.uniform(-0.1, 0.5, n))
    qe_grid = ((3, 5, 0.0), (5, 10, 3.0))
    for chamfer in (0.0, 0.3):
        aps = rs.query_aps([q], [(query, vecs)], floor=99.5, lam=0.5, qe_grid=qe_grid, chamfer=chamfer)
        conf = EnsembleConfig(lam=0.5, inlier_floor=99.5, chamfer_weight=chamfer)
        order = rerank_order(combine("sp", q.s_global, q.raw_local, q.has_locals, conf, q.chamfer), q.rows)
        for j, qe in enumerate(qe_grid):
            s_qe = expanded_scores(query, vecs, order, q.raw_local, ExpansionConfig(*qe))
            final = rerank_order(combine("sp", s_qe, q.raw_local, q.has_locals, conf, q.chamfer), q.rows)
            assert aps[j, 0] == pytest.approx(ap_of_order(q.positive[final], q.n_positives, 1000))
            setting = {"lam": 0.5, "floor": 99.5, "chamfer": chamfer, "qe": list(qe)}
            expected = combine("sp", s_qe, q.raw_local, q.has_locals, conf, q.chamfer)
            np.testing.assert_allclose(rs.final_scores(q, (query, vecs), setting), expected)


def test_bench_glue_scores_every_pass_and_reports(monkeypatch, capsys):
    """bench/rerank_scoring.py's held_out_by_source on fake scoring passes: each (tokens, threshold,
    pairs) scored once, the defaults found in the grid, a table printed."""
    spec = importlib.util.spec_from_file_location(
        "bench_rerank_scoring", Path(__file__).resolve().parents[2] / "bench" / "rerank_scoring.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(
        bench,
        "HELD_OUT_GRID",
        {
            "max_hamming": (28, 32),
            "pair_seeds": (0, 8),
            "floors": (0.0, 99.5),
            "chamfers": (0.0, 0.3),
            "qe": (None, (5, 10, 0.0)),
            "lambdas": (0.45, 1.0),
        },
    )
    rng = np.random.default_rng(1)
    n, d = 30, 6
    vecs = rng.normal(size=(n, d))
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    lists, vectors, sources = [], [], {}
    for i in range(6):
        positive = np.zeros(n, bool)
        positive[rng.choice(n, 2, replace=False)] = True
        lists.append({"key": f"k{i}", "positive": positive, "n_positives": 2})
        vectors.append((vecs[i], vecs))
        sources[f"k{i}"] = "AB"[i % 2]
    calls = []

    def scored(tokens, conf):
        calls.append((tokens, conf.match.max_distance, conf.spatial.pair_seeds))
        vq = [_query(e["positive"], -np.arange(n) / n, rng.integers(0, 40, n), rng.uniform(0, 0.5, n)) for e in lists]
        return vq, 1.0

    report = bench.held_out_by_source(scored, lists, vectors, sources, "aliked")
    assert len(calls) == 3 * 2 * 2 and len(set(calls)) == len(calls)  # tokens image/200/500 x 28/32 x 0/8
    assert report["held_out_settings"] == 12 * 2 * 2 * 2 * 2
    assert set(report["by_source_held_out"]) == {"A", "B"}
    from rerank.rerank import RerankConfig, with_kind_defaults

    chamfer = with_kind_defaults(RerankConfig(), "aliked").ensemble.chamfer_weight
    assert (
        report["defaults_in_sample"]["setting"]
        == f"tokens=image,max_hamming=28,pair_seeds=8,floor=0.0,chamfer={chamfer},qe=5/10/0.0,lam=0.45"
    )
    assert set(report["held_out_by_floor"]) == {"0.0", "99.5"}
    assert set(report["held_out_by_chamfer"]) == {"0.0", "0.3"}
    assert "| A | 3 |" in capsys.readouterr().out


def _glue_module():
    spec = importlib.util.spec_from_file_location(
        "bench_rerank_glue", Path(__file__).resolve().parents[2] / "bench" / "rerank_glue.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_second_stage_settings_are_chosen_without_the_source_under_each_sources_first_stage():
    """bench/rerank_glue.py: every source's first stage is its own held-out one (two here), and the
    second-stage row is chosen on the other sources' queries under that first stage."""
    glue = _glue_module()
    grid = [{"top": 0}, {"top": 5}, {"top": 10}]
    # first stage "s1" (A's), "s2" (B's and C's): rows are the grid, columns the queries
    tables = {"s1": TABLE, "s2": TABLE[[0, 2, 1]]}
    chosen = {"A": {}, "B": {}, "C": {}}
    names = {"A": "s1", "B": "s2", "C": "s2"}
    per_query, by_source = glue.held_out_tables(tables, chosen, names, np.array(SOURCES), grid)
    # A under s1: as rs.held_out chose 2 for it; B and C under s2, whose rows 1/2 are TABLE's 2/1
    assert by_source["A"]["chosen"] == {"top": 10}
    assert by_source["B"]["chosen"] == {"top": 10} and by_source["C"]["chosen"] == {"top": 10}
    np.testing.assert_allclose(per_query, [0.0, 0.0, 0.0, 0.1, 0.1, 0.1, 0.1])
    assert by_source["A"]["first_stage_held_out"] == 50.0  # row 0: no second stage


def test_the_glue_grid_starts_with_no_second_stage_and_covers_every_setting():
    glue = _glue_module()
    grid = glue.glue_grid((5, 10))
    assert grid[0]["top"] == 0
    assert len(grid) == 1 + 2 * len(glue.GLUE_WEIGHTS) * len(glue.GLUE_CAPS)
