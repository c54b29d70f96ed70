"""One index shard served where its data is: a Ray actor (cluster/ray_shards.py wraps ShardGroup, a
group of these, with ``ray.remote``) that stages its shard directory to its node's disk (shards/staging.py),
opens it by itself (``index.shard.open_shard``) and answers everything about its rows
(the calls of ``shards.calls.ShardCalls``):

- ``search``: its shortlist (index scores, row ids, exact scores) and the shortlist's keys;
- ``keys_of``, ``find_key``, ``tokens_of_key``, ``vectors_of_rows``: lookups in its own files
  (keys in O(log n) through its key files, rows by their Parquet shard id);
- ``thumbnail``: a JPEG of one of its keys' images, read from the source tar its infos record;
- ``score_shortlists``: its members of each query's global re-ranking shortlist scored against
  its own stored local tokens; the raw local scores travel back, with the match evidence of the
  members that can be among the query's final top k (the coordinator combines and orders).

Every method only reads, so a call may be retried on a restarted actor or another replica. The
class is plain Python: tests run it in-process (shards/local_shards.py).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from core.joined_keys import JoinedKeys
from core.tokens import LocalTokens, TokenBatch
from index.coarse import CoarseAssignment
from index.shard import open_shard
from ingest.source_images import SourceImages, SourceImagesConfig, tar_urls_of_files, thumbnail_jpeg
from shards.calls import ShardCalls, ShardKeys
from shards.staging import StageConfig, read_delete_set_of, stage_shard

if TYPE_CHECKING:
    from index.locals import LocalStore
    from rerank.rerank import RerankConfig, Reranker

log = logging.getLogger(__name__)

EVIDENCE_MARGIN = 8  # match evidence sent for this many members past a shard's own top k


def writable(xq: np.ndarray) -> np.ndarray:
    """Queries as C-contiguous, writable float32: Ray hands arrays over read-only, torch wants them writable."""
    return np.require(xq, np.float32, ["C", "W"])


def scored_shortlist(
    reranker: Any, query: Any, rows: np.ndarray, scores: np.ndarray, candidates: Any, k: int, evidence: bool
) -> dict[str, Any]:
    """Shortlist members ``rows`` (global ``scores``, stored tokens ``candidates``) scored with the
    query's tokens: ``{"raw", "has_locals", "inliers", "chamfer", "evidence"}``, the evidence (with
    ``evidence``) of the members among these ones' top k + EVIDENCE_MARGIN by final score (the
    coordinator asks for any other it places in the final top k). A member's scores do not depend
    on the members beside it (rerank.rerank), so one shard or several together give the same."""
    from rerank.ensemble import combine, rerank_order

    conf = reranker.conf
    local = reranker.local_scores(query, candidates)
    sent = None
    if evidence and local.evidence is not None:
        final = combine(conf.method, scores, local.raw, local.has_locals, conf.ensemble, local.chamfer)
        sent = {int(i): local.evidence(int(i)) for i in rerank_order(final, rows)[: k + EVIDENCE_MARGIN]}
    return {
        "raw": local.raw,
        "has_locals": local.has_locals,
        "inliers": local.inliers,
        "chamfer": local.chamfer,
        "evidence": sent,
    }


def split_scored(scored: dict[str, Any], sizes: list[int]) -> list[dict[str, Any]]:
    """``scored_shortlist``'s answer for several members' shortlists joined in order, split back
    into one answer per member (evidence keyed by each member's own positions)."""
    out, start, evidence = [], 0, scored["evidence"]
    for size in sizes:
        end = start + size
        out.append(
            {
                "raw": scored["raw"][start:end],
                "has_locals": scored["has_locals"][start:end],
                "inliers": None if scored["inliers"] is None else scored["inliers"][start:end],
                "chamfer": None if scored["chamfer"] is None else scored["chamfer"][start:end],
                "evidence": None
                if evidence is None
                else {i - start: e for i, e in evidence.items() if start <= i < end},
            }
        )
        start = end
    return out


class ShardActor(ShardCalls):
    """Shard ``name`` of the index at ``source``, staged to this node and memory-mapped."""

    def __init__(
        self,
        source: str,
        name: str,
        stage: StageConfig,
        replica: int = 0,
        entry: dict[str, Any] | None = None,
        images: SourceImagesConfig | None = None,
        node: str | None = None,  # the node this runs on (a Ray node id; None: the host name)
        device: str = "cpu",  # where this process re-ranks (rerank.device): the process's, never a request's
    ):
        self.name = name
        self.device = device
        self.images_conf = images or SourceImagesConfig(endpoint_url=stage.endpoint_url)
        self.replica = replica
        self.node = node or socket.gethostname()
        self.staged = stage_shard(source, name, stage, self.node, entry)
        deletes = read_delete_set_of(source, entry or {}, stage.endpoint_url)
        self.shard = open_shard(self.staged.directory.parent, name, deletes=deletes)
        # One search and the re-scoring loaded before reporting ready: the first would load what
        # they need (torch for re-scoring: seconds) within the first request's timeout.
        self.shard.search(np.zeros((1, self.shard.index.d), np.float32), 1, None, True)
        self.shard.warm()
        self._lock = threading.Lock()
        self._rerankers: dict[str, Any] = {}
        self._images: SourceImages | None = None

    def info(self) -> dict[str, Any]:
        """Where this replica runs and what it staged (a cheap liveness probe)."""
        return {
            "shard": self.name,
            "replica": self.replica,
            "node": self.node,
            "pid": os.getpid(),
            "directory": str(self.staged.directory),
            "fetched": self.staged.fetched,
            "reused": self.staged.reused,
        }

    def search(
        self, xq: np.ndarray, kk: int, nprobe: int | None, refine: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, ShardKeys]:
        """``ShardCalls.search``: candidates, then their exact scores and keys."""
        D, I = self.candidates(xq, kk, nprobe)
        return self.completed(xq, D, I, refine)

    def candidates(
        self, xq: np.ndarray, kk: int, nprobe: int | None, assigned: CoarseAssignment | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(index scores, row ids) of this shard's best ``kk`` candidates (``Shard.candidates``;
        ``assigned``: the queries' lists, shared with the other segments of its group)."""
        return self.shard.candidates(writable(xq), kk, nprobe, assigned)

    def completed(
        self, xq: np.ndarray, D: np.ndarray, I: np.ndarray, refine: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, ShardKeys]:
        """Candidates ``(D, I)`` of this shard (-1 padding allowed) with their exact scores and keys."""
        return D, I, self.shard.exact_scores(writable(xq), D, I, refine), self.shard.keys_of(I)

    def keys_of(self, rows: np.ndarray) -> list[str | None]:
        return self.shard.keys_of(np.asarray(rows, np.int64)[None])[0]

    def joined_keys_of(self, rows: np.ndarray) -> JoinedKeys | list[str | None]:
        """``keys_of`` as the channel sends it (``Shard.joined_keys_of``: decoded as the same list)."""
        return self.shard.joined_keys_of(rows)

    def find_key(self, key: str, with_tokens: bool = False) -> dict[str, Any] | None:
        """``{"position": shard-local position, "vector": float32 vector or None (no valid
        descriptor)}`` of ``key`` (and ``"tokens"``, its stored LocalTokens, ``with_tokens``), or
        None where this shard does not hold it."""
        position = self.shard.position_of(key)
        if position < 0:
            return None
        found: dict[str, Any] = {"position": position, "vector": self.shard.vector_at(position)}
        if with_tokens:
            found["tokens"] = self.store().tokens(position)
        return found

    def find_keys(self, keys: list[str], with_tokens: bool = False) -> list[dict[str, Any] | None]:
        """``find_key`` of each of ``keys`` (one call for a request's keys)."""
        return [self.find_key(key, with_tokens) for key in keys]

    def tokens_of_key(self, key: str) -> LocalTokens | None:
        """The stored LocalTokens of ``key`` (None where this shard does not hold it)."""
        position = self.shard.position_of(key)
        if position < 0:
            return None
        return self.store().tokens(position)

    def thumbnail(self, key: str, px: int) -> bytes | None:
        """A JPEG of ``key``'s image, longer side ``px``, read from its source tar here (where the
        key is owned: only the thumbnail travels); None where this shard does not hold the key."""
        if self.shard.position_of(key) < 0:
            return None
        return thumbnail_jpeg(self.images().image_bytes(key), px, key)

    def images(self) -> SourceImages:
        """The source tars of this shard's rows (recorded per Parquet file in its infos)."""
        with self._lock:
            if self._images is None:
                files = self.shard.files.infos.get("files", [])
                urls = tar_urls_of_files(files, self.images_conf.endpoint_url)
                self._images = SourceImages(urls, self.images_conf)
            return self._images

    def vectors_of_rows(self, rows: np.ndarray) -> np.ndarray:
        positions = self.shard.positions_of_rows(np.asarray(rows, np.int64))
        return np.asarray(self.shard.vectors[positions], dtype=np.float32)

    def rescore(self, xq: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Exact scores (nq, C) of (nq, d) queries with this shard's rows (nq, C), -inf for -1."""
        return self.shard.rescore(writable(xq), np.asarray(rows, np.int64))

    def store(self) -> LocalStore:
        from core.errors import NeedleInputError

        store = self.shard.local_store
        if store is None:
            raise NeedleInputError(f"index shard {self.name} has no local tokens: rebuild with --locals to re-rank")
        return store

    def max_tokens(self) -> int:
        """The most tokens any of this shard's rows has."""
        return self.store().max_tokens

    def reranker(self, conf: RerankConfig) -> Reranker:
        from rerank.rerank import Reranker

        with self._lock:
            if repr(conf) not in self._rerankers:
                self._rerankers[repr(conf)] = Reranker(conf, device=self.device, itq=self.local_itq)
            return self._rerankers[repr(conf)]

    def candidate_tokens(self, conf: RerankConfig, rows: np.ndarray) -> TokenBatch:
        """The stored tokens (a TokenBatch of ``conf.db_tokens`` each) of this shard's ``rows``."""
        return self.store().batch(self.shard.positions_of_rows(np.asarray(rows, np.int64)), conf.db_tokens)

    def score_shortlists(
        self,
        conf: RerankConfig,
        shortlists: list[np.ndarray],
        s_global: list[np.ndarray],
        tokens: list[LocalTokens | None],
        k: int,
        evidence: bool = True,
    ) -> list[dict[str, Any] | None]:
        """``ShardCalls.score_shortlists``, each query's members scored by ``scored_shortlist``."""
        reranker = self.reranker(conf)
        out: list[dict[str, Any] | None] = []
        for rows, scores, query in zip(shortlists, s_global, tokens):
            if query is None or not len(rows):
                out.append(None)
                continue
            candidates = self.candidate_tokens(conf, rows)
            out.append(scored_shortlist(reranker, query, np.asarray(rows, np.int64), scores, candidates, k, evidence))
        return out

    def evidence_of(self, conf: RerankConfig, rows: np.ndarray, query: LocalTokens) -> list[dict[str, Any] | None]:
        """The match evidence of each of ``rows`` (scored again, alone: a member the coordinator
        placed in the top k without its evidence)."""
        local = self.reranker(conf).local_scores(query, self.candidate_tokens(conf, rows))
        return [local.evidence(i) if local.evidence is not None else None for i in range(len(rows))]

    def glue_matches(self, conf: RerankConfig, rows: np.ndarray, query: LocalTokens) -> np.ndarray:
        """``ShardCalls.glue_matches``: the second verification of this shard's ``rows``."""
        positions = self.shard.positions_of_rows(np.asarray(rows, np.int64))
        return self.reranker(conf).glue_of_stored(self.store(), positions, query)

    def local_itq(self) -> Any:
        """The ITQ projection this shard's local tokens were made with (its recorded file, verified
        by SHA-256 here: the packaged one wherever needle is installed, another one where it lies
        on this machine)."""
        from query.recorded import index_itq

        return index_itq(self.shard.files.infos, self.name)

    def memory(self) -> dict[str, int]:
        """This actor's process memory (see index.memory)."""
        from index.memory import process_memory

        return process_memory()
