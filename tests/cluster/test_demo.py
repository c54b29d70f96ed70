"""`needle demo`: demo data -> local Ray head -> `ray job submit` ingestion -> index -> mAP@1k, run
while every CPU is busy (the head's job agent then starts well after its dashboard answers)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture
def busy_cpus():
    """One spinning process per CPU, plus one, for the duration of the test."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range((os.cpu_count() or 2) + 1)]
    try:
        yield len(spinners)
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def test_demo_end_to_end_on_a_busy_machine(tmp_path, busy_cpus):
    run = subprocess.run(
        [sys.executable, "-m", "cli.main", "demo", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "mAP@1000" in run.stdout
    assert "swigfaiss" not in run.stdout + run.stderr  # FAISS's loader INFO lines are quiet
    report = json.loads((tmp_path / "report.json").read_text())
    truth = json.loads((tmp_path / "shards" / "ground_truth.json").read_text())
    assert report["n_queries"] == len(truth["queries"]) == 60
    assert report["images"] == len(truth["database"]) and report["error_rows"] == 0
    # Augmented views of the same photo must be found far above chance (random ranking: about 5).
    assert report["map_at_1000"] > 80
    assert report["map_at_1000_rerank_sp"] > 80  # re-ranked with the stored local tokens
    # Re-ranking must never be what makes the first results a user sees worse (issue 21).
    assert report["map_at_1000_rerank_sp"] >= report["map_at_1000"]
