"""The OpenAPI page (webapi/docs_page.py): Swagger UI's files come from this app, never a CDN, so
``/docs`` renders on a server and a browser without internet (issue 57, item 4)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support.live_server import CHROMIUM, CHROMIUM_ARGS, served

# pytest fixtures and the fixtures they request, imported by name (``x as x``: on purpose, not unused)
from tests.support.service import client as client
from tests.support.service import index as index
from tests.support.service import index_dir as index_dir


def test_docs_page_names_only_its_own_files(client):
    page = client.get("/docs")
    assert page.status_code == 200
    assert "http://" not in page.text and "https://" not in page.text, page.text  # no CDN, no other host
    for name, kind in (("swagger-ui-bundle.js", "javascript"), ("swagger-ui.css", "css")):
        assert f"/docs/{name}" in page.text
        response = client.get(f"/docs/{name}")
        assert response.status_code == 200 and kind in response.headers["content-type"]
        assert len(response.content) > 100_000  # the real Swagger UI, not a placeholder
    assert client.get("/redoc").status_code == 404  # FastAPI's ReDoc page loads from a CDN: not offered
    assert client.get("/openapi.json").json()["paths"]["/search"]


@pytest.mark.slow
def test_docs_page_renders_in_chromium_without_network(index):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (Debian's chromium package)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
    from webapi.query_service import QueryService
    from webapi.webapp import create_app

    elsewhere: list[str] = []

    def only_loopback(route):
        if urlsplit(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:  # what a box without internet does: the request fails
            elsewhere.append(route.request.url)
            route.abort()

    with served(create_app(QueryService(index))) as base, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context()
            context.route("**/*", only_loopback)
            page = context.new_page()
            page.goto(base + "/docs")
            page.wait_for_selector(".opblock", timeout=30000)
            paths = page.locator(".opblock-summary-path").all_text_contents()
            assert {"/search", "/search/image", "/health"} <= {p.replace("\u200b", "") for p in paths}, paths
        finally:
            browser.close()
    assert not elsewhere, elsewhere
