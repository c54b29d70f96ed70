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
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from query.index_protocol import Index
from webapi.guard import Gate, busy_message
from webapi.http_errors import json_response
from webapi.limits import retry_after

HEALTH_MAX_AGE = 1.0  # seconds an answer is reused for the same generation


def health_answer(index: Index) -> tuple[int, dict[str, Any]]:
    """(status, body) of /health: the index's size, dimension, shards and kind, and the replicas'
    state where the shards are served elsewhere (503 when a shard has no live replica)."""
    infos = index.infos
    shards = len(infos["shard_segments"])  # a generation view's (index.generation.GenerationView.as_infos)
    out: dict[str, Any] = {"ntotal": index.ntotal, "d": index.d, "shards": shards, "kind": infos.get("kind")}
    out["generation"] = int(infos.get("generation", 0))  # the generation served (docs/live_index.md)
    out["index_id"] = infos.get("index_id")  # which index (None: built before index ids): --wait-for checks it
    replicas = index.health()  # {} in one process: every shard is here
    out.update(replicas)
    return (200 if replicas.get("ok", True) else 503), out


class HealthCache:
    """The last /health answer, its time and generation; one refresh at a time, under ``gate``."""

    def __init__(self, index: Index, gate: Gate, max_age: float = HEALTH_MAX_AGE):
        self.index, self.gate, self.max_age = index, gate, max_age
        self.answer: tuple[int, dict[str, Any]] | None = None
        self.at = 0.0
        self.lock = asyncio.Lock()  # made on first use's loop (Python 3.10+ binds it lazily)
        self.refreshes = 0  # answers made (not reused): what the cache saves is visible in tests

    def fresh(self) -> tuple[int, dict[str, Any]] | None:
        """The cached answer if younger than ``max_age`` and of the generation served now."""
        if self.answer is None or time.monotonic() - self.at > self.max_age:
            return None
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
            answer = health_answer(self.index)
        self.answer, self.at, self.refreshes = answer, time.monotonic(), self.refreshes + 1
        return answer


def busy(gate: Gate) -> Response:
    """The 503 of a health check the gate had no slot for (the body a refused search gets)."""
    return json_response(503, {"error": busy_message(gate), "limit": "max_inflight"}, {"Retry-After": retry_after(1)})


def add_health(app: FastAPI, index: Index, gate: Gate) -> HealthCache:
    cache = HealthCache(index, gate)

    @app.get("/health", summary="index size, dimension, shards, kind, generation (and each shard replica's state)")
    async def health() -> Response:
        return await cache.respond()

    return cache
