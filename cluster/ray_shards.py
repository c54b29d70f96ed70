"""Shard actors on a Ray cluster, placed on purpose, and the coordinator's Ray backend.

``start_shard_actors`` starts ``replicas`` actors per shard with ``scheduling_strategy="SPREAD"``
(across nodes), ``memory=`` the shard's bytes from the top-level infos (its files: what it maps),
``max_concurrency`` concurrent calls each, and ``max_restarts=-1``: a dead actor is restarted,
wherever Ray places it, and stages its shard again (from its node's cache where it has one).
Calls are reads, so they may be retried: with one replica a call waits for the restart
(``max_task_retries=-1``, bounded by the coordinator's timeout); with several, a call to a dead
replica fails at once (``max_task_retries=0``) and goes to the next replica.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from cluster.coordinator import ReplicaFailed, ShardsUnavailable
from cluster.shard_actor import ShardActor
from cluster.staging import StageConfig
from ingest.source_images import SourceImagesConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardPlacement:
    replicas: int = 1  # actors per shard; requests are spread over them
    concurrency: int = 4  # concurrent calls per actor (its max_concurrency)
    cpus: float | None = None  # CPUs reserved per actor; None: the cluster's CPUs shared among all actors (at most 1)
    reserve_memory: bool = True  # reserve the shard's bytes (its files) as the actor's Ray memory resource
    stage_timeout: float = 1800.0  # seconds to wait for every actor to stage its shard and report ready


class RayShards:
    """A ShardBackend over Ray actor handles ``[shard][replica]``."""

    def __init__(self, actors: list[list[Any]]):
        self.actors = actors
        self.replicas = [len(a) for a in actors]

    def submit(self, shard: int, replica: int, method: str, *args: Any) -> Any:
        return getattr(self.actors[shard][replica], method).remote(*args)

    def wait(self, handles: list[Any], timeout: float) -> list[Any]:
        import ray

        # one wait for all: a failed call is done at once, so only a hung one holds it to the timeout
        done, _ = ray.wait(handles, num_returns=len(handles), timeout=timeout)
        return done

    def result(self, handle: Any) -> Any:
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        try:
            return ray.get(handle)
        except (RayActorError, ActorDiedError, ActorUnavailableError) as exc:
            raise ReplicaFailed(str(exc).splitlines()[0]) from exc


def start_shard_actors(
    source: str,
    infos: dict[str, Any],
    stage: StageConfig,
    placement: ShardPlacement,
    images: SourceImagesConfig | None = None,
) -> list[list[Any]]:
    """``placement.replicas`` ShardActors per shard of the index at ``source``, spread over the
    nodes, each staging its shard to its node's disk; returns the handles [shard][replica]."""
    import ray

    if placement.replicas < 1 or placement.concurrency < 1:
        from core.errors import NeedleInputError

        raise NeedleInputError(
            f"--shard-replicas and --shard-concurrency must be at least 1, got {placement.replicas}, "
            f"{placement.concurrency}"
        )
    entries = infos["shards"]
    cpus = placement.cpus
    if cpus is None:
        cpus = min(1.0, ray.cluster_resources().get("CPU", 1) / (len(entries) * placement.replicas))
    actor_cls = ray.remote(ShardActor)
    actors = []
    for entry in entries:
        options = {
            "num_cpus": cpus,
            "scheduling_strategy": "SPREAD",
            "max_restarts": -1,
            "max_task_retries": -1 if placement.replicas == 1 else 0,
            "max_concurrency": placement.concurrency,
        }
        if placement.reserve_memory:
            options["memory"] = max(1, int(entry["bytes"]))
        actors.append(
            [
                actor_cls.options(**options).remote(source, entry["name"], stage, replica, entry, images)
                for replica in range(placement.replicas)
            ]
        )
    return actors


def wait_ready(actors: list[list[Any]], names: list[str], timeout: float) -> list[dict[str, Any]]:
    """Every actor's ``info()`` once it has staged its shard, or ShardsUnavailable naming the
    shards not ready within ``timeout`` seconds (a staging error is raised as it is)."""
    import ray

    start = time.monotonic()
    refs = {actor.info.remote(): s for s, replicas in enumerate(actors) for actor in replicas}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
    if pending:
        raise ShardsUnavailable(sorted({names[refs[r]] for r in pending}), f"staging within {timeout:.0f} s")
    infos = ray.get(ready)
    log.info("%d shard actors ready in %.1f s", len(infos), time.monotonic() - start)
    return infos
