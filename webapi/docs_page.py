"""The OpenAPI page (``GET /docs``) with Swagger UI's script and style served by this app.

FastAPI's own page loads Swagger UI from a CDN, so a server without internet (or a browser that
may not reach one) showed a blank page. The files come from the ``fastapi-offline`` package,
installed as a dependency; nothing the page loads comes from another host.

- ``GET /docs``                      the Swagger UI page, reading ``/openapi.json``
- ``GET /docs/swagger-ui-bundle.js`` and ``GET /docs/swagger-ui.css``, ``GET /docs/favicon.png``
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, Response

STATIC = Path(fastapi_offline.__file__).resolve().parent / "static"  # the package's copy of swagger-ui-dist
DOCS_FILES = {  # served name -> media type; only these, never a path taken from the request
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon.png": "image/png",
}


def add_docs_page(app: FastAPI) -> None:
    """``/docs`` and its files on ``app``, which must be made with ``docs_url=None`` (no CDN page)."""

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")  # behind a proxy that strips a prefix
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}/docs/swagger-ui-bundle.js",
            swagger_css_url=f"{root}/docs/swagger-ui.css",
            swagger_favicon_url=f"{root}/docs/favicon.png",
        )

    for name, media_type in DOCS_FILES.items():
        add_file(app, name, media_type)


def add_file(app: FastAPI, name: str, media_type: str) -> None:
    path = STATIC / name

    @app.get(f"/docs/{name}", include_in_schema=False)
    async def docs_file() -> Response:
        return FileResponse(path, media_type=media_type)
