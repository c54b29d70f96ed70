"""Faults during ingestion: a worker killed mid-job, a job killed mid-way and resumed."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cluster.ingest_job import main
from ingest.config import IngestConfig
from tests.support.tars import jpeg_bytes, write_tar

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def many_shards(directory, photos, n_shards, per_shard):
    """``n_shards`` tars of ``per_shard`` distinct images (crops of the real photos)."""
    names = list(photos)
    rng = np.random.default_rng(0)
    for s in range(n_shards):
        members = []
        for i in range(per_shard):
            photo = photos[names[(s + i) % len(names)]]
            y, x = rng.integers(0, 60, size=2)
            members.append((f"{s:03d}{i:03d}.jpg", jpeg_bytes(np.ascontiguousarray(photo[y : y + 240, x : x + 240]))))
        write_tar(directory / f"{s:06d}.tar", members)
    return str(directory / "*.tar")


def all_rows(out):
    return pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("*.parquet")))


def test_killed_worker_loses_and_duplicates_nothing(tmp_path, photos, ray_local):
    import ray

    pattern = many_shards(tmp_path, photos, n_shards=6, per_shard=8)
    conf = IngestConfig(resolution=224, batch_size=8, cpus_per_worker=1, num_workers=2)
    killed = []

    def killer():
        # Once the first shard is committed, kill a busy worker without restart.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            names = [
                n["name"]
                for n in ray.util.list_named_actors(all_namespaces=True)
                if n["name"].startswith("needle-ingest-")
            ]
            if names and list((tmp_path / "desc").glob("*.parquet")):
                ray.kill(ray.get_actor(names[0], namespace=ray.get_runtime_context().namespace), no_restart=True)
                killed.append(names[0])
                return
            time.sleep(0.05)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    out = main(conf, pattern, tmp_path / "desc")
    thread.join(5)
    assert killed, "the worker was never killed: the test did not exercise the fault"
    table = all_rows(out)
    keys = table["key"].to_pylist()
    assert len(keys) == 48 and len(set(keys)) == 48
    assert set(table["status"].to_pylist()) == {"ok"}
    info = json.loads((out / "ingest_info.json").read_text())
    assert info["shards_ok"] == 6 and info["shards_failed"] == 0 and info["shards_retried"] >= 1


def test_killed_job_resumes_with_unfinished_shards_only(tmp_path, photos):
    pattern = many_shards(tmp_path, photos, n_shards=8, per_shard=16)
    out = tmp_path / "desc"
    cmd = [
        sys.executable,
        "-m",
        "cli.main",
        "ingest",
        "--shards",
        pattern,
        "--out",
        str(out),
        "--resolution",
        "224",
        "--cpus-per-worker",
        "1",
        "--workers",
        "1",
    ]
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while len(list(out.glob("*.parquet"))) < 2 and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGKILL)  # the driver and the Ray processes of its group
    job.wait()
    # An orphaned worker may still commit the shard it was on before Ray reaps it: wait until
    # the output is quiet (a commit is atomic either way).
    settled, last = time.monotonic(), None
    while time.monotonic() - settled < 3 and time.monotonic() < deadline:
        now = sorted(p.name for p in out.glob("*.parquet"))
        if now != last:
            settled, last = time.monotonic(), now
        time.sleep(0.1)
    done_before = sorted(p.name for p in out.glob("*.parquet"))
    assert 2 <= len(done_before) < 8, f"kill came too late or too early: {done_before}"
    stamps = {name: (out / name).stat().st_mtime_ns for name in done_before}

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    info = json.loads((out / "ingest_info.json").read_text())
    assert info["shards_processed"] == 8 - len(done_before)
    assert {name: (out / name).stat().st_mtime_ns for name in done_before} == stamps  # not redone
    keys = all_rows(out)["key"].to_pylist()
    assert len(keys) == 8 * 16 and len(set(keys)) == len(keys)
    assert not list(out.glob("*.tmp"))


def test_queue_replaces_a_dead_actor_once_and_requeues_all_its_shards(ray_local):
    import ray

    from cluster.ingest_job import run_queue

    @ray.remote(max_restarts=0)
    class Worker:
        def work(self, url, die):
            if die:
                os._exit(1)
            time.sleep(0.2)
            return {"url": url}

    created, died = [], set()

    def make_worker():
        created.append(Worker.remote())
        return created[-1]

    def submit(worker, url):
        die = url == "b" and url not in died
        died.add(url)
        return worker.work.remote(url, die)

    out = {
        url: attempts for url, result, attempts, _ in run_queue(["b", "a", "c"], make_worker, submit, 1, max_retries=2)
    }
    assert out == {"b": 2, "a": 2, "c": 1}  # "a" was queued on the dead actor: re-queued too
    assert len(created) == 2  # one replacement, not one per lost shard
