"""bench/streaming.py: its runbook replay and scoring checked piece by piece, and the whole bench at
tiny sizes (``--dry-run``: both runbooks, needle through its CLI and HTTP API, the peers that are
importable), so that the record's contract (docs/results.md, bench/results/streaming.json) holds."""

import itertools
from pathlib import Path

import numpy as np
import pytest

from tests.support.bench import bench_module, dry_run

ROOT = Path(__file__).resolve().parents[2]
rb = bench_module("streaming_runbook")  # by path: bench/ never joins sys.path (its rerank.py)
kth_distance, score = bench_module("streaming_truth").kth_distance, bench_module("streaming_truth").score


def test_generated_runbook_follows_the_recipe():
    steps, bounds = rb.generated_runbook(20_000, clusters=6, rounds=5, rng=np.random.default_rng(1))
    edges = [*bounds, 20000]
    inserts = [s for s in steps if s.op == "insert"]
    deletes = [s for s in steps if s.op == "delete"]
    assert len(inserts) == len(deletes) == 30 and sum(s.op == "search" for s in steps) == 60
    assert all(steps[i + 1].op == "search" for i, s in enumerate(steps) if s.op != "search")
    for c in range(6):  # a cluster's shares are contiguous and cover it, in order
        mine = [s for s in inserts if edges[c] <= s.start < edges[c + 1]]
        assert mine[0].start == edges[c] and mine[-1].end == edges[c + 1]
        assert all(a.end == b.start for a, b in itertools.pairwise(mine))
    state = rb.LiveState(20_000)
    for _i, step in enumerate(steps):
        if step.op == "delete":  # from the oldest end: the cluster's live rows before it start there
            c = next(c for c in range(6) if edges[c] <= step.start < edges[c + 1])
            live = np.flatnonzero(state.vec[edges[c] : edges[c + 1]] >= 0) + edges[c]
            assert step.start == live[0] and 0.5 <= (step.end - step.start) / len(live) <= 0.9 + 1 / len(live)
        if step.op != "search":
            state.apply({"op": step.op, "start": step.start, "end": step.end})


def test_track_runbook_scaled_and_its_clusters():
    name, steps = rb.read_track_runbook(ROOT.parent / "shared" / "streaming" / "runbooks" / "final_runbook.yaml")
    assert name == "msturing-30M-clustered" and rb.dataset_rows(name, steps) == 30_000_000
    assert [s.op for s in steps].count("search") == 640
    scaled = rb.scale_steps(steps, 30_000_000, 300_000)
    assert scaled[0] == rb.Step("insert", 0, 388) and max(s.end for s in scaled) <= 300_000
    assert len(rb.clusters_of(scaled, 300_000)) == 64  # the scored runbook's 64 clusters


def test_kept_searches_and_phases_keep_every_state():
    steps = [rb.Step("insert", 0, 5), rb.Step("search"), rb.Step("insert", 5, 9), rb.Step("search"),
             rb.Step("delete", 0, 2), rb.Step("search"), rb.Step("insert", 9, 9), rb.Step("search")]  # fmt: skip
    kept = rb.keep_searches(steps, 2)  # the first and the last search
    assert kept == steps[:2] + steps[2:3] + steps[4:5] + steps[6:]
    assert rb.keep_searches(steps, 0) == steps
    phases = rb.phases(kept)
    assert [p["op"] for p in phases] == ["insert", "search", "insert", "delete", "search"]
    assert [s["end"] for s in phases[2]["steps"]] == [9]  # the empty insert dropped
    merged = rb.phases(rb.keep_searches(steps, 1))  # only the last search: the inserts merged, in order
    assert [p["op"] for p in merged] == ["insert", "delete", "search"]
    assert [s["end"] for s in merged[0]["steps"]] == [5, 9]


def test_score_counts_ties_and_deleted_rows():
    data = np.array([[1, 0], [0.6, 0.8], [0.6, 0.8], [0, 1], [-1, 0]], np.float16)
    queries = np.array([[1, 0]], np.float32)
    vec = np.array([0, 1, 2, -1, 4])  # tag 3 deleted
    kth = kth_distance(data, np.array([0, 1, 2, 4]), queries, 2)
    # the 2nd nearest of [1, 0] is tied between tags 1 and 2: either counts
    assert score(np.array([[0, 2]]), vec, data, queries, kth, 2) == (1.0, 0)
    assert score(np.array([[0, 1]]), vec, data, queries, kth, 2) == (1.0, 0)
    assert score(np.array([[0, 3]]), vec, data, queries, kth, 2) == (0.5, 1)  # a deleted tag, counted
    assert score(np.array([[0, 0]]), vec, data, queries, kth, 2) == (0.5, 0)  # a repeat counts once
    assert score(np.array([[4, 99]]), vec, data, queries, kth, 2) == (0.0, 1)  # an invented id


@pytest.mark.slow
def test_streaming_bench_dry_run():
    # one runbook, the track's file end to end (the generated one's recipe: the tests above); the
    # dry run's default, both, took 6.4 minutes of the suite on a loaded box
    record = dry_run("streaming.py", "--runbook", "final", timeout=900)[-1]
    assert [r["runbook"]["name"] for r in record["runs"]] == ["msturing-30M-clustered"]
    for run in record["runs"]:
        assert {"name", "n", "dim", "steps"} <= set(run["runbook"])
        systems = {s["system"]: s for s in run["systems"]}
        assert {"needle", "needle-ivfpq", "faiss-ivfpq"} <= set(systems)
        every = {"needle", "needle-ivfpq", "faiss-ivfpq", "faiss-ivfflat", "hnswlib", "diskannpy"}
        assert set(systems) | set(run["skipped"]) == every
        for entry in systems.values():
            assert len(entry["recall_at_10_per_search"]) == run["runbook"]["searches_kept"] == 2
            assert 0 <= entry["recall_at_10_mean"] <= 1 and entry["qps"] > 0 and entry["total_s"] > 0
            assert entry["rss_peak_mb"] > 0 and entry["deleted_returned"] >= 0
        for needle in (systems["needle"], systems["needle-ivfpq"]):
            assert needle["deleted_returned"] == 0
            assert len(needle["fresh_recall_at_10_per_search"]) == 2
            assert needle["compact_retrain_flag"] in (True, False)
        assert systems["needle-ivfpq"]["final_index"].get("kind", "ivfpq") == "ivfpq"
        assert "recall_mean_ge_0.95" in run["targets"]


def test_peer_slots_answer_a_replaced_or_deleted_row_as_not_live():
    Slots = bench_module("streaming_peers").Slots

    slots = Slots(n=10, capacity=20)
    first = slots.take(np.arange(0, 5))  # tags 0-4 in slots 0-4
    slots.drop(np.array([1]))  # tag 1 deleted
    slots.drop(np.array([2]))  # tag 2 replaced: its old slot goes, a new one comes
    (again,) = slots.take(np.array([2]))
    assert list(first) == [0, 1, 2, 3, 4] and again == 5
    # live slots give their tag; a deleted or replaced slot, or one never given, gives n (counted
    # as a deleted row returned); -1 (no answer) stays -1
    assert list(slots.tags(np.array([0, 1, 2, 5, 7, -1]))) == [0, 10, 10, 2, 10, -1]
