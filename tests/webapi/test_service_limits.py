"""``needle serve`` facing a network (webapi.limits, webapi.json_budget, webapi.guard's body bounds):
each bound refused with a status that says whose fault it was and a body naming the field and the
limit, before the work or the decoder it bounds; the serve flags that make the limits. Through
TestClient: fast. Slow clients and memory: tests/webapi/test_serve_connections.py."""

from __future__ import annotations

import json

import pytest

from tests.support.service import JSON, KEY, OCTETS, app_client, png_header

# pytest fixtures and the fixtures they request, imported by name (``x as x``: on purpose, not unused)
from tests.support.service import client as client
from tests.support.service import index as index
from tests.support.service import index_dir as index_dir


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


def test_served_limits_answer_the_bound_address():
    from cluster.serve_run import served_limits
    from webapi.limits import ServiceLimits
    from webapi.spec import Listen

    assert served_limits(Listen(host="10.0.0.5"), None).allow_hosts == ("10.0.0.5",)
    assert served_limits(Listen(host="0.0.0.0"), None).allow_hosts == ()
    with pytest.raises(Exception, match="--max-queries"):
        served_limits(Listen(), ServiceLimits(max_queries=0))


def test_serve_refuses_a_shortlist_no_request_could_use(tmp_path):
    from cluster.serve_run import run
    from core.errors import NeedleInputError
    from rerank.options import RerankOptions
    from webapi.spec import ServeSpec

    spec = ServeSpec(index=str(tmp_path / "never-opened"), rerank=RerankOptions(method="sp", shortlist=20000))
    with pytest.raises(NeedleInputError, match="--shortlist 20000 is over --max-k-total 10000"):
        run(spec)


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


def test_a_decompression_bomb_png_is_refused_by_the_default_limit(index):
    """The issue's 20,000² PNG: a 500 before (PIL's DecompressionBombError), a 413 now."""
    with app_client(index) as c:
        response = c.post("/search/image", content=png_header(20_000, 20_000), headers={"Content-Type": "image/png"})
        assert response.status_code == 413 and response.json()["max"] == 25_000_000


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
