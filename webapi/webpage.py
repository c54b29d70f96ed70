"""The browser page of ``needle serve``: query by image, text or key, see thumbnails and evidence.

:func:`register_page` adds to the JSON API's FastAPI app (webapi/webapp.py):

- ``GET  /``                      the page (webapi/web/index.html; app.js and style.css under ``/web/``)
- ``GET  /page/info``             ``{"has_text", "has_locals", "ntotal", "d", "local_resolution", "rerank", ...}``
- ``POST /page/search``           JSON ``{"k", "nprobe"?, "rerank"?, "shortlist"?, one of "key" | "text"}``
- ``POST /page/search/image?k=&nprobe=&rerank=&shortlist=``  raw image bytes (at most ``max_upload_bytes``)
- ``GET  /thumb?key=K``           a JPEG thumbnail of the database image, cut from its tar member
- ``GET  /report``                the configured ``needle eval map`` report, per query: AP and the missed positives
- ``GET  /report/scaling.png``    the configured scaling plot

The page switches re-ranking per request (``"rerank": true``) as the JSON API does
(QueryService.request_rerank): with the service's re-ranking settings (or the SP defaults) and the
given shortlist, within the server's bounds, whenever the index carries local tokens.

Thumbnails (``Index.thumbnail``): a key is ``<shard name>/<__key__>``; its image is read again
from the tar ingestion read it from. In one process (index/images.py) that is the URL ingestion
recorded beside the descriptors, else ``<shard name>.tar`` in one of ``PageConfig.shard_dirs``.
For an index served across nodes the shard actor that owns the key reads it and makes the
thumbnail: only the JPEG reaches the page's process, which keeps nothing per tar. Nothing is
written to disk.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import Request  # module level: the routes' annotations are resolved in this module's globals

from core.errors import NeedleInputError
from core.quoting import short_text
from shards.coordinator import ShardsUnavailable
from webapi.http_errors import error_response, is_server_side, request_id, scrub, server_locations
from webapi.limits import FieldError, parse_json, short_repr

if TYPE_CHECKING:
    from query.index_protocol import Index
    from webapi.query_service import QueryService

log = logging.getLogger(__name__)
WEB_DIR = Path(__file__).resolve().parent / "web"
PAGE_FIELDS = ("key", "text", "k", "nprobe", "rerank", "shortlist")  # of a /page/search body


@dataclass(frozen=True)
class PageConfig:
    report: str | None = None  # a `needle eval map` JSON report shown in the report section; None: no report
    scaling_plot: str | None = None  # a scaling PNG (`needle eval plot`) shown beside it; None: none
    max_upload_bytes: int = 16 << 20  # larger uploaded query images are refused (413) before being read whole
    thumbnail_px: int = 256  # longer side of the result thumbnails
    shard_dirs: tuple[str, ...] = ()  # directories searched for `<shard>.tar` when ingestion records no URL for it
    report_depth: int = 1000  # missed positives: how deep the global ranking is searched to give their rank


def _error(status: int, message: str, request: Request | None = None):
    from fastapi.responses import JSONResponse

    payload = {"error": message} if request is None else {"error": message, "request_id": request_id(request.scope)}
    return JSONResponse(payload, status_code=status)


# --- searching with a per-request re-ranking switch -----------------------------------------------
class PageSearch:
    """The page's searches: the service's index and extractors, re-ranked when asked."""

    def __init__(self, service: QueryService):
        self.service = service
        self.index = service.index
        self.locations = server_locations(service.index)  # never named in an error body

    @property
    def has_locals(self) -> bool:
        return bool(self.index.infos.get("locals"))

    @property
    def has_text(self) -> bool:
        extractors = [e for e in self.index.infos.get("extractors", []) if e.get("extractor") == "global"]
        return bool(extractors) and (extractors[0].get("model") or {}).get("library") == "open_clip"

    @property
    def has_model(self) -> bool:
        return any(e.get("extractor") == "global" for e in self.index.infos.get("extractors", []))

    def local_resolution(self) -> int | None:
        info = (self.index.infos.get("locals") or {}).get("extractor") or {}
        return (info.get("config") or {}).get("resolution")

    def rerank_config(self, rerank: Any, shortlist: Any):
        """The page's re-rank box: off, none; on, what a JSON request's ``"rerank": true`` gets
        (QueryService.request_rerank: the server's settings, ``shortlist`` within its bounds)."""
        if not rerank:
            return None
        return self.service.request_rerank(True, shortlist)

    def check(self, field: str, k: Any, nprobe: Any, conf: Any = None) -> None:
        """k, nprobe and the work of one query (re-ranking ``conf``'s shortlist) within the limits."""
        shortlist = conf.shortlist if conf is not None else None
        self.service.checks.work(field, 1, self.service.check_k(k), shortlist, self.service.checks.nprobe(nprobe))

    def run(self, xq: np.ndarray, k: Any, nprobe: Any, label: dict[str, Any], conf, tokens) -> dict[str, Any]:
        [out] = self.service.search(xq, k, nprobe, [label], tokens=tokens, rerank=conf)
        return {**out, "reranked": conf is not None and tokens is not None}

    def by_key(self, key: Any, k: Any, nprobe: Any, rerank: Any, shortlist: Any) -> dict[str, Any]:
        from query.retrieve import stored_tokens

        if not isinstance(key, str) or not key.strip():
            raise FieldError("key", "'key' must be a non-empty string")
        key = key.strip()
        conf = self.rerank_config(rerank, shortlist)
        self.check("key", k, nprobe, conf)
        xq = self.index.vector_of(key)[None]
        tokens = stored_tokens(self.index, [key]) if conf is not None else None
        return self.run(xq, k, nprobe, {"key": key}, conf, tokens)

    def by_text(self, text: Any, k: Any, nprobe: Any) -> dict[str, Any]:
        from query.retrieve import embed_texts

        if not isinstance(text, str) or not text.strip():
            raise FieldError("text", "the text query is empty")
        [text] = self.service.checks.texts(text)
        if not self.has_text:
            raise FieldError("text", "the index's model has no text tower: text queries need an open_clip model")
        self.check("text", k, nprobe)
        return self.run(embed_texts(self.index, [text], self.service.files), k, nprobe, {"text": text}, None, None)

    def by_image(self, data: bytes, k: Any, nprobe: Any, rerank: Any, shortlist: Any) -> dict[str, Any]:
        if not data:
            raise FieldError("image", "the uploaded file is empty")
        conf = self.rerank_config(rerank, shortlist)
        self.check("image", k, nprobe, conf)
        width, height = self.service.checks.image_size(data, "upload")  # its header: before any model loads
        if not self.has_model:
            raise FieldError("image", "the index does not record its model: query by key instead")
        xq, tokens = self.service.embed_image(data, conf, "uploaded image")
        return self.run(xq, k, nprobe, {"image": f"{len(data)} bytes", "width": width, "height": height}, conf, tokens)


# --- the eval report ------------------------------------------------------------------------------
def page_report(conf: PageConfig, search: PageSearch) -> dict[str, Any]:
    """The report's summary and per-query AP; each query's missed positives (not in the top k) and
    their rank when the report records rankings, or else when its ground truth can be read and the
    query key is in this index (recomputed with the global search, excluding the query itself)."""
    try:
        report = json.loads(Path(conf.report).read_text())
    except (OSError, ValueError) as exc:
        raise NeedleInputError(f"cannot read the report {conf.report}: {exc}") from exc
    if not isinstance(report, dict):
        raise NeedleInputError(f"the report {conf.report} is not a JSON object")
    k = int(report.get("k") or (report.get("config") or {}).get("k") or 10)
    per_query = [q for q in report.get("per_query", []) or [] if isinstance(q, dict)]
    summary = {  # the report's scalars, any server path in them scrubbed (the index, the ground truth ...)
        name: scrub(value, server_locations(search.index)) if isinstance(value, str) else value
        for name, value in report.items()
        if name != "per_query" and not isinstance(value, (dict, list))
    }
    positives = _truth_positives(report.get("ground_truth"))
    notes = []
    queries = []
    index = search.index
    for q in per_query:
        entry = {name: q.get(name) for name in ("key", "kind", "ap", "recall", "oracle") if name in q}
        ranking = q.get("ranking") or q.get("results")
        pos = q.get("positives") or positives.get(q.get("key"))
        if isinstance(q.get("missed"), list):
            entry["missed"] = q["missed"]
        elif pos is not None and isinstance(ranking, list):
            keys = [r if isinstance(r, str) else (r or {}).get("key") for r in ranking]
            entry["missed"] = _missed(pos, keys, k)
        elif pos is not None and q.get("kind", "image") == "image" and q.get("key"):
            entry["missed"] = _missed_by_search(index, q["key"], pos, k, conf.report_depth)
            entry["ranks_recomputed"] = True
        queries.append(entry)
    if queries and not any("missed" in q for q in queries):
        notes.append("the report records no rankings and its ground truth could not be read: per-query AP only")
    elif any(q.get("ranks_recomputed") for q in queries):
        notes.append(
            f"missed positives and their ranks recomputed with this index's global search "
            f"(searched to depth {conf.report_depth}; re-ranking, if the report used it, not applied)"
        )
    return {
        "path": Path(conf.report).name,  # its file name: a body never names a server path
        "k": k,
        "summary": summary,
        "breakdowns": report.get("breakdowns"),
        "per_query": queries,
        "notes": notes,
        "scaling_plot": bool(conf.scaling_plot),
    }


def _truth_positives(source: Any) -> dict[str, list[str]]:
    if not source:
        return {}
    try:
        from eval.evaluate import load_truth

        return {q["key"]: list(q["positives"]) for q in load_truth(source).queries}
    except Exception as exc:  # a moved or unreadable ground truth: show what the report has
        log.info("report ground truth %s unreadable: %s", source, exc)
        return {}


def _missed(positives: list[str], ranking: list[str | None], k: int) -> list[dict[str, Any]]:
    rank = {key: i + 1 for i, key in reversed(list(enumerate(ranking))) if key is not None}
    return [{"key": p, "rank": rank.get(p)} for p in positives if rank.get(p) is None or rank[p] > k]


def _missed_by_search(index: Index, key: str, positives: list[str], k: int, depth: int) -> list[dict[str, Any]] | None:
    try:
        xq = index.vector_of(key)[None]
    except NeedleInputError:
        return None
    _, I = index.search(xq, min(index.ntotal, max(depth, k) + 1))
    ranking = [r for r in index.keys_of(I)[0] if r is not None and r != key]
    return _missed(positives, ranking, k)


# --- routes ---------------------------------------------------------------------------------------
def register_page(app: Any, service: QueryService, conf: PageConfig | None = None) -> None:
    """Add the page, its static files and its endpoints to the FastAPI ``app``."""
    from fastapi.staticfiles import StaticFiles

    conf = conf or PageConfig()
    search = PageSearch(service)
    app.mount("/web", StaticFiles(directory=WEB_DIR), name="page-static")
    add_page(app, search, conf)
    add_page_search(app, search)
    add_page_search_image(app, search, conf)
    add_thumbnails(app, search.index, conf)
    add_report(app, search, conf)


async def guarded(request: Request, search: PageSearch, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in the thread pool, as JSON; an error as webapi.http_errors answers it: 400/413
    for bad input, 503 for shards that did not answer in time or storage, 500 (logged with the
    request id, which is all its body says) for the server's faults."""
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    def run() -> Any:
        with search.service.index.pinned():  # every index call of the request: one generation
            return fn(*args)

    try:
        return JSONResponse(await run_in_threadpool(run))
    except Exception as exc:  # keep serving
        return error_response(exc, request_id(request.scope), search.locations)


def add_page(app: Any, search: PageSearch, conf: PageConfig) -> None:
    """``GET /`` (the page) and ``GET /page/info`` (what the page offers for this index)."""
    from fastapi.responses import FileResponse

    service = search.service

    @app.get("/", include_in_schema=False)
    def page():
        return FileResponse(WEB_DIR / "index.html", media_type="text/html")

    @app.get("/page/info")
    def info():
        idx = service.index
        return {
            "has_text": search.has_text,
            "has_locals": search.has_locals,
            "has_model": search.has_model,
            "ntotal": idx.ntotal,
            "d": idx.d,
            "kind": idx.infos.get("kind"),
            "local_resolution": search.local_resolution(),
            "rerank_default": service.rerank is not None,
            "shortlist": (service.rerank.shortlist if service.rerank is not None else 100),
            "max_upload_bytes": conf.max_upload_bytes,
            "thumbnail_px": conf.thumbnail_px,
            "report": bool(conf.report),
            "scaling_plot": bool(conf.scaling_plot),
        }


def add_page_search(app: Any, search: PageSearch) -> None:
    """``POST /page/search``: a JSON body with one of ``key`` or ``text``."""
    from webapi.guard import read_limited

    limit = search.service.limits.max_json

    def answer(data: bytes) -> dict[str, Any]:
        body = parse_json(data, search.service.limits)
        unknown = sorted(set(body) - set(PAGE_FIELDS))
        if unknown:
            fields = ", ".join(PAGE_FIELDS)
            named = short_repr(unknown[0])  # the field named short: never megabytes of it
            raise FieldError(short_text(unknown[0]), f"unknown field {named}: a /page/search body has {fields}")
        k, nprobe = body.get("k", 10), body.get("nprobe")
        given = [name for name in ("key", "text") if name in body]
        if len(given) != 1:
            raise FieldError("key", "give exactly one of 'key' or 'text'")
        if "key" in body:
            return search.by_key(body["key"], k, nprobe, body.get("rerank"), body.get("shortlist"))
        return search.by_text(body["text"], k, nprobe)

    @app.post("/page/search")
    async def page_search(request: Request):
        try:
            data = await read_limited(request, limit, "max_json_mb")
        except FieldError as exc:
            return error_response(exc, request_id(request.scope))
        return await guarded(request, search, answer, data)


def add_page_search_image(app: Any, search: PageSearch, conf: PageConfig) -> None:
    """``POST /page/search/image``: the uploaded image bytes, at most ``conf.max_upload_bytes``."""
    from webapi.guard import read_limited

    @app.post("/page/search/image")
    async def page_search_image(
        request: Request, k: str = "10", nprobe: str | None = None, rerank: str = "0", shortlist: str | None = None
    ):
        try:
            k_, nprobe_ = int(k), (int(nprobe) if nprobe not in (None, "") else None)
            shortlist_ = int(shortlist) if shortlist not in (None, "") else None
        except ValueError as exc:
            return _error(400, f"bad query parameter: {exc}", request)
        try:  # in memory only, never on disk
            data = await read_limited(request, conf.max_upload_bytes, "max_upload_mb")
        except FieldError as exc:
            return error_response(exc, request_id(request.scope))
        on = rerank.lower() in ("1", "true", "on", "yes")
        return await guarded(request, search, search.by_image, data, k_, nprobe_, on, shortlist_)


def add_thumbnails(app: Any, index: Index, conf: PageConfig) -> None:
    """``GET /thumb?key=K``: a JPEG of the key's image, made where the key's rows are (``Index.thumbnail``).
    An unknown key or an unreadable image is a 404; the server's data faults (a corrupt index file,
    storage refused) are its own (500/503, webapi.http_errors)."""
    from fastapi.responses import Response

    locations = server_locations(index)

    @app.get("/thumb")
    def thumb(request: Request, key: str = ""):
        if not key:
            return _error(400, "give ?key=", request)
        try:
            jpeg = index.thumbnail(key, conf.thumbnail_px, conf.shard_dirs)
        except Exception as exc:
            if is_server_side(exc) or isinstance(exc, ShardsUnavailable):  # the index's files, storage, shards
                return error_response(exc, request_id(request.scope), locations)
            # an unknown key, a tar that cannot be read, undecodable bytes, ShardReadError: no thumbnail
            log.info("thumbnail of %r: %s: %s", key, type(exc).__name__, exc)
            if isinstance(exc, NeedleInputError):
                return _error(404, scrub(str(exc), locations), request)
            return _error(404, f"the image of {short_repr(key)} cannot be read or decoded", request)
        return Response(jpeg, media_type="image/jpeg", headers={"Cache-Control": "max-age=3600"})


def add_report(app: Any, search: PageSearch, conf: PageConfig) -> None:
    """``GET /report`` (made once, then kept) and ``GET /report/scaling.png``."""
    from fastapi.responses import FileResponse

    report_cache: dict[str, Any] = {}

    @app.get("/report")
    def report(request: Request):
        if not conf.report:
            return _error(404, "no report configured (serve with --report FILE)")
        if "report" not in report_cache:
            try:
                report_cache["report"] = page_report(conf, search)
            except NeedleInputError as exc:
                log.warning("the configured report cannot be shown: %s", exc)
                return _error(404, "the configured report cannot be read (the server's log says why)", request)
        return report_cache["report"]

    @app.get("/report/scaling.png")
    def scaling_png():
        if not conf.scaling_plot or not Path(conf.scaling_plot).is_file():
            missing = (
                "no scaling plot configured" if not conf.scaling_plot else "the configured scaling plot does not exist"
            )
            return _error(404, missing)
        return FileResponse(conf.scaling_plot, media_type="image/png")
