"""bench/live_index.py at tiny sizes (``--dry-run``): every step of the benchmark runs, so that it
cannot rot, and its last JSON line carries the figures issue 43 names."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "bench/live_index.py", "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(FIELDS) <= set(last)
    assert last["deleted_returned"] == 0 and last["query_errors"] == 0
    assert last["queries_during_run"] > 0 and last["live_rows"] == last["n"]
    assert 0 <= last["visible_after_return_s"] < 30
