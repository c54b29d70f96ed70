"""Serving: Ray shard actors equal the single index; the HTTP endpoint answers and refuses bad input."""

import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from helpers_index import clustered_unit_vectors, write_descriptor_file
from index.build import IndexConfig, main
from index.search import load_index

IVF = IndexConfig(kind="ivfpq", nlist=8, pq_bytes=8, points_per_list=50, nprobe=4, refine_factor=3)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from dataclasses import replace

    root = tmp_path_factory.mktemp("serve")
    for s in range(4):
        write_descriptor_file(root / "desc", f"{s:06d}", s, clustered_unit_vectors(120, 32, seed=10 + s))
    main(IVF, root / "desc", root / "single")
    main(replace(IVF, shards=4), root / "desc", root / "sharded")
    return root


@pytest.mark.ray
def test_ray_sharded_service_equals_single_index(built, ray_local):
    from cluster.serve import serve_sharded

    single = load_index(built / "single")
    service = serve_sharded(built / "sharded")
    assert len(service.actors) == 4 and service.ntotal == single.ntotal == 480
    xq = np.asarray(single.vectors[::13], dtype=np.float32)
    for nprobe, factor in ((1, None), (4, None), (8, None), (8, 1)):
        D1, I1 = single.search(xq, 25, nprobe, refine_factor=factor)
        D2, I2 = service.search(xq, 25, nprobe, refine_factor=factor)
        np.testing.assert_array_equal(I1, I2)
        np.testing.assert_allclose(D1, D2, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def server(built):
    from cluster.serve import QueryService, make_server

    srv = make_server(QueryService(load_index(built / "single")), "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def post(url, body, content_type="application/json"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_http_search_by_key_and_vector(server, built):
    index = load_index(built / "single")
    status, out = post(f"{server}/search", {"keys": ["000002/00005"], "k": 3})
    assert status == 200 and out[0]["results"][0]["key"] == "000002/00005" and len(out[0]["results"]) == 3
    vector = index.vector_of("000001/00007").tolist()
    status, out = post(f"{server}/search", {"vectors": [vector], "k": 5, "nprobe": 8, "refine_factor": 4})
    assert status == 200 and out[0]["results"][0]["key"] == "000001/00007"
    assert out[0]["results"][0]["score"] == pytest.approx(1.0, abs=1e-2)
    with urllib.request.urlopen(f"{server}/health") as response:
        assert json.loads(response.read())["ntotal"] == 480


@pytest.mark.parametrize("path,body,message", [
    ("/search", {"vectors": [[0.0] * 31], "k": 2}, "expects (n, 32)"),
    ("/search", {"keys": ["000000/00001"], "k": 100000}, "larger than the index"),
    ("/search", {"text": "   ", "k": 2}, "non-empty string"),
    ("/search", {"keys": ["nope"], "k": 2}, "not in the index"),
    ("/search", {"k": 2}, "exactly one of"),
    ("/search", {"keys": ["000000/00001"], "k": 2, "refine_factor": 0}, "refine_factor must be"),
    ("/search", b"{not json", "not JSON"),
    ("/search/image?k=2", b"definitely not an image", "cannot decode"),
])
def test_http_bad_input_is_a_4xx_with_a_message(server, path, body, message):
    status, out = post(f"{server}{path}", body)
    assert status == 400 and message in out["error"]


@pytest.mark.ray
def test_ray_parallel_build_equals_sequential(built, ray_local, tmp_path):
    from dataclasses import replace

    from cluster.index_job import main as build_on_ray

    out = build_on_ray(replace(IVF, parts=4), built / "desc", tmp_path / "ray")
    ray_index, single = load_index(out), load_index(built / "single")
    xq = np.asarray(single.vectors[::17], dtype=np.float32)
    np.testing.assert_array_equal(ray_index.search(xq, 20)[1], single.search(xq, 20)[1])
