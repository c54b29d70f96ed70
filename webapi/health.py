"""``GET /health``: the served index's size, dimension, shards, kind and generation, and with shards
in Ray every replica's state (a fan-out to each replica, waiting up to 5 s).

Why a cache and the gate: a health check of shards served elsewhere costs a call to every replica,
on the same worker threads as searches. Ungated, a client sending health checks in a loop could
keep those threads busy; uncached, every probe pays the fan-out. So an answer is kept for
``HEALTH_MAX_AGE`` s (and for the generation it describes: a new generation is reported at
once, which ``needle index ... --wait-for`` waits on), and a fresh one is made under the same
gate as searches (``--max-inflight``, ``--max-queue``, ``--queue-timeout``: webapi.guard.Gate),
one at a time; probes arriving meanwhile share it. A server busier than its queue answers a
stale probe 503 with Retry-After, as it answers a search.

Under Ray Serve with several replicas (``replicas``: cluster.generation_board's view of each
replica's generation) ``"generation"`` is the minimum over the live replicas, null while one is
still opening the index, and ``"serve_replicas"`` maps each replica's id to its generation: a
probe answered by any replica then tells what every replica serves (``--wait-for`` waits on it).
Where that view cannot be read the answer is a 503, never one replica's generation alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from query.index_protocol import Index
from webapi.guard import Gate, busy_message
from webapi.http_errors import json_response
from webapi.limits import retry_after

HEALTH_MAX_AGE = 1.0  # seconds an answer is reused for the same generation

# this replica's generation -> every live Serve replica's (None: still opening the index)
ReplicaGenerations = Callable[[int], dict[str, int | None]]


class ReplicaStateUnavailable(RuntimeError):
    """The generations of the other Serve replicas cannot be read: /health cannot vouch for them."""


def health_answer(index: Index, replicas: ReplicaGenerations | None = None) -> tuple[int, dict[str, Any]]:
    """(status, body) of /health: the index's size, dimension, shards and kind, and the replicas'
    state where the shards are served elsewhere (503 when a shard has no live replica); with
    ``replicas``, the generation every Serve replica serves (503 where that cannot be read)."""
    infos = index.infos
    shards = len(infos["shard_segments"])  # a generation view's (index.generation.GenerationView.as_infos)
    out: dict[str, Any] = {"ntotal": index.ntotal, "d": index.d, "shards": shards, "kind": infos.get("kind")}
    out["generation"] = int(infos.get("generation", 0))  # the generation served (docs/live_index.md)
    out["index_id"] = infos.get("index_id")  # which index (None: built before index ids): --wait-for checks it
    shard_state = index.health()  # {} in one process: every shard is here
    out.update(shard_state)
    status = 200 if shard_state.get("ok", True) else 503
    if replicas is not None:
        try:
            served = replicas(out["generation"])
        except ReplicaStateUnavailable as exc:
            return 503, {**out, "generation": None, "error": str(exc)}
        known = [g for g in served.values() if g is not None]
        out["generation"] = min(known) if len(known) == len(served) else None  # None: one is opening
        out["serve_replicas"] = served
    return status, out


class HealthCache:
    """The last /health answer, its time and generation; one refresh at a time, under ``gate``."""

    def __init__(
        self, index: Index, gate: Gate, max_age: float = HEALTH_MAX_AGE, replicas: ReplicaGenerations | None = None
    ):
        self.index, self.gate, self.max_age, self.replicas = index, gate, max_age, replicas
        self.answer: tuple[int, dict[str, Any]] | None = None
        self.at = 0.0
        self.lock = asyncio.Lock()  # made on first use's loop (Python 3.10+ binds it lazily)
        self.refreshes = 0  # answers made (not reused): what the cache saves is visible in tests

    def fresh(self) -> tuple[int, dict[str, Any]] | None:
        """The cached answer if younger than ``max_age`` and of the generation served now."""
        if self.answer is None or time.monotonic() - self.at > self.max_age:
            return None
        # with replicas the answer's generation is their minimum: while another replica lags this
        # one (or opens the index) every probe asks the board again, so --wait-for sees it catch up
        return self.answer if self.answer[1]["generation"] == int(self.index.infos.get("generation", 0)) else None

    async def respond(self) -> Response:
        cached = self.fresh()
        if cached is None:
            async with self.lock:
                cached = self.fresh()  # made while this one waited
                if cached is None:
                    if not await self.gate.acquire():
                        return busy(self.gate)
                    try:
                        cached = await run_in_threadpool(self.make)
                    finally:
                        self.gate.release()
        return json_response(*cached)

    def make(self) -> tuple[int, dict[str, Any]]:
        with self.index.pinned():  # one generation's figures
            answer = health_answer(self.index, self.replicas)
        self.answer, self.at, self.refreshes = answer, time.monotonic(), self.refreshes + 1
        return answer


def busy(gate: Gate) -> Response:
    """The 503 of a health check the gate had no slot for (the body a refused search gets)."""
    return json_response(503, {"error": busy_message(gate), "limit": "max_inflight"}, {"Retry-After": retry_after(1)})


def add_health(app: FastAPI, index: Index, gate: Gate, replicas: ReplicaGenerations | None = None) -> HealthCache:
    cache = HealthCache(index, gate, replicas=replicas)

    @app.get("/health", summary="index size, dimension, shards, kind, generation (and each shard replica's state)")
    async def health() -> Response:
        return await cache.respond()

    return cache
