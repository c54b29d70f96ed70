"""Shard actors on a Ray cluster, placed on purpose, and the coordinator's Ray backend.

``start_shard_actors`` starts ``replicas`` actors per group of ``shards_per_actor`` consecutive
shards (cluster/shard_group.py; one shard per actor by default) with
``scheduling_strategy="SPREAD"`` (across nodes), ``memory=`` its shards' bytes from the top-level
infos (their files: what it maps), ``max_concurrency`` concurrent calls each, and
``max_restarts=-1``: a dead actor is restarted, wherever Ray places it, and stages its shards again
(from its node's cache where it has one). The backend sends the calls a request makes to the
shards of one actor as one Ray call.
Calls are reads, so they may be retried: with one replica a call waits for the restart
(``max_task_retries=-1``, bounded by the coordinator's timeout); with several, a call to a dead
replica fails at once (``max_task_retries=0``) and goes to the next replica.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any

from cluster.coordinator import ReplicaFailed, ShardsUnavailable
from cluster.shard_group import ShardGroup
from cluster.staging import StageConfig
from ingest.source_images import SourceImagesConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardPlacement:
    replicas: int = 1  # actors per shard group; requests are spread over them
    concurrency: int = 4  # concurrent calls per actor (its max_concurrency)
    cpus: float | None = None  # CPUs reserved per actor (its members' threads: whole CPUs, >= 1); None: a share, <= 1
    reserve_memory: bool = True  # reserve the shards' bytes (their files) as the actor's Ray memory resource
    stage_timeout: float = 1800.0  # seconds to wait for every actor to stage its shards and report ready
    shards_per_actor: int = 1  # consecutive shards served by one actor (one Ray call per group and request)


def shard_groups(n_shards: int, shards_per_actor: int) -> list[list[int]]:
    """The shards of each actor: consecutive runs of ``shards_per_actor``."""
    size = max(1, shards_per_actor)
    return [list(range(start, min(start + size, n_shards))) for start in range(0, n_shards, size)]


class GroupBatch:
    """One Ray call to a group actor, carrying several shard calls; its answers decoded once."""

    def __init__(self, ref: Any):
        self.ref = ref
        self.answers: list[tuple[str, Any]] | None = None

    def decoded(self) -> list[tuple[str, Any]]:
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        if self.answers is None:
            try:
                self.answers = pickle.loads(ray.get(self.ref))
            except (RayActorError, ActorDiedError, ActorUnavailableError) as exc:
                raise ReplicaFailed(str(exc).splitlines()[0]) from exc
        return self.answers


@dataclass(eq=False)  # a handle: hashed by identity
class GroupCall:
    """A shard's call, answered by its group's Ray call (several shards' calls share one)."""

    group: int
    member: int
    replica: int
    batch: GroupBatch | None = None  # the Ray call that carries it, once sent
    slot: int = 0  # its place among the batch's calls


class RayShards:
    """A ShardBackend over ShardGroup actors ``[group][replica]`` (cluster/shard_group.py): the
    calls submitted to one actor before a wait go as one Ray call (arguments and answers pickled
    in one bytes object each way)."""

    def __init__(self, actors: list[list[Any]], groups: list[list[int]] | None = None):
        self.actors = actors
        self.groups = groups if groups is not None else [[g] for g in range(len(actors))]
        if len(self.groups) != len(actors):
            raise ValueError(f"{len(actors)} shard actors for {len(self.groups)} shard groups")
        self.of_shard = {shard: (g, m) for g, shards in enumerate(self.groups) for m, shard in enumerate(shards)}
        self.replicas = [len(actors[self.of_shard[s][0]]) for s in range(len(self.of_shard))]
        self._unsent: list[tuple[GroupCall, str, tuple]] = []
        self._lock = threading.Lock()
        self.ray_calls = 0  # Ray calls sent (the calls of a wait to one actor count once)

    def submit(self, shard: int, replica: int, method: str, *args: Any) -> GroupCall:
        group, member = self.of_shard[shard]
        call = GroupCall(group, member, replica)
        with self._lock:
            self._unsent.append((call, method, args))
        return call

    def send(self) -> None:
        """One Ray call per (group, replica, method) among the calls not sent yet (of this
        request, and of any other thread's submitted meanwhile). Under the lock throughout: when
        it returns, every call submitted before has its batch."""
        with self._lock:
            batches: dict[tuple[int, int, str], list[tuple[GroupCall, tuple]]] = {}
            for call, method, args in self._unsent:
                batches.setdefault((call.group, call.replica, method), []).append((call, args))
            self._unsent = []
            self.ray_calls += len(batches)
            for (group, replica, method), calls in batches.items():
                packed = pickle.dumps((method, [(c.member, args) for c, args in calls]), protocol=5)
                batch = GroupBatch(self.actors[group][replica].run.remote(packed))
                for slot, (call, _) in enumerate(calls):
                    call.batch, call.slot = batch, slot

    def wait(self, handles: list[GroupCall], timeout: float) -> list[GroupCall]:
        import ray

        self.send()
        refs = list(dict.fromkeys(h.batch.ref for h in handles))
        # one wait for all: a failed call is done at once, so only a hung one holds it to the timeout
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        finished = set(done)
        return [h for h in handles if h.batch.ref in finished]

    def result(self, handle: GroupCall) -> Any:
        if handle.batch is None:
            self.send()
        status, value = handle.batch.decoded()[handle.slot]
        if status == "error":
            raise value
        return value


def start_shard_actors(
    source: str,
    infos: dict[str, Any],
    stage: StageConfig,
    placement: ShardPlacement,
    images: SourceImagesConfig | None = None,
) -> list[list[Any]]:
    """``placement.replicas`` ShardGroup actors per group of ``placement.shards_per_actor`` shards
    of the index at ``source``, spread over the nodes, each staging its shards to its node's disk;
    returns the handles [group][replica]."""
    import ray

    if placement.replicas < 1 or placement.concurrency < 1 or placement.shards_per_actor < 1:
        from core.errors import NeedleInputError

        raise NeedleInputError(
            "--shard-replicas, --shard-concurrency and --shards-per-actor must be at least 1, got "
            f"{placement.replicas}, {placement.concurrency}, {placement.shards_per_actor}"
        )
    entries = infos["shards"]
    groups = shard_groups(len(entries), placement.shards_per_actor)
    cpus = placement.cpus
    if cpus is None:
        cpus = min(1.0, ray.cluster_resources().get("CPU", 1) / (len(groups) * placement.replicas))
    threads = max(1, int(cpus))  # members searching at once: no more than the CPUs reserved
    actor_cls = ray.remote(ShardGroup)
    actors = []
    for shards in groups:
        members = [entries[s] for s in shards]
        options = {
            "num_cpus": cpus,
            "scheduling_strategy": "SPREAD",
            "max_restarts": -1,
            "max_task_retries": -1 if placement.replicas == 1 else 0,
            "max_concurrency": placement.concurrency,
        }
        if placement.reserve_memory:
            options["memory"] = max(1, sum(int(e["bytes"]) for e in members))
        actors.append(
            [
                actor_cls.options(**options).remote(source, members, stage, replica, images, threads)
                for replica in range(placement.replicas)
            ]
        )
    return actors


def wait_ready(
    actors: list[list[Any]], names: list[str], timeout: float, groups: list[list[int]] | None = None
) -> list[dict[str, Any]]:
    """Every shard replica's ``info()`` once its actor has staged its shards, or ShardsUnavailable
    naming the shards not ready within ``timeout`` seconds (a staging error is raised as it is)."""
    import ray

    groups = groups if groups is not None else [[g] for g in range(len(actors))]
    start = time.monotonic()
    refs = {actor.info.remote(): g for g, replicas in enumerate(actors) for actor in replicas}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
    if pending:
        missing = sorted({names[s] for r in pending for s in groups[refs[r]]})
        raise ShardsUnavailable(missing, f"staging within {timeout:.0f} s")
    infos = [info for infos in ray.get(ready) for info in infos]
    log.info("%d shard replicas in %d actors ready in %.1f s", len(infos), len(refs), time.monotonic() - start)
    return infos
