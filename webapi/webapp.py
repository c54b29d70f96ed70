"""``needle serve``: one ASGI (FastAPI) app, run by uvicorn or as a Ray Serve deployment.

- ``GET  /health``                       -> ``{"ntotal", "d", "shards", "kind"}``; with shards in Ray
  actors also ``"ok"``, ``"unavailable_shards"`` and ``"replicas"`` (each replica's shard, replica
  number, ``"ready"``/``"unreachable"`` and node), and 503 when a shard has no live replica; under
  Ray Serve ``"generation"`` is the one every replica serves and ``"serve_replicas"`` each one's
- ``POST /search[?partial=1]``  JSON ``{"k", "nprobe"?, "refine_factor"?, "partial"?, "rerank"?, "shortlist"?,
  one of "keys" | "vectors" | "text"}``
- ``POST /search/image?k=10[&nprobe=N][&partial=1][&rerank=true&shortlist=S]`` raw image bytes (the request
  body, at most ``--max-body-mb``)
- ``GET  /docs``                         the OpenAPI page, Swagger UI served by this app (webapi.docs_page)
- ``/`` and the web page's own routes when a ``PageConfig`` is given (webapi.webpage)

Every request passes webapi.guard first (request id, Host, Content-Type, body limits, the
concurrency gate); webapi.connections bounds slow and many connections under uvicorn. Answers:

=====  ==========================================================================================
200    the answer
400    bad input: a malformed or out-of-range field, named in ``"field"``; JSON that does not parse
       or nests too deep; an unknown key; non-image bytes
403    a browser request from another origin's page (``Origin``, ``Sec-Fetch-Site``)
404    no such endpoint
408    the body did not arrive within ``--body-timeout`` (the headers: ``--header-timeout``)
413    past a limit: the body (``--max-body-mb``, ``--max-json-mb``), queries (``--max-queries``),
       k x queries (``--max-k-total``), image pixels (``--max-image-pixels``), text length
       (``--max-text-length``); the body names ``"field"``, ``"limit"``, ``"max"`` and ``"got"``
415    a Content-Type the endpoint does not take (JSON: application/json; images: image/*,
       application/octet-stream; curl needs -H 'Content-Type: image/jpeg')
421    a Host header that names another server (``--allow-host``)
431    request headers over ``--max-header-kb``
500    the server's fault: ``{"error": "internal error ...", "request_id"}``; the log has the rest
503    busy (``--max-inflight``/``--max-queue``, ``--max-buffered-mb``, ``--max-connections``),
       storage unreachable, or shards that did not answer in time; with Retry-After
=====  ==========================================================================================

Every error body is ``{"error": message, ...}``, with ``"request_id"`` once the request reached the
app, and names no path of the server.
Shards that did not answer within the shard timeout: 503 with ``"missing_shards"``, unless the
request allows a partial answer (``"partial": true`` / ``?partial=1``): then each query's answer
carries ``"partial": true`` and ``"missing_shards"``. Searches run in the thread pool, so
concurrent requests search in parallel (at most ``--max-inflight``; the QueryService's lock guards
only the lazy loading of its models). Uploaded bytes stay in memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from shards.coordinator import ShardsUnavailable
from webapi.docs_page import add_docs_page
from webapi.guard import Guard, Route, allowed_hosts, gate_of, read_limited
from webapi.health import ReplicaGenerations, add_health
from webapi.http_errors import error_response, json_response, request_id, server_locations
from webapi.limits import FieldError, ServiceLimits, parse_json
from webapi.query_service import QueryService

if TYPE_CHECKING:
    from webapi.webpage import PageConfig

log = logging.getLogger(__name__)

RERANK_HELP = (
    "re-rank with local tokens (key and image queries): true, the server's --rerank settings (SP with the "
    "index's token kind's where it was started without); false, global only; absent, the server's choice"
)
SHORTLIST_HELP = "the re-ranked shortlist, at most the server's --shortlist (without --rerank: --max-k-total)"
SEARCH_BODY_SCHEMA = {
    "type": "object",
    "properties": {
        "k": {"type": "integer", "default": 10, "minimum": 1},
        "nprobe": {"type": "integer", "description": "IVF lists visited (default: the index's)"},
        "refine_factor": {"type": "integer", "description": "shortlist = factor * k, re-scored exactly"},
        "partial": {
            "type": "boolean",
            "default": False,
            "description": "shards served by Ray actors: answer from the shards that answered in time "
            "(marked partial, with missing_shards) instead of 503",
        },
        "rerank": {"type": "boolean", "description": RERANK_HELP},
        "shortlist": {"type": "integer", "minimum": 1, "description": SHORTLIST_HELP},
        "keys": {"type": "array", "items": {"type": "string"}, "description": "stored keys to query with"},
        "vectors": {
            "oneOf": [
                {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                {
                    "type": "object",
                    "required": ["dtype", "shape", "base64"],
                    "properties": {
                        "dtype": {"enum": ["float32", "float16"]},
                        "shape": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
                        "base64": {"type": "string", "description": "the array's little-endian bytes, by row"},
                    },
                },
            ],
            "description": "query vectors, (n, d) or (d,) numbers, or packed (base64 of float32 or float16: "
            "far cheaper to send and parse than decimals)",
        },
        "text": {
            "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
            "description": "text queries (open_clip models)",
        },
    },
    "example": {"keys": ["000000/00001"], "k": 10},
}


async def respond(request: Request, call: Callable[[], Any], locations: tuple[str, ...] = ()) -> Response:
    """200 with ``call()`` run in the thread pool; an error as webapi.http_errors answers it (400/413
    for bad input, 500 with only a request id for the server's faults, 503 for shards or storage)."""
    try:
        return json_response(200, await run_in_threadpool(call))
    except Exception as exc:  # keep serving; the log has the server's faults with the request id
        return error_response(exc, request_id(request.scope), locations)


def guard_routes(limits: ServiceLimits, page: PageConfig | None) -> dict[tuple[str, str], Route]:
    """What webapi.guard reads and gates: the search endpoints (their bodies) and thumbnails."""
    routes = {
        ("POST", "/search"): Route("json", limits.max_json, "max_json_mb"),
        ("POST", "/search/image"): Route("image", limits.max_body, "max_body_mb"),
    }
    if page is not None:
        routes[("POST", "/page/search")] = Route("json", limits.max_json, "max_json_mb")
        routes[("POST", "/page/search/image")] = Route("image", page.max_upload_bytes, "max_upload_mb")
        routes[("GET", "/thumb")] = Route()
    return routes


def create_app(
    service: QueryService, page: PageConfig | None = None, replicas: ReplicaGenerations | None = None
) -> FastAPI:
    """The app of ``service`` (its ServiceLimits bound every request) and, with ``page``, the web page;
    ``replicas``: under Ray Serve, every replica's generation, which /health reports (webapi.health)."""
    app = FastAPI(
        title="needle",
        description="Instance-level image retrieval: search an index by stored key, vector, text or image.",
        version="0.1.0",
        docs_url=None,  # webapi.docs_page serves it with Swagger UI's files from this app, not a CDN
        redoc_url=None,  # ReDoc, too, loads from a CDN; /docs is the one OpenAPI page
    )
    locations = server_locations(service.index)
    add_error_handlers(app, locations)
    gate = gate_of(service.limits)  # searches, thumbnails and fresh health answers share it
    add_health(app, service.index, gate, replicas)
    add_search(app, service, locations)
    add_search_image(app, service, locations)
    add_docs_page(app)
    if page is not None:
        from webapi.webpage import register_page

        register_page(app, service, page)
    limits = service.limits
    app.add_middleware(Guard, limits=limits, routes=guard_routes(limits, page), hosts=allowed_hosts(limits), gate=gate)
    return app


def add_error_handlers(app: FastAPI, locations: tuple[str, ...] = ()) -> None:
    """Errors FastAPI answers itself (a bad query parameter, no such endpoint, an exception no
    endpoint caught) as ``{"error": message, "request_id"}``, like the endpoints' own."""

    @app.exception_handler(RequestValidationError)
    def _invalid(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors())
        payload = {"error": f"bad query parameter: {problems}", "request_id": request_id(request.scope)}
        return json_response(400, payload)

    @app.exception_handler(StarletteHTTPException)
    def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = f"no such endpoint {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return json_response(exc.status_code, {"error": message, "request_id": request_id(request.scope)})

    @app.exception_handler(FieldError)
    def _field(request: Request, exc: FieldError) -> Response:
        return error_response(exc, request_id(request.scope), locations)

    @app.exception_handler(Exception)
    def _unexpected(request: Request, exc: Exception) -> Response:
        return error_response(exc, request_id(request.scope), locations)


def add_search(app: FastAPI, service: QueryService, locations: tuple[str, ...] = ()) -> None:
    @app.post(
        "/search",
        summary="search by stored keys, vectors or text",
        openapi_extra={
            "requestBody": {"required": True, "content": {"application/json": {"schema": SEARCH_BODY_SCHEMA}}}
        },
    )
    async def search(
        request: Request,
        partial: bool = Query(False, description="allow an answer from the shards that answered in time"),
    ) -> Response:
        data = await read_limited(request, service.limits.max_json, "max_json_mb")

        def run() -> Any:
            body = parse_json(data, service.limits)  # in the thread pool: a large body parses off the event loop
            if partial:
                body.setdefault("partial", True)
            return service.search_json(body)

        return await respond(request, run, locations)


def add_search_image(app: FastAPI, service: QueryService, locations: tuple[str, ...] = ()) -> None:
    @app.post(
        "/search/image",
        summary="search by an image (the raw image bytes are the request body)",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                    "image/*": {"schema": {"type": "string", "format": "binary"}},
                },
            }
        },
    )
    async def search_image(
        request: Request,
        k: int = Query(10, description="results"),
        nprobe: int | None = Query(None, description="IVF lists visited (default: the index's)"),
        partial: bool = Query(False, description="allow an answer from the shards that answered in time"),
        rerank: bool | None = Query(None, description=RERANK_HELP),
        shortlist: int | None = Query(None, description=SHORTLIST_HELP),
    ) -> Response:
        data = await read_limited(request, service.limits.max_body, "max_body_mb")

        def run() -> Any:
            extra: dict[str, Any] = {"partial": True} if partial else {}
            if rerank is not None or shortlist is not None:  # else the server's own settings
                extra["rerank"] = service.request_rerank(rerank, shortlist) or False
            return service.search_image(data, k, nprobe, **extra)

        return await respond(request, run, locations)


def check_shards(service: QueryService) -> None:
    """ShardsUnavailable naming the shards without a live replica (shards in Ray actors); nothing
    for an index in this process."""
    state = service.index.health()  # {} in one process: every shard is here
    if not state.get("ok", True):
        raise ShardsUnavailable(state["unavailable_shards"], "the health check")
