"""How ``needle serve`` answers a request that failed: a status that says whose fault it was, and a
body that names the bad input but nothing of the server.

Why: the issue found bad input answered 500 (a RecursionError, a TypeError), server faults
answered 400 (a corrupt shard, an S3 permission error: ``NeedleInputError`` subclasses), 500 bodies
carrying exception text and 400 bodies naming the index's path on the server.

- 400 (413 for a request past a limit): the request's fault, ``{"error", "field"?, "limit"?, "request_id"}``;
  the message is the error's own, with server paths and URLs replaced by ``<index>``/``<path>``.
- 500: the server's fault (``NeedleDataError``: IndexFileError, a corrupt or missing index file;
  the NeedleInputErrors of files the operator named, see SERVER_SIDE; anything unexpected):
  ``{"error": "internal error", "request_id"}``. The log has the exception, its traceback and the
  same request id.
- 503 with Retry-After: the server cannot answer now: ``StorageError`` (a store that refused or
  could not be reached: a later try, or another replica, may succeed), shards that did not answer
  in time (``ShardsUnavailable``, with ``"missing_shards"``), and the busy answers of webapi.guard.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fastapi.responses import Response

from core.errors import ImageDecodeError, NeedleDataError, NeedleInputError
from core.storage import StorageError
from query.index_protocol import Index
from shards.coordinator import ShardsUnavailable
from webapi.limits import FieldError

log = logging.getLogger(__name__)

# NeedleInputErrors that, raised while answering a request, are about files the operator named (the
# model's weights, the index's key and token stores, an adapter, the device), never about the
# request: by class name, so that checking them imports none of their (torch-heavy) modules.
# tests/webapi/test_service_errors.py checks that each name still names a NeedleInputError.
SERVER_SIDE = frozenset(
    {
        "query.recorded.RecordedFileError",
        "embed.registry.WeightsError",
        "embed.registry.UnknownModelError",
        "embed.adapt.AdapterError",
        "embed.itq.ITQFileError",
        "embed.pca.PCAError",
        "embed.locals.aliked.AlikedWeightsMissing",
        "index.keys.KeyFileError",
        "index.locals.LocalStoreError",
        "ingest.descriptors.DescriptorFileError",
        "rerank.ames.AMESCheckpointError",
        "rerank.device.DeviceUnavailableError",
    }
)
INTERNAL = "internal error: the server failed to answer; the request id is in its log"
STORAGE = "the server's storage could not be read; try again later"
_URL = re.compile(r"\b(?:s3|gs|file|https?)://[^\s'\"),]+")
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~\-/])/(?:[^\s'\"/),:;]+/)*[^\s'\"/),:;]+")
# The app's own routes: public, and what a message about a request names ("a /search body has ..."),
# so kept where any other absolute path is scrubbed (they were answered as "a <path> body").
ROUTES = frozenset({"/search", "/search/image", "/page/search", "/page/search/image", "/health", "/thumb", "/report"})


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def request_id(scope: Mapping[str, Any]) -> str:
    """The id webapi.guard gave the request (in its scope's state); a new one on an app without it."""
    state = scope.get("state")
    if isinstance(state, dict) and isinstance(state.get("request_id"), str):
        return state["request_id"]
    return new_request_id()


def json_response(status: int, payload: Any, headers: Mapping[str, str] | None = None) -> Response:
    """``json.dumps`` as the http.server handler did (NaN allowed, no re-validation)."""
    return Response(json.dumps(payload), status_code=status, media_type="application/json", headers=headers)


def server_locations(index: Index) -> tuple[str, ...]:
    """The strings that name where the server's index is (as given and resolved): never sent to a
    client. Read from the ``Index`` protocol's ``path``: an index that does not say where it is is
    an error here, not an index whose location goes unscrubbed."""
    given = str(index.path or "")
    if not given:
        return ()
    names = {given, given.rstrip("/")}
    if "://" not in given:
        names.add(str(Path(given).resolve()))
    return tuple(sorted((n for n in names if len(n) > 1), key=len, reverse=True))


def scrub(message: str, locations: Iterable[str] = ()) -> str:
    """``message`` without the server's paths: its index location as ``<index>``, any other absolute
    path or URL as ``<path>``, except the app's own routes (ROUTES). Keys (``000000/00001``) and
    media types (``image/png``) stay."""
    for location in locations:
        message = message.replace(location, "<index>")
    return _ABSOLUTE_PATH.sub(_unless_route, _URL.sub("<path>", message))


def _unless_route(match: re.Match[str]) -> str:
    return match.group(0) if match.group(0) in ROUTES else "<path>"


def is_server_side(exc: BaseException) -> bool:
    """Whether ``exc`` is a fault of the server's data, whatever else it is (see the module doc)."""
    if isinstance(exc, NeedleDataError):
        return True
    return any(f"{cls.__module__}.{cls.__qualname__}" in SERVER_SIDE for cls in type(exc).__mro__)


def describe(exc: BaseException, rid: str, locations: Iterable[str] = ()) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, JSON body, headers) for ``exc`` raised while answering request ``rid``; server faults
    are logged with their traceback and ``rid``, their bodies say nothing of them."""
    if isinstance(exc, StorageError):
        log.error("request %s: storage unavailable: %s", rid, exc, exc_info=exc)
        return 503, {"error": STORAGE, "request_id": rid}, {"Retry-After": "5"}
    if is_server_side(exc):
        log.error("request %s failed on the server's data: %s: %s", rid, type(exc).__name__, exc, exc_info=exc)
        return 500, {"error": INTERNAL, "request_id": rid}, {}
    if isinstance(exc, ShardsUnavailable):
        log.warning("request %s: 503: %s", rid, exc)
        body = {"error": str(exc), "missing_shards": exc.missing, "request_id": rid}
        return 503, body, {"Retry-After": "1"}
    if isinstance(exc, FieldError):
        payload = {**exc.payload(), "error": scrub(str(exc), locations), "request_id": rid}
        return exc.status, payload, {}
    if isinstance(exc, (NeedleInputError, ImageDecodeError)):
        return 400, {"error": scrub(str(exc), locations), "request_id": rid}, {}
    log.error("request %s failed: %s: %s", rid, type(exc).__name__, exc, exc_info=exc)
    return 500, {"error": INTERNAL, "request_id": rid}, {}


def error_response(exc: BaseException, rid: str, locations: Iterable[str] = ()) -> Response:
    status, payload, headers = describe(exc, rid, locations)
    return json_response(status, payload, headers)
