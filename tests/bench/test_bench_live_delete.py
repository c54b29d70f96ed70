"""bench/live_delete.py at tiny sizes (``--dry-run``): every step runs, so that it cannot rot, and
its last JSON line carries the figures docs/live_index.md quotes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_live_delete_bench_dry_run():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "bench/live_delete.py", "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert [d["keys"] for d in last["deletes"]] == [10, 100, 1000]
    assert [d["generation"] for d in last["deletes"]] == [1, 2, 3]
    assert last["keys"] == 1000 and last["keys_per_s"] > 0 and last["seconds"] > 0
