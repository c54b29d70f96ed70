"""The QueryService behind the HTTP app (webapi.webapp): turns JSON bodies, images and text into
searches of any ``query.index_protocol.Index`` (one process's ``SearchIndex`` or a coordinator of
shards, ``shards.coordinator.ShardedIndex``).

Bad input (non-image bytes, wrong vector dimension, k larger than the index, empty text, unknown key,
malformed JSON) is a ``NeedleInputError``, answered 400 with ``{"error": message}`` by the app.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from core.errors import NeedleInputError
from query.index_protocol import Index

log = logging.getLogger(__name__)
MAX_BODY = 64 << 20  # 64 MiB: an image or a batch of vectors


class QueryService:
    """Turns requests into searches; shared by the app's request threads (its lock guards only the
    lazy loading of the query models: searches run in parallel)."""

    def __init__(self, index: Index, files: Any = None, rerank: Any = None):
        from query.recorded import QueryFiles
        from query.retrieve import token_kind
        from rerank.rerank import Reranker

        self.index = index
        self.token_kind = token_kind(index)  # whose re-ranking settings fill what rerank leaves open
        self.files = files or QueryFiles()  # files in place of those the index records (verified by SHA-256)
        self.rerank = rerank  # RerankConfig: re-rank key and image queries with local tokens; None: global only
        self.reranker = Reranker(rerank, self.token_kind) if rerank is not None else None
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
        from rerank.rerank import Reranker

        if conf is None or conf == self.rerank:
            return self.reranker
        with self._lock:
            if repr(conf) not in self._rerankers:
                self._rerankers[repr(conf)] = Reranker(conf, self.token_kind)
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
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise NeedleInputError(f"k must be a positive integer, got {k!r}")
        if k > self.index.ntotal:
            raise NeedleInputError(f"k={k} is larger than the index ({self.index.ntotal} vectors)")
        return k

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
        conf = QueryConfig(k=self.check_k(k), nprobe=nprobe, refine_factor=refine_factor, rerank=rerank)
        D, I, details = search(self.index, xq, conf, tokens, self.reranker_for(rerank), evidence=True)
        results = results_json(self.index, D, I)
        return [query_json(label, k, r, detail) for label, r, detail in zip(labels, results, details)]

    def answering(self, partial: Any, call: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """``call()`` as one request to the shards: where ``partial`` allows it and shards were
        missing, each query's answer says so (``"partial": true``, ``"missing_shards"``)."""
        if not isinstance(partial, bool):
            raise NeedleInputError(f"'partial' must be true or false, got {partial!r}")
        with self.index.request(partial) as state:  # in one process no shard is ever missing
            out = call()
        if state.missing:
            for query in out:
                query.update(partial=True, missing_shards=sorted(state.missing))
        return out

    def search_json(self, body: dict[str, Any], partial: bool = False) -> list[dict[str, Any]]:
        """Answer a /search body (``"partial": true`` in it, or ``partial``, allows a partial answer)."""
        return self.answering(body.get("partial", partial), lambda: self.search_body(body))

    def search_body(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        from query.retrieve import embed_texts

        k, nprobe, factor = body.get("k", 10), body.get("nprobe"), body.get("refine_factor")
        given = [name for name in ("keys", "vectors", "text") if name in body]
        if len(given) != 1:
            raise NeedleInputError("give exactly one of 'keys', 'vectors' or 'text'")
        if "keys" in body:
            keys = body["keys"]
            if not isinstance(keys, list) or not keys or not all(isinstance(x, str) for x in keys):
                raise NeedleInputError("'keys' must be a non-empty list of strings")
            self.index.prefetch_keys(keys, with_tokens=self.rerank is not None)  # shards elsewhere: one call to each
            tokens = None
            if self.rerank is not None:
                from query.retrieve import stored_tokens

                tokens = stored_tokens(self.index, keys)
            return self.search(
                np.stack([self.index.vector_of(x) for x in keys]), k, nprobe, [{"key": x} for x in keys], factor, tokens
            )
        if "vectors" in body:
            try:
                xq = np.asarray(body["vectors"], dtype=np.float32)
            except (TypeError, ValueError) as exc:
                raise NeedleInputError(f"'vectors' is not a numeric array: {exc}") from exc
            xq = xq[None] if xq.ndim == 1 else xq
            if xq.ndim != 2 or xq.shape[1] != self.index.d:
                raise NeedleInputError(f"vectors have shape {xq.shape}, the index expects (n, {self.index.d})")
            return self.search(xq, k, nprobe, [{"vector": i} for i in range(len(xq))], factor)
        text = body["text"]
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t.strip() for t in texts):
            raise NeedleInputError("'text' must be a non-empty string (or list of them)")
        return self.search(embed_texts(self.index, texts, self.files), k, nprobe, [{"text": t} for t in texts], factor)

    def search_image(
        self, data: bytes, k: int, nprobe: int | None, rerank: Any = None, partial: bool = False
    ) -> list[dict[str, Any]]:
        """Search with an image's bytes, re-ranked with ``rerank`` (default: the service's settings)."""
        return self.answering(partial, lambda: self.search_image_bytes(data, k, nprobe, rerank))

    def search_image_bytes(self, data: bytes, k: int, nprobe: int | None, rerank: Any = None) -> list[dict[str, Any]]:
        import io

        from PIL import Image, UnidentifiedImageError

        try:  # refuse non-image bytes before loading any model
            Image.open(io.BytesIO(data)).close()
        except (UnidentifiedImageError, OSError) as exc:
            raise NeedleInputError(f"cannot decode the request body as an image: {exc}") from exc
        rerank = rerank or self.rerank
        xq, tokens = self.embed_image(data, rerank, "request body")
        return self.search(xq, k, nprobe, [{"image": f"{len(data)} bytes"}], tokens=tokens, rerank=rerank)

    def embed_image(self, data: bytes, rerank: Any = None, name: str = "image") -> tuple[np.ndarray, list[Any] | None]:
        """(the image's global descriptor through the index's adapter, (1, d); its query-side local
        tokens when ``rerank`` is set, else None), from one decode resized for both extractors."""
        from ingest.images import decode_resized_many

        extractor = self.extractor()
        local = self.local_extractor(rerank) if rerank is not None else None
        sides = (extractor.resolution,) + ((local.resolution,) if local is not None else ())
        images = decode_resized_many(data, sides, name)[0]
        xq = self.adapt(extractor([images[extractor.resolution]])["global"].astype(np.float32))
        return xq, (local.tokens([images[local.resolution]]) if local is not None else None)
