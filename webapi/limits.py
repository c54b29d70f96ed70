"""What one request may ask of ``needle serve``, and how many may run at once.

Why: the service faces a network. Before these bounds one body of 80k keys cost +495 MB, a 152 KB
PNG of 12,500² px +721 MB, 200 re-ranked keys 2.9 s, and 1,000 connections trickling headers were
never closed. Every bound has a default, a flag (``needle serve --max-queries`` ...) and a key of
``--config``'s ``[request]`` or ``[connection]`` section (the fields of ``RequestLimits`` and
``ConnectionLimits``, which ``ServiceLimits`` joins), and a request past one is refused before the
work starts with a ``LimitError`` (413) or a ``FieldError`` (400) whose JSON body names the field
and the limit.

Memory under parallel worst-case requests is bounded by: request bodies buffered at once
(``max_buffered_mb``, webapi.guard) + ``max_inflight`` searches, each at most the decode of a
``max_image_pixels`` image (about 9 bytes per pixel: an RGB copy and its conversion, measured) or
the parse of a ``max_json_mb`` body; requests past ``max_inflight`` wait (at most ``max_queue`` of
them, for ``queue_timeout`` s, holding no body beyond the bytes they sent) or get a 503.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.errors import NeedleInputError
from core.quoting import short_repr
from core.settings import setting

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")  # always answered: this machine's own names
ANY_HOST = "*"  # --allow-host '*': answer any Host (no DNS-rebinding protection: behind a proxy that checks it)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask: its queries, the work they make the index do, its body's size."""

    max_queries: int = setting(1000, "queries in one request (keys, vectors or texts); more: 413")
    max_k_total: int = setting(
        10000, "k x queries in one request (with re-ranking each query counts max(k, shortlist)); more: 413"
    )
    max_nprobe: int = setting(4096, "largest nprobe a request may ask; more: 400")
    max_probes: int = setting(262_144, "IVF lists scanned by one request: nprobe x queries (IVF-PQ); more: 413")
    max_rescored: int = setting(
        200_000,
        "rows one request re-scores exactly: k x refine_factor x queries (IVF-PQ; each row read as float32); more: 413",
    )
    max_refine_factor: int = setting(64, "largest refine_factor a request may ask; more: 400")
    max_image_pixels: int = setting(
        25_000_000, "query image width x height, read from its header before decoding; more: 413"
    )
    max_jpeg_scans: int = setting(
        64, "scans of a query JPEG (each a pass over the image), counted before decoding; more: 413"
    )
    max_text_length: int = setting(1000, "characters of one text query; more: 413")
    max_body_mb: int = setting(64, "largest /search/image body (MiB); larger: 413")
    max_json_mb: int = setting(16, "largest JSON body of /search and /page/search (MiB); larger: 413")
    max_json_items: int = setting(
        2_000_000,
        "values in one JSON body, a container counting twice, counted before parsing (webapi/json_budget.py); "
        "more: 413",
    )
    max_json_depth: int = setting(32, "nesting of arrays and objects in one JSON body; deeper: 400")


@dataclass(frozen=True)
class ConnectionLimits:
    """What all clients together may hold of the server: bodies in memory, searches at once and in
    line, slow senders and readers, open connections (the last five under uvicorn only:
    webapi.connections; under --ray Serve's proxy owns the connections)."""

    max_buffered_mb: int = setting(256, "request bodies held in memory at once, all requests (MiB); past it: 503")
    max_inflight: int = setting(4, "searches, image decodes and thumbnails running at once")
    max_queue: int = setting(64, "requests waiting for one of max_inflight; more: 503 with Retry-After")
    queue_timeout: float = setting(10.0, "seconds a request waits for one of max_inflight, then 503")
    body_timeout: float = setting(60.0, "seconds to receive a whole request body, then 408")
    header_timeout: float = setting(
        10.0, "seconds to receive a request's headers (each request of a connection), then 408"
    )
    max_header_kb: int = setting(64, "request line and headers of one request (KiB); more: 431")
    max_connections: int = setting(512, "open HTTP connections; more are answered 503 and closed at once")
    send_timeout: float = setting(
        30.0, "seconds a connection's unsent answer bytes may wait for the client to take them all; then closed hard"
    )
    max_unsent_mb: int = setting(
        256, "answer bytes waiting for their clients, all connections (MiB); the connection passing it is closed hard"
    )


# --allow-host's help: the limits' and the server spec's (webapi.spec.Listen) field
ALLOW_HOSTS_HELP = (
    "Host names answered besides localhost, 127.0.0.1, ::1 and --host (DNS rebinding: others are 421); '*': any"
)


@dataclass(frozen=True)
class ServiceLimits(RequestLimits, ConnectionLimits):
    """Everything the app bounds, in one object for its parts (webapi.guard, webapi.connections,
    webapi.query_service): a request's limits, the connections', and the Host names answered."""

    allow_hosts: tuple[str, ...] = setting((), ALLOW_HOSTS_HELP)

    @classmethod
    def of(
        cls, request: RequestLimits, connection: ConnectionLimits, allow_hosts: tuple[str, ...] = ()
    ) -> ServiceLimits:
        """The limits of a server spec's sections (webapi.spec.ServeSpec), unchecked."""
        return cls(**_values(request), **_values(connection), allow_hosts=tuple(allow_hosts))

    def check(self) -> ServiceLimits:
        """Self, or a NeedleInputError naming the flag whose value cannot be used."""
        for name in (
            "max_queries",
            "max_k_total",
            "max_nprobe",
            "max_probes",
            "max_rescored",
            "max_refine_factor",
            "max_image_pixels",
            "max_jpeg_scans",
            "max_text_length",
            "max_body_mb",
            "max_json_mb",
            "max_json_items",
            "max_json_depth",
            "max_buffered_mb",
            "max_inflight",
            "max_header_kb",
            "max_connections",
            "max_unsent_mb",
        ):
            if getattr(self, name) < 1:
                raise NeedleInputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("queue_timeout", "body_timeout", "header_timeout", "send_timeout"):
            if not getattr(self, name) > 0:
                raise NeedleInputError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise NeedleInputError(f"--max-queue must be at least 0, got {self.max_queue}")
        return self

    @property
    def max_body(self) -> int:
        return self.max_body_mb << 20

    @property
    def max_json(self) -> int:
        return self.max_json_mb << 20


def _values(config: Any) -> dict[str, Any]:
    """A dataclass's own field values (not deep-copied, unlike dataclasses.asdict)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


# --- refusals -------------------------------------------------------------------------------------
class FieldError(NeedleInputError):
    """A request field that is malformed or out of range: 400, naming the field."""

    status = 400

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def payload(self) -> dict[str, Any]:
        return {"error": str(self), "field": self.field}


class LimitError(FieldError):
    """A request past one of ServiceLimits: 413, naming the field, the limit (its flag) and both values."""

    status = 413

    def __init__(self, field: str, limit: str, maximum: int, got: int, what: str):
        flag = "--" + limit.replace("_", "-")
        super().__init__(field, f"{what}: {got} is over the limit of {maximum} ({flag})")
        self.limit, self.maximum, self.got = limit, maximum, got

    def payload(self) -> dict[str, Any]:
        return {**super().payload(), "limit": self.limit, "max": self.maximum, "got": self.got}


class ProductLimitError(LimitError):
    """A request whose work, a product of several fields, is past one of ServiceLimits: 413 naming
    the product, its factors' values, the limit's flag and the request fields that make it."""

    def __init__(self, field: str, limit: str, maximum: int, factors: list[tuple[str, int]]):
        product = " x ".join(name for name, _ in factors)
        values = " x ".join(str(value) for _, value in factors)
        got = math.prod(value for _, value in factors)
        super().__init__(field, limit, maximum, got, f"{product} in '{field}' ({values})")
        self.product, self.factors = product, dict(factors)

    def payload(self) -> dict[str, Any]:
        return {**super().payload(), "product": self.product, "factors": self.factors}


# --- fields ---------------------------------------------------------------------------------------
def positive_int(value: Any, field: str, maximum: int | None = None, limit: str | None = None) -> int:
    """``value`` as a positive int (bools, floats and strings refused), at most ``maximum``: past
    it a FieldError (or, naming a ``limit`` of ServiceLimits, a LimitError)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise FieldError(field, f"'{field}' must be a positive integer, got {short_repr(value)}")
    if maximum is not None and value > maximum:
        if limit is not None:
            raise LimitError(field, limit, maximum, value, f"'{field}'")
        raise FieldError(field, f"'{field}' must be at most {maximum}, got {value}")
    return value


def optional_int(value: Any, field: str, maximum: int, limit: str) -> int | None:
    """None, or a positive int of at most ``maximum`` (a FieldError naming ``limit``'s flag past it)."""
    if value is None:
        return None
    value = positive_int(value, field)
    if value > maximum:
        raise FieldError(field, f"'{field}' must be at most {maximum} (--{limit.replace('_', '-')}), got {value}")
    return value


def boolean(value: Any, field: str) -> bool:
    """``value`` if it is a JSON boolean: "yes", 1 or null are refused, not read as truthy."""
    if not isinstance(value, bool):
        raise FieldError(field, f"'{field}' must be true or false, got {short_repr(value)}")
    return value


class RequestChecks:
    """The checks of one service's requests against its limits and its index's size."""

    def __init__(
        self, limits: ServiceLimits, ntotal: Callable[[], int], infos: Callable[[], dict[str, Any]] = lambda: {}
    ):
        self.limits = limits
        self.ntotal = ntotal  # the served index's size now (it grows and shrinks with its generations)
        self.infos = infos  # the served index's infos now: its kind, nlist and default nprobe and refine_factor

    def k(self, value: Any) -> int:
        """k: a positive int up to ``max_k_total``. A k past the index's live rows is no error
        (deletes shrink an index under its clients, to none at all): the answer holds the rows
        there are (the index's search returns min(k, ntotal) columns)."""
        return positive_int(value, "k", self.limits.max_k_total, "max_k_total")

    def nprobe(self, value: Any) -> int | None:
        """nprobe: None (the index's) or a positive int up to ``max_nprobe`` (``[1]`` was a 500 before)."""
        return optional_int(value, "nprobe", self.limits.max_nprobe, "max_nprobe")

    def refine_factor(self, value: Any) -> int | None:
        """refine_factor: None or a positive int up to ``max_refine_factor`` (the message of a
        non-positive one is the one the API always gave)."""
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise FieldError("refine_factor", f"refine_factor must be a positive integer, got {short_repr(value)}")
        return optional_int(value, "refine_factor", self.limits.max_refine_factor, "max_refine_factor")

    def shortlist(self, value: Any) -> int | None:
        """The page's re-ranking shortlist: None (the service's) or a positive int up to ``max_k_total``."""
        return optional_int(value, "shortlist", self.limits.max_k_total, "max_k_total")

    def work(
        self,
        field: str,
        queries: int,
        k: int,
        shortlist: int | None = None,
        nprobe: int | None = None,
        refine_factor: int | None = None,
    ) -> None:
        """``queries`` queries of ``k`` results (re-ranking a ``shortlist`` each) within the limits,
        and the rows they make the index touch: an IVF-PQ index scans ``nprobe`` lists per query
        and re-scores ``refine_factor`` x k rows per query (None: the index's defaults)."""
        if queries > self.limits.max_queries:
            raise LimitError(field, "max_queries", self.limits.max_queries, queries, f"queries in '{field}'")
        if shortlist and shortlist > k:
            self.product(field, "max_k_total", [("shortlist", shortlist), ("queries", queries)])
        else:
            self.product(field, "max_k_total", [("k", k), ("queries", queries)])
        infos = self.infos()
        if infos.get("kind", "ivfpq") == "flat":
            return  # an exact scan: no lists, no re-scoring; k x queries is its work
        nprobe = nprobe or int(infos.get("nprobe", 64))
        nprobe = min(nprobe, int(infos.get("nlist", nprobe)))  # never more lists than there are
        self.product(field, "max_probes", [("nprobe", nprobe), ("queries", queries)])
        factor = refine_factor or max(1, int(infos.get("refine_factor", 2)))
        self.product(field, "max_rescored", [("k", k), ("refine_factor", factor), ("queries", queries)])

    def product(self, field: str, limit: str, factors: list[tuple[str, int]]) -> None:
        """A ProductLimitError where the product of ``factors`` is past the limit ``limit``."""
        maximum = getattr(self.limits, limit)
        if math.prod(value for _, value in factors) > maximum:
            raise ProductLimitError(field, limit, maximum, factors)

    def texts(self, value: Any, field: str = "text") -> list[str]:
        """A text query or a list of them: non-empty strings of at most ``max_text_length``."""
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t.strip() for t in texts):
            raise FieldError(field, f"'{field}' must be a non-empty string (or list of them)")
        longest = max(len(t) for t in texts)
        if longest > self.limits.max_text_length:
            raise LimitError(field, "max_text_length", self.limits.max_text_length, longest, f"characters in '{field}'")
        return texts

    def keys(self, value: Any, field: str = "keys") -> list[str]:
        """Stored keys: a non-empty list of strings (their number is checked by ``work``)."""
        if not isinstance(value, list) or not value or not all(isinstance(x, str) for x in value):
            raise FieldError(field, f"'{field}' must be a non-empty list of strings")
        return value

    def image_size(self, data: bytes, field: str = "image") -> tuple[int, int]:
        """(width, height) of an image from its header, without decoding it: a FieldError for bytes
        that are not an image of QUERY_FORMATS, a LimitError past ``max_image_pixels``."""
        from PIL import Image

        from core.errors import ImageDecodeError
        from ingest.images import TooManyScans, open_image

        if not data:
            raise FieldError(field, "empty request body: send the image bytes")
        try:  # the header only; nothing is decoded before .load()
            with open_image(data, field, QUERY_FORMATS, self.limits.max_jpeg_scans) as image:
                width, height = image.size
        except TooManyScans as exc:  # each scan a pass over the image: a CPU bound the pixels do not give
            raise LimitError(field, "max_jpeg_scans", exc.max_scans, exc.scans, "scans of the JPEG") from exc
        except ImageDecodeError as exc:
            bomb = exc.__cause__ if isinstance(exc.__cause__, Image.DecompressionBombError) else None
            if bomb is not None:  # PIL's own cap (2x its MAX_IMAGE_PIXELS), met at open
                pixels = _pixels_in(str(bomb))
                raise LimitError(
                    field, "max_image_pixels", self.limits.max_image_pixels, pixels, "image pixels"
                ) from exc
            what = "request body" if field == "image" else field
            formats = ", ".join(QUERY_FORMATS)
            raise FieldError(field, f"cannot decode the {what}: not an image of {formats}") from exc
        if width * height > self.limits.max_image_pixels:
            raise LimitError(
                field, "max_image_pixels", self.limits.max_image_pixels, width * height, f"image of {width}x{height}"
            )
        return width, height


def parse_json(data: bytes, limits: ServiceLimits) -> dict[str, Any]:
    """A request body as a JSON object, or a FieldError: more items or nesting than ``limits``
    allow (counted from the bytes before anything is parsed: webapi/json_budget.py), bytes that
    are not JSON (or not UTF-8, or an integer of more digits than Python parses), not an object."""
    import json

    from webapi.json_budget import json_shape

    shape = json_shape(data or b"")
    if shape.depth > limits.max_json_depth:
        raise FieldError(
            "body", f"request body nests JSON too deep: {shape.depth} levels (--max-json-depth {limits.max_json_depth})"
        )
    if shape.items > limits.max_json_items:
        raise LimitError("body", "max_json_items", limits.max_json_items, shape.items, "JSON items in the request body")
    try:
        body = json.loads(data or b"null")
    except RecursionError:
        raise FieldError("body", "request body nests JSON too deep") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, the int digits limit
        raise FieldError("body", f"request body is not JSON: {str(exc)[:120]}") from None
    if not isinstance(body, dict):
        raise FieldError("body", "request body must be a JSON object")
    return body


# Image formats a query may come in: the common photo formats (ingest.images.SERVE_FORMATS: no TIFF,
# see there). Others (EPS, which runs Ghostscript; PSD, ICO, TIFF ...) are refused from the header,
# before any decoder runs.
QUERY_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "MPO")


def _pixels_in(message: str) -> int:
    """The pixel count PIL's DecompressionBombError states (0 where it states none)."""
    import re

    found = re.search(r"\((\d+) pixels\)", message)
    return int(found.group(1)) if found else 0


def retry_after(seconds: float) -> str:
    """A Retry-After header value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
