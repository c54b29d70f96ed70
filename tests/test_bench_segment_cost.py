"""bench/segment_cost.py at tiny sizes (``--dry-run``): build, adds, compact and the timing of every
generation run, so that it cannot rot; its last line carries the figures docs/live_index.md quotes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_segment_cost_bench_dry_run():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "bench/segment_cost.py", "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    last = lines[-1]
    segments = last["segments_build_last_compacted"]
    assert segments[1] == segments[0] + last["adds"]  # each add: one new segment
    assert segments[2] < segments[1]  # compact merged the small ones
    timed = [line for line in lines if line.get("phase") == "timed"]
    assert len(timed) == 2 * (last["adds"] + 2) and all(t["searches"] > 0 for t in timed)
    assert {"ms_per_segment", "p50_ratio_last_vs_compacted", "p50_ratio_last_vs_build"} <= set(last)
    assert last["rows_build_last_compacted"][1] == last["rows_build_last_compacted"][2]  # compaction keeps the rows
