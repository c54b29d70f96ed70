"""The coordinator of an index whose shards are served elsewhere (Ray actors on other nodes): it
holds the top-level ``index_infos.json`` and the shards' handles, nothing that grows with the
rows (no id table, vectors, key files or local store), and answers the query path's ``Index``
(query/index_protocol.py) as ``SearchIndex`` does, each call to the shards one of
``shards.calls.ShardCalls``:

- ``search``: every shard returns its shortlist with its keys; the merge is
  ``index.build.merge.merge_shortlists``, the single index's own, so D and I (ties included) are
  identical to ``load_index`` over the same data;
- ``keys_of``, ``position_of``, ``vector_of``, ``tokens_of_key``, ``vectors_of_rows``, ``thumbnail``: routed to
  the shard that owns a row (by its Parquet shard id, from the top-level infos), or asked of
  every shard's O(log n) key lookup for a key;
- ``score_shortlists`` (re-ranking): each shard gets its members of the global shortlist and the
  query's tokens once, and returns raw local scores; query.retrieve.search combines and orders
  the whole shortlist as in one process.

Faults. A call goes to one replica of each shard (round robin); a replica that died is replaced
by the next one, one that hangs (restarting, on a lost node) is hedged on another after
``HEDGE_FRACTION`` of the timeout; what has not answered within ``timeout`` seconds is missing. Inside
``request(partial=True)`` the answer is made from the shards that answered and the missing ones
are recorded (``RequestState.missing``); otherwise ``ShardsUnavailable`` names them (HTTP 503).
The calls go through a ``ShardBackend``: Ray actors (cluster/ray_shards.py) or, in tests,
ShardActor objects in this process (shards/local_shards.py).
"""

from __future__ import annotations

import contextvars
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from core.quoting import short_repr
from index.build.merge import checked_queries, merge_shortlists, shortlist_size
from index.errors import UnknownKeyError
from shards.calls import ReplicaFailed, ShardBackend, ShardCalls, Traffic, replica_health
from shards.messages import count_unwired
from shards.routing import RowRouter

if TYPE_CHECKING:
    from core.tokens import LocalTokens
    from query.index_protocol import Index
    from rerank.rerank import LocalScores, Reranker

log = logging.getLogger(__name__)

HEDGE_FRACTION = 0.3  # a shard's call unanswered after this fraction of the timeout goes to another replica too
POLL_S = 0.02  # once hedged, how often the calls are checked
SUSPECT_S = 10.0  # a replica that failed or hung is asked after the others for this long


class ShardsUnavailable(RuntimeError):
    """Shards that did not answer in time (no live replica, or slower than the timeout)."""

    def __init__(self, missing: list[str], what: str = "the request"):
        self.missing = sorted(missing)
        super().__init__(f"shards {', '.join(self.missing)} did not answer {what} in time")


@dataclass
class RequestState:
    """One request's view of the shards: whether a partial answer is allowed, the shards that
    were missing, and the keys of the rows its searches returned (so ``keys_of`` asks no shard
    again for them)."""

    partial: bool = False
    missing: set[str] = field(default_factory=set)
    keys: dict[int, str | None] = field(default_factory=dict)
    found: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)  # key -> (its shard, find_key's answer)


_REQUEST: contextvars.ContextVar[RequestState | None] = contextvars.ContextVar("needle_shard_request", default=None)


class ShardedIndex:
    """The ``Index`` (query/index_protocol.py) of shards served by ``backend``."""

    def __init__(self, infos: dict[str, Any], path: str, backend: ShardBackend, timeout: float = 10.0):
        self.infos = infos  # the top-level index_infos.json
        self.path = path  # the index location (s3:// URL or path), for messages
        self.backend = backend
        self.timeout = timeout  # seconds a request waits for the shards
        self.names = [entry["name"] for entry in infos["shards"]]
        self.bases = np.cumsum([0] + [int(e["rows"]) for e in infos["shards"][:-1]]).astype(np.int64)
        self.router = RowRouter(infos)  # row id -> index shard: one entry per Parquet file, never per row
        self._turn = [itertools.count() for _ in self.names]
        self.suspect: dict[tuple[int, int], float] = {}  # (shard, replica) -> when it failed or hung
        wire = getattr(backend, "traffic", None)  # a backend that counts its wire's bytes itself
        self.counts_wire = isinstance(wire, Traffic)
        self.traffic = wire if isinstance(wire, Traffic) else Traffic()
        self._max_tokens: int | None = None

    # --- what SearchIndex offers ------------------------------------------------------------
    @property
    def d(self) -> int:
        return int(self.infos["dim"])

    @property
    def ntotal(self) -> int:
        """Vectors a search can return (less those deleted in the generation served)."""
        return int(self.infos.get("live_ntotal", self.infos["ntotal"]))

    @property
    def generation(self) -> int:
        """The generation every shard answers from (0: as built)."""
        return int(self.infos.get("generation", 0))

    @property
    def is_exact(self) -> bool:
        return self.infos.get("kind") == "flat"

    @property
    def has_locals(self) -> bool:
        return bool(self.infos.get("locals"))

    # The same checks and shortlist size as the single index (index.build.merge's, which SearchIndex uses).
    def check_queries(self, xq: np.ndarray, k: int) -> np.ndarray:
        return checked_queries(xq, k, self.d)

    def shortlist_size(self, k: int, refine: bool = True, refine_factor: int | None = None) -> int:
        return shortlist_size(k, self.infos, self.ntotal, refine, refine_factor)

    # --- requests and calls ----------------------------------------------------------------
    @contextmanager
    def request(self, partial: bool = False) -> Iterator[RequestState]:
        """The scope of one request: ``partial`` allows answers from the shards that answered."""
        state = RequestState(partial)
        token = _REQUEST.set(state)
        try:
            yield state
        finally:
            _REQUEST.reset(token)

    def pinned(self) -> AbstractContextManager[ShardedIndex]:
        """``Index.pinned``: these shards serve one generation (a newer one gets new shard actors)."""
        return nullcontext(self)

    def warm(self) -> None:
        """``Index.warm``: nothing here (each shard actor warms its shard as it starts)."""

    def state(self) -> RequestState:
        return _REQUEST.get() or RequestState()

    def call(
        self, method: Callable[..., Any] | str, args: dict[int, tuple], what: str = "the request"
    ) -> dict[int, Any]:
        """``method(*args[s])`` (a ``ShardCalls`` method, or its name) on a replica of each shard
        ``s``; {shard: result} of those that
        answered within the timeout. A replica that fails is replaced by the next one at once; one
        that has not answered after ``HEDGE_FRACTION`` of the timeout (a restarting actor, a lost
        node) is asked again on another replica, and both are suspect for ``SUSPECT_S`` seconds
        (others are asked first). Missing shards raise ShardsUnavailable, or with a partial
        request are recorded and left out."""
        method = method if isinstance(method, str) else method.__name__
        start = time.monotonic()
        deadline = start + self.timeout
        several = any(self.backend.replicas[s] > 1 for s in args)
        hedge_at = start + self.timeout * HEDGE_FRACTION if several else deadline
        pending: dict[Any, tuple[int, int]] = {}
        tried: dict[int, set[int]] = {s: set() for s in args}
        results: dict[int, Any] = {}

        def submit(s: int) -> bool:
            untried = [r for r in range(self.backend.replicas[s]) if r not in tried[s]]
            if not untried:
                return False
            trusted = [r for r in untried if not self.is_suspect(s, r)] or untried
            replica = trusted[next(self._turn[s]) % len(trusted)]
            tried[s].add(replica)
            pending[self.backend.submit(s, replica, method, *args[s])] = (s, replica)
            return True

        for s in args:
            submit(s)
        hedged = False
        while pending and len(results) < len(args):
            now = time.monotonic()
            if now >= deadline:
                break
            # one wait for all while nothing is wrong; short polls once a hung call was hedged
            until = min(deadline, now + POLL_S) if hedged else min(deadline, hedge_at)
            for handle in self.backend.wait(list(pending), until - now):
                s, replica = pending.pop(handle)
                try:
                    value = self.backend.result(handle)
                except ReplicaFailed as exc:
                    log.warning("shard %s replica %d failed: %s", self.names[s], replica, exc)
                    self.suspect[s, replica] = time.monotonic()
                    if s not in results:
                        submit(s)  # the next replica, where there is one
                    continue
                self.suspect.pop((s, replica), None)
                results.setdefault(s, value)
            if not hedged and time.monotonic() >= hedge_at:
                hedged = True
                for s, replica in list(pending.values()):
                    if s not in results and submit(s):
                        log.warning("shard %s replica %d is slow: asking another replica", self.names[s], replica)
                        self.suspect[s, replica] = time.monotonic()
        if pending:  # hung past the timeout, or beaten by a hedged call: nobody waits for them
            self.backend.abandon(list(pending))
        if self.traffic.count and not self.counts_wire:
            count_unwired(self.traffic, method, args, results)
        missing = [self.names[s] for s in args if s not in results]
        if missing:
            log.warning(
                "%s: no answer from %s after %.2f s (replicas asked: %s)",
                what,
                ", ".join(missing),
                time.monotonic() - start,
                {self.names[s]: sorted(tried[s]) for s in args if s not in results},
            )
            state = self.state()
            if not state.partial or not results:
                raise ShardsUnavailable(missing, what)
            state.missing.update(missing)
        return results

    def is_suspect(self, shard: int, replica: int) -> bool:
        since = self.suspect.get((shard, replica))
        return since is not None and time.monotonic() - since < SUSPECT_S

    def every_shard(self, *args: Any) -> dict[int, tuple]:
        return dict.fromkeys(range(len(self.names)), args)

    def shard_of_rows(self, rows: np.ndarray) -> np.ndarray:
        """The index shard of each row id (-1 for the padding)."""
        return self.router.shard_of_rows(rows)

    # --- search ----------------------------------------------------------------------------
    def search(
        self, xq: np.ndarray, k: int, nprobe: int | None = None, refine: bool = True, refine_factor: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(D, I) as ``SearchIndex.search``: every shard's shortlist, merged by the same code."""
        xq = self.check_queries(xq, k)
        k = min(k, self.ntotal)  # past the live rows: the rows there are (FAISS pads, the answer does not)
        if k == 0:  # every row deleted: an empty answer, no shard asked
            return np.zeros((len(xq), 0), np.float32), np.zeros((len(xq), 0), np.int64)
        kk, nprobe = self.shortlist_size(k, refine, refine_factor), nprobe or self.infos.get("nprobe")  # served default
        parts = self.call(ShardCalls.search, self.every_shard(xq, kk, nprobe, refine), "the search")
        request = _REQUEST.get()
        if request is not None:  # kept for this request's keys_of (-1 padding maps to None, never asked)
            for s in sorted(parts):
                _, I, _, shard_keys = parts[s]
                for row_ids, row_keys in zip(I.tolist(), shard_keys):
                    request.keys.update(zip(row_ids, row_keys))
        return merge_shortlists([parts[s][:3] for s in sorted(parts)], kk, k)

    def keys_of(self, I: np.ndarray) -> list[list[str | None]]:
        """Row ids (nq, k) -> keys (None for the padding, and for rows of a shard missing from a
        partial request): those this request's searches returned, the others from their shards.

        Few numpy calls, none per shard: on a 2-core box the coordinator's own bookkeeping ran
        cold (its caches taken by the shards' processes) at ~0.4 ms of a ~2 ms lookup."""
        I = np.atleast_2d(np.asarray(I, np.int64))
        where: np.ndarray | None = None
        if I.shape[0] > 1:  # several queries may share rows: each distinct row asked once
            rows, where = np.unique(I, return_inverse=True)
        else:  # one query's rows are distinct (but for the padding, which no shard owns)
            rows = I.reshape(-1)
        owners = self.shard_of_rows(rows)  # -1: the padding
        keys: list[str | None] = [None] * len(rows)
        known = self.state().keys  # the rows this request's searches returned ask no shard
        if known:  # (a lookup outside a search's request knows none: no pass over the rows for it)
            keys = [known.get(i) for i in rows.tolist()]
            owners[np.array([key is not None for key in keys], dtype=bool)] = -1
        order, asks = self.router.grouped(owners)  # shard s asks for the rows at order[lo:hi]
        if asks:
            ordered = rows[order]
            args = {s: (ordered[lo:hi],) for s, (lo, hi) in asks.items()}
            answers = self.call(ShardCalls.keys_of, args, "the key lookup")
            if answers:  # each shard's keys put back at its rows' places in one numpy scatter
                placed = np.array(keys, dtype=object)
                placed[np.concatenate([order[asks[s][0] : asks[s][1]] for s in answers])] = [
                    key for s in answers for key in answers[s]
                ]
                keys = placed.tolist()
        if where is None:
            return [keys]
        return [[keys[i] for i in row] for row in where.reshape(I.shape).tolist()]

    def find_keys(self, keys: list[str], with_tokens: bool = False) -> dict[str, tuple[int, dict[str, Any]]]:
        """{key: (the shard holding it, its find_key answer)} of those of ``keys`` found, from one
        call to every shard (each an O(log n) lookup per key), kept for the rest of the request
        (a key's vector and then its tokens ask no shard again); ``with_tokens``: with the stored
        tokens of each (re-ranking)."""
        state = self.state()
        todo = [
            k
            for k in dict.fromkeys(keys)
            if k not in state.found or (with_tokens and "tokens" not in state.found[k][1])
        ]
        if todo:
            answers = self.call(ShardCalls.find_keys, self.every_shard(todo, with_tokens), "the key lookup")
            for i, key in enumerate(todo):
                hits = {s: answer[i] for s, answer in answers.items() if answer[i] is not None}
                if hits:
                    state.found[key] = (min(hits), hits[min(hits)])
        return {k: state.found[k] for k in keys if k in state.found}

    def find_key(self, key: str, with_tokens: bool = False) -> tuple[int, dict[str, Any]]:
        """(the shard holding ``key``, its find_key answer); UnknownKeyError where no shard holds
        it, ShardsUnavailable where a missing shard might (a partial request)."""
        found = self.find_keys([key], with_tokens)
        if key not in found:
            if self.state().missing:  # a partial request: the key may be on a missing shard
                raise ShardsUnavailable(sorted(self.state().missing), f"the lookup of key {short_repr(key)}")
            raise UnknownKeyError(f"key {short_repr(key)} is not in the index at {self.path}")
        return found[key]

    def prefetch_keys(self, keys: list[str], with_tokens: bool = False) -> None:
        """``Index.prefetch_keys``: ``find_keys``, its answer kept for the rest of the request."""
        self.find_keys(keys, with_tokens)

    def position_of(self, key: str) -> int:
        s, out = self.find_key(key)
        return int(self.bases[s]) + int(out["position"])

    def vector_of(self, key: str) -> np.ndarray:
        _, out = self.find_key(key)
        if out["vector"] is None:
            raise UnknownKeyError(
                f"key {short_repr(key)} has no valid descriptor in {self.path} (its image failed or was rejected)"
            )
        return out["vector"]

    def tokens_of_key(self, key: str) -> LocalTokens:
        from core.errors import NeedleInputError

        if not self.has_locals:
            raise NeedleInputError(
                f"index {self.path} has no local tokens: ingest with --locals and rebuild it to re-rank"
            )
        s, found = self.find_key(key)
        if "tokens" in found:
            return found["tokens"]
        return self.call(ShardCalls.tokens_of_key, {s: (key,)}, "the token lookup")[s]

    def thumbnail(self, key: str, px: int, tar_dirs: tuple[str, ...] = ()) -> bytes:
        """A JPEG thumbnail of ``key``'s image, made by the shard that owns the key from its source
        tar (one call to every shard: an O(log n) lookup each; only the JPEG travels; the shards
        look for tars as their serving configures, ``tar_dirs`` is not theirs). UnknownKeyError
        where no shard holds the key, ShardsUnavailable where a shard that might did not answer."""
        with self.request(partial=True) as state:
            answers = self.call(ShardCalls.thumbnail, self.every_shard(key, px), "the thumbnail")
        for s in sorted(answers):
            if answers[s] is not None:
                return answers[s]
        if state.missing:
            raise ShardsUnavailable(sorted(state.missing), f"the thumbnail of key {short_repr(key)}")
        raise UnknownKeyError(f"key {short_repr(key)} is not in the index at {self.path}")

    def vectors_of_rows(self, I: np.ndarray) -> np.ndarray:
        I = np.atleast_2d(I)
        flat = I.reshape(-1)
        out = np.zeros((len(flat), self.d), np.float32)
        owners = self.shard_of_rows(flat)
        args = {int(s): (flat[owners == s],) for s in np.unique(owners[owners >= 0])}
        for s, vectors in self.call(ShardCalls.vectors_of_rows, args, "the vector lookup").items():
            out[owners == s] = vectors
        return out.reshape((*I.shape, self.d))

    def rescore(self, xq: np.ndarray, I: np.ndarray) -> np.ndarray:
        """Exact scores (nq, C) of (nq, d) queries with rows ``I`` (nq, C), -inf for -1: each shard
        scores the rows it owns (their vectors stay where they are; a query vector travels)."""
        xq = np.ascontiguousarray(np.atleast_2d(xq), dtype=np.float32)
        I = np.atleast_2d(np.asarray(I, np.int64))
        owners = self.shard_of_rows(I.reshape(-1)).reshape(I.shape)
        D = np.full(I.shape, -np.inf, dtype=np.float32)
        args, places = {}, {}
        for s in np.unique(owners[owners >= 0]):
            mine = owners == s
            width = int(mine.sum(1).max())
            rows = np.full((len(I), width), -1, np.int64)
            place = [np.flatnonzero(m) for m in mine]  # each query's columns this shard owns
            for q, columns in enumerate(place):
                rows[q, : len(columns)] = I[q, columns]
            args[int(s)], places[int(s)] = (xq, rows), place
        for s, scores in self.call(ShardCalls.rescore, args, "the second scoring").items():
            for q, columns in enumerate(places[s]):
                D[q, columns] = scores[q, : len(columns)]
        return D

    # --- re-ranking: scored where the tokens are --------------------------------------------
    def score_shortlists(
        self,
        reranker: Reranker,
        shortlists: list[np.ndarray],
        s_global: list[np.ndarray],
        tokens: Sequence[LocalTokens | None],
        k: int,
        evidence: bool = True,
    ) -> list[LocalScores]:
        """``Index.score_shortlists``: each member scored by the shard that owns it; evidence not
        sent with the scores is asked for when wanted. Members of a shard missing from a partial
        request keep their global score (no local evidence)."""
        from rerank.rerank import LocalScores, candidate_width, no_local_scores

        # the width the single index would gather to (AMES: its longest row), the same on every shard
        conf = dataclasses.replace(reranker.conf, db_tokens=candidate_width(reranker.conf, self.max_tokens))
        owners = [self.shard_of_rows(rows) for rows in shortlists]
        # a query without tokens matches nothing: no shard is asked (as Reranker.local_scores)
        asked = [t is not None and len(t) > 0 for t in tokens]
        args = {}
        for s in range(len(self.names)):
            members = [np.flatnonzero(o == s) if a else np.zeros(0, np.int64) for o, a in zip(owners, asked)]
            if any(len(m) for m in members):
                args[s] = (
                    conf,
                    [rows[m] for rows, m in zip(shortlists, members)],
                    [g[m] for g, m in zip(s_global, members)],
                    [t if len(m) else None for t, m in zip(tokens, members)],  # once per query per shard
                    k,
                    evidence,
                )
        answers = self.call(ShardCalls.score_shortlists, args, "the re-ranking") if args else {}
        out = []
        for q, rows in enumerate(shortlists):
            if not asked[q]:
                out.append(no_local_scores(len(rows)))
                continue
            raw = np.zeros(len(rows), np.float64)
            has_locals = np.zeros(len(rows), bool)
            inliers = np.zeros(len(rows), np.int64) if conf.method == "sp" else None
            chamfer = np.zeros(len(rows), np.float64) if conf.method == "sp" else None
            sent: dict[int, Any] = {}  # member -> the match evidence its shard sent with the scores
            for s, answer in answers.items():
                part = answer[q]
                if part is None:
                    continue
                mine = np.flatnonzero(owners[q] == s)
                raw[mine] = part["raw"]
                has_locals[mine] = part["has_locals"]
                if inliers is not None and part["inliers"] is not None:
                    inliers[mine] = part["inliers"]
                if chamfer is not None and part["chamfer"] is not None:
                    chamfer[mine] = part["chamfer"]
                if part["evidence"] is not None:
                    sent.update((int(mine[i]), ev) for i, ev in part["evidence"].items())
            fetch = self.evidence_fetcher(conf, rows, owners[q], tokens[q], sent, set(answers))
            out.append(LocalScores(raw, has_locals, inliers, fetch if conf.method == "sp" else None, chamfer))
        return out

    def glue_matches(self, reranker: Reranker, rows: np.ndarray, query: LocalTokens) -> np.ndarray:
        """``Index.glue_matches``: each shard verifies its own rows; the rows of a shard missing from a
        partial request get none (0)."""
        owners = self.shard_of_rows(rows)
        args = {int(s): (reranker.conf, rows[owners == s], query) for s in np.unique(owners)}
        answers = self.call(ShardCalls.glue_matches, args, "the second verification")
        out = np.zeros(len(rows))
        for s, answer in answers.items():
            out[owners == s] = answer
        return out

    def max_tokens(self) -> int:
        """The most tokens any row of the index has: from the top-level infos, or (indexes built
        before it was recorded) asked of every shard once."""
        if self._max_tokens is None:
            recorded = (self.infos.get("locals") or {}).get("max_tokens")
            if recorded is not None:
                self._max_tokens = int(recorded)
            else:
                answers = self.call(ShardCalls.max_tokens, self.every_shard(), "the token count")
                if len(answers) < len(self.names):  # a partial request: the missing shards may hold longer rows
                    return max(answers.values())
                self._max_tokens = max(answers.values())
        return self._max_tokens

    def evidence_fetcher(
        self, conf: Any, rows: np.ndarray, owners: np.ndarray, query: Any, evidence: dict[int, Any], reached: set[int]
    ) -> Any:
        """Member -> its match evidence: sent with the scores, or asked of its shard (rare: a
        member in the final top k past its shard's own top k + margin)."""

        def evidence_of(c: int) -> Any:
            if c not in evidence:
                s = int(owners[c])
                if s not in reached:
                    return {"inliers": 0, "query_xy": [], "db_xy": []}
                answer = self.call(ShardCalls.evidence_of, {s: (conf, rows[c : c + 1], query)}, "the evidence")
                evidence[c] = answer[s][0]
            return evidence[c]

        return evidence_of

    def health(self, timeout: float | None = None) -> dict[str, Any]:
        """``Index.health``: every replica's state (``replica_health``), within ``timeout`` seconds
        (default: the request timeout, at most 5 s)."""
        return replica_health(self.backend, self.names, min(self.timeout, 5.0) if timeout is None else timeout)


if TYPE_CHECKING:  # mypy checks that the coordinator is an Index, as SearchIndex is (query/index_protocol.py)
    _sharded: type[Index] = ShardedIndex
