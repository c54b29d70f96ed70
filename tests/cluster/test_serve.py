"""Serving: Ray shard actors equal the single index; the HTTP app (TestClient, uvicorn, Ray Serve)
answers, in parallel, and refuses bad input."""

import json
import threading
import time

import numpy as np
import pytest

from index.build.stage import main
from index.search import load_index
from tests.support.indexes import SERVED_480, write_synthetic
from tests.support.indexes import SERVED_IVF as IVF
from tests.support.ports import free_port, urlopen_json


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from dataclasses import replace

    root = tmp_path_factory.mktemp("serve")
    write_synthetic(SERVED_480, root)
    main(IVF, root / "desc", root / "single")
    main(replace(IVF, shards=4), root / "desc", root / "sharded")
    return root


@pytest.mark.ray
def test_ray_sharded_service_equals_single_index(built, ray_local):
    from cluster.serve import serve_sharded

    single = load_index(built / "single")
    service = serve_sharded(built / "sharded")
    assert len(service.backend.actors) == 4 and service.ntotal == single.ntotal == 480
    xq = np.asarray(single.vectors[::13], dtype=np.float32)
    for nprobe, factor in ((1, None), (4, None), (8, None), (8, 1)):
        D1, I1 = single.search(xq, 25, nprobe, refine_factor=factor)
        D2, I2 = service.search(xq, 25, nprobe, refine_factor=factor)
        np.testing.assert_array_equal(I1, I2)
        np.testing.assert_array_equal(D1, D2)


@pytest.fixture(scope="module")
def service(built):
    from webapi.query_service import QueryService

    return QueryService(load_index(built / "single"))


@pytest.fixture(scope="module")
def client(service):
    from fastapi.testclient import TestClient

    from webapi.webapp import create_app

    with TestClient(create_app(service), base_url="http://localhost", raise_server_exceptions=False) as c:
        yield c


def post(client, path, body, content_type=None):
    """POST ``body`` (JSON, or bytes) with the Content-Type the endpoint takes unless one is given."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    content_type = content_type or (
        "application/octet-stream" if path.startswith("/search/image") else "application/json"
    )
    response = client.post(path, content=data, headers={"Content-Type": content_type})
    return response.status_code, response.json()


def test_http_search_by_key_and_vector(client, built):
    index = load_index(built / "single")
    status, out = post(client, "/search", {"keys": ["000002/00005"], "k": 3})
    assert status == 200 and out[0]["results"][0]["key"] == "000002/00005" and len(out[0]["results"]) == 3
    vector = index.vector_of("000001/00007").tolist()
    status, out = post(client, "/search", {"vectors": [vector], "k": 5, "nprobe": 8, "refine_factor": 4})
    assert status == 200 and out[0]["results"][0]["key"] == "000001/00007"
    assert out[0]["results"][0]["score"] == pytest.approx(1.0, abs=1e-2)
    response = client.get("/health")
    assert response.status_code == 200 and response.json() == {
        "ntotal": 480,
        "d": 32,
        "shards": 1,
        "kind": "ivfpq",
        "generation": 0,
        "index_id": index.infos["index_id"],  # the build's (16 hex digits)
    }
    assert len(index.infos["index_id"]) == 16


@pytest.mark.parametrize(
    "path,body,message",
    [
        ("/search", {"vectors": [[0.0] * 31], "k": 2}, "expects (n, 32)"),
        ("/search", {"keys": ["000000/00001"], "k": 0}, "positive integer"),
        ("/search", {"text": "   ", "k": 2}, "non-empty string"),
        ("/search", {"keys": ["nope"], "k": 2}, "not in the index"),
        ("/search", {"k": 2}, "exactly one of"),
        ("/search", {"keys": ["000000/00001"], "k": 2, "refine_factor": 0}, "refine_factor must be"),
        ("/search", b"{not json", "not JSON"),
        ("/search", b"[1, 2]", "must be a JSON object"),
        ("/search/image?k=2", b"definitely not an image", "cannot decode"),
        ("/search/image?k=2", b"", "empty request body"),
        ("/search/image?k=two", b"\xff\xd8", "bad query parameter"),
    ],
)
def test_http_bad_input_is_a_4xx_with_a_message(client, path, body, message):
    status, out = post(client, path, body)
    assert status == 400 and message in out["error"] and out["request_id"]


def test_http_unknown_endpoint_too_large_body_and_failure(client, service, built, monkeypatch, caplog):
    """A failure is a 500 that says nothing but its request id; the log has the exception with the
    same id. A body over its limit is a 413 naming the limit."""
    from fastapi.testclient import TestClient

    from webapi.limits import ServiceLimits
    from webapi.query_service import QueryService
    from webapi.webapp import create_app

    response = client.get("/nope")
    assert response.status_code == 404 and response.json()["error"] == "no such endpoint /nope"

    def boom(body):
        raise RuntimeError("disk on fire at /srv/secret/index")

    monkeypatch.setattr(service, "search_json", boom)
    status, out = post(client, "/search", {"keys": ["000000/00001"]})
    assert status == 500 and "disk on fire" not in json.dumps(out) and "/srv" not in json.dumps(out)
    assert out["request_id"] in caplog.text and "disk on fire at /srv/secret/index" in caplog.text
    small = QueryService(load_index(built / "single"), limits=ServiceLimits(max_body_mb=1, max_json_mb=1))
    with TestClient(create_app(small), base_url="http://localhost") as c:
        for path, limit in (("/search/image?k=2", "max_body_mb"), ("/search", "max_json_mb")):
            status, out = post(c, path, b"x" * ((1 << 20) + 1))
            assert (
                status == 413 and out["limit"] == limit and out["field"] == "body" and "over the limit" in out["error"]
            )


def test_openapi_page(client):
    assert client.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/health", "/search", "/search/image"} <= set(paths)


def test_search_image_reads_the_body_in_memory(client, service, monkeypatch):
    seen = {}

    def fake(data, k, nprobe):
        seen.update(data=data, k=k, nprobe=nprobe)
        return [{"query": {"image": f"{len(data)} bytes"}, "k": k, "results": []}]

    monkeypatch.setattr(service, "search_image", fake)
    status, _ = post(client, "/search/image?k=3&nprobe=2", b"\x89PNG fake", "image/png")
    assert status == 200 and seen == {"data": b"\x89PNG fake", "k": 3, "nprobe": 2}


def kill_and_wait_until_dead(ray, actor, timeout=30.0):
    """ray.kill only asks for the kill: until the process is gone the actor still answers, and a
    health probe sent in that window sees it ready. Return once a call to it fails."""
    import time

    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(deadline - time.monotonic(), 0.1))
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            break
        time.sleep(0.05)
    raise TimeoutError(f"actor {actor} still answers {timeout} s after ray.kill")


def test_uvicorn_answers_concurrent_requests_like_sequential_ones(service, built):
    """A real uvicorn server: 8 threads at once get the answers one client gets alone."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import uvicorn

    from webapi.webapp import create_app

    server = uvicorn.Server(
        uvicorn.Config(create_app(service), host="127.0.0.1", port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        index = load_index(built / "single")
        keys = [f"{s:06d}/{i:05d}" for s in range(4) for i in range(0, 120, 20)]
        bodies = [{"keys": [key], "k": 7} for key in keys] + [
            {"vectors": [index.vector_of(key).tolist()], "k": 7, "nprobe": 8} for key in keys
        ]
        sequential = [urlopen_json(f"{url}/search", body) for body in bodies]
        with ThreadPoolExecutor(8) as pool:
            concurrent = list(pool.map(lambda body: urlopen_json(f"{url}/search", body), bodies))
        assert all(status == 200 for status, _ in sequential)
        assert concurrent == sequential
        assert urlopen_json(f"{url}/health")[1]["ntotal"] == 480
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.ray
@pytest.mark.slow
def test_ray_serve_deployment_answers_through_the_proxy(built, ray_local):
    from ray import serve

    from cluster.serve import ray_app
    from webapi.spec import ServeSpec

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(ray_app(ServeSpec(index=str(built / "single"))), name="needle", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        status, health = urlopen_json(f"{url}/health")
        assert list(health.pop("serve_replicas").values()) == [0]  # its one replica's (cluster/generation_board.py)
        index_id = load_index(built / "single").infos["index_id"]
        assert (status, health) == (
            200,
            {"ntotal": 480, "d": 32, "shards": 1, "kind": "ivfpq", "generation": 0, "index_id": index_id},
        )
        status, out = urlopen_json(f"{url}/search", {"keys": ["000002/00005"], "k": 3})
        assert status == 200 and out[0]["results"][0]["key"] == "000002/00005" and len(out[0]["results"]) == 3
        status, out = urlopen_json(f"{url}/search", {"k": 2})
        assert status == 400 and "exactly one of" in out["error"]
    finally:
        serve.shutdown()


@pytest.mark.ray
@pytest.mark.slow
def test_ray_serve_deployment_in_front_of_shard_actors(built, ray_local, tmp_path):
    """--ray --ray-shards: a Serve replica is a coordinator of the shard actors (reporting them
    in /health) and answers like the directory loaded in one process."""
    from ray import serve

    from cluster.serve import ShardServing, ray_app, serve_sharded
    from shards.staging import StageConfig
    from webapi.query_service import QueryService
    from webapi.spec import ServeSpec

    serving = ShardServing(stage=StageConfig(str(tmp_path / "cache")), timeout=20.0)
    actors = serve_sharded(built / "sharded", serving).backend.actors
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        spec = ServeSpec(index=str(built / "sharded"))
        serve.run(ray_app(spec, shard_actors=actors, serving=serving), name="needle", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        status, health = urlopen_json(f"{url}/health")
        assert status == 200 and health["ok"] and health["shards"] == 4
        assert [r["status"] for r in health["replicas"]] == ["ready"] * 4
        one_process = QueryService(load_index(built / "sharded"))
        for body in ({"keys": ["000002/00005"], "k": 5}, {"keys": ["000001/00100"], "k": 9, "nprobe": 8}):
            assert urlopen_json(f"{url}/search", body) == (200, one_process.search_json(body))
        # a shard with no live replica: /health is a 503 naming it, and Serve's health probe of the
        # live deployment's replica fails (the controller then replaces it)
        serve.get_app_handle("needle").check_health.remote().result()
        kill_and_wait_until_dead(ray_local, actors[1][0])
        deadline = time.monotonic() + 5  # /health answers from its one-second cache (webapi/health.py)
        while (answer := urlopen_json(f"{url}/health"))[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        status, health = answer
        assert status == 503 and health["unavailable_shards"] == ["shard_001"]
        with pytest.raises(Exception, match="shard_001"):
            serve.get_app_handle("needle").check_health.remote().result()
    finally:
        serve.shutdown()
        for [actor] in actors:
            ray_local.kill(actor)


@pytest.mark.ray
def test_ray_parallel_build_equals_sequential(built, ray_local, tmp_path):
    from dataclasses import replace

    from cluster.index_job import main as build_on_ray

    out = build_on_ray(replace(IVF, parts=4), built / "desc", tmp_path / "ray")
    ray_index, single = load_index(out), load_index(built / "single")
    xq = np.asarray(single.vectors[::17], dtype=np.float32)
    np.testing.assert_array_equal(ray_index.search(xq, 20)[1], single.search(xq, 20)[1])


def test_create_app_with_the_web_page(service):
    webpage = pytest.importorskip("webapi.webpage")
    from fastapi.testclient import TestClient

    from webapi.webapp import create_app

    with TestClient(create_app(service, webpage.PageConfig()), base_url="http://localhost") as c:
        assert c.get("/").status_code == 200
        assert c.get("/health").json()["ntotal"] == 480


def test_serve_flags():
    from cli.main import build_parser
    from cli.spec_flags import serve_spec

    spec = serve_spec(build_parser().parse_args(["serve", "--index", "x"]))
    assert (spec.listen.host, spec.listen.port, spec.listen.ray, spec.listen.replicas, spec.shards.ray) == (
        "127.0.0.1",
        8000,
        False,
        1,
        False,
    )
    spec = serve_spec(
        build_parser().parse_args(
            ["serve", "--index", "x", "--ray", "--replicas", "3", "--ray-shards", "--rerank", "sp"]
        )
    )
    assert (spec.listen.ray, spec.listen.replicas, spec.shards.ray, spec.rerank.method) == (True, 3, True, "sp")
