"""The QueryService behind the HTTP app (webapi.webapp): turns JSON bodies, images and text into
searches of any ``query.index_protocol.Index`` (one process's ``SearchIndex`` or a coordinator of
shards, ``shards.coordinator.ShardedIndex``).

Bad input (non-image bytes, wrong vector dimension, k not a positive integer, empty text, unknown key,
malformed JSON, a field of the wrong type or out of range, an unknown field) is a ``NeedleInputError``
(a ``webapi.limits.FieldError`` naming the field where the service checks it), answered 400 by the
app; a request past one of ``ServiceLimits`` (queries, k x queries, image pixels, text length) is
a ``LimitError``, answered 413. Each is raised before any search, model or decoder runs.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from core.quoting import short_repr, short_text
from query.index_protocol import Index
from webapi.limits import FieldError, RequestChecks, ServiceLimits, boolean, positive_int
from webapi.packed_vectors import packed_rows, unpack_vectors

log = logging.getLogger(__name__)
MAX_BODY = ServiceLimits().max_body  # 64 MiB: an image (--max-body-mb)
SEARCH_FIELDS = ("k", "nprobe", "refine_factor", "partial", "rerank", "shortlist", "keys", "vectors", "text")  # /search
REQUEST_SHORTLIST = 100  # a re-ranked request's shortlist on a server started without --rerank (the page's too)


class QueryService:
    """Turns requests into searches; shared by the app's request threads (its lock guards only the
    lazy loading of the query models: searches run in parallel)."""

    def __init__(
        self,
        index: Index,
        files: Any = None,
        rerank: Any = None,
        device: str = "cpu",
        limits: ServiceLimits | None = None,
    ):
        from query.recorded import QueryFiles
        from query.retrieve import token_kind
        from query.verify_top import make_reranker

        self.index = index
        self.token_kind = token_kind(index)  # whose re-ranking settings fill what rerank leaves open
        self.files = files or QueryFiles()  # files in place of those the index records (verified by SHA-256)
        self.rerank = rerank  # RerankConfig: re-rank key and image queries with local tokens; None: global only
        # where this process re-ranks (--device): the server's, never a request's (rerank.device)
        self.device = device
        self.reranker = make_reranker(rerank, index, self.token_kind, device, self.files) if rerank else None
        self.limits = (limits or ServiceLimits()).check()  # what one request may ask (webapi.limits)
        self.checks = RequestChecks(self.limits, lambda: index.ntotal, lambda: index.infos)
        self._lock = threading.Lock()
        self._extractor = None
        self._adapter: Any = False  # the index's adapter, loaded (and verified) once; False: not yet
        self._local_extractors: dict[Any, Any] = {}  # by (query scales, query tokens)
        self._rerankers: dict[str, Any] = {}  # per-request re-ranking settings other than the service's

    def local_extractor(self, conf: Any = None):
        """The query-side local extractor for re-ranking settings ``conf`` (default: the service's)."""
        from query.retrieve import query_local_extractor

        conf = conf or self.rerank
        key = (conf.query_scales, conf.query_top_k)
        with self._lock:
            if key not in self._local_extractors:
                self._local_extractors[key] = query_local_extractor(self.index, conf, self.files)
            return self._local_extractors[key]

    def reranker_for(self, conf: Any):
        """The Reranker of settings ``conf``: the service's own, or one made once per other setting."""
        from query.verify_top import make_reranker

        if conf is None or conf == self.rerank:
            return self.reranker
        with self._lock:
            if repr(conf) not in self._rerankers:
                self._rerankers[repr(conf)] = make_reranker(conf, self.index, self.token_kind, self.device, self.files)
            return self._rerankers[repr(conf)]

    def extractor(self):
        from query.retrieve import query_extractor

        with self._lock:
            if self._extractor is None:
                self._extractor = query_extractor(self.index, self.files)
            return self._extractor

    def adapt(self, xq: np.ndarray) -> np.ndarray:
        """Embedded queries through the index's adapter (unchanged without one)."""
        from query.retrieve import index_adapter

        with self._lock:
            if self._adapter is False:
                self._adapter = index_adapter(self.index, self.files)
        return xq if self._adapter is None else self._adapter.apply(xq)

    def check_k(self, k: Any) -> int:
        """k as a positive int within the index's size and ``max_k_total``, else a FieldError."""
        return self.checks.k(k)

    def shortlist_of(self, rerank: Any) -> int | None:
        """The shortlist a query re-ranked with ``rerank`` (default: the service's) scores: what it
        costs counts in ``max_k_total`` like k does."""
        conf = rerank or self.rerank
        return conf.shortlist if conf is not None else None

    def request_rerank(self, rerank: Any, shortlist: Any) -> Any:
        """The RerankConfig one request asks for (None: global only). ``rerank`` None (not given):
        the server's own; true: the server's settings, or SP with the index's token kind's where it
        was started without --rerank; false: none. ``shortlist`` (re-ranked requests only) at most
        the server's --shortlist (without --rerank: --max-k-total): a request never asks for more
        work than the server was set to do; past it a FieldError naming the field."""
        asked = self.rerank is not None if rerank is None else boolean(rerank, "rerank")
        if not asked:
            if shortlist is not None:
                raise FieldError("shortlist", "'shortlist' is the re-ranked shortlist: give \"rerank\": true with it")
            return None
        if not self.index.infos.get("locals"):
            raise FieldError("rerank", "this index has no local tokens: re-ranking needs an index built with --locals")
        from rerank.rerank import RerankConfig

        base = self.rerank or RerankConfig(method="sp", shortlist=REQUEST_SHORTLIST)
        if shortlist is None:
            return base
        most = self.rerank.shortlist if self.rerank is not None else self.limits.max_k_total
        flag = "--shortlist" if self.rerank is not None else "--max-k-total"
        n = positive_int(shortlist, "shortlist")
        if n > most:
            raise FieldError("shortlist", f"'shortlist' must be at most the server's {flag} {most}, got {n}")
        return dataclasses.replace(base, shortlist=n)

    def search(
        self,
        xq: np.ndarray,
        k: int,
        nprobe: int | None,
        labels: list[dict[str, Any]],
        refine_factor: int | None = None,
        tokens: list[Any] | None = None,
        rerank: Any = None,
    ) -> list[dict[str, Any]]:
        """Search, re-ranked where ``tokens`` holds the queries' tokens, with ``rerank`` (default:
        the service's settings)."""
        from query.retrieve import QueryConfig, query_json, results_json, search

        rerank = (rerank or self.rerank) if tokens is not None else None
        k, nprobe, refine_factor = self.check_k(k), self.checks.nprobe(nprobe), self.checks.refine_factor(refine_factor)
        conf = QueryConfig(k=k, nprobe=nprobe, refine_factor=refine_factor, rerank=rerank)
        D, I, details = search(self.index, xq, conf, tokens, self.reranker_for(rerank), evidence=True)
        results = results_json(self.index, D, I)
        return [query_json(label, k, r, detail) for label, r, detail in zip(labels, results, details)]

    def answering(self, partial: Any, call: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """``call()`` as one request to the shards: where ``partial`` allows it and shards were
        missing, each query's answer says so (``"partial": true``, ``"missing_shards"``)."""
        # pinned: every index call of ``call`` answered by one generation; in one process no shard is ever missing
        with self.index.pinned(), self.index.request(boolean(partial, "partial")) as state:
            out = call()
        if state.missing:
            for query in out:
                query.update(partial=True, missing_shards=sorted(state.missing))
        return out

    def search_json(self, body: dict[str, Any], partial: bool = False) -> list[dict[str, Any]]:
        """Answer a /search body (``"partial": true`` in it, or ``partial``, allows a partial answer)."""
        return self.answering(body.get("partial", partial), lambda: self.search_body(body))

    def search_body(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """Answer a parsed /search body, every field checked (type, range, limits) before any work."""
        unknown = sorted(set(body) - set(SEARCH_FIELDS))
        if unknown:
            fields = ", ".join(SEARCH_FIELDS)  # the field named short: never megabytes of it
            raise FieldError(
                short_text(unknown[0]), f"unknown field {short_repr(unknown[0])}: a /search body has {fields}"
            )
        given = [name for name in ("keys", "vectors", "text") if name in body]
        if len(given) != 1:
            raise FieldError("keys", "give exactly one of 'keys', 'vectors' or 'text'")
        k, nprobe, factor = self.check_k(body.get("k", 10)), body.get("nprobe"), body.get("refine_factor")
        self.checks.nprobe(nprobe)
        self.checks.refine_factor(factor)
        if "keys" in body:
            rerank = self.request_rerank(body.get("rerank"), body.get("shortlist"))
            return self.search_keys(self.checks.keys(body["keys"]), k, nprobe, factor, rerank)
        asked = body.get("rerank") is not None and boolean(body["rerank"], "rerank")
        if asked or body.get("shortlist") is not None:  # false: what vectors and text get anyway
            given = given[0]
            raise FieldError("rerank", f"re-ranking needs key or image queries: '{given}' queries have no local tokens")
        if "vectors" in body:
            xq = self.query_vectors(body["vectors"], k, nprobe, factor)
            return self.search(xq, k, nprobe, [{"vector": i} for i in range(len(xq))], factor)
        from query.retrieve import embed_texts

        texts = self.checks.texts(body["text"])
        self.checks.work("text", len(texts), k, nprobe=nprobe, refine_factor=factor)
        return self.search(embed_texts(self.index, texts, self.files), k, nprobe, [{"text": t} for t in texts], factor)

    def search_keys(
        self, keys: list[str], k: int, nprobe: Any, factor: Any, rerank: Any = None
    ) -> list[dict[str, Any]]:
        """Search with stored keys, re-ranked with ``rerank`` (request_rerank's: None, global only)."""
        self.checks.work("keys", len(keys), k, rerank.shortlist if rerank is not None else None, nprobe, factor)
        self.index.prefetch_keys(keys, with_tokens=rerank is not None)  # shards elsewhere: one call to each
        tokens = None
        if rerank is not None:
            from query.retrieve import stored_tokens

            tokens = stored_tokens(self.index, keys)
        xq = np.stack([self.index.vector_of(x) for x in keys])
        return self.search(xq, k, nprobe, [{"key": x} for x in keys], factor, tokens, rerank)

    def query_vectors(self, value: Any, k: int, nprobe: int | None = None, factor: int | None = None) -> np.ndarray:
        """'vectors' as (n, d) finite float32 queries: a list of numbers, a list of such lists, or
        packed (webapi/packed_vectors.py: base64 of little-endian float32 or float16, with its shape)."""
        if isinstance(value, dict):
            n = packed_rows(value, self.index.d)
            self.checks.work("vectors", n, k, None, nprobe, factor)
            return unpack_vectors(value, self.index.d)
        if not isinstance(value, list) or not value:
            raise FieldError("vectors", "'vectors' must be a non-empty list of numbers (or of such lists), or packed")
        self.checks.work("vectors", len(value) if isinstance(value[0], list) else 1, k, None, nprobe, factor)
        try:
            raw = np.asarray(value)
        except (TypeError, ValueError) as exc:  # ragged rows
            raise FieldError("vectors", f"'vectors' is not a numeric array: {exc}") from exc
        if raw.dtype.kind not in "iuf":  # strings, booleans, objects
            raise FieldError("vectors", f"'vectors' must hold numbers only, got an array of {raw.dtype}")
        xq = raw.astype(np.float32)
        xq = xq[None] if xq.ndim == 1 else xq
        if xq.ndim != 2 or xq.shape[1] != self.index.d:
            raise FieldError("vectors", f"vectors have shape {xq.shape}, the index expects (n, {self.index.d})")
        if not np.isfinite(xq).all():
            raise FieldError("vectors", "'vectors' hold NaN or infinity (or numbers beyond float32)")
        return xq

    def search_image(
        self, data: bytes, k: int, nprobe: int | None, rerank: Any = None, partial: bool = False
    ) -> list[dict[str, Any]]:
        """Search with an image's bytes, re-ranked with ``rerank``: None, the service's settings;
        False, none (a request's ``rerank=false``); a RerankConfig (request_rerank's)."""
        return self.answering(partial, lambda: self.search_image_bytes(data, k, nprobe, rerank))

    def search_image_bytes(self, data: bytes, k: int, nprobe: int | None, rerank: Any = None) -> list[dict[str, Any]]:
        """Search with an image's bytes: k, nprobe and the image's header (its format and pixel
        count) checked before any model loads or any decoder runs."""
        k, nprobe = self.check_k(k), self.checks.nprobe(nprobe)
        self.checks.work("image", 1, k, self.shortlist_of(rerank) if rerank is not False else None, nprobe)
        self.checks.image_size(data)
        rerank = self.rerank if rerank is None else (rerank or None)
        xq, tokens = self.embed_image(data, rerank, "request body")
        return self.search(xq, k, nprobe, [{"image": f"{len(data)} bytes"}], tokens=tokens, rerank=rerank)

    def embed_image(self, data: bytes, rerank: Any = None, name: str = "image") -> tuple[np.ndarray, list[Any] | None]:
        """(the image's global descriptor through the index's adapter, (1, d); its query-side local
        tokens when ``rerank`` is set, else None), from one decode resized for both extractors."""
        from ingest.images import SERVE_FORMATS, decode_resized_many

        extractor = self.extractor()
        local = self.local_extractor(rerank) if rerank is not None else None
        sides = (extractor.resolution,) + ((local.resolution,) if local is not None else ())
        images = decode_resized_many(data, sides, name, SERVE_FORMATS, self.limits.max_jpeg_scans)[0]
        xq = self.adapt(extractor([images[extractor.resolution]])["global"].astype(np.float32))
        return xq, (local.tokens([images[local.resolution]]) if local is not None else None)
