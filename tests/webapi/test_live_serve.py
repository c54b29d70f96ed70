"""Serving follows the index (issue 43): a served index switches to each new generation without a
restart, a request is answered by one generation, and ``--wait-for`` returns once the change is
visible."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from index.errors import UnknownKeyError
from index.live.delete_rows import DeleteConfig
from index.live.delete_rows import main as delete
from index.search import load_index
from query.live_index import LiveIndex
from tests.support.index import clustered_unit_vectors, write_descriptor_file
from tests.support.live import D

ROOT = Path(__file__).resolve().parents[2]


class Fake:
    def __init__(self, generation):
        self.generation = generation
        self.closed = False

    def warm(self):  # Index.warm: what every generation offers, nothing to do here
        pass


def test_a_pinned_request_finishes_on_its_generation_and_the_old_one_closes_after():
    newest = {"n": 0}
    closed = []
    live = LiveIndex(lambda n, _: Fake(n or 0), lambda: newest["n"], reload_interval=0, close_generation=closed.append)
    entered, release = threading.Event(), threading.Event()
    seen = []

    def request():
        with live.pinned():
            seen.append(live.generation)
            entered.set()
            release.wait(5)
            seen.append(live.generation)  # still the generation it started on

    thread = threading.Thread(target=request)
    thread.start()
    entered.wait(5)
    newest["n"] = 1
    assert live.reload() and live.generation == 1  # new requests see generation 1 at once
    assert not closed  # generation 0 still has a request in flight
    release.set()
    thread.join(5)
    assert seen == [0, 0] and [f.generation for f in closed] == [0]
    assert not live.reload()  # nothing newer


def test_a_failing_open_keeps_serving_the_generation_it_has():
    newest = {"n": 0}

    def opener(n, _served):
        if n == 1:
            raise OSError("segment unreadable")
        return Fake(n or 0)

    live = LiveIndex(opener, lambda: newest["n"], reload_interval=0.05)
    newest["n"] = 1
    time.sleep(0.3)
    assert live.generation == 0
    live.close()


def needle(*args, env_extra=None, **kwargs):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=env, **kwargs)


@pytest.mark.slow
def test_serve_follows_a_delete_and_wait_for_returns_once_it_is_visible(live_flat_index, tmp_path):
    from tests.support.ports import free_port, urlopen_json

    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", "--index", str(live_flat_index), "--port", str(port),
         "--reload-interval", "0.5"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, health = urlopen_json(f"{url}/health")
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "needle serve did not start"
                time.sleep(0.2)
        assert status == 200 and health["generation"] == 0 and health["ntotal"] == 120
        victim = "t1/00003"
        status, out = urlopen_json(f"{url}/search", {"keys": [victim], "k": 5})
        assert status == 200 and out[0]["results"][0]["key"] == victim
        vector = load_index(live_flat_index).vector_of(victim).tolist()
        # a writer killed before it publishes: the server keeps answering from what it serves
        write_descriptor_file(tmp_path / "more", "t5", 5, clustered_unit_vectors(20, D, seed=5))
        killed = needle(
            "index", "add", "--index", str(live_flat_index), "--descriptors", str(tmp_path / "more"),
            env_extra={"NEEDLE_KILL_AT": "before_publish"}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert killed.returncode == -9, killed.stderr
        time.sleep(1.0)  # two reload intervals
        status, health = urlopen_json(f"{url}/health")
        assert status == 200 and health["generation"] == 0
        status, out = urlopen_json(f"{url}/search", {"keys": [victim], "k": 5})
        assert status == 200 and out[0]["results"][0]["key"] == victim
        done = needle(
            "index", "delete", "--index", str(live_flat_index), "--keys", "-", "--wait-for", url,
            input=f"{victim}\nnot/there\n", capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        change = json.loads(done.stdout)
        assert change["generation"] == 1 and change["deleted"] == 1 and change["unknown_keys"] == ["not/there"]
        assert change["visible_after_s"] <= 0.5 + 1.0
        # visible when the command returns: never the deleted key, and the key itself unknown
        status, health = urlopen_json(f"{url}/health")
        assert health["generation"] == 1 and health["ntotal"] == 119
        status, out = urlopen_json(f"{url}/search", {"vectors": [vector], "k": 119})
        assert status == 200 and victim not in {r["key"] for r in out[0]["results"]}
        assert len(out[0]["results"]) == 119
        status, out = urlopen_json(f"{url}/search", {"keys": [victim], "k": 5})
        assert status == 400 and "not in the index" in out["error"]
    finally:
        server.terminate()
        server.wait(20)


def test_a_deleted_key_has_no_thumbnail_and_no_tokens(live_flat_index):
    delete(DeleteConfig(), ["t2/00001"], live_flat_index)
    index = load_index(live_flat_index)
    with pytest.raises(UnknownKeyError):
        index.thumbnail("t2/00001", 64)
    with pytest.raises(UnknownKeyError):
        index.position_of("t2/00001")


@pytest.mark.ray
@pytest.mark.slow
def test_ray_shards_switch_generations_together(live_flat_index, ray_local):
    """--ray-shards with --reload-interval: after an add and a delete the coordinator answers from
    the new generation's actors like the index loaded in one process; the old actors stop."""
    from cluster.index_job import ray_part_runner
    from cluster.serve import ShardServing, follow_index
    from index.live.add_rows import AddConfig
    from index.live.add_rows import main as add
    from shards.staging import StageConfig

    serving = ShardServing(stage=StageConfig(copy_local=False))
    live = follow_index(live_flat_index, 0.2, serving)
    try:
        first = live._current
        more = live_flat_index.parent / "more"
        write_descriptor_file(more, "t7", 7, clustered_unit_vectors(30, D, seed=7))
        add(AddConfig(), more, live_flat_index, run_parts=ray_part_runner())  # needle index add --ray
        delete(DeleteConfig(), ["t0/00000", "t7/00002"], live_flat_index)
        deadline = time.monotonic() + 120
        while live.generation < 2:
            assert time.monotonic() < deadline, "the coordinator did not switch"
            time.sleep(0.2)
        single = load_index(live_flat_index)
        xq = clustered_unit_vectors(6, D, seed=42).astype(np.float32)
        D_live, I_live = live.search(xq, 20)
        D_one, I_one = single.search(xq, 20)
        np.testing.assert_array_equal(I_live, I_one)
        np.testing.assert_allclose(D_live, D_one, rtol=1e-5)
        assert live.ntotal == single.ntotal == 148
        with pytest.raises(UnknownKeyError):
            live.position_of("t7/00002")
        import ray

        with pytest.raises(ray.exceptions.RayActorError):  # the first generation's actors were stopped
            ray.get(first.backend.actors[0][0].__ray_ready__.remote(), timeout=30)
    finally:
        live.close()
        live._current.backend.close()


def test_serve_on_a_busy_port_is_one_line_naming_it_before_serving(live_flat_index):
    """Issue 57, item 5: ``needle serve`` on a busy port logged "serving ..." and then failed."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        run = needle("serve", "--index", str(live_flat_index), "--port", str(port), capture_output=True, text=True,
                     timeout=120)  # fmt: skip
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and errors[0].endswith(f"--port {port}: 127.0.0.1:{port} is in use by another process; "
                                                   "choose another --port"), run.stderr[-3000:]  # fmt: skip
    assert "serving" not in run.stderr and "Traceback" not in run.stderr, run.stderr[-3000:]
