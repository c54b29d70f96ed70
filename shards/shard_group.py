"""Several index shards served by one process (one Ray actor): a request reaches the group in one
call (a message on the group's direct channel, shards/direct.py, or a Ray call) carrying every
member's arguments, the members answer in parallel threads (FAISS, numpy and torch release the
GIL), and one reply carries every answer.

Why: a call costs coordinator and transport time whatever it carries (a Ray call about as much
as a whole shard's search, ~0.5 ms of CPU at each end; a direct message less, but still a
wake-up of the actor and a reply), so on nodes with fewer cores than shards a request pays per
call, not per shard (``bench/sharded_serving.py``: grouped 1.27x the single index at 4M, one
actor per shard 1.66x, both direct). With
``--shards-per-actor G`` the shards are grouped G to an actor (consecutive shards), one call per
group. Each member is a ``ShardActor`` (shards/shard_actor.py), staged and opened as on its own.
Members answer in up to ``threads`` parallel threads: as many as the CPUs the actor reserved
(``--shard-cpus``), since on a node with fewer free cores than threads handing the GIL between
them costs more than it saves (measured on the 2-core box: 3 members' searches 2.0 ms one after
another, 3.1 ms in 3 threads).

Members' searches of one query batch run in two steps: every member's candidates by index score,
then only the members of the batch's shortlist among them (index.build.merge.trim_to_shortlist) are
re-scored and given keys, and only they go back; the merge at the coordinator is unchanged and
exact. A group of G shards thus re-scores kk rows per query, not G times kk. Arguments and
answers travel as one typed message each way (shards/wire.py, shards/messages.py: no pickle, a
call of the ``ShardCalls`` allow-list only): Ray's own serialisation of several small numpy
arrays and lists per call costs more (measured with bench/sharded_serving.py's fan-out; the
answers are a few KB).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from core.tokens import TokenBatch
from index.build.merge import trim_to_shortlist
from index.live.segment_merge import MergedSegments, merged_groups
from index.shard import shared_assignments, warm_coarse
from ingest.source_images import SourceImagesConfig
from shards.calls import ShardCalls
from shards.direct import DirectServer, Endpoint
from shards.messages import answer_request
from shards.shard_actor import ShardActor, scored_shortlist, split_scored
from shards.staging import StageConfig

log = logging.getLogger(__name__)


def batches_of(calls: list[tuple[int, tuple]], key: Callable[[tuple], Any]) -> list[list[int]]:
    """The slots of ``calls`` in batches of one ``key(args)``, each member at most once per batch
    (calls of several requests, even of the same arguments, may share a Ray call)."""
    batches: dict[Any, list[list[int]]] = {}
    for slot, (member, args) in enumerate(calls):
        same = batches.setdefault(key(args), [])
        batch = next((b for b in same if all(calls[s][0] != member for s in b)), None)
        if batch is None:
            same.append(batch := [])
        batch.append(slot)
    return [batch for same in batches.values() for batch in same]


def search_key(args: tuple) -> tuple:
    """Searches of one query batch (one request's reach every member with the same arguments)."""
    xq = np.asarray(args[0])
    return xq.shape, xq.tobytes(), repr(args[1:])


def rerank_key(args: tuple) -> int:
    """Re-ranking calls of one request: the coordinator sends every shard the same conf object
    (one message: one object again here, shards/wire.py)."""
    return id(args[0])


class ShardGroup:
    """The shards ``entries`` (top-level infos entries) of the index at ``source``, each staged to
    this node and opened by its own ``ShardActor``; ``run`` answers many members' calls at once."""

    def __init__(
        self,
        source: str,
        entries: list[dict[str, Any]],
        stage: StageConfig,
        replica: int = 0,
        images: SourceImagesConfig | None = None,
        threads: int = 1,
        node: str | None = None,  # the node this runs on (a Ray node id; None: the host name)
        address: str = "127.0.0.1",  # the address other nodes reach this process at (its direct channel)
        device: str = "cpu",  # where the members re-rank (rerank.device): this process's
        concurrency: int = 0,  # requests answered at once, over the channel and Ray together (0: no bound)
    ):
        self.members = [ShardActor(source, e["name"], stage, replica, e, images, node, device) for e in entries]
        warm_coarse([member.shard for member in self.members])  # which segments share one assignment
        # a living index's small segments searched as one FAISS index (index/live/segment_merge.py)
        self.merged: list[MergedSegments] = merged_groups([member.shard for member in self.members])
        self.address = address
        self.threads = max(1, min(threads, len(self.members)))  # members answering at once
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shard") if self.threads > 1 else None
        self._server: DirectServer | None = None
        self._server_lock = threading.Lock()
        # A request holds a slot until its answer is made, also when its caller gave up on it
        # (a closed channel connection, a Ray call nobody waits for): the work cannot be stopped
        # (FAISS, numpy), so it counts until it ends, and abandoned calls never pile up beyond it.
        self.slots = threading.BoundedSemaphore(concurrency) if concurrency > 0 else None
        self.running = 0  # requests being answered now (tests, logs)
        self.waited = 0  # requests that waited for a slot
        self._count_lock = threading.Lock()

    def endpoint(self) -> Endpoint:
        """Where this group answers ``run`` over a direct channel (shards/direct.py), with its
        key: the channel starts at the first ask, on this node's address."""
        with self._server_lock:
            if self._server is None:
                # ShardGroup.run itself: in a Ray actor ``self.run`` is Ray's tracing wrapper of it,
                # a cost per message that a call that does not come through Ray need not pay
                self._server = DirectServer(functools.partial(ShardGroup.run, self), self.address)
                where = self._server.endpoint
                log.info("shards %s: direct channel on %s:%d", self.names(), where.host, where.port)
            return self._server.endpoint

    def names(self) -> list[str]:
        return [member.name for member in self.members]

    def info(self) -> list[dict[str, Any]]:
        """Every member's ``info()`` (where it runs, what it staged)."""
        return [member.info() for member in self.members]

    def memory(self) -> dict[str, int]:
        """This process's memory (all members)."""
        return self.members[0].memory()

    def run(self, packed: bytes | memoryview) -> bytes:
        """``packed``: a request (``shards.messages.pack_request``: a call of the allow-list and
        ``[(member, args), ...]``); returns the message of ``("ok", value)`` or ``("error",
        exception)``, in order: each member's ``method(*args)``. A request that is not one is
        refused (WireError) before anything is called. At most ``concurrency`` are answered at
        once (the others wait), however they came and whether or not their caller still waits."""
        if self.slots is None:
            return answer_request(self.answer, packed, len(self.members))
        if not self.slots.acquire(blocking=False):
            with self._count_lock:
                self.waited += 1
            self.slots.acquire()
        with self._count_lock:
            self.running += 1
        try:
            return answer_request(self.answer, packed, len(self.members))
        finally:
            with self._count_lock:
                self.running -= 1
            self.slots.release()

    def answer(self, method: str, calls: list[tuple[int, tuple]]) -> list[tuple[str, Any]]:
        if method == ShardCalls.search.__name__ and len(calls) > 1:
            return self.searched(calls)
        if method == ShardCalls.score_shortlists.__name__ and len(calls) > 1:
            return self.scored(calls)
        if method == ShardCalls.keys_of.__name__:  # the keys as the key files give them (decoded as the list)
            method = ShardActor.joined_keys_of.__name__
        return self.each([(member, method, args) for member, args in calls])

    def each(self, calls: list[tuple[int, str, tuple]]) -> list[tuple[str, Any]]:
        """``("ok", value)`` or ``("error", exception)`` of each member's ``method(*args)``, in
        ``threads`` parallel threads: one member's error goes back to its caller, the others
        still answer."""

        def one(member: int, method: str, args: tuple) -> tuple[str, Any]:
            try:
                return "ok", getattr(self.members[member], method)(*args)
            except Exception as exc:
                return "error", exc

        if self.pool is None or len(calls) == 1:  # no thread hop
            return [one(*call) for call in calls]
        return [future.result() for future in [self.pool.submit(one, *call) for call in calls]]

    def searched(self, calls: list[tuple[int, tuple]]) -> list[tuple[str, Any]]:
        """Members' ``search`` answers, each batch of the same arguments trimmed to its shortlist
        among the members before re-scoring and keys (``index.build.merge.trim_to_shortlist``)."""
        out: list[tuple[str, Any]] = [("error", RuntimeError("not answered"))] * len(calls)
        for slots in batches_of(calls, search_key):
            xq, kk, nprobe, refine = calls[slots[0]][1]
            try:  # a shard's segments assign the queries to lists once (index/coarse.py)
                assigned = shared_assignments([self.members[calls[s][0]].shard for s in slots], xq, nprobe)
            except Exception as exc:  # FAISS refused the queries: every member's answer
                for slot in slots:
                    out[slot] = ("error", exc)
                continue
            found = self.candidates_of(calls, slots, (xq, kk, nprobe), assigned)
            ok = [slot for slot, (status, _) in zip(slots, found) if status == "ok"]
            for slot, answer in zip(slots, found):
                if answer[0] != "ok":
                    out[slot] = answer
            parts = [value for status, value in found if status == "ok"]
            trimmed = trim_to_shortlist(parts, int(kk)) if len(parts) > 1 else parts
            completing = [(calls[slot][0], "completed", (xq, D, I, refine)) for slot, (D, I) in zip(ok, trimmed)]
            for slot, answer in zip(ok, self.each(completing)):
                out[slot] = answer
        return out

    def candidates_of(
        self, calls: list[tuple[int, tuple]], slots: list[int], args: tuple, assigned: list[Any]
    ) -> list[tuple[str, Any]]:
        """Each slot's member's ``candidates(*args)``: the members of a merged group in this batch
        from one search of the group (an error is each of its members'), the others each alone."""
        found: dict[int, tuple[str, Any]] = {}
        slot_of = {calls[s][0]: (s, a) for s, a in zip(slots, assigned)}
        for group in self.merged:
            if not all(m in slot_of for m in group.members):
                continue
            try:
                xq, kk, nprobe = args
                parts = group.candidates(xq, kk, nprobe, slot_of[group.members[0]][1])
                found.update({slot_of[m][0]: ("ok", part) for m, part in zip(group.members, parts)})
            except Exception as exc:
                found.update({slot_of[m][0]: ("error", exc) for m in group.members})
        alone = [(s, a) for s, a in zip(slots, assigned) if s not in found]
        answers = self.each([(calls[s][0], "candidates", (*args, a)) for s, a in alone])
        found.update({s: answer for (s, _), answer in zip(alone, answers)})
        return [found[s] for s in slots]

    def scored(self, calls: list[tuple[int, tuple]]) -> list[tuple[str, Any]]:
        """Members' ``score_shortlists`` answers, each query's members of every member's shortlist
        scored together (one gathering, one matching, one verification per query and group, as
        the single index scores its whole shortlist), then split back per member. A batch that
        fails is answered member by member, so that an error stays its own member's."""
        out: list[tuple[str, Any]] = [("error", RuntimeError("not answered"))] * len(calls)
        for slots in batches_of(calls, rerank_key):
            try:
                answers = self.scored_together([calls[slot] for slot in slots])
            except Exception as exc:
                names = [self.members[calls[slot][0]].name for slot in slots]
                log.warning("shards %s: scoring together failed (%r): scoring member by member", names, exc)
                alone = ShardCalls.score_shortlists.__name__
                answers = self.each([(calls[slot][0], alone, calls[slot][1]) for slot in slots])
            for slot, answer in zip(slots, answers):
                out[slot] = answer
        return out

    def scored_together(self, calls: list[tuple[int, tuple]]) -> list[tuple[str, Any]]:
        """``score_shortlists`` of one request's calls to several members (the same conf, k and
        query tokens; each its own members of each query's shortlist)."""
        conf, _, _, tokens, k, *rest = calls[0][1]
        evidence = rest[0] if rest else True
        reranker = self.members[calls[0][0]].reranker(conf)
        answers: list[list[dict[str, Any] | None]] = [[] for _ in calls]
        for q in range(len(tokens)):
            taking = [c for c, (_, args) in enumerate(calls) if args[3][q] is not None and len(args[1][q])]
            parts = self.scored_query(conf, k, evidence, q, [calls[c] for c in taking], reranker) if taking else []
            scored = dict(zip(taking, parts))
            for c in range(len(calls)):
                answers[c].append(scored.get(c))
        return [("ok", answer) for answer in answers]

    def scored_query(
        self, conf: Any, k: int, evidence: bool, q: int, calls: list[tuple[int, tuple]], reranker: Any
    ) -> list[dict[str, Any]]:
        """Query ``q``'s members of the ``calls``' shortlists scored together, split back per call."""
        query = calls[0][1][3][q]
        if any(args[3][q] is not query for _, args in calls):
            raise ValueError("members' calls of one request carry different query tokens")
        rows = [np.asarray(args[1][q], np.int64) for _, args in calls]
        scores = np.concatenate([np.asarray(args[2][q]) for _, args in calls])
        candidates = TokenBatch.concat(
            [self.members[member].candidate_tokens(conf, r) for (member, _), r in zip(calls, rows)]
        )
        joined = scored_shortlist(reranker, query, np.concatenate(rows), scores, candidates, k, evidence)
        return split_scored(joined, [len(r) for r in rows])
