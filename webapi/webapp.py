"""``needle serve``: one ASGI (FastAPI) app, run by uvicorn or as a Ray Serve deployment.

- ``GET  /health``                       -> ``{"ntotal", "d", "shards", "kind"}``; with shards in Ray
  actors also ``"ok"``, ``"unavailable_shards"`` and ``"replicas"`` (each replica's shard, replica
  number, ``"ready"``/``"unreachable"`` and node), and 503 when a shard has no live replica
- ``POST /search[?partial=1]``  JSON ``{"k", "nprobe"?, "refine_factor"?, "partial"?, one of "keys" |
  "vectors" | "text"}``
- ``POST /search/image?k=10[&nprobe=N][&partial=1]`` raw image bytes (the request body, at most ``MAX_BODY``)
- ``GET  /docs``                         the OpenAPI page
- ``/`` and the web page's own routes when a ``PageConfig`` is given (webapi.webpage)

Bad input is answered 400 with ``{"error": message}``, an unknown endpoint 404, a body over
``MAX_BODY`` 413, a failure 500 (logged with its traceback). Shards that did not answer within the
shard timeout: 503 with ``{"error", "missing_shards"}``, unless the request allows a partial
answer (``"partial": true`` / ``?partial=1``): then each query's answer carries ``"partial": true``
and ``"missing_shards"``. The endpoints are plain ``def``
functions: FastAPI runs them in its thread pool, so concurrent requests search in parallel (the
QueryService's lock guards only the lazy loading of its models). Uploaded bytes stay in memory.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.errors import ImageDecodeError, NeedleInputError
from index.shard_files import shard_names
from shards.coordinator import ShardsUnavailable
from webapi.query_service import MAX_BODY, QueryService

if TYPE_CHECKING:
    from query.index_protocol import Index
    from webapi.webpage import PageConfig

log = logging.getLogger(__name__)

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
        "keys": {"type": "array", "items": {"type": "string"}, "description": "stored keys to query with"},
        "vectors": {
            "type": "array",
            "items": {"type": "array", "items": {"type": "number"}},
            "description": "query vectors, (n, d) or (d,)",
        },
        "text": {
            "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
            "description": "text queries (open_clip models)",
        },
    },
    "example": {"keys": ["000000/00001"], "k": 10},
}


class BodyTooLarge(Exception):
    def __init__(self, size: int):
        super().__init__(f"request body of {size} bytes is over {MAX_BODY}")


def json_response(status: int, payload: Any) -> Response:
    """``json.dumps`` as the http.server handler did (NaN allowed, no re-validation)."""
    return Response(json.dumps(payload), status_code=status, media_type="application/json")


async def request_body(request: Request) -> bytes:
    """The raw body, refused past ``MAX_BODY`` (by its Content-Length, or while it streams)."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > MAX_BODY:
        raise BodyTooLarge(int(length))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise BodyTooLarge(size)
        chunks.append(chunk)
    return b"".join(chunks)


def answer(call: Callable[[], Any]) -> Response:
    """200 with ``call()``; 400 for bad input; 503 for shards that did not answer in time; 500
    (logged) for anything else."""
    try:
        return json_response(200, call())
    except (NeedleInputError, ImageDecodeError) as exc:
        return json_response(400, {"error": str(exc)})
    except ShardsUnavailable as exc:
        log.warning("503: %s", exc)
        return json_response(503, {"error": str(exc), "missing_shards": exc.missing})
    except Exception as exc:  # keep serving; the log has the traceback
        log.exception("request failed")
        return json_response(500, {"error": f"{type(exc).__name__}: {exc}"})


def create_app(service: QueryService, page: PageConfig | None = None) -> FastAPI:
    app = FastAPI(
        title="needle",
        description="Instance-level image retrieval: search an index by stored key, vector, text or image.",
        version="0.1.0",
    )
    add_error_handlers(app)
    add_health(app, service)
    add_search(app, service)
    add_search_image(app, service)
    if page is not None:
        from webapi.webpage import register_page

        register_page(app, service, page)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Errors FastAPI answers itself (a body too large, a bad query parameter, no such endpoint)
    as ``{"error": message}``, like the endpoints' own."""

    @app.exception_handler(BodyTooLarge)
    def _too_large(request: Request, exc: BodyTooLarge) -> Response:
        return json_response(413, {"error": str(exc)})

    @app.exception_handler(RequestValidationError)
    def _invalid(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors())
        return json_response(400, {"error": f"bad query parameter: {problems}"})

    @app.exception_handler(StarletteHTTPException)
    def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = f"no such endpoint {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return json_response(exc.status_code, {"error": message})


def health_answer(index: Index) -> tuple[int, dict[str, Any]]:
    """(status, body) of /health: the index's size, dimension, shards and kind, and the replicas'
    state where the shards are served elsewhere (503 when a shard has no live replica)."""
    shards = len(shard_names(index.infos))
    out: dict[str, Any] = {"ntotal": index.ntotal, "d": index.d, "shards": shards, "kind": index.infos.get("kind")}
    replicas = index.health()  # {} in one process: every shard is here
    out.update(replicas)
    return (200 if replicas.get("ok", True) else 503), out


def add_health(app: FastAPI, service: QueryService) -> None:
    @app.get("/health", summary="index size, dimension, shards and kind (and each shard replica's state)")
    def health() -> Response:
        return json_response(*health_answer(service.index))


def add_search(app: FastAPI, service: QueryService) -> None:
    @app.post(
        "/search",
        summary="search by stored keys, vectors or text",
        openapi_extra={
            "requestBody": {"required": True, "content": {"application/json": {"schema": SEARCH_BODY_SCHEMA}}}
        },
    )
    def search(
        partial: bool = Query(False, description="allow an answer from the shards that answered in time"),
        data: bytes = Depends(request_body),
    ) -> Response:
        def run() -> Any:
            try:
                body = json.loads(data or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise NeedleInputError(f"request body is not JSON: {exc}") from exc
            if not isinstance(body, dict):
                raise NeedleInputError("request body must be a JSON object")
            if partial:
                body.setdefault("partial", True)
            return service.search_json(body)

        return answer(run)


def add_search_image(app: FastAPI, service: QueryService) -> None:
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
    def search_image(
        k: int = Query(10, description="results"),
        nprobe: int | None = Query(None, description="IVF lists visited (default: the index's)"),
        partial: bool = Query(False, description="allow an answer from the shards that answered in time"),
        data: bytes = Depends(request_body),
    ) -> Response:
        def run() -> Any:
            if not data:
                raise NeedleInputError("empty request body: send the image bytes")
            return service.search_image(data, k, nprobe, **({"partial": True} if partial else {}))

        return answer(run)


def check_shards(service: QueryService) -> None:
    """ShardsUnavailable naming the shards without a live replica (shards in Ray actors); nothing
    for an index in this process."""
    state = service.index.health()  # {} in one process: every shard is here
    if not state.get("ok", True):
        raise ShardsUnavailable(state["unavailable_shards"], "the health check")
