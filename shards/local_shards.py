"""A ShardBackend without Ray: ShardActor objects in this process, called from a thread pool, with
replicas that can be made to fail (``down``) or hang (``slow``): the coordinator's merge, routing,
failover, hedging and partial answers are tested against the single index with it."""

from __future__ import annotations

import time
from typing import Any

from shards.calls import ReplicaFailed


class LocalShards:
    """A ShardBackend over ShardActor objects in this process (tests, and an index searched
    without Ray): each call runs in a thread pool; ``down`` marks replicas as dead."""

    def __init__(self, actors: list[list[Any]], workers: int = 8):
        from concurrent.futures import ThreadPoolExecutor

        self.actors = actors  # [shard][replica]
        self.replicas = [len(a) for a in actors]
        self.down: set[tuple[int, int]] = set()  # (shard, replica) that fail like a dead actor
        self.slow: dict[tuple[int, int], float] = {}  # (shard, replica) -> seconds each call hangs first
        self.pool = ThreadPoolExecutor(workers)

    def submit(self, shard: int, replica: int, method: str, *args: Any) -> Any:
        def run() -> Any:
            if (shard, replica) in self.slow:
                time.sleep(self.slow[shard, replica])
            if (shard, replica) in self.down:
                raise ReplicaFailed(f"replica {replica} of shard {shard} is down")
            return getattr(self.actors[shard][replica], method)(*args)

        return self.pool.submit(run)

    def wait(self, handles: list[Any], timeout: float) -> list[Any]:
        from concurrent.futures import wait as wait_futures

        done, _ = wait_futures(handles, timeout)
        return list(done)

    def result(self, handle: Any) -> Any:
        return handle.result()

    def abandon(self, handles: list[Any]) -> None:
        for handle in handles:
            handle.cancel()  # a call not started yet is dropped; one running finishes unread
