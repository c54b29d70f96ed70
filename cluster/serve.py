"""Serving an index: in this process (``load_index``), or its shards in Ray actors across nodes
(``serve_sharded``: cluster/ray_shards.py places them, cluster/shard_actor.py stages and serves a
shard, cluster/coordinator.py merges), and the QueryService behind the HTTP app (cluster.webapp).

A query fans out to every shard actor; each takes its shortlist from its index and re-scores it
exactly from the memory-mapped float16 vectors of its rows; the coordinator keeps the shortlist a
single index would take and returns the top k of its exact scores: the same computation
(``index.search.Shard.search``, ``merge_shortlists``) as searching the directory in one process,
and the same answer as a single index over the same data. Re-ranking scores each shortlist member
on the shard that holds its tokens. A request the shards cannot answer in time is refused
(``ShardsUnavailable``, HTTP 503), or answered from the shards that answered, marked
``"partial": true`` with ``"missing_shards"``, where the caller allows it.

``needle serve --index DIR`` binds 127.0.0.1 by default; its endpoints are in cluster.webapp. Bad
input (non-image bytes, wrong vector dimension, k larger than the index, empty text, unknown key,
malformed JSON) is answered 400 with ``{"error": message}``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cluster.coordinator import ShardedIndex
from cluster.ray_shards import ShardPlacement
from cluster.staging import StageConfig
from core.errors import NeedleInputError
from index.search import SearchIndex, load_index
from ingest.source_images import SourceImagesConfig

log = logging.getLogger(__name__)
MAX_BODY = 64 << 20  # 64 MiB: an image or a batch of vectors


@dataclass(frozen=True)
class ShardServing:
    """How ``--ray-shards`` serves an index: its shards' placement, staging and time limits."""

    placement: ShardPlacement = field(default_factory=ShardPlacement)  # replicas, concurrency, CPUs, memory
    stage: StageConfig = field(default_factory=StageConfig)  # each node's cache dir, the S3 endpoint
    timeout: float = 10.0  # seconds a request waits for the shards before 503 (or a partial answer)
    images: SourceImagesConfig | None = None  # where shard actors read thumbnails' tars (None: as recorded)
    transport: str = "direct"  # calls to shard actors: "direct" TCP channels (cluster/direct.py), else Ray calls only


def serve_sharded(
    path: str | Path, serving: ShardServing | None = None, actors: list[list[Any]] | None = None
) -> ShardedIndex:
    """A coordinator (cluster.coordinator.ShardedIndex) of the index at ``path`` (an ``s3://``
    prefix or a path every node can read), its shards in Ray actors (Ray must be initialised).

    The coordinator reads only the top-level ``index_infos.json``; each actor stages its shard to
    its node's disk and opens it there. ``actors``: the shard actors of another coordinator of the
    same index ([group][replica], ``.backend.actors``), shared instead of starting new ones (one
    set of shard actors behind several Serve replicas).
    """
    from cluster.ray_shards import RayShards, shard_groups, start_shard_actors, wait_ready
    from cluster.staging import read_index_infos, source_url

    serving = serving or ShardServing()
    source = source_url(path)
    infos = read_index_infos(source, serving.stage.endpoint_url)
    names = [entry["name"] for entry in infos["shards"]]
    groups = shard_groups(len(names), serving.placement.shards_per_actor)
    if actors is None:
        actors = start_shard_actors(source, infos, serving.stage, serving.placement, serving.images)
        wait_ready(actors, names, serving.placement.stage_timeout, groups)
    elif len(actors) != len(groups):
        raise ValueError(f"{len(actors)} shard actors for the {len(groups)} shard groups of {path}")
    backend = RayShards(actors, groups, serving.transport == "direct")
    if backend.direct:
        opened = backend.open_channels(serving.placement.stage_timeout)
        log.info("%d of %d shard actors answer over direct channels", opened, sum(map(len, actors)))
    return ShardedIndex(infos, source, backend, serving.timeout)


def open_index(
    path: str | Path, ray_shards: bool = False, address: str | None = None, serving: ShardServing | None = None
) -> Any:
    """The index to search: its shards in Ray actors with ``ray_shards`` (joining ``address``, else
    $RAY_ADDRESS, else a local instance), else loaded in this process."""
    if ray_shards:
        from cluster.ingest_job import connect_ray

        connect_ray(address)
        return serve_sharded(path, serving)
    return load_index(path)


class QueryService:
    """Turns requests into searches; shared by the app's request threads (its lock guards only the
    lazy loading of the query models: searches run in parallel)."""

    def __init__(self, index: SearchIndex, files: Any = None, rerank: Any = None):
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
        request = getattr(self.index, "request", None)
        if request is None:  # one process: every shard is here
            return call()
        with request(partial) as state:
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
            lookup = getattr(self.index, "find_keys", None)  # shards elsewhere: all keys in one call to each
            if lookup is not None:
                lookup(keys, with_tokens=self.rerank is not None)
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
