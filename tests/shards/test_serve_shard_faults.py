"""Serving shards when something is wrong, without Ray: staging checks the checksums of cached
copies, a dead or hung replica is replaced or hedged, a dead shard is a 503 or a partial answer
bounded in time (HTTP and /health), and an old index layout or bad serve flags are refused."""

import json
import time
from dataclasses import replace

import numpy as np
import pytest

from index.build.stage import SHARD_INFOS_FILE
from index.errors import IndexFileError
from index.search import load_index
from shards.coordinator import ShardsUnavailable
from shards.staging import StageConfig, read_index_infos, stage_shard

# pytest fixtures and the fixtures they request, imported by name (``x as x``: on purpose, not unused)
from tests.support.serve_shards import built as built
from tests.support.serve_shards import coordinator, queries
from tests.support.serve_shards import sharded as sharded


def test_staging_verifies_checksums_and_reuses_the_cache(built, tmp_path):
    _, out, _ = built
    conf = StageConfig(str(tmp_path / "cache-{node}"))
    first = stage_shard(str(out), "shard_001", conf, "n1")
    assert first.fetched > 0 and first.reused == 0 and str(first.directory).startswith(str(tmp_path / "cache-n1"))
    again = stage_shard(str(out), "shard_001", conf, "n1")
    assert (again.fetched, again.reused) == (0, first.fetched)
    (again.directory / "keys.bin").write_bytes(b"changed")  # a damaged cached copy is fetched again
    assert stage_shard(str(out), "shard_001", conf, "n1").fetched == 1
    assert stage_shard(str(out), "shard_001", conf, "n2").fetched == first.fetched  # another node: its own copy
    source = tmp_path / "source"
    import shutil

    shutil.copytree(out, source)
    data = bytearray((source / "shard_002" / "keys.bin").read_bytes())
    data[0] ^= 1  # same size, other bytes
    (source / "shard_002" / "keys.bin").write_bytes(bytes(data))
    with pytest.raises(IndexFileError, match=r"shard_002.*keys\.bin does not match"):
        stage_shard(str(source), "shard_002", conf, "n1")
    infos = json.loads((out / "index_infos.json").read_text())
    with pytest.raises(IndexFileError, match="says"):
        stage_shard(str(out), "shard_001", conf, "n1", {**infos["shards"][1], "rows": 1})
    assert json.loads((first.directory / SHARD_INFOS_FILE).read_text())["name"] == "shard_001"
    in_place = stage_shard(str(out), "shard_001", replace(conf, copy_local=False), "n3")
    assert (in_place.directory, in_place.fetched) == (out / "shard_001", 0) and not (tmp_path / "cache-n3").exists()


def test_a_dead_replica_is_replaced_and_a_dead_shard_is_named(built, sharded):
    _, out, xb = built
    single = load_index(out)
    xq = queries(xb)
    _, I1 = single.search(xq, 20)
    backend = sharded.backend
    try:
        backend.down = {(0, 0), (2, 1)}  # one replica of two shards: the other answers
        for _ in range(4):
            np.testing.assert_array_equal(sharded.search(xq, 20)[1], I1)
        backend.down = {(1, 0), (1, 1)}  # no live replica of shard_001
        with pytest.raises(ShardsUnavailable, match="shard_001") as caught:
            sharded.search(xq, 20)
        assert caught.value.missing == ["shard_001"]
        with sharded.request(partial=True) as state:
            D2, I2 = sharded.search(xq, 20)
        assert state.missing == {"shard_001"}
        assert (sharded.shard_of_rows(I2.reshape(-1)) != 1).all()  # what it has is from the live shards
        assert (np.diff(D2, axis=1) <= 0).all() and (I2 >= 0).all()
    finally:
        backend.down = set()
    np.testing.assert_array_equal(sharded.search(xq, 20)[1], I1)  # exact again


def test_a_hung_replica_is_hedged_on_another_and_then_avoided(built, tmp_path):
    _, out, xb = built
    index = coordinator(out, tmp_path / "cache", replicas=2, timeout=1.0)
    xq = queries(xb)
    _, I1 = load_index(out).search(xq, 20)
    index.backend.slow = {(2, 0): 5.0, (2, 1): 5.0}  # shard_002 hangs on both: 503 within the timeout
    start = time.monotonic()
    with pytest.raises(ShardsUnavailable, match="shard_002"):
        index.search(xq, 20)
    assert time.monotonic() - start < 1.5
    index.backend.slow = {(2, 0): 5.0}  # one replica hangs: the other answers after the hedge
    index.suspect.clear()
    start = time.monotonic()
    np.testing.assert_array_equal(index.search(xq, 20)[1], I1)
    assert 0.25 < time.monotonic() - start < 0.9 and index.is_suspect(2, 0) and not index.is_suspect(2, 1)
    for _ in range(3):  # then the hung replica is asked after the other: no hedge delay
        start = time.monotonic()
        np.testing.assert_array_equal(index.search(xq, 20)[1], I1)
        assert time.monotonic() - start < 0.25


def test_http_503_partial_and_health(built, tmp_path):
    from fastapi.testclient import TestClient

    from webapi.query_service import QueryService
    from webapi.webapp import check_shards, create_app

    _, out, xb = built
    index = coordinator(out, tmp_path / "cache", replicas=1, timeout=0.5)
    single = QueryService(load_index(out))
    body = {"vectors": xb[:2].tolist(), "k": 5}
    with TestClient(
        create_app(QueryService(index)), base_url="http://localhost", raise_server_exceptions=False
    ) as client:
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["ok"] is True
        assert {r["status"] for r in health.json()["replicas"]} == {"ready"} and len(health.json()["replicas"]) == 4
        assert client.post("/search", json=body).json() == single.search_json(body)
        index.backend.slow[(3, 0)] = 3.0  # shard_003 hangs: the request does not
        start = time.monotonic()
        response = client.post("/search", json=body)
        assert time.monotonic() - start < 2.5
        assert response.status_code == 503 and response.json()["missing_shards"] == ["shard_003"]
        response = client.post("/search?partial=1", json=body)
        assert response.status_code == 200
        out_partial = response.json()
        assert all(q["partial"] is True and q["missing_shards"] == ["shard_003"] for q in out_partial)
        assert all(r["key"] is not None for q in out_partial for r in q["results"])
        response = client.post("/search", json={**body, "partial": True})
        assert response.status_code == 200 and response.json()[0]["partial"] is True
        response = client.post("/search", json={"keys": ["000007/00001"], "k": 3})
        assert response.status_code == 503 and "shard_003" in response.json()["error"]
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["unavailable_shards"] == ["shard_003"]
        with pytest.raises(ShardsUnavailable, match="shard_003"):  # Ray Serve's check_health
            check_shards(QueryService(index))
        check_shards(single)  # one process: nothing to check
        del index.backend.slow[(3, 0)]
        time.sleep(3.0)  # the hung calls finish
        assert client.post("/search", json=body).json() == single.search_json(body)
        assert client.get("/health").status_code == 200


def test_old_layout_is_refused_for_serving_across_nodes(built, tmp_path):
    from index.errors import OldIndexLayoutError
    from tests.support.index import to_old_layout

    old = to_old_layout(built[1], tmp_path / "old")
    with pytest.raises(OldIndexLayoutError, match=f"index {old} was built before shard directories.*--out {old}`"):
        read_index_infos(old)
    with pytest.raises(IndexFileError, match=f"{tmp_path} is not an index .*`needle index build`"):
        read_index_infos(tmp_path)


def test_serve_flags_for_shards():
    from cli.main import build_parser
    from cli.spec_flags import serve_spec
    from cluster.serve_run import shard_serving
    from webapi.spec import Shards

    args = build_parser().parse_args(
        [
            *("serve", "--index", "s3://b/i", "--ray-shards", "--shard-replicas", "2", "--shard-timeout", "3"),
            *("--cache-dir", "/data/needle-{node}", "--s3-endpoint-url", "http://127.0.0.1:9000"),
        ]
    )
    serving = shard_serving(serve_spec(args).shards)
    assert (serving.placement.replicas, serving.timeout, serving.placement.cpus) == (2, 3.0, None)
    assert serving.stage == StageConfig("/data/needle-{node}", "http://127.0.0.1:9000")
    args = build_parser().parse_args(["serve", "--index", "idx", "--ray-shards", "--no-stage-local"])
    assert shard_serving(serve_spec(args).shards).stage.copy_local is False
    with pytest.raises(Exception, match="shard-timeout"):
        shard_serving(Shards(timeout=0))
    args = build_parser().parse_args(["serve", "--index", "idx", "--ray-shards", "--shard-cpus", "3"])
    assert shard_serving(serve_spec(args).shards).placement.cpus == 3.0
    with pytest.raises(Exception, match="shard-cpus"):
        shard_serving(Shards(cpus=0))
    assert shard_serving(Shards()).transport == "direct"
    args = build_parser().parse_args(["serve", "--index", "idx", "--ray-shards", "--shard-transport", "ray"])
    assert shard_serving(serve_spec(args).shards).transport == "ray"
    with pytest.raises(Exception, match="shard-transport must be one of direct, ray, got 'grpc'"):
        shard_serving(Shards(transport="grpc"))
