"""The calls the coordinator (shards/coordinator.py) makes to shard replicas, and how they travel.

``ShardCalls``: the calls to one shard replica, declared once. ``ShardActor``
(shards/shard_actor.py) answers them for its shard; a ``ShardGroup`` (shards/shard_group.py)
passes each to its members by name. The coordinator names a call by its
declaration here (``ShardCalls.search``), so a renamed or removed call cannot be left behind.

Every call only reads, so it may be retried on a restarted actor or another replica.

``ShardBackend``: how a call reaches a replica (Ray actors, cluster/ray_shards.py; or ShardActor
objects in this process, shards/local_shards.py); ``replica_health``: every replica asked at once
whether it is alive.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from core.tokens import LocalTokens

if TYPE_CHECKING:  # rerank.rerank imports torch: a coordinator stays small
    from rerank.rerank import RerankConfig

ShardKeys = list[list[str | None]]  # keys of an (nq, kk) block of row ids, None for the -1 padding


class ShardCalls(Protocol):
    def info(self) -> dict[str, Any]:
        """Where this replica runs and what it staged (a cheap liveness probe)."""
        ...

    def search(
        self, xq: np.ndarray, kk: int, nprobe: int | None, refine: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, ShardKeys]:
        """(index scores, row ids, exact scores, keys) of this shard's best ``kk`` candidates
        (``index.shard.Shard.search``); the coordinator merges every shard's (index.build.merge)."""
        ...

    def keys_of(self, rows: np.ndarray) -> list[str | None]:
        """The keys of this shard's row ids ``rows`` (None for -1)."""
        ...

    def find_keys(self, keys: list[str], with_tokens: bool = False) -> list[dict[str, Any] | None]:
        """Per key, ``{"position": shard-local position, "vector": float32 vector or None}`` (and
        ``"tokens"`` with ``with_tokens``), or None where this shard does not hold it."""
        ...

    def tokens_of_key(self, key: str) -> LocalTokens | None:
        """The stored local tokens of ``key`` (None where this shard does not hold it)."""
        ...

    def thumbnail(self, key: str, px: int) -> bytes | None:
        """A JPEG of ``key``'s image, longer side ``px``, made here (only the JPEG travels); None
        where this shard does not hold the key."""
        ...

    def vectors_of_rows(self, rows: np.ndarray) -> np.ndarray:
        """The float32 vectors of this shard's row ids ``rows`` (C,) -> (C, d)."""
        ...

    def rescore(self, xq: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Exact scores (nq, C) of (nq, d) queries with this shard's rows (nq, C), -inf for -1."""
        ...

    def max_tokens(self) -> int:
        """The most tokens any of this shard's rows has."""
        ...

    def score_shortlists(
        self,
        conf: RerankConfig,
        shortlists: list[np.ndarray],
        s_global: list[np.ndarray],
        tokens: list[LocalTokens | None],
        k: int,
        evidence: bool = True,
    ) -> list[dict[str, Any] | None]:
        """Per query, this shard's members of its shortlist (row ids, global scores) scored against
        their stored tokens with the query's ``tokens`` and ``conf``: ``{"raw", "has_locals",
        "inliers", "chamfer", "evidence": {member: evidence}}``, the evidence (with ``evidence``) of the
        members that can reach the query's top k; None where it has none."""
        ...

    def evidence_of(self, conf: RerankConfig, rows: np.ndarray, query: LocalTokens) -> list[dict[str, Any] | None]:
        """The match evidence of each of ``rows`` (a member the coordinator placed in the top k
        without its evidence)."""
        ...

    def glue_matches(self, conf: RerankConfig, rows: np.ndarray, query: LocalTokens) -> np.ndarray:
        """The second verification's expected matches (rerank/glue.py) of ``query`` with this
        shard's ``rows``, made here from their stored tokens."""
        ...


class ReplicaFailed(RuntimeError):
    """A replica that cannot answer (its actor died or is restarting)."""


class ShardBackend(Protocol):
    """Calls to shard replicas: ``submit`` returns a handle, ``wait`` the handles done when all are
    or ``timeout`` seconds have passed, ``result`` a done handle's value (ReplicaFailed where the
    replica died), ``abandon`` the handles a request stopped waiting for."""

    replicas: list[int]  # replicas of each shard

    def submit(self, shard: int, replica: int, method: str, *args: Any) -> Any: ...
    def wait(self, handles: list[Any], timeout: float) -> list[Any]: ...
    def result(self, handle: Any) -> Any: ...
    def abandon(self, handles: list[Any]) -> None: ...  # calls no longer waited for (hung, or hedged and beaten)


def replica_health(backend: ShardBackend, names: list[str], timeout: float) -> dict[str, Any]:
    """Every replica's state (ready with its node, or unreachable within ``timeout`` seconds) of
    the shards ``names``, and ``ok``: whether every shard has a live replica."""
    handles = {
        backend.submit(s, r, ShardCalls.info.__name__): (s, r)
        for s in range(len(names))
        for r in range(backend.replicas[s])
    }
    deadline, done = time.monotonic() + timeout, set[Any]()
    while len(done) < len(handles) and time.monotonic() < deadline:
        finished = backend.wait([h for h in handles if h not in done], deadline - time.monotonic())
        if not finished:
            break
        done.update(finished)
    replicas = []
    for handle, (s, r) in handles.items():
        entry = {"shard": names[s], "replica": r, "status": "unreachable", "node": None}
        if handle in done:
            try:
                info = backend.result(handle)
                entry.update(status="ready", node=info["node"])
            except ReplicaFailed:
                pass
        replicas.append(entry)
    live = {e["shard"] for e in replicas if e["status"] == "ready"}
    unavailable = [name for name in names if name not in live]
    return {"ok": not unavailable, "unavailable_shards": unavailable, "replicas": replicas}


@dataclass
class Traffic:
    """Bytes of the typed messages (shards/messages.py) sent to and received from the shards:
    what the wire carries, counted only while ``count`` is set. A backend with a wire counts them
    as they are sent and read (cluster/ray_shards.py: a call to an actor carrying several shards'
    calls counts once); for one without (shards/local_shards.py), the coordinator counts what
    each call's message would be."""

    count: bool = False
    sent: int = 0
    received: int = 0
    calls: int = 0  # messages sent
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, sent: int = 0, received: int = 0, calls: int = 0) -> None:
        with self.lock:
            self.sent += sent
            self.received += received
            self.calls += calls
