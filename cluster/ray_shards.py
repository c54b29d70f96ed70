"""Shard actors on a Ray cluster, placed on purpose, and the coordinator's Ray backend.

``start_shard_actors`` starts ``replicas`` actors per group of ``shards_per_actor`` consecutive
shards (shards/shard_group.py; one shard per actor by default) with
``scheduling_strategy="SPREAD"`` (across nodes), ``memory=`` its shards' bytes from the top-level
infos (their files: what it maps), ``max_concurrency`` concurrent calls each, and
``max_restarts=-1``: a dead actor is restarted, wherever Ray places it, and stages its shards again
(from its node's cache where it has one). The backend sends the calls a request makes to the
shards of one actor as one call, a typed message (shards/wire.py: no pickle): on the actor's
direct channel (shards/direct.py; its endpoint and key asked of the actor through Ray), or as a
Ray call where the actor has no channel (not yet, ``--shard-transport ray``, or after its channel
failed: the call then goes again through Ray, to the same actor).
Calls are reads, so they may be retried: with one replica a Ray call waits for the restart
(``max_task_retries=-1``, bounded by the coordinator's timeout); with several, a call to a dead
replica fails at once (``max_task_retries=0``) and goes to the next replica.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from ingest.source_images import SourceImagesConfig
from shards.calls import ReplicaFailed
from shards.coordinator import ShardsUnavailable, Traffic
from shards.direct import ChannelError, DirectCall, DirectChannel, readable
from shards.messages import pack_request, unpack_answers
from shards.shard_group import ShardGroup
from shards.staging import StageConfig
from shards.wire import WireError

log = logging.getLogger(__name__)

CHANNEL_RETRY_S = 2.0  # after a direct channel failed, its actor's endpoint is asked again after this long
MIXED_POLL_S = 0.002  # while both direct and Ray calls are pending, each is checked in turns this long


@dataclass(frozen=True)
class ShardPlacement:
    replicas: int = 1  # actors per shard group; requests are spread over them
    concurrency: int = 4  # concurrent calls per actor (its max_concurrency)
    cpus: float | None = None  # CPUs reserved per actor (its members' threads: whole CPUs, >= 1); None: a share, <= 1
    reserve_memory: bool = True  # reserve the shards' bytes (their files) as the actor's Ray memory resource
    stage_timeout: float = 1800.0  # seconds to wait for every actor to stage its shards and report ready
    shards_per_actor: int = 1  # consecutive shards served by one actor (one Ray call per group and request)
    # sets of shard actors alive at once: 2 while serving follows the index's generations (the next
    # generation's set starts before the last one stops), so the default CPU share leaves room for both
    sets: int = 1


def shard_groups(n_shards: int, shards_per_actor: int) -> list[list[int]]:
    """The shards of each actor: consecutive runs of ``shards_per_actor``."""
    size = max(1, shards_per_actor)
    return [list(range(start, min(start + size, n_shards))) for start in range(0, n_shards, size)]


def actor_groups(infos: dict[str, Any], shards_per_actor: int) -> list[list[int]]:
    """The entries of ``infos["shards"]`` each actor serves: of a generation (index.generation.
    GenerationView.as_infos), every segment of ``shards_per_actor`` consecutive shards, so that a shard's
    segments live in one actor with its rows; of an index as built, ``shard_groups``."""
    segments = infos.get("shard_segments")
    if not segments:
        return shard_groups(len(infos["shards"]), shards_per_actor)
    return [[entry for shard in group for entry in shard] for group in shard_groups_of(segments, shards_per_actor)]


def shard_groups_of(items: list[list[int]], size: int) -> list[list[list[int]]]:
    size = max(1, size)
    return [items[start : start + size] for start in range(0, len(items), size)]


class GroupBatch:
    """One call to a group actor carrying several shard calls, over its direct channel
    (shards/direct.py) or as a Ray call; its answers decoded once. A direct call whose connection
    fails goes again as a Ray call to the same actor (which waits for a restarting actor)."""

    def __init__(self, shards: RayShards, group: int, replica: int, packed: bytes):
        # the backend (for the actor handle, its channel's failures and the Ray call count)
        self.shards = shards
        self.group, self.replica = group, replica
        self.packed = packed
        self.direct: DirectCall | None = None  # the call in flight on the channel
        self.ref: Any = None  # the Ray call, where it went (or went again) through Ray
        self.ready = False  # the Ray call's result can be taken without waiting
        self.answers: list[tuple[str, Any]] | None = None
        self._lock = threading.Lock()  # calls of several requests share a batch: one thread receives

    @property
    def actor(self) -> Any:
        return self.shards.actors[self.group][self.replica]

    def start(self, channel: DirectChannel | None) -> None:
        if channel is not None:
            try:
                self.direct = channel.send(self.packed)
                return
            except ChannelError as exc:
                self.shards.channel_failed(self.group, self.replica, channel, exc)
        self.through_ray()

    def through_ray(self) -> None:
        self.direct = None
        self.ref = self.actor.run.remote(self.packed)
        self.shards.ray_calls += 1

    @property
    def done(self) -> bool:
        return self.answers is not None or self.ready

    def receive(self, deadline: float | None) -> None:
        """The direct reply, read once (the readable socket may be seen by several threads); by
        ``deadline`` (None: however long it takes, as ``ray.get``)."""
        with self._lock:
            if self.direct is None:
                return
            try:
                timeout = None if deadline is None else deadline - time.monotonic()
                message = self.direct.receive(timeout)
                self.shards.count_received(message)
                self.answers = unpack_answers(message)
                self.direct = None
            except (ChannelError, WireError) as exc:  # a reply that is not one: the channel is not trusted again
                self.shards.channel_failed(self.group, self.replica, self.direct.channel, exc)
                self.through_ray()

    def abandon(self) -> DirectChannel | None:
        """Close the direct call's connection if it is still waiting for its reply (its channel
        then). Another request's calls may share this batch: if one still waits, the batch goes
        again through Ray then (``resend_if_abandoned``)."""
        with self._lock:
            if self.direct is None:
                return None
            call, self.direct = self.direct, None
            call.close()
            return call.channel

    def resend_if_abandoned(self) -> None:
        with self._lock:
            if self.direct is None and self.ref is None and self.answers is None:
                self.through_ray()

    def decoded(self) -> list[tuple[str, Any]]:
        if self.answers is not None:  # read already (every call of the batch asks)
            return self.answers
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        if self.answers is None and self.direct is not None:
            self.receive(None)
        self.resend_if_abandoned()
        if self.answers is None:
            try:
                message = ray.get(self.ref)
            except (RayActorError, ActorDiedError, ActorUnavailableError) as exc:
                raise ReplicaFailed(str(exc).splitlines()[0]) from exc
            self.shards.count_received(message)
            self.answers = unpack_answers(message)
        return self.answers


@dataclass(eq=False)  # a handle: hashed by identity
class GroupCall:
    """A shard's call, answered by its group's batch (several shards' calls share one)."""

    group: int
    member: int
    replica: int
    batch: GroupBatch | None = None  # the call that carries it, once sent
    slot: int = 0  # its place among the batch's calls


class RayShards:
    """A ShardBackend over ShardGroup actors ``[group][replica]`` (shards/shard_group.py): the
    calls submitted to one actor before a wait go as one call (arguments and answers in one typed
    message each way, shards/wire.py: no pickle), over the actor's direct channel where ``direct`` (each actor's
    endpoint asked of it through Ray once, and again after the channel failed) and as a Ray call
    where there is no channel (yet)."""

    def __init__(self, actors: list[list[Any]], groups: list[list[int]] | None = None, direct: bool = True):
        self.actors = actors
        self.groups = groups if groups is not None else [[g] for g in range(len(actors))]
        if len(self.groups) != len(actors):
            raise ValueError(f"{len(actors)} shard actors for {len(self.groups)} shard groups")
        self.of_shard = {shard: (g, m) for g, shards in enumerate(self.groups) for m, shard in enumerate(shards)}
        self.replicas = [len(actors[self.of_shard[s][0]]) for s in range(len(self.of_shard))]
        self.direct = direct
        self._unsent: list[tuple[GroupCall, str, tuple]] = []
        self._lock = threading.RLock()  # re-entered where a send finds a channel failed
        self._channels: dict[tuple[int, int], DirectChannel] = {}
        self._asked: dict[tuple[int, int], Any] = {}  # (group, replica) -> the Ray call for its endpoint
        self._failed: dict[tuple[int, int], float] = {}  # (group, replica) -> when its channel failed
        self.traffic = Traffic()  # bytes of the messages sent and read, while its ``count`` is set
        self.calls = 0  # calls sent to actors (the calls of a wait to one actor count once)
        self.ray_calls = 0  # of which went through Ray (no channel, or again after the channel failed)
        if direct:
            for group, replicas in enumerate(actors):
                for replica in range(len(replicas)):
                    self.ask_endpoint(group, replica)

    def close(self) -> None:
        """Close the channels and stop the actors (a generation no request uses any more)."""
        import ray

        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
        for replicas in self.actors:
            for actor in replicas:
                ray.kill(actor, no_restart=True)

    def ask_endpoint(self, group: int, replica: int) -> None:
        self._asked[group, replica] = self.actors[group][replica].endpoint.remote()

    def channels_open(self) -> int:
        """Actors whose calls go over their direct channel now."""
        return len(self._channels)

    def open_channels(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for every actor's endpoint (so that the first requests go
        direct too); returns the number of channels open."""
        import ray

        if self._asked:
            ray.wait(list(self._asked.values()), num_returns=len(self._asked), timeout=timeout)
        with self._lock:
            for group, replicas in enumerate(self.actors):
                for replica in range(len(replicas)):
                    self.channel(group, replica)
            return self.channels_open()

    def channel(self, group: int, replica: int) -> DirectChannel | None:
        """The actor's channel, once its endpoint has come (never waiting for it: until then its
        calls go through Ray). After a failure the endpoint is asked again (a restarted actor
        listens elsewhere) once ``CHANNEL_RETRY_S`` has passed."""
        import ray

        at = (group, replica)
        if not self.direct or at in self._channels:
            return self._channels.get(at)
        if at not in self._asked:
            if time.monotonic() - self._failed.get(at, -CHANNEL_RETRY_S) < CHANNEL_RETRY_S:
                return None
            self.ask_endpoint(group, replica)
        ref = self._asked[at]
        if not ray.wait([ref], timeout=0)[0]:
            return None
        del self._asked[at]
        try:
            self._channels[at] = DirectChannel(ray.get(ref))
        except Exception as exc:  # the actor died meanwhile: ask its restarted self later
            self._failed[at] = time.monotonic()
            log.warning("shard group %d replica %d: no direct channel (%s); Ray carries its calls", group, replica, exc)
        return self._channels.get(at)

    def channel_failed(self, group: int, replica: int, channel: DirectChannel, exc: Exception) -> None:
        """Forget the actor's ``channel``, which failed (its calls go through Ray until the
        endpoint is asked again); nothing where the actor's channel is already another one (a call
        of the old channel failing after a restarted actor's new channel opened)."""
        with self._lock:
            if self._channels.get((group, replica)) is not channel:
                return
            del self._channels[group, replica]
            self._failed[group, replica] = time.monotonic()
        log.warning("shard group %d replica %d: direct channel failed (%s); through Ray", group, replica, exc)
        channel.close()

    def submit(self, shard: int, replica: int, method: str, *args: Any) -> GroupCall:
        group, member = self.of_shard[shard]
        call = GroupCall(group, member, replica)
        with self._lock:
            self._unsent.append((call, method, args))
        return call

    def send(self) -> None:
        """One call per (group, replica, method) among the calls not sent yet (of this request,
        and of any other thread's submitted meanwhile). Under the lock throughout: when it
        returns, every call submitted before has its batch."""
        with self._lock:
            batches: dict[tuple[int, int, str], list[tuple[GroupCall, tuple]]] = {}
            for call, method, args in self._unsent:
                batches.setdefault((call.group, call.replica, method), []).append((call, args))
            self._unsent = []
            self.calls += len(batches)
            for (group, replica, method), calls in batches.items():
                packed = pack_request(method, [(c.member, args) for c, args in calls])
                if self.traffic.count:
                    self.traffic.add(sent=len(packed), calls=1)
                batch = GroupBatch(self, group, replica, packed)
                for slot, (call, _) in enumerate(calls):
                    call.batch, call.slot = batch, slot
                batch.start(self.channel(group, replica))

    def count_received(self, message: bytes | bytearray | memoryview) -> None:
        if self.traffic.count:
            self.traffic.add(received=len(message))

    def wait(self, handles: list[GroupCall], timeout: float) -> list[GroupCall]:
        """The handles done within ``timeout`` seconds: direct replies read as they come, Ray calls
        waited for together (while both are pending, each in short turns)."""
        import ray

        self.send()
        deadline = time.monotonic() + timeout
        batches = list(dict.fromkeys(h.batch for h in handles))
        while True:
            for batch in batches:  # another request gave up on a batch these calls share
                batch.resend_if_abandoned()
            # a snapshot: another thread may receive (or give up on) a shared batch meanwhile
            receiving = {id(call): (b, call) for b in batches if (call := b.direct) is not None}
            remote = [b for b in batches if b.ref is not None and b.answers is None and not b.ready]
            left = deadline - time.monotonic()
            if not (receiving or remote) or left <= 0:
                break
            if receiving:
                waiting = [call for _, call in receiving.values()]
                for call in readable(waiting, min(left, MIXED_POLL_S) if remote else left):
                    receiving[id(call)][0].receive(deadline)
            if remote:
                refs = [b.ref for b in remote]
                # one wait for all: a failed call is done at once, so only a hung one holds it to the timeout
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=0 if receiving else left)
                finished = set(done)
                for b in remote:
                    b.ready = b.ref in finished
        return [h for h in handles if h.batch.done]

    def abandon(self, handles: list[GroupCall]) -> None:
        """Calls a request stopped waiting for: a direct one's connection is closed (its reply would
        be stale) and its actor's channel dropped, since an actor that hung past a request's
        timeout may be on a lost node (a new connection there would wait out its connect
        timeout); Ray carries its calls until its endpoint answers again through Ray."""
        for batch in dict.fromkeys(h.batch for h in handles if h.batch is not None):
            channel = batch.abandon()
            if channel is not None:
                gave_up = ChannelError("no reply before the request gave up")
                self.channel_failed(batch.group, batch.replica, channel, gave_up)

    def result(self, handle: GroupCall) -> Any:
        if handle.batch is None:
            self.send()
        status, value = handle.batch.decoded()[handle.slot]
        if status == "error":
            raise value
        return value


def current_node() -> str:
    """This process's Ray node id (its host name outside a Ray worker)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # not a Ray worker: the host names the node
        pass
    import socket

    return socket.gethostname()


def node_address() -> str:
    """The address other nodes reach this process's node at (Ray's node IP; 127.0.0.1 outside a
    Ray worker)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # not a Ray worker: this machine only
        pass
    return "127.0.0.1"


class RayShardGroup(ShardGroup):
    """A ShardGroup in a Ray actor: its members know their Ray node, its direct channel listens on
    the node's address, and its calls (over the channel or through Ray) come and go as typed
    messages (shards/wire.py): a call of the ``ShardCalls`` allow-list with arguments its
    signature takes, or nothing is called."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, node=current_node(), address=node_address(), **kwargs)

    def run(self, packed: bytes | memoryview) -> bytes:
        """The answers to the request ``packed`` (``shards.wire.pack_request``), packed: at most
        ``--shard-concurrency`` at once over the channel and Ray together (``ShardGroup.run``)."""
        return super().run(packed)


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
    groups = actor_groups(infos, placement.shards_per_actor)
    cpus = placement.cpus
    if cpus is None:
        cpus = min(1.0, ray.cluster_resources().get("CPU", 1) / (len(groups) * placement.replicas * placement.sets))
    threads = max(1, int(cpus))  # members searching at once: no more than the CPUs reserved
    actor_cls = ray.remote(RayShardGroup)
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
                actor_cls.options(**options).remote(
                    source, members, stage, replica, images, threads, concurrency=placement.concurrency
                )
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
