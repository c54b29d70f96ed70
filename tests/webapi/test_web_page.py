"""The web page (webapi/webpage.py, webapi/web/): its endpoints through TestClient, and the page
itself in Chromium (Playwright): upload, re-ranking evidence lines, error messages, a screenshot."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from tests.support.live_server import CHROMIUM, CHROMIUM_ARGS, served
from tests.support.tars import photo_tars

OCTETS = {"Content-Type": "application/octet-stream"}  # what the page's upload sends
DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def web_index(tmp_path_factory, photos, extractor):
    """Two tars of three photos (the second mirrored), ingested with global and local features,
    a flat index with its local store, the ingestion's manifest naming the tars, a ground truth
    and an eval report, and a scaling plot."""
    from embed.locals.extract import LocalExtractor
    from embed.locals.presets import LITE0_ITQ, LocalConfig
    from index.build.stage import IndexConfig
    from index.build.stage import main as build
    from ingest.pipeline import process_shard

    root = tmp_path_factory.mktemp("web")
    shards = photo_tars(root / "tars", photos)
    local = LocalExtractor(LocalConfig(resolution=192, top_k=30, itq=LITE0_ITQ))
    desc = root / "desc"
    for i, shard in enumerate(shards):
        assert process_shard(str(shard), i, desc, [extractor, local]).status == "ok"
    (desc / "ingest_info.json").write_text(json.dumps({"extractors": [extractor.info(), local.info()]}))
    # What the ingestion job records beside its parts: each shard's URL.
    (desc / "manifest.json").write_text(
        json.dumps({"shards": {f"{s:06d}": {"url": str(p), "state": "committed"} for s, p in enumerate(shards)}})
    )
    index_dir = build(IndexConfig(kind="flat"), desc, root / "idx")
    truth = root / "truth.json"
    truth.write_text(json.dumps({"queries": [{"key": "000000/00000", "positives": ["000001/01000", "000001/01001"]}]}))
    report = root / "report.json"
    report.write_text(
        json.dumps(
            {
                "map_at_5": 50.0,
                "k": 5,
                "n_queries": 1,
                "ground_truth": str(truth),
                "per_query": [{"key": "000000/00000", "kind": "image", "ap": 50.0, "recall": 50.0}],
            }
        )
    )
    from PIL import Image

    plot = root / "scaling.png"
    Image.new("RGB", (40, 30), (200, 30, 30)).save(plot)
    return {"root": root, "index": index_dir, "shards": shards, "report": report, "plot": plot, "photos": photos}


@pytest.fixture(scope="module")
def app(web_index):
    from index.search import load_index
    from webapi.query_service import QueryService
    from webapi.webpage import PageConfig

    service = QueryService(load_index(web_index["index"]))
    conf = PageConfig(
        report=str(web_index["report"]), scaling_plot=str(web_index["plot"]), max_upload_bytes=200_000, thumbnail_px=96
    )
    try:
        from webapi.webapp import create_app
    except ImportError:  # the JSON API not there: the page on a bare app
        from fastapi import FastAPI

        from webapi.webpage import register_page

        application = FastAPI()
        register_page(application, service, conf)
        return application
    return create_app(service, conf)


@pytest.fixture(scope="module")
def client(app):
    from fastapi.testclient import TestClient

    with TestClient(app, base_url="http://localhost") as c:
        yield c


def member(path: Path, name: str) -> bytes:
    with tarfile.open(path) as tar:
        return tar.extractfile(name).read()


# --- endpoints ------------------------------------------------------------------------------------


def test_page_and_static_files_are_served(client):
    page = client.get("/")
    assert page.status_code == 200 and 'id="error"' in page.text and "/web/app.js" in page.text
    assert (
        "http://" not in page.text.replace("http://www.w3.org", "") and "https://" not in page.text
    )  # nothing fetched from elsewhere
    js = client.get("/web/app.js")
    assert js.status_code == 200 and "page/search" in js.text and "https://" not in js.text
    assert client.get("/web/style.css").status_code == 200


def test_page_info(client):
    info = client.get("/page/info").json()
    assert info["has_locals"] is True and info["has_text"] is False  # ResNet-style default model: no text tower
    assert info["ntotal"] == 6 and info["d"] > 0 and info["local_resolution"] == 192


def test_thumb_is_a_jpeg_of_the_tar_member(client, web_index):
    from PIL import Image

    response = client.get("/thumb", params={"key": "000001/01002"})
    assert response.status_code == 200 and response.headers["content-type"] == "image/jpeg"
    thumb = Image.open(io.BytesIO(response.content))
    original = Image.open(io.BytesIO(member(web_index["shards"][1], "01002.jpg")))
    assert max(thumb.size) == 96 and abs(thumb.size[0] / thumb.size[1] - original.size[0] / original.size[1]) < 0.05
    for key in ("nope/00000", "000000/99999"):
        response = client.get("/thumb", params={"key": key})
        assert response.status_code == 404 and "not in the index" in response.json()["error"]
    assert client.get("/thumb").status_code == 400


def test_thumb_falls_back_to_shard_dirs(web_index):
    """Without ingestion records naming the tar, <shard>.tar in a configured directory."""
    from index.images import ImageSource
    from index.search import load_index

    index = load_index(web_index["index"])
    index.infos = dict(index.infos, descriptors=[])
    index.source_files = lambda: []  # nor the tar each shard recorded for its files
    data = member(web_index["shards"][0], "00001.jpg")
    assert ImageSource(index, (str(web_index["shards"][0].parent),)).image_bytes("000000/00001") == data
    with pytest.raises(FileNotFoundError, match="no source recorded"):
        ImageSource(index).image_bytes("000000/00001")


def test_search_by_key_with_and_without_reranking(client):
    plain = client.post("/page/search", json={"key": "000000/00001", "k": 3})
    assert plain.status_code == 200, plain.text
    out = plain.json()
    assert out["results"][0]["key"] == "000000/00001" and not out["reranked"] and "inliers" not in out["results"][0]
    out = client.post("/page/search", json={"key": "000000/00001", "k": 3, "rerank": True, "shortlist": 5}).json()
    top = out["results"][0]
    assert out["reranked"] and top["key"] == "000000/00001" and top["inliers"] >= 5
    assert {"global_score", "local_score"} <= set(top) and len(top["matches"]["query_xy"]) == top["inliers"]


def test_search_by_uploaded_image_reranked(client, web_index):
    data = member(web_index["shards"][0], "00002.jpg")
    response = client.post("/page/search/image?k=3&rerank=1&shortlist=6", content=data, headers=OCTETS)
    assert response.status_code == 200
    top = response.json()["results"][0]
    assert top["key"] == "000000/00002" and top["inliers"] >= 5 and len(top["matches"]["db_xy"]) == top["inliers"]


@pytest.mark.parametrize(
    "path,kwargs,status,message",
    [
        ("/page/search/image?k=3", {"content": b"definitely not an image", "headers": OCTETS}, 400, "not an image"),
        ("/page/search/image?k=3", {"content": b"", "headers": OCTETS}, 400, "empty"),
        ("/page/search/image?k=3", {"content": b"x" * 300_000, "headers": OCTETS}, 413, "over the limit"),
        ("/page/search/image?k=abc", {"content": b"x", "headers": OCTETS}, 400, "bad query parameter"),
        ("/page/search", {"json": {"text": "  ", "k": 3}}, 400, "empty"),
        ("/page/search", {"json": {"text": "a red car", "k": 3}}, 400, "no text tower"),
        ("/page/search", {"json": {"key": "nope/1", "k": 3}}, 400, "not in the index"),
        ("/page/search", {"json": {"key": "000000/00001", "k": 10**6}}, 413, "--max-k-total"),
        ("/page/search", {"json": {"key": "000000/00001", "k": 3, "rerank": True, "shortlist": 0}}, 400, "shortlist"),
        ("/page/search", {"json": {"k": 3}}, 400, "exactly one of"),
        ("/page/search", {"content": b"{nope", "headers": {"Content-Type": "application/json"}}, 400, "not JSON"),
    ],
)
def test_bad_input_is_a_json_error(client, path, kwargs, status, message):
    response = client.post(path, **kwargs)
    assert response.status_code == status and message in response.json()["error"]


def test_report_lists_ap_and_missed_positives(client):
    report = client.get("/report").json()
    assert report["summary"]["map_at_5"] == 50.0 and report["k"] == 5
    [query] = report["per_query"]
    assert query["key"] == "000000/00000" and query["ap"] == 50.0
    # 6 images, k=5: the query's 5 neighbours are every other image, so no positive is missed.
    assert query["missed"] == [] and query["ranks_recomputed"]
    png = client.get("/report/scaling.png")
    assert png.status_code == 200 and png.content[:4] == b"\x89PNG"


def test_report_missed_positives_from_recorded_rankings(tmp_path, web_index):
    from index.search import load_index
    from webapi.query_service import QueryService
    from webapi.webpage import PageConfig, PageSearch, page_report

    path = tmp_path / "r.json"
    path.write_text(
        json.dumps(
            {
                "k": 2,
                "per_query": [
                    {"key": "a", "ap": 10.0, "positives": ["p1", "p2", "p3"], "ranking": ["x", "p1", "y", "p2"]},
                    {"key": "b", "ap": 0.0},
                ],
            }
        )
    )
    out = page_report(PageConfig(report=str(path)), PageSearch(QueryService(load_index(web_index["index"]))))
    assert out["per_query"][0]["missed"] == [{"key": "p2", "rank": 4}, {"key": "p3", "rank": None}]
    assert "missed" not in out["per_query"][1]


def test_report_not_configured_is_404(web_index):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from index.search import load_index
    from webapi.query_service import QueryService
    from webapi.webpage import register_page

    app = FastAPI()
    register_page(app, QueryService(load_index(web_index["index"])), None)
    with TestClient(app, base_url="http://localhost") as c:
        assert c.get("/report").status_code == 404 and "error" in c.get("/report").json()
        assert c.get("/report/scaling.png").status_code == 404


# --- JSON /search: re-ranking asked per request (issue 57) ------------------------------------------


def test_json_search_reranks_per_request(client, web_index):
    """The page could re-rank per request and the JSON API could not: ``"rerank"`` and
    ``"shortlist"`` in /search (and ``?rerank=&shortlist=`` of /search/image) now ask for it."""
    body = {"keys": ["000000/00001"], "k": 3}
    [plain] = client.post("/search", json=body).json()  # the server was started without --rerank
    assert "inliers" not in plain["results"][0]
    response = client.post("/search", json={**body, "rerank": True, "shortlist": 5})
    assert response.status_code == 200, response.text
    [top] = response.json()[0]["results"][:1]
    assert top["key"] == "000000/00001" and top["inliers"] >= 5 and {"global_score", "local_score"} <= set(top)
    [off] = client.post("/search", json={**body, "rerank": False}).json()
    assert "inliers" not in off["results"][0]
    data = member(web_index["shards"][0], "00002.jpg")
    response = client.post("/search/image?k=3&rerank=true&shortlist=6", content=data, headers=OCTETS)
    assert response.status_code == 200 and response.json()[0]["results"][0]["inliers"] >= 5, response.text


@pytest.mark.parametrize(
    "extra,field,message",
    [
        ({"rerank": "yes"}, "rerank", "must be true or false"),
        ({"rerank": True, "shortlist": 0}, "shortlist", "positive integer"),
        ({"rerank": True, "shortlist": 10**6}, "shortlist", "at most the server's --max-k-total"),
        ({"shortlist": 5}, "shortlist", 'give "rerank": true'),
    ],
)
def test_json_search_rerank_fields_are_checked(client, extra, field, message):
    response = client.post("/search", json={"keys": ["000000/00001"], "k": 3, **extra})
    assert response.status_code == 400 and response.json()["field"] == field, response.text
    assert message in response.json()["error"]


def test_json_search_rerank_within_the_servers_settings(web_index):
    """A server started with --rerank bounds the shortlist a request may ask; vectors cannot be re-ranked."""
    from fastapi.testclient import TestClient

    from index.search import load_index
    from rerank.rerank import RerankConfig
    from webapi.query_service import QueryService
    from webapi.webapp import create_app

    service = QueryService(load_index(web_index["index"]), rerank=RerankConfig(method="sp", shortlist=6))
    with TestClient(create_app(service), base_url="http://localhost") as c:
        body = {"keys": ["000000/00001"], "k": 3}
        assert "inliers" in c.post("/search", json=body).json()[0]["results"][0]  # the server's default
        assert "inliers" not in c.post("/search", json={**body, "rerank": False}).json()[0]["results"][0]
        assert c.post("/search", json={**body, "shortlist": 4}).status_code == 200
        response = c.post("/search", json={**body, "shortlist": 7})
        assert response.status_code == 400 and response.json()["field"] == "shortlist"
        assert "at most the server's --shortlist 6, got 7" in response.json()["error"]
        response = c.post("/search/image?k=3&shortlist=7", content=member(web_index["shards"][0], "00002.jpg"),
                          headers=OCTETS)  # fmt: skip
        assert response.status_code == 400 and response.json()["field"] == "shortlist"
        vector = service.index.vector_of("000000/00001").tolist()
        response = c.post("/search", json={"vectors": [vector], "k": 3, "rerank": True})
        assert response.status_code == 400 and response.json()["field"] == "rerank"
        assert c.post("/search", json={"vectors": [vector], "k": 3, "rerank": False}).status_code == 200


# --- the page in Chromium -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live_server(app):
    with served(app) as url:
        yield url


@pytest.mark.slow
def test_page_in_chromium(live_server, web_index, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (Debian's chromium package)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
    query = tmp_path / "query.jpg"
    query.write_bytes(member(web_index["shards"][0], "00001.jpg"))
    junk = tmp_path / "notes.txt"
    junk.write_bytes(b"this is not an image")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page_errors = []
            page.on("pageerror", lambda exc: page_errors.append(str(exc)))
            page.goto(live_server + "/")
            page.wait_for_selector("body[data-ready='1']", timeout=15000)
            assert page.is_disabled("#tab-text")  # no text tower

            # Upload a database image: its own key comes first.
            page.set_input_files("#file", str(query))
            page.wait_for_selector("#results .card", timeout=60000)
            assert page.text_content("#results .card .key") == "000000/00001"
            assert page.locator("#results .card img.thumb").count() == 6 and page.is_hidden("#error")

            # Re-ranked: the inlier lines between the query and each result.
            page.check("#rerank")
            page.fill("#shortlist", "6")
            page.set_input_files("#file", [])
            page.set_input_files("#file", str(query))
            page.wait_for_selector("#results svg.matches line", timeout=60000)
            assert page.locator("#results svg line").count() > 0
            assert page.text_content("#results .card .key") == "000000/00001"
            assert "inliers" in page.text_content("#results .card .scores")
            page.wait_for_selector("#report-table tbody tr")
            shot = tmp_path / "web_page.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if os.environ.get("NEEDLE_UPDATE_SCREENSHOT"):  # refresh the README's copy on purpose only
                shutil.copyfile(shot, DOCS / "web_page.png")

            # A non-image upload: a visible message.
            page.set_input_files("#file", str(junk))
            page.wait_for_selector("#error:not(.hidden)", timeout=30000)
            assert "not an image" in page.text_content("#error")

            # An unknown key: a visible message.
            page.click("#tab-key")
            page.fill("#key", "nope/123")
            page.click("#key-go")
            page.wait_for_selector("#error:not(.hidden)", timeout=30000)
            assert "not in the index" in page.text_content("#error")

            # A known key works again and clears the message.
            page.fill("#key", "000001/01000")
            page.click("#key-go")
            page.wait_for_function(
                "document.querySelector('#results .card .key').textContent === '000001/01000'", timeout=30000
            )
            assert page.is_hidden("#error")
            assert not page_errors, page_errors
        finally:
            browser.close()


def test_serve_flags_make_the_page_config(tmp_path):
    from cli.main import _page_config, build_parser
    from webapi.webpage import PageConfig

    args = build_parser().parse_args(
        [
            "serve",
            "--index",
            str(tmp_path),
            "--report",
            "r.json",
            "--scaling-plot",
            "s.png",
            "--shard-dir",
            "a",
            "--shard-dir",
            "b",
            "--max-upload-mb",
            "2",
        ]
    )
    assert _page_config(args) == PageConfig(
        report="r.json", scaling_plot="s.png", shard_dirs=("a", "b"), max_upload_bytes=2 << 20
    )
    assert _page_config(build_parser().parse_args(["serve", "--index", str(tmp_path)])) == PageConfig()


def test_report_and_plot_bodies_name_no_server_path(web_index, tmp_path):
    """Issue 44, item 9: ``/report`` and a missing plot's 404 named server paths."""
    from fastapi.testclient import TestClient

    from index.search import load_index
    from webapi.query_service import QueryService
    from webapi.webapp import create_app
    from webapi.webpage import PageConfig

    service = QueryService(load_index(web_index["index"]))
    good = TestClient(create_app(service, PageConfig(report=str(web_index["report"]))), base_url="http://localhost")
    body = good.get("/report").text
    assert str(web_index["root"]) not in body and good.get("/report").json()["path"] == "report.json"
    missing = tmp_path / "secret-dir" / "nope.json"
    conf = PageConfig(report=str(missing), scaling_plot=str(tmp_path / "secret-dir" / "plot.png"))
    bad = TestClient(create_app(service, conf), base_url="http://localhost")
    for path in ("/report", "/report/scaling.png"):
        response = bad.get(path)
        assert response.status_code == 404 and "secret-dir" not in response.text, response.text


@pytest.mark.slow
def test_page_reruns_on_the_rerank_box_and_the_same_file(web_index, tmp_path):
    """Issue 57, item 6: ticking the re-rank box left the old results under it, choosing the same
    file again did nothing, and an expanded query's global score was shown as a plain "global"."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (Debian's chromium package)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
    from index.search import load_index
    from rerank.expand import ExpansionConfig
    from rerank.rerank import RerankConfig
    from webapi.query_service import QueryService
    from webapi.webapp import create_app
    from webapi.webpage import PageConfig

    expanding = RerankConfig(method="sp", shortlist=6, expansion=ExpansionConfig(top=3, min_inliers=5))
    service = QueryService(load_index(web_index["index"]), rerank=expanding)
    query = tmp_path / "query.jpg"
    query.write_bytes(member(web_index["shards"][0], "00001.jpg"))
    uploads = []
    with served(create_app(service, PageConfig(thumbnail_px=96))) as base, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.on("request", lambda r: uploads.append(r.url) if "/page/search/image" in r.url else None)
            page.goto(base + "/")
            page.wait_for_selector("body[data-ready='1']", timeout=15000)
            page.uncheck("#rerank")
            page.set_input_files("#file", str(query))
            page.wait_for_selector("#results .card", timeout=60000)
            assert page.locator("#results .scores").count() == 0  # not re-ranked: no local evidence

            page.check("#rerank")  # the same query, re-ranked, without choosing the file again
            page.wait_for_selector("#results .card .scores", timeout=60000)
            assert len(uploads) == 2 and "rerank=1" in uploads[-1]
            scores = page.text_content("#results .card .scores")
            assert scores.startswith("global (expanded query) ") and "inliers" in scores, scores
            assert "(re-ranked)" in page.text_content("#status")

            page.uncheck("#rerank")
            page.wait_for_function("document.querySelectorAll('#results .scores').length === 0", timeout=60000)
            assert len(uploads) == 3 and "rerank=0" in uploads[-1]

            with page.expect_request(lambda r: "/page/search/image" in r.url, timeout=30000):
                page.set_input_files("#file", str(query))  # the same file again: searched again
            assert len(uploads) == 4
        finally:
            browser.close()
