"""bench/gpu.py's dry run: every figure's code path on the CPU at tiny sizes, so the GPU benchmark
cannot rot between the sessions that have a GPU (its figures are docs/gpu.md's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_bench_dry_run_runs_every_figure(tmp_path):
    jsonl = tmp_path / "gpu.jsonl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry-run", "--jsonl", str(jsonl), "--budget", "600"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env=env,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines == [json.loads(line) for line in jsonl.read_text().splitlines()]  # the file has every line
    errors = [line for line in lines if "error" in line]
    assert done.returncode == 0 and not errors, (errors, done.stderr[-3000:])
    figures = {line["figure"] for line in lines if "skipped" not in line}
    expected = {"env", "shape_plan_exact_baseline", "ingest", "shape_plan", "aliked", "worker_tokens"}
    assert expected | {"ames", "spatial", "exact_resident", "exact_streamed"} <= figures
    ingest = next(line for line in lines if line["figure"] == "ingest" and "skipped" not in line)
    assert ingest["shape_grid"] == 32 and ingest["worker_pil_img_s"] > 0 and ingest["worker_pil_processes_img_s"] > 0
    aliked = next(line for line in lines if line["figure"] == "aliked")
    assert aliked["keypoints_within_1px"] == 1.0 and aliked["codes_equal"] == 1.0  # CPU: batched == alone
