"""The living index's benchmarks at tiny sizes (``--dry-run``): every step of bench/live_index.py,
bench/segment_cost.py and bench/generation_cost.py runs, so that they cannot rot, and their last
JSON lines carry the figures issue 43 names and docs/live_index.md quotes."""

import pytest

from tests.support.bench import dry_run

FIELDS = (
    "n",
    "deleted_returned",
    "add_rate_vs_build",
    "visible_after_return_s",
    "p99_ratio_during_changes",
    "recall_gap_vs_fresh",
    "compact_rss_vs_fresh",
)


@pytest.mark.slow
def test_live_index_bench_dry_run():
    last = dry_run("live_index.py")[-1]
    assert set(FIELDS) <= set(last)
    assert last["deleted_returned"] == 0 and last["query_errors"] == 0
    assert last["queries_during_run"] > 0 and last["live_rows"] == last["n"]
    assert 0 <= last["visible_after_return_s"] < 30
    assert last["p99_busy_core_ms"] > 0 and last["p99_ratio_busy_core"] > 0  # the control window had answers
    retrain = last["retrain"]  # issue 56: a retrain under load loses no change published while it ran
    assert retrain["retrained"] is True and retrain["added_during_retrain_served"] is True
    assert retrain["deleted_during_retrain_served"] == 0 and retrain["server_rss_peak_vs_steady"] > 0
    assert retrain["added_during_retrain_missing"] == 0 and retrain["deleted_during_retrain_present"] == 0


@pytest.mark.slow
def test_segment_cost_bench_dry_run():
    lines = dry_run("segment_cost.py")
    last = lines[-1]
    segments = last["segments_build_last_compacted"]
    assert segments[1] == segments[0] + last["adds"]  # each add: one new segment
    assert segments[2] < segments[1]  # compact merged the small ones
    timed = [line for line in lines if line.get("phase") == "timed"]
    assert len(timed) == 2 * (last["adds"] + 2) and all(t["searches"] > 0 for t in timed)
    assert {"ms_per_segment", "p50_ratio_last_vs_compacted", "p50_ratio_last_vs_build"} <= set(last)
    assert last["rows_build_last_compacted"][1] == last["rows_build_last_compacted"][2]  # compaction keeps the rows


@pytest.mark.slow
def test_generation_cost_bench_dry_run():
    last = dry_run("generation_cost.py")[-1]
    assert last["same_answers"] is True  # over-fetching and the selector skip the same rows
    variants = ("build", "added", "deleted", "deleted_selector")
    assert all(last[v]["p50_ms"] > 0 and last[v]["paired_ratio"] > 0 for v in variants)
    assert last["build"]["paired_ratio"] == 1.0
    generations = last["generations"]
    assert generations["build"] < generations["added"] < generations["deleted"]
    assert last["searches_per_variant"] == 2 * 10
