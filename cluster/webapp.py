"""``needle serve``: one ASGI (FastAPI) app, run by uvicorn or as a Ray Serve deployment.

- ``GET  /health``                       -> ``{"ntotal", "d", "shards", "kind"}``
- ``POST /search``  JSON ``{"k", "nprobe"?, "refine_factor"?, one of "keys" | "vectors" | "text"}``
- ``POST /search/image?k=10[&nprobe=N]`` raw image bytes (the request body, at most ``MAX_BODY``)
- ``GET  /docs``                         the OpenAPI page
- ``/`` and the web page's own routes when a ``PageConfig`` is given (cluster.webpage)

Bad input is answered 400 with ``{"error": message}``, an unknown endpoint 404, a body over
``MAX_BODY`` 413, a failure 500 (logged with its traceback). The endpoints are plain ``def``
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

from cluster.serve import MAX_BODY, QueryService
from core.errors import ImageDecodeError, NeedleInputError
from index.search import shard_names

if TYPE_CHECKING:
    from cluster.webpage import PageConfig

log = logging.getLogger(__name__)

SEARCH_BODY_SCHEMA = {
    "type": "object",
    "properties": {
        "k": {"type": "integer", "default": 10, "minimum": 1},
        "nprobe": {"type": "integer", "description": "IVF lists visited (default: the index's)"},
        "refine_factor": {"type": "integer", "description": "shortlist = factor * k, re-scored exactly"},
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
    """200 with ``call()``; 400 for bad input; 500 (logged) for anything else."""
    try:
        return json_response(200, call())
    except (NeedleInputError, ImageDecodeError) as exc:
        return json_response(400, {"error": str(exc)})
    except Exception as exc:  # keep serving; the log has the traceback
        log.exception("request failed")
        return json_response(500, {"error": f"{type(exc).__name__}: {exc}"})


def create_app(service: QueryService, page: PageConfig | None = None) -> FastAPI:
    app = FastAPI(
        title="needle",
        description="Instance-level image retrieval: search an index by stored key, vector, text or image.",
        version="0.1.0",
    )

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

    @app.get("/health", summary="index size, dimension, shards and kind")
    def health() -> Response:
        idx = service.index
        return json_response(
            200,
            {
                "ntotal": idx.ntotal,
                "d": idx.d,
                "shards": len(shard_names(idx.infos)),
                "kind": idx.infos.get("kind"),
            },
        )

    @app.post(
        "/search",
        summary="search by stored keys, vectors or text",
        openapi_extra={
            "requestBody": {"required": True, "content": {"application/json": {"schema": SEARCH_BODY_SCHEMA}}}
        },
    )
    def search(data: bytes = Depends(request_body)) -> Response:
        def run() -> Any:
            try:
                body = json.loads(data or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise NeedleInputError(f"request body is not JSON: {exc}") from exc
            if not isinstance(body, dict):
                raise NeedleInputError("request body must be a JSON object")
            return service.search_json(body)

        return answer(run)

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
        data: bytes = Depends(request_body),
    ) -> Response:
        def run() -> Any:
            if not data:
                raise NeedleInputError("empty request body: send the image bytes")
            return service.search_image(data, k, nprobe)

        return answer(run)

    if page is not None:
        from cluster.webpage import register_page

        register_page(app, service, page)
    return app


# Ray Serve: replicas of the same app. Replicas reserve no CPU by default: with --ray-shards the
# shard actors already hold the cluster's CPUs (see cluster.serve.serve_sharded).
REPLICA_CPUS = 0.0


def ray_app(
    index_path: str,
    files: Any = None,
    rerank: Any = None,
    page: PageConfig | None = None,
    shard_actors: list[Any] | None = None,
    replicas: int = 1,
    replica_cpus: float = REPLICA_CPUS,
):
    """The app as a bound Ray Serve deployment (``serve.run(ray_app(...))``; Ray must be initialised).

    Each replica opens the index itself; with ``shard_actors`` (from ``serve_sharded``) every replica
    is a coordinator in front of the same shard actors, which hold the index.
    """
    from ray import serve

    @serve.deployment(name="needle", num_replicas=replicas, ray_actor_options={"num_cpus": replica_cpus})
    @serve.ingress()
    class NeedleDeployment:
        def __init__(self, index_path: str, files: Any, rerank: Any, page: Any, shard_actors: Any):
            from cluster.serve import serve_sharded
            from index.search import load_index

            index = serve_sharded(index_path, actors=shard_actors) if shard_actors else load_index(index_path)
            self.service = QueryService(index, files, rerank)
            self.page = page

        def __serve_build_asgi_app__(self) -> FastAPI:
            return create_app(self.service, self.page)

    return NeedleDeployment.bind(str(index_path), files, rerank, page, shard_actors)
