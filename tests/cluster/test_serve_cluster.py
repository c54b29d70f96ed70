"""Serving across nodes on a real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``:
three nodes, each its own cache directory, so no path is shared) from an index built to S3 (moto),
two replicas per shard: the answers, global and re-ranked, equal the single-process index on a
local copy; a killed replica costs nothing (its twin answers); a shard whose replicas are all
killed, and a removed node, give bounded 503 or partial answers naming the missing shard, then
exact answers again once the actors have restarted (and re-staged) elsewhere."""

import tarfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from core.storage import MARKER_SUFFIX, s3_client
from index.build.stage import main
from index.search import load_index
from ingest.source_images import thumbnail_jpeg
from tests.support.indexes import CLUSTER_TOKENS, write_synthetic

pytestmark = [pytest.mark.ray, pytest.mark.s3, pytest.mark.slow]

TIMEOUT = 3.0  # seconds a request waits for the shards (2 loaded cores: a restarting actor competes)


@pytest.fixture(scope="module")
def cluster():
    """Three Ray nodes of one CPU each, with distinct custom resources (the session's local Ray,
    if one is running, is shut down meanwhile and started again after)."""
    import ray
    from ray.cluster_utils import Cluster

    was_running = ray.is_initialized()
    if was_running:
        ray.shutdown()
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1}})
    nodes.add_node(num_cpus=1, resources={"node_b": 1})
    nodes.add_node(num_cpus=1, resources={"node_c": 1})
    ray.init(address=nodes.address, log_to_driver=False)
    nodes.wait_for_nodes()
    yield nodes
    ray.shutdown()
    nodes.shutdown()
    if was_running:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)


@pytest.fixture(scope="module")
def index_on_s3(s3_endpoint, tmp_path_factory):
    """(s3:// URL of the index, the single-process index of a local copy, the vectors)."""
    root = tmp_path_factory.mktemp("serve_cluster")
    xb, tars = write_synthetic(CLUSTER_TOKENS, root, lambda path: f"s3://serving/tars/{path.name}")
    client = s3_client(s3_endpoint)
    client.create_bucket(Bucket="serving")
    for path in tars.values():
        client.upload_file(str(path), "serving", f"tars/{path.name}")
    url = main(replace(CLUSTER_TOKENS.config, s3_endpoint_url=s3_endpoint), root / "desc", "s3://serving/index")
    local = root / "copy"
    for item in client.list_objects_v2(Bucket="serving", Prefix="index/")["Contents"]:
        name = item["Key"][len("index/") :]
        if name.endswith(MARKER_SUFFIX) or name.startswith("trained"):
            continue
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        client.download_file("serving", item["Key"], str(local / name))
    return url, load_index(local), xb, tars


@pytest.fixture(scope="module")
def served(cluster, index_on_s3, s3_endpoint, tmp_path_factory):
    from cluster.ray_shards import ShardPlacement
    from cluster.serve import ShardServing, serve_sharded
    from shards.staging import StageConfig

    cache = tmp_path_factory.mktemp("caches")
    serving = ShardServing(
        ShardPlacement(replicas=2, cpus=0.1, concurrency=2),
        StageConfig(str(cache / "node-{node}"), s3_endpoint),
        TIMEOUT,
    )
    return serve_sharded(index_on_s3[0], serving), cache


def exact_answers(service, single_service, bodies):
    return [service.search_json(b) for b in bodies] == [single_service.search_json(b) for b in bodies]


def test_the_cluster_answers_like_the_single_index(served, index_on_s3):
    import ray

    from query.retrieve import QueryConfig, search, stored_tokens
    from rerank.rerank import RerankConfig
    from webapi.query_service import QueryService

    coordinator, cache = served
    _, single, xb, tars = index_on_s3
    health = coordinator.health()
    assert health["ok"] and len({r["node"] for r in health["replicas"]}) >= 2  # spread over the nodes
    infos = [i for a in coordinator.backend.actors for r in a for i in ray.get(r.info.remote())]
    assert all(Path(i["directory"]).is_relative_to(cache / f"node-{i['node']}") for i in infos)
    assert len({(i["shard"], i["node"]) for i in infos}) == len({i["directory"] for i in infos})
    assert len(infos) == 8 and {i["replica"] for i in infos} == {0, 1}
    xq = np.ascontiguousarray(xb[::53], dtype=np.float32)
    for k, nprobe in ((10, None), (100, 32)):
        D1, I1 = single.search(xq, k, nprobe)
        D2, I2 = coordinator.search(xq, k, nprobe)
        np.testing.assert_array_equal(I1, I2)
        np.testing.assert_array_equal(D1, D2)
        assert coordinator.keys_of(I2) == single.keys_of(I1)
    keys = ["000000/00003", "000003/00100", "000005/00700"]
    conf = QueryConfig(k=10, rerank=RerankConfig(method="sp", shortlist=50))
    answers = [
        search(i, np.stack([i.vector_of(k) for k in keys]), conf, stored_tokens(i, keys), evidence=True)
        for i in (single, coordinator)
    ]
    np.testing.assert_array_equal(answers[0][1], answers[1][1])
    np.testing.assert_array_equal(answers[0][0], answers[1][0])
    assert [d["evidence"] for d in answers[0][2]] == [d["evidence"] for d in answers[1][2]]
    rerank = RerankConfig(method="sp", shortlist=40)
    bodies = [{"keys": keys, "k": 8}, {"vectors": xb[7:9].tolist(), "k": 20}]
    assert exact_answers(QueryService(coordinator, rerank=rerank), QueryService(single, rerank=rerank), bodies)
    # thumbnails: the owning shard reads its member from the tar on S3 (ranged GET), only the JPEG travels
    for key in ("000001/00002", "000005/00007"):
        shard, member = key.split("/")
        with tarfile.open(tars[shard]) as tar:
            data = tar.extractfile(f"{member}.jpg").read()
        assert coordinator.thumbnail(key, 24) == thumbnail_jpeg(data, 24)
    assert coordinator.backend.calls > 0 and coordinator.backend.ray_calls == 0  # all over the direct channels


class Stream:
    """Requests sent one after another from a thread (alternately allowing a partial answer or
    not) while the test breaks things; each records (start, seconds, outcome, missing shards):
    "exact", "partial", "503", or "wrong" (anything else)."""

    def __init__(self, service, body, exact):
        import threading

        self.service, self.body, self.exact = service, body, exact
        self.records: list[tuple[float, float, str, list[str]]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        from shards.coordinator import ShardsUnavailable

        i = 0
        while not self.stop.is_set():
            began = time.monotonic()
            try:
                out = self.service.search_json({**self.body, "partial": bool(i % 2)})
            except ShardsUnavailable as exc:
                outcome, missing = "503", exc.missing
            except Exception as exc:  # recorded, so that the test fails naming it
                outcome, missing = f"wrong: {type(exc).__name__}: {exc}", []
            else:
                if out == self.exact:
                    outcome, missing = "exact", []
                elif all(q.get("partial") for q in out):
                    outcome, missing = "partial", out[0]["missing_shards"]
                else:
                    outcome, missing = "wrong", []
            self.records.append((began, time.monotonic() - began, outcome, missing))
            i += 1
            time.sleep(0.05)

    def exact_since(self, moment: float) -> bool:
        return any(began > moment and outcome == "exact" for began, _, outcome, _ in self.records)

    def finish(self) -> list[tuple[float, float, str, list[str]]]:
        self.stop.set()
        self.thread.join(TIMEOUT + 10)
        assert all(seconds < TIMEOUT + 3.0 for _, seconds, _, _ in self.records), "a request hung"
        return self.records


def wait_until(condition, seconds: float, message: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.5)


def all_ready(coordinator) -> bool:
    return all(r["status"] == "ready" for r in coordinator.health()["replicas"])


def test_shards_grouped_per_actor_answer_in_one_call_per_actor(
    cluster, index_on_s3, s3_endpoint, tmp_path, monkeypatch
):
    """--shards-per-actor 3: 4 shards in 2 actors (x2 replicas), one Ray call per actor and request,
    answers equal to the single index; a killed replica's group answers from its twin."""
    import ray

    from cluster.ray_shards import ShardPlacement
    from cluster.serve import ShardServing, serve_sharded
    from query.retrieve import QueryConfig, search, stored_tokens
    from rerank.rerank import RerankConfig
    from shards.staging import StageConfig

    url, single, xb, tars = index_on_s3
    placement = ShardPlacement(replicas=2, cpus=0.05, concurrency=2, shards_per_actor=3)
    serving = ShardServing(placement, StageConfig(str(tmp_path / "node-{node}"), s3_endpoint), TIMEOUT)
    coordinator = serve_sharded(url, serving)
    try:
        assert coordinator.backend.groups == [[0, 1, 2], [3]] and len(coordinator.backend.actors) == 2
        xq = np.ascontiguousarray(xb[::61], dtype=np.float32)
        backend = coordinator.backend
        assert backend.channels_open() == 4  # every actor's direct channel open before the first request
        before, before_ray = backend.calls, backend.ray_calls
        import cluster.ray_shards as ray_shards

        wire = {"sent": [], "received": []}  # the messages as they are written and read
        pack, unpack = ray_shards.pack_request, ray_shards.unpack_answers
        monkeypatch.setattr(ray_shards, "pack_request", lambda *a: wire["sent"].append(len(m := pack(*a))) or m)
        monkeypatch.setattr(ray_shards, "unpack_answers", lambda m: wire["received"].append(len(m)) or unpack(m))
        coordinator.traffic.count = True
        D2, I2 = coordinator.search(xq, 50)
        coordinator.traffic.count = False
        monkeypatch.undo()
        traffic = coordinator.traffic  # wire bytes: one message per actor each way, as written and read
        assert (traffic.calls, traffic.sent, traffic.received) == (2, sum(wire["sent"]), sum(wire["received"]))
        assert backend.calls - before == 2  # one per actor, not one per shard
        assert backend.ray_calls == before_ray  # both over the direct channels
        D1, I1 = single.search(xq, 50)
        np.testing.assert_array_equal(I1, I2)
        np.testing.assert_array_equal(D1, D2)
        keys = ["000002/00011", "000004/00500"]
        conf = QueryConfig(k=10, rerank=RerankConfig(method="sp", shortlist=50))
        a, b = (
            search(i, np.stack([i.vector_of(k) for k in keys]), conf, stored_tokens(i, keys), evidence=True)
            for i in (single, coordinator)
        )
        np.testing.assert_array_equal(a[1], b[1])
        np.testing.assert_array_equal(a[0], b[0])
        # members scored together by their group: the same inliers and match evidence
        for one, many in zip(a[2], b[2]):
            np.testing.assert_array_equal(one["inliers"], many["inliers"])
            assert one["evidence"] == many["evidence"]
        with tarfile.open(tars["000003"]) as tar:
            assert coordinator.thumbnail("000003/00004", 20) == thumbnail_jpeg(tar.extractfile("00004.jpg").read(), 20)
        # requests from several threads at once: their calls to one actor may share a Ray call
        from concurrent.futures import ThreadPoolExecutor

        rows = [np.ascontiguousarray(xb[i : i + 2], dtype=np.float32) for i in range(0, 240, 12)]
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda x: coordinator.search(x, 20), rows))
        for x, (D, I) in zip(rows, answers):
            D0, I0 = single.search(x, 20)
            np.testing.assert_array_equal(I0, I)
            np.testing.assert_array_equal(D0, D)
        ray.kill(coordinator.backend.actors[0][0], no_restart=False)
        D3, I3 = coordinator.search(xq, 50)
        np.testing.assert_array_equal(I1, I3)
        np.testing.assert_array_equal(D1, D3)
    finally:
        for replicas in coordinator.backend.actors:
            for actor in replicas:
                ray.kill(actor, no_restart=True)


def test_local_build_parts_run_on_the_drivers_node(cluster):
    """A local --out is on the driver's disk: its part tasks never run on another node."""
    import ray

    from cluster.index_job import node_cpus, ray_part_runner

    def slow_node_id(*_):  # defined here: pickled by value for the workers
        import time

        import ray

        time.sleep(0.3)  # long enough that an unpinned task would spill to the other nodes
        return ray.get_runtime_context().get_node_id()

    here = ray.get_runtime_context().get_node_id()
    # half a CPU each: more than the head has free beside the shard actors, so unpinned they would spill
    assert ray_part_runner(0.5, task=slow_node_id)([()] * 6) == [here] * 6
    assert node_cpus("/tmp/out") == 1 and node_cpus("s3://b/out") == 3


def test_killed_shard_actors_during_a_stream_of_queries(served, index_on_s3):
    """One replica killed: its twin answers, every answer exact. Every replica of shard_001
    killed: 503 or partial answers naming shard_001 only, never a hang, then exact again."""
    import ray

    from webapi.query_service import QueryService

    coordinator, _ = served
    _, single, xb, _ = index_on_s3
    body = {"vectors": xb[::97].tolist(), "k": 30}
    service = QueryService(coordinator)
    stream = Stream(service, body, QueryService(single).search_json(body))
    try:
        time.sleep(1.0)
        first_kill = time.monotonic()
        ray.kill(coordinator.backend.actors[2][0], no_restart=False)
        time.sleep(3.0)
        second_kill = time.monotonic()
        for actor in coordinator.backend.actors[1]:
            ray.kill(actor, no_restart=False)
        wait_until(lambda: stream.exact_since(second_kill + TIMEOUT), 60, "the killed shard did not come back")
        wait_until(lambda: all_ready(coordinator), 60, "the killed replicas did not come back")
        # the restarted actors listen elsewhere: their channels open again (until then Ray carries their calls)
        assert coordinator.backend.ray_calls > 0  # the calls that met a dead channel went again through Ray
        wait_until(lambda: coordinator.backend.channels_open() == 8, 30, "the direct channels did not open again")
        ray_calls, reopened = coordinator.backend.ray_calls, time.monotonic()
        wait_until(lambda: stream.exact_since(reopened), 30, "no exact answer over the reopened channels")
        assert coordinator.backend.ray_calls == ray_calls  # all direct again
    finally:
        records = stream.finish()
    # a request that was still running at the second kill may meet it: it counts with those after
    before = [o for began, took, o, _ in records if began + took < second_kill]
    after = [(o, m) for began, took, o, m in records if began + took >= second_kill]
    odd = [(round(b - first_kill, 2), round(t, 2), o, m) for b, t, o, m in records if o != "exact"]
    assert before and set(before) == {"exact"}, odd  # incl. the kill of one replica of shard_002
    assert any(began < first_kill for began, _, _, _ in records) and any(
        first_kill < began < second_kill for began, _, _, _ in records
    )
    assert {o for o, _ in after} <= {"exact", "503", "partial"}, after
    assert any(o != "exact" for o, _ in after) and after[-1][0] == "exact"
    assert all(m == ["shard_001"] for o, m in after if o != "exact")


def test_a_removed_node_does_not_hang_requests_and_its_shards_restart_elsewhere(cluster, served, index_on_s3):
    from webapi.query_service import QueryService

    coordinator, _ = served
    _, single, xb, _ = index_on_s3
    replicas = coordinator.health()["replicas"]
    victim = next(n for n in cluster.worker_nodes if any(r["node"] == n.node_id for r in replicas))
    lost = {r["shard"] for r in replicas if r["node"] == victim.node_id}  # a shard may still have its twin
    body = {"vectors": xb[::89].tolist(), "k": 25}
    stream = Stream(QueryService(coordinator), body, QueryService(single).search_json(body))
    try:
        time.sleep(1.0)
        removed = time.monotonic()
        cluster.remove_node(victim)
        wait_until(lambda: all_ready(coordinator), 90, "the lost node's replicas did not restart elsewhere")
        ready = time.monotonic()
        wait_until(lambda: stream.exact_since(ready), 30, "no exact answer after the restart")
    finally:
        records = stream.finish()
    after = [(o, m) for began, _, o, m in records if began >= removed]
    assert {o for o, _ in after} <= {"exact", "503", "partial"}, after
    assert all(set(m) <= lost for _, m in after) and after[-1][0] == "exact"
    assert victim.node_id not in {r["node"] for r in coordinator.health()["replicas"]}
