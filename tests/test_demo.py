"""`needle demo`: demo data -> local Ray head -> `ray job submit` ingestion -> index -> mAP@1k."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_demo_end_to_end(tmp_path):
    run = subprocess.run([sys.executable, "-m", "cluster.cli", "demo", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "mAP@1000" in run.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    truth = json.loads((tmp_path / "shards" / "ground_truth.json").read_text())
    assert report["n_queries"] == len(truth["queries"]) == 60
    assert report["images"] == len(truth["database"]) and report["error_rows"] == 0
    # Augmented views of the same photo must be found far above chance (random ranking: about 5).
    assert report["map_at_1000"] > 80
    assert report["map_at_1000_rerank_sp"] > 80  # re-ranked with the stored local tokens
