"""Serving across nodes on a real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``:
three nodes, each its own cache directory, so no path is shared) from an index built to S3 (moto),
two replicas per shard: the answers, global and re-ranked, equal the single-process index on a
local copy; a killed replica costs nothing (its twin answers); a shard whose replicas are all
killed, and a removed node, give bounded 503 or partial answers naming the missing shard, then
exact answers again once the actors have restarted (and re-staged) elsewhere."""

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers_index import write_descriptors_with_tokens

from index.build import IndexConfig, main
from index.search import load_index
from ingest.storage import MARKER_SUFFIX, s3_client

pytestmark = [pytest.mark.ray, pytest.mark.s3, pytest.mark.slow]

SIZES = {0: 700, 1: 600, 2: 800, 3: 500, 4: 650, 5: 750}
D = 32
IVF = IndexConfig(kind="ivfpq", nlist=32, pq_bytes=8, points_per_list=20, nprobe=8, refine_factor=2, shards=4)
TIMEOUT = 1.5  # seconds a request waits for the shards


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
    xb = write_descriptors_with_tokens(root / "desc", SIZES, D, seed=11)
    client = s3_client(s3_endpoint)
    client.create_bucket(Bucket="serving")
    url = main(replace(IVF, s3_endpoint_url=s3_endpoint), root / "desc", "s3://serving/index")
    local = root / "copy"
    for item in client.list_objects_v2(Bucket="serving", Prefix="index/")["Contents"]:
        name = item["Key"][len("index/") :]
        if name.endswith(MARKER_SUFFIX) or name.startswith("trained"):
            continue
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        client.download_file("serving", item["Key"], str(local / name))
    return url, load_index(local), xb


@pytest.fixture(scope="module")
def served(cluster, index_on_s3, s3_endpoint, tmp_path_factory):
    from cluster.ray_shards import ShardPlacement
    from cluster.serve import ShardServing, serve_sharded
    from cluster.staging import StageConfig

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

    from cluster.serve import QueryService
    from query.retrieve import QueryConfig, search, stored_tokens
    from rerank.rerank import RerankConfig

    coordinator, cache = served
    _, single, xb = index_on_s3
    health = coordinator.health()
    assert health["ok"] and len({r["node"] for r in health["replicas"]}) >= 2  # spread over the nodes
    infos = ray.get([a.info.remote() for replicas in coordinator.backend.actors for a in replicas])
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


def stream_until_exact(service, single_service, body, expected_missing, deadline_s=60):
    """Requests (alternately partial and not) until the answer is exact again: each must take at
    most the timeout (plus slack) and be exact, or a 503 / partial answer naming the missing shard.
    Returns how many were not exact."""
    from cluster.coordinator import ShardsUnavailable

    exact = single_service.search_json(body)
    not_exact, start = 0, time.monotonic()
    for i in range(10_000):
        assert time.monotonic() - start < deadline_s, "the shard did not come back"
        began = time.monotonic()
        try:
            out = service.search_json({**body, "partial": bool(i % 2)})
        except ShardsUnavailable as exc:
            assert set(exc.missing) <= expected_missing and exc.missing
            not_exact += 1
        else:
            if out == exact:
                return not_exact
            assert all(q["partial"] and set(q["missing_shards"]) <= expected_missing for q in out)
            not_exact += 1
        assert time.monotonic() - began < TIMEOUT + 3.0, "a request hung"
        time.sleep(0.1)
    raise AssertionError("unreachable")


def test_killed_shard_actors_give_exact_then_503_or_partial_then_exact_answers(served, index_on_s3):
    import ray

    from cluster.serve import QueryService

    coordinator, _ = served
    _, single, xb = index_on_s3
    body = {"vectors": xb[::97].tolist(), "k": 30}
    service, single_service = QueryService(coordinator), QueryService(single)
    exact = single_service.search_json(body)
    assert service.search_json(body) == exact
    ray.kill(coordinator.backend.actors[2][0], no_restart=False)  # one replica: its twin answers
    for _ in range(10):
        start = time.monotonic()
        assert service.search_json(body) == exact
        assert time.monotonic() - start < TIMEOUT + 1.0
    for actor in coordinator.backend.actors[1]:  # every replica of shard_001
        ray.kill(actor, no_restart=False)
    assert stream_until_exact(service, single_service, body, {"shard_001"}) >= 1
    deadline = time.monotonic() + 60
    while not all(r["status"] == "ready" for r in coordinator.health()["replicas"]):
        assert time.monotonic() < deadline, "the killed replicas did not come back"
        time.sleep(0.5)


def test_a_removed_node_does_not_hang_requests_and_its_shards_restart_elsewhere(cluster, served, index_on_s3):
    from cluster.serve import QueryService

    coordinator, _ = served
    _, single, xb = index_on_s3
    replicas = coordinator.health()["replicas"]
    victim = next(n for n in cluster.worker_nodes if any(r["node"] == n.node_id for r in replicas))
    lost = {r["shard"] for r in replicas if r["node"] == victim.node_id}  # a shard may still have its twin
    cluster.remove_node(victim)
    body = {"vectors": xb[::89].tolist(), "k": 25}
    service, single_service = QueryService(coordinator), QueryService(single)
    stream_until_exact(service, single_service, body, lost, deadline_s=90)
    deadline = time.monotonic() + 90
    while not all(r["status"] == "ready" for r in coordinator.health()["replicas"]):
        assert time.monotonic() < deadline, "the lost node's replicas did not restart elsewhere"
        time.sleep(0.5)
    assert victim.node_id not in {r["node"] for r in coordinator.health()["replicas"]}
