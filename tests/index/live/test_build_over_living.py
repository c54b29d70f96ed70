"""``needle index build --out IDX`` over a living index (issue 55) is refused, naming the folder and
what to do, exit 2, every file of it untouched; over a build-only index it rebuilds as before."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from index.layout import LIVING_FILES, WRITER_LOCK
from index.live.delete_rows import DeleteConfig
from index.live.delete_rows import main as delete
from index.live.generations import CURRENT_FILE, GENERATIONS_DIR
from index.live.writer import LOCK_FILE, writing
from tests.support.indexes import LIVE_FLAT_4

ROOT = Path(__file__).resolve().parents[3]


def snapshot(directory: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``directory``: its SHA-256 and mtime (ns)."""
    return {
        str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def build(descriptors: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = ["index", "build", "--descriptors", str(descriptors), "--out", str(out), "--kind", "flat", "--shards", "2"]
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_build_over_a_living_index_is_refused_and_touches_nothing(synthetic_indexes, tmp_path):
    out, _ = synthetic_indexes.copy(LIVE_FLAT_4, tmp_path)
    delete(DeleteConfig(), ["t1/00003"], out)
    before = snapshot(out)
    done = build(tmp_path / "desc", out)
    assert done.returncode == 2, done.stderr
    assert f"--out {out} holds a living index" in done.stderr and "new --out folder" in done.stderr
    assert snapshot(out) == before


def test_a_build_over_a_build_only_index_rebuilds_it(synthetic_indexes, tmp_path):
    out, _ = synthetic_indexes.copy(LIVE_FLAT_4, tmp_path)
    with writing(out):  # a writer that found nothing to do leaves only its lock: still build-only
        pass
    done = build(tmp_path / "desc", out)
    assert done.returncode == 0, done.stderr


def test_the_builds_names_of_a_living_index_are_the_writers():
    assert LIVING_FILES == (GENERATIONS_DIR, CURRENT_FILE) and f"{GENERATIONS_DIR}/{WRITER_LOCK}" == LOCK_FILE
