"""``needle serve`` facing a network (webapi.limits, webapi.guard, webapi.http_errors): each bound
refused with a status that says whose fault it was and a body naming the field and the limit;
server faults never a 4xx and never described to the client; Host, Origin and Content-Type
checks; the concurrency gate. Through TestClient: fast. Slow clients and memory:
tests/test_serve_connections.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import threading
import time
import zlib

import pytest
from helpers_index import clustered_unit_vectors, write_descriptor_file

from index.build import IndexConfig, main
from index.search import load_index

IVF = IndexConfig(kind="ivfpq", nlist=8, pq_bytes=8, points_per_list=50, nprobe=4, refine_factor=3)
JSON = {"Content-Type": "application/json"}
OCTETS = {"Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    for s in range(2):
        write_descriptor_file(root / "desc", f"{s:06d}", s, clustered_unit_vectors(150, 32, seed=20 + s))
    return main(IVF, root / "desc", root / "index")


@pytest.fixture(scope="module")
def index(index_dir):
    return load_index(index_dir)


def app_client(index, **limits):
    from fastapi.testclient import TestClient

    from webapi.limits import ServiceLimits
    from webapi.query_service import QueryService
    from webapi.webapp import create_app

    service = QueryService(index, limits=ServiceLimits(**limits))
    return TestClient(create_app(service), base_url="http://localhost", raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(index):
    with app_client(index, max_queries=50, max_k_total=200, max_text_length=20, max_image_pixels=10_000) as c:
        yield c


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header says width x height: PIL reads its size without decoding (no valid data)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"\x00" * 8) + chunk(b"IEND", b"")


KEY = "000000/00001"


@pytest.mark.parametrize(
    "body,status,field,limit",
    [
        ({"keys": [KEY] * 51, "k": 1}, 413, "keys", "max_queries"),
        ({"keys": [KEY] * 21, "k": 10}, 413, "keys", "max_k_total"),
        ({"vectors": [[0.1] * 32] * 51, "k": 1}, 413, "vectors", "max_queries"),
        ({"text": "x" * 21, "k": 1}, 413, "text", "max_text_length"),
        ({"keys": [KEY], "k": 201}, 413, "k", "max_k_total"),
        ({"keys": [KEY], "nprobe": [1]}, 400, "nprobe", None),
        ({"keys": [KEY], "nprobe": "4"}, 400, "nprobe", None),
        ({"keys": [KEY], "nprobe": 0}, 400, "nprobe", None),
        ({"keys": [KEY], "nprobe": 10**6}, 400, "nprobe", None),
        ({"keys": [KEY], "k": "10"}, 400, "k", None),
        ({"keys": [KEY], "k": True}, 400, "k", None),
        ({"keys": [KEY], "k": 1.5}, 400, "k", None),
        ({"keys": [KEY], "refine_factor": 10**6}, 400, "refine_factor", None),
        ({"keys": [1, 2]}, 400, "keys", None),
        ({"keys": KEY}, 400, "keys", None),
        ({"keys": [KEY], "partial": "yes"}, 400, "partial", None),
        ({"keys": [KEY], "kk": 3}, 400, "kk", None),
        ({"vectors": [[float("nan")] * 32]}, 400, "vectors", None),
        ({"vectors": [["0.1"] * 32]}, 400, "vectors", None),
        ({"vectors": [[0.1] * 32, [0.1] * 5]}, 400, "vectors", None),
        ({"vectors": {"a": 1}}, 400, "vectors", None),
        ({"text": ["ok", 3]}, 400, "text", None),
    ],
)
def test_every_field_is_checked_and_named(client, body, status, field, limit):
    response = client.post("/search", content=json.dumps(body), headers=JSON)
    out = response.json()
    assert response.status_code == status, out
    assert out["field"] == field and out["request_id"] == response.headers["x-request-id"]
    if limit:
        assert out["limit"] == limit and f"--{limit.replace('_', '-')}" in out["error"] and out["got"] > out["max"]


@pytest.mark.parametrize(
    "data,message",
    [
        (b"[" * 100_000, "too deep"),  # RecursionError in json.loads: bad input, not a 500
        (b'{"k": ' + b"9" * 5000 + b"}", "not JSON"),  # past Python's int digits limit
        (b"\xff\xfe{", "not JSON"),
        (b'"just a string"', "JSON object"),
    ],
)
def test_malformed_json_is_a_400(client, data, message):
    response = client.post("/search", content=data, headers=JSON)
    assert response.status_code == 400 and message in response.json()["error"]


def test_image_is_refused_from_its_header_before_any_decoder(client, monkeypatch):
    from webapi.query_service import QueryService

    def never(*args, **kwargs):
        raise AssertionError("decoded")

    monkeypatch.setattr(QueryService, "embed_image", never)
    response = client.post("/search/image?k=2", content=png_header(12_500, 12_500), headers=OCTETS)
    out = response.json()
    assert response.status_code == 413 and out["limit"] == "max_image_pixels" and out["got"] == 12_500**2
    response = client.post(
        "/search/image?k=2", content=png_header(20_000, 20_000), headers={"Content-Type": "image/png"}
    )
    assert response.status_code == 413 and response.json()["limit"] == "max_image_pixels"  # PIL's bomb error too
    response = client.post("/search/image?k=2", content=b"P6 4 4 255\n" + b"\x00" * 48, headers=OCTETS)
    assert response.status_code == 400 and "not an image of JPEG" in response.json()["error"]  # PPM: not a query format
    for query in ("k=0", "k=201", "nprobe=0", "k=2&nprobe=100000"):
        response = client.post(f"/search/image?{query}", content=png_header(10, 10), headers=OCTETS)
        assert response.status_code in (400, 413) and response.json()["field"] in ("k", "nprobe"), query


def many_scan_jpeg(scans: int) -> bytes:
    """A small progressive JPEG whose last scan is repeated: ``scans`` start-of-scan markers in
    ~20 KB that libjpeg decodes, each a pass over the image (1,010 scans of a 12 MP one took 34 s)."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90, progressive=True)
    data = out.getvalue()
    last = data[data.rindex(b"\xff\xda") : -2]
    extra = scans - data.count(b"\xff\xda")
    return data[:-2] + last * extra + b"\xff\xd9"


def tiff_bytes() -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (32, 24), (9, 9, 9)).save(out, "TIFF")
    return out.getvalue()


def test_query_images_are_refused_past_the_scan_cap_and_as_tiff(client, monkeypatch):
    """A JPEG of more scans than --max-jpeg-scans is a 413 from its bytes (each scan is a pass of
    the decoder over the image: the pixel cap does not bound the time); TIFF is not a query format
    (libtiff: ingest/images.py says why); within the cap, the same file decodes."""
    from ingest.images import decode_resized_many, jpeg_scans
    from webapi.query_service import QueryService

    many = many_scan_jpeg(65)
    assert jpeg_scans(many) == 65 and decode_resized_many(many, (32,), max_scans=65)[0][32].shape == (24, 32, 3)
    monkeypatch.setattr(QueryService, "embed_image", lambda *a, **k: pytest.fail("decoded"))
    response = client.post("/search/image?k=2", content=many, headers=OCTETS)
    out = response.json()
    assert response.status_code == 413 and (out["limit"], out["got"], out["max"]) == ("max_jpeg_scans", 65, 64)
    response = client.post("/search/image?k=2", content=tiff_bytes(), headers=OCTETS)
    assert response.status_code == 400 and "not an image of JPEG, PNG, WEBP, GIF, BMP, MPO" in response.json()["error"]


def test_every_image_open_holds_the_allow_list_and_the_scan_cap():
    """Ingestion decodes TIFF (tar members may be .tif) but no server path does: the query decode
    and thumbnails open SERVE_FORMATS only, with the scan cap and (thumbnails) a pixel cap."""
    import io

    from PIL import Image

    from core.errors import ImageDecodeError
    from ingest.images import SERVE_FORMATS, TooManyScans, decode_resized_many
    from ingest.source_images import thumbnail_jpeg
    from webapi.limits import QUERY_FORMATS

    assert QUERY_FORMATS == SERVE_FORMATS
    assert decode_resized_many(tiff_bytes(), (16,))[0][16].shape == (12, 16, 3)  # ingestion
    with pytest.raises(ImageDecodeError, match="not an image of"):
        decode_resized_many(tiff_bytes(), (16,), "q", SERVE_FORMATS)
    with pytest.raises(TooManyScans):
        decode_resized_many(many_scan_jpeg(65), (16,), "q")
    with pytest.raises(ImageDecodeError, match="not an image of"):
        thumbnail_jpeg(tiff_bytes(), 16, "000000/00001")
    with pytest.raises(TooManyScans, match="000000/00001"):
        thumbnail_jpeg(many_scan_jpeg(100), 16, "000000/00001")
    with pytest.raises(ImageDecodeError, match="over 100 pixels"):
        thumbnail_jpeg(many_scan_jpeg(10), 16, "k", max_pixels=100)
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"
    with pytest.raises(ImageDecodeError, match="not an image of"):
        thumbnail_jpeg(eps, 16)  # no plugin outside the list ever sees the bytes (EPS runs Ghostscript)
    with Image.open(io.BytesIO(thumbnail_jpeg(many_scan_jpeg(10), 16))) as small:
        assert small.format == "JPEG" and max(small.size) == 16


def test_body_over_its_limit_is_refused_before_it_is_read(index):
    with app_client(index, max_json_mb=1, max_body_mb=1) as c:
        for path, headers, limit in (("/search", JSON, "max_json_mb"), ("/search/image", OCTETS, "max_body_mb")):
            response = c.post(path, content=b"x" * ((1 << 20) + 1), headers=headers)
            out = response.json()
            assert response.status_code == 413 and (out["field"], out["limit"]) == ("body", limit)

            def chunks():  # no Content-Length: counted while it streams
                yield b"x" * (1 << 20)
                yield b"x" * 10

            response = c.post(path, content=chunks(), headers=headers)
            assert response.status_code == 413 and response.json()["limit"] == limit


def test_bodies_held_at_once_are_bounded(index):
    with app_client(index, max_buffered_mb=1, max_body_mb=4) as c:
        response = c.post("/search/image", content=b"x" * (2 << 20), headers=OCTETS)
        assert response.status_code == 503 and response.json()["limit"] == "max_buffered_mb"
        assert response.headers["retry-after"] == "1"


# --- whose fault: the server's faults are 5xx and say nothing of themselves ------------------------
def test_server_faults_are_5xx_with_only_a_request_id(client, index_dir, monkeypatch, caplog):
    from core.storage import StorageError
    from index.errors import IndexFileError
    from webapi.query_service import QueryService

    faults = [
        (IndexFileError(f"index shard shard_000 ({index_dir}/shard_000): keys.bin is missing"), 500),
        (StorageError("cannot read s3://bucket/idx/index_infos.json: AccessDenied"), 503),
        (TypeError("unsupported operand at /usr/lib/python3/site.py"), 500),
    ]
    for fault, status in faults:

        def fail(self, body, partial=False, fault=fault):
            raise fault

        monkeypatch.setattr(QueryService, "search_json", fail)
        response = client.post("/search", json={"keys": [KEY]}, headers=JSON)
        out = response.json()
        assert response.status_code == status and set(out) == {"error", "request_id"}, out
        assert str(index_dir) not in response.text and "s3://" not in response.text and "/usr" not in response.text
        assert out["request_id"] in caplog.text and str(fault) in caplog.text  # the log has it all, with the id
        assert (status == 503) == ("retry-after" in response.headers)


def test_bad_input_names_no_server_path(client, index_dir):
    response = client.post("/search", json={"keys": ["nope"]}, headers=JSON)
    out = response.json()
    assert response.status_code == 400 and "not in the index at <index>" in out["error"]
    assert str(index_dir) not in response.text and str(index_dir.resolve()) not in response.text


def test_scrub_keeps_keys_and_media_types():
    from webapi.http_errors import scrub

    message = "key '000000/00001' of image/png not in /srv/data/idx nor s3://b/p/x.tar (n, 32)"
    assert scrub(message, ["/srv/data/idx"]) == "key '000000/00001' of image/png not in <index> nor <path> (n, 32)"
    assert scrub("cannot read /etc/passwd: denied") == "cannot read <path>: denied"


def test_data_errors_are_the_servers_fault_but_the_cli_users_input(tmp_path):
    """IndexFileError and StorageError are NeedleDataErrors (5xx behind HTTP) and NeedleInputErrors,
    so the CLI still reports a missing index file as bad input (exit 2)."""
    from cli.main import main as needle
    from core.errors import NeedleDataError, NeedleInputError
    from core.storage import StorageError
    from index.errors import IndexFileError, UnknownKeyError
    from webapi.http_errors import describe, is_server_side

    for cls in (IndexFileError, StorageError):
        assert issubclass(cls, NeedleDataError) and issubclass(cls, NeedleInputError) and is_server_side(cls("x"))
    assert not is_server_side(UnknownKeyError("x")) and describe(UnknownKeyError("x"), "r")[0] == 400
    assert needle(["query", "--index", str(tmp_path / "missing"), "--key", "a"]) == 2


def test_server_side_names_are_input_errors_that_exist():
    """SERVER_SIDE names classes by string (no torch import to check them): each must still exist."""
    import importlib

    from core.errors import NeedleInputError
    from webapi.http_errors import SERVER_SIDE

    for name in SERVER_SIDE:
        module, _, cls = name.rpartition(".")
        assert issubclass(getattr(importlib.import_module(module), cls), NeedleInputError), name


# --- browsers: Host, Origin, Content-Type ----------------------------------------------------------
@pytest.mark.parametrize(
    "headers,status",
    [
        ({"Host": "evil.example:8000"}, 421),
        ({"Host": "localhost.evil.example"}, 421),
        ({"Host": "127.0.0.1:8000"}, 200),
        ({"Host": "[::1]:8000"}, 200),
        ({"Host": "LOCALHOST."}, 200),
        ({"Content-Type": "text/plain"}, 415),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ({"Content-Type": "multipart/form-data; boundary=x"}, 415),
        ({"Content-Type": "application/json; charset=utf-8"}, 200),
        ({"Origin": "http://evil.example"}, 403),
        ({"Origin": "null"}, 403),
        ({"Origin": "http://localhost:3000"}, 403),
        ({"Origin": "http://localhost"}, 200),
        ({"Sec-Fetch-Site": "cross-site"}, 403),
        ({"Sec-Fetch-Site": "same-origin"}, 200),
    ],
)
def test_browser_checks(client, headers, status):
    response = client.post("/search", content=json.dumps({"keys": [KEY], "k": 2}), headers={**JSON, **headers})
    assert response.status_code == status, response.text


def test_json_api_needs_a_content_type_and_images_an_image_type(client):
    response = client.post("/search", content=json.dumps({"keys": [KEY]}))
    assert response.status_code == 415 and response.json()["field"] == "Content-Type"
    png = {"Content-Type": "image/png"}
    assert client.post("/search/image?k=2", content=png_header(10, 10), headers=png).status_code == 400  # no model
    form = {"Content-Type": "application/x-www-form-urlencoded"}  # curl --data-binary's default: a form's type
    assert client.post("/search/image?k=2", content=png_header(10, 10), headers=form).status_code == 415
    assert client.post("/search/image?k=2", content=png_header(10, 10)).status_code == 415
    assert (
        client.post("/search/image?k=2", content=png_header(10, 10), headers={"Content-Type": "text/plain"}).status_code
        == 415
    )


def test_host_names_and_health(index):
    from webapi.guard import allowed_hosts
    from webapi.limits import ServiceLimits

    assert client_status(index, "evil.example", "/health") == 421
    assert client_status(index, "needle.lan:8000", "/health", allow_hosts=("needle.lan",)) == 200
    assert client_status(index, "anything", "/health", allow_hosts=("*",)) == 200
    assert allowed_hosts(ServiceLimits(allow_hosts=("*",))) is None
    assert client_status(index, "testserver", "/health") == 421  # TestClient's default: refused like any other


def client_status(index, host: str, path: str, **limits) -> int:
    with app_client(index, **limits) as c:
        return c.get(path, headers={"Host": host}).status_code


def test_served_limits_answer_the_bound_address():
    from cluster.serve_run import ServeConfig, served_limits
    from webapi.limits import ServiceLimits

    assert served_limits(ServeConfig(host="10.0.0.5"), None).allow_hosts == ("10.0.0.5",)
    assert served_limits(ServeConfig(host="0.0.0.0"), None).allow_hosts == ()
    with pytest.raises(Exception, match="--max-queries"):
        served_limits(ServeConfig(), ServiceLimits(max_queries=0))


def test_serve_refuses_a_shortlist_no_request_could_use(tmp_path):
    from types import SimpleNamespace

    from cluster.serve_run import ServeConfig, run
    from core.errors import NeedleInputError

    with pytest.raises(NeedleInputError, match="--shortlist 20000 is over --max-k-total 10000"):
        run(ServeConfig(), tmp_path / "never-opened", rerank=SimpleNamespace(shortlist=20000))


def test_serve_flags_make_the_limits(tmp_path):
    from cli.main import build_parser
    from cli.search import service_limits
    from webapi.limits import ServiceLimits

    args = build_parser().parse_args(["serve", "--index", str(tmp_path)])
    assert service_limits(args) == ServiceLimits()
    argv = ["serve", "--index", "x", "--max-queries", "7", "--max-image-pixels", "1000", "--allow-host", "a.lan"]
    args = build_parser().parse_args(
        [*argv, "--allow-host", "b.lan", "--max-connections", "9", "--header-timeout", "2"]
    )
    assert service_limits(args) == ServiceLimits(
        max_queries=7, max_image_pixels=1000, allow_hosts=("a.lan", "b.lan"), max_connections=9, header_timeout=2.0
    )


# --- the concurrency gate --------------------------------------------------------------------------
def test_gate_hands_slots_over_and_bounds_its_queue():
    from webapi.guard import Gate

    async def scenario():
        gate = Gate(slots=1, queue=1, timeout=0.2)
        assert await gate.acquire()
        waiter = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        assert not await gate.acquire()  # the queue is full
        gate.release()  # handed to the waiter, not freed
        assert await waiter and gate.busy == 1
        assert not await gate.acquire()  # waits 0.2 s, then gives up
        assert not gate.waiters
        gate.release()
        assert gate.busy == 0 and await gate.acquire()

    asyncio.run(scenario())


def test_busy_server_answers_503_and_health_is_cached_and_gated(index, monkeypatch):
    """A busy server refuses a search past its queue; /health answers from its one-second cache
    (for the generation served) and makes a fresh answer only with a slot of the same gate."""
    from webapi.query_service import QueryService

    started, finish = threading.Event(), threading.Event()

    def slow(self, body, partial=False):
        started.set()
        finish.wait(10)
        return []

    monkeypatch.setattr(QueryService, "search_json", slow)
    with app_client(index, max_inflight=1, max_queue=0) as c:
        assert c.get("/health").status_code == 200  # a fresh answer, cached for a second
        first = threading.Thread(target=lambda: c.post("/search", json={"keys": [KEY]}, headers=JSON))
        first.start()
        try:
            assert started.wait(10)
            response = c.post("/search", json={"keys": [KEY]}, headers=JSON)
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            assert response.json()["limit"] == "max_inflight"
            assert c.get("/health").status_code == 200  # from the cache: no slot needed
            time.sleep(1.1)
            stale = c.get("/health")  # a fresh answer needs a slot: busy, as a search
            assert stale.status_code == 503 and stale.json()["limit"] == "max_inflight"
            assert stale.headers["retry-after"] == "1"
        finally:
            finish.set()
            first.join(10)
        assert c.post("/search", json={"keys": [KEY]}, headers=JSON).status_code == 200


def test_a_decompression_bomb_png_is_refused_by_the_default_limit(index):
    """The issue's 20,000² PNG: a 500 before (PIL's DecompressionBombError), a 413 now."""
    with app_client(index) as c:
        response = c.post("/search/image", content=png_header(20_000, 20_000), headers={"Content-Type": "image/png"})
        assert response.status_code == 413 and response.json()["max"] == 25_000_000


def test_user_values_are_quoted_short_in_every_error(client, index):
    """Issue 44, item 3: a 2.5M-character unknown key came back whole as a 12.5 MB 400 body; an
    unknown field's name too. Every message quotes user values in at most 80 characters."""
    from core.quoting import SHORT_REPR_WIDTH, short_repr
    from index.errors import UnknownKeyError

    huge = "k" * 2_500_000
    response = client.post("/search", json={"keys": [huge], "k": 3}, headers=JSON)
    assert response.status_code == 400 and len(response.content) < 1_000, len(response.content)
    response = client.post("/search", json={huge: 1, "keys": ["x"]}, headers=JSON)
    assert response.status_code == 400 and len(response.content) < 1_000 and len(response.json()["field"]) <= 80
    with pytest.raises(UnknownKeyError) as caught:
        index.position_of(huge)
    assert len(str(caught.value)) < 300
    assert len(short_repr(huge)) == SHORT_REPR_WIDTH and len(short_repr("é" * 10**6)) <= SHORT_REPR_WIDTH
    assert short_repr([1] * 10**6) == "a list of 1000000" and short_repr("ok") == "'ok'"


def test_the_scrubber_reads_the_index_location_from_the_index_protocol(index, index_dir):
    """Issue 44, item 9: ``server_locations`` read ``getattr(index, "path", "")``, so an index object
    without the protocol's ``path`` had nothing scrubbed, silently; a following index (LiveIndex)
    passes its generation's path on."""
    from webapi.http_errors import server_locations
    from webapi.live_index import LiveIndex

    assert str(index_dir.resolve()) in server_locations(index)
    live = LiveIndex(lambda n, _: index, lambda: 0, reload_interval=0)
    assert server_locations(live) == server_locations(index)
    with pytest.raises(AttributeError):
        server_locations(object())


@pytest.mark.parametrize(
    "body,limit,product,got",
    [
        ({"keys": [KEY] * 30, "k": 1, "nprobe": 8}, "max_probes", "nprobe x queries", 240),
        ({"keys": [KEY] * 13, "k": 1, "nprobe": 64}, "max_probes", "nprobe x queries", 104),  # 64 of 8 lists: 8
        ({"keys": [KEY] * 26, "k": 1}, "max_probes", "nprobe x queries", 104),  # the index's nprobe, 4
        ({"keys": [KEY], "k": 20, "refine_factor": 30}, "max_rescored", "k x refine_factor x queries", 600),
        ({"vectors": [[0.1] * 32] * 10, "k": 20}, "max_rescored", "k x refine_factor x queries", 600),  # its factor, 3
        ({"text": "cat", "k": 20, "refine_factor": 26}, "max_rescored", "k x refine_factor x queries", 520),
    ],
)
def test_the_work_bound_counts_probed_lists_and_rescored_rows(index, body, limit, product, got):
    """nprobe x queries and k x refine_factor x queries are bounded (413 naming the product, its
    factors and the flag) before any work: one query of k=10000 at refine factor 64 re-scored 640k rows."""
    with app_client(index, max_probes=100, max_rescored=500) as c:
        response = c.post("/search", content=json.dumps(body), headers=JSON)
        out = response.json()
        assert response.status_code == 413, out
        assert (out["limit"], out["product"], out["got"], out["max"]) == (
            limit,
            product,
            got,
            100 if "probes" in limit else 500,
        )
        assert f"--{limit.replace('_', '-')}" in out["error"] and product in out["error"]
        assert c.post("/search", content=json.dumps({"keys": [KEY] * 12, "k": 10}), headers=JSON).status_code == 200


def test_the_work_bound_of_the_defaults_and_of_re_ranking():
    from webapi.limits import ProductLimitError, RequestChecks, ServiceLimits

    ivf = RequestChecks(ServiceLimits(), lambda: 10**6, lambda: {"kind": "ivfpq", "nlist": 4096, "refine_factor": 2})
    with pytest.raises(ProductLimitError, match=r"k x refine_factor x queries.*--max-rescored"):
        ivf.work("keys", 1, 10_000, refine_factor=64)  # the 640k rows
    ivf.work("keys", 1, 10_000)  # the default factor: 20k rows
    with pytest.raises(ProductLimitError, match=r"shortlist x queries in 'keys' \(300 x 40\).*--max-k-total"):
        ivf.work("keys", 40, 10, shortlist=300)
    flat = RequestChecks(ServiceLimits(max_probes=1, max_rescored=1), lambda: 10**6, lambda: {"kind": "flat"})
    flat.work("keys", 100, 100)  # an exact scan probes no lists and re-scores nothing


def json_reference_shape(value, depth=0):
    """(items, depth) of a parsed JSON value, counted as webapi.json_budget counts them."""
    if isinstance(value, dict | list):
        children = list(value.values()) if isinstance(value, dict) else value
        shapes = [json_reference_shape(child, depth + 1) for child in children]
        return 2 + sum(i for i, _ in shapes), max([depth + 1] + [d for _, d in shapes])
    return 1, depth


@pytest.mark.parametrize(
    "value",
    [
        {"keys": ["a,b[", 'q"uo\\"te{', "x"], "k": 10, "nested": [[1, [2, {"a": [3]}]], {}]},
        {"vectors": [[0.5, -1e-3, 2] for _ in range(5)], "text": "]]]]}}}},,,,"},
        [],
        "just a string, with [brackets]",
    ],
)
def test_the_json_budget_counts_the_items_and_depth_the_parse_would_build(value):
    from webapi.json_budget import json_shape

    data = json.dumps(value).encode()
    shape = json_shape(data)
    items, depth = json_reference_shape(value)
    assert shape.depth == depth
    assert items <= shape.items <= items + 1  # an empty container's missing first value: over by one at most


def test_a_json_body_of_millions_of_objects_is_refused_before_parsing(index, monkeypatch):
    """The issue's 14 MiB of 5M empty objects (+374 MB of RSS to parse) is a 413 from its bytes:
    json.loads never runs; too deep a body is a 400; within the budget, the parse of the costliest
    bodies (empty objects, short strings, floats) takes at most ~70 bytes per counted item."""
    import tracemalloc

    from webapi.json_budget import json_shape

    real_loads, parsed = json.loads, []
    monkeypatch.setattr(json, "loads", lambda data, *a, **k: parsed.append(len(data)) or real_loads(data, *a, **k))
    with app_client(index) as c:
        body = b'{"keys": [' + b",".join([b"{}"] * 5_000_000) + b"]}"
        response = c.post("/search", content=body, headers=JSON)
        out = response.json()
        assert response.status_code == 413 and out["limit"] == "max_json_items" and out["got"] > 10_000_000, out
        deep = c.post("/search", content=b'{"keys": ' + b"[" * 40 + b"]" * 40 + b"}", headers=JSON)
        assert (
            deep.status_code == 400
            and "too deep" in deep.json()["error"]
            and "--max-json-depth" in deep.json()["error"]
        )
    assert max(parsed) < 1000  # only the answers' small bodies were parsed (by the test client)
    monkeypatch.undo()
    for element in (b"{}", b'"ab"', b"0.5", b"[1]"):
        body = b"[" + b",".join([element] * 100_000) + b"]"
        items = json_shape(body).items
        tracemalloc.start()
        value = json.loads(body)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del value
        assert peak / items < 70, (element, peak / items)


def test_health_answers_are_shared_for_a_second_and_never_hide_a_new_generation(index):
    """Many probes make one health answer (with shards in Ray each costs a call to every replica);
    a changed generation is reported at once (``--wait-for`` polls /health for it)."""
    import asyncio

    from webapi.guard import Gate
    from webapi.health import HealthCache

    class Changing:
        def __init__(self, inner):
            self.inner, self.generation = inner, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        @property
        def infos(self):
            return {**self.inner.infos, "generation": self.generation}

    changing = Changing(index)
    cache = HealthCache(changing, Gate(1, 0, 1.0))

    async def probes(n):
        return [json.loads((await cache.respond()).body)["generation"] for _ in range(n)]

    assert asyncio.run(probes(50)) == [0] * 50 and cache.refreshes == 1
    changing.generation = 3
    assert asyncio.run(probes(5)) == [3] * 5 and cache.refreshes == 2


def test_a_request_cancelled_when_its_client_left_keeps_its_slot_until_its_work_ends():
    """Ray Serve cancels a request whose client disconnected; its search or decode in the thread
    pool cannot be stopped. The guard runs the endpoint shielded, so its slot of --max-inflight
    (and its body's bytes) stay counted until the work ends: the ceiling stays --max-inflight."""
    import asyncio

    from starlette.concurrency import run_in_threadpool

    from webapi.guard import Guard, Route, gate_of
    from webapi.limits import ServiceLimits

    ended = threading.Event()

    async def endpoint(scope, receive, send):
        await run_in_threadpool(lambda: (time.sleep(0.5), ended.set()))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    limits = ServiceLimits(max_inflight=1, max_queue=0)
    gate = gate_of(limits)
    guard = Guard(endpoint, limits, {("POST", "/search"): Route("json", 1 << 20, "max_json_mb")}, None, gate)
    body = [{"type": "http.request", "body": b'{"keys": ["a"]}', "more_body": False}]
    scope = {"type": "http", "method": "POST", "path": "/search", "headers": [(b"content-type", b"application/json")]}

    async def scenario():
        sent = []

        async def receive():
            return body.pop(0) if body else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        request = asyncio.ensure_future(guard(dict(scope), receive, send))
        await asyncio.sleep(0.2)
        request.cancel()  # the client went away
        with contextlib.suppress(asyncio.CancelledError):
            await request
        held_after_cancel = (gate.busy, guard.budget.used)
        await asyncio.sleep(0.6)
        return held_after_cancel, (gate.busy, guard.budget.used), ended.is_set()

    after_cancel, after_work, finished = asyncio.run(scenario())
    assert after_cancel == (1, len(b'{"keys": ["a"]}'))  # still counted: the work goes on
    assert finished and after_work == (0, 0)  # given back when it ended
