"""Serving an index with Ray: its shards in Ray actors across nodes (``serve_sharded``:
cluster/ray_shards.py places them, shards/shard_actor.py stages and serves a shard,
shards/coordinator.py merges), and the HTTP app (webapi.webapp) as a Ray Serve deployment
(``ray_app``). In one process without Ray the index is ``index.search.load_index``'s.

A query fans out to every shard actor; each takes its shortlist from its index and re-scores it
exactly from the memory-mapped float16 vectors of its rows; the coordinator keeps the shortlist a
single index would take and returns the top k of its exact scores: the same computation
(``index.shard.Shard.search``, ``merge_shortlists``) as searching the directory in one process,
and the same answer as a single index over the same data. Re-ranking scores each shortlist member
on the shard that holds its tokens. A request the shards cannot answer in time is refused
(``ShardsUnavailable``, HTTP 503), or answered from the shards that answered, marked
``"partial": true`` with ``"missing_shards"``, where the caller allows it.

``needle serve --index DIR`` binds 127.0.0.1 by default; its endpoints and how they answer bad
input are webapi.webapp's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.ray_shards import ShardPlacement
from index.search import load_index
from ingest.source_images import SourceImagesConfig
from shards.coordinator import ShardedIndex
from shards.staging import StageConfig

if TYPE_CHECKING:
    from webapi.limits import ServiceLimits
    from webapi.spec import ServeSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardServing:
    """How ``--ray-shards`` serves an index: its shards' placement, staging and time limits."""

    placement: ShardPlacement = field(default_factory=ShardPlacement)  # replicas, concurrency, CPUs, memory
    stage: StageConfig = field(default_factory=StageConfig)  # each node's cache dir, the S3 endpoint
    timeout: float = 10.0  # seconds a request waits for the shards before 503 (or a partial answer)
    images: SourceImagesConfig | None = None  # where shard actors read thumbnails' tars (None: as recorded)
    transport: str = "direct"  # calls to shard actors: "direct" TCP channels (shards/direct.py), else Ray calls only


def serve_sharded(
    path: str | Path,
    serving: ShardServing | None = None,
    actors: list[list[Any]] | None = None,
    generation: int | None = None,
) -> ShardedIndex:
    """A coordinator (shards.coordinator.ShardedIndex) of the index at ``path`` (an ``s3://``
    prefix or a path every node can read), its shards in Ray actors (Ray must be initialised).

    The coordinator reads only the top-level ``index_infos.json``; each actor stages its shard to
    its node's disk and opens it there. ``actors``: the shard actors of another coordinator of the
    same index ([group][replica], ``.backend.actors``), shared instead of starting new ones (one
    set of shard actors behind several Serve replicas). ``generation``: the one to serve (None:
    the newest); each shard's segments are served by one actor.
    """
    from cluster.ray_shards import RayShards, actor_groups, start_shard_actors, wait_ready
    from core.storage import canonical_url
    from shards.staging import read_index_infos

    serving = serving or ShardServing()
    source = canonical_url(path)
    infos = read_index_infos(source, serving.stage.endpoint_url, generation)
    names = [entry["name"] for entry in infos["shards"]]
    groups = actor_groups(infos, serving.placement.shards_per_actor)
    if actors is None:
        actors = start_shard_actors(source, infos, serving.stage, serving.placement, serving.images)
        wait_ready(actors, names, serving.placement.stage_timeout, groups)
    elif len(actors) != len(groups):
        raise ValueError(f"{len(actors)} shard actors for the {len(groups)} shard groups of {path}")
    backend = RayShards(actors, groups, serving.transport == "direct")
    if backend.direct:
        opened = backend.open_channels(serving.placement.stage_timeout)
        log.info("%d of %d shard actors answer over direct channels", opened, sum(map(len, actors)))
    return ShardedIndex(infos, source, backend, serving.timeout)


def open_index(
    path: str | Path,
    ray_shards: bool = False,
    address: str | None = None,
    serving: ShardServing | None = None,
    reload_interval: float = 0.0,
) -> Any:
    """The index to search: its shards in Ray actors with ``ray_shards`` (joining ``address``, else
    $RAY_ADDRESS, else a local instance), else loaded in this process. With ``reload_interval``
    (seconds), one that follows the index's newest generation (query.live_index.LiveIndex): under
    ``ray_shards`` each generation gets its own shard actors, stopped once no request uses them."""
    if ray_shards:
        from cluster.connect import connect_ray

        connect_ray(address)
    if reload_interval <= 0:
        if ray_shards:
            return serve_sharded(path, serving)
        index = load_index(path)
        index.warm()  # before the first request
        return index
    return follow_index(path, reload_interval, serving if ray_shards else None)


def follow_index(
    path: str | Path,
    reload_interval: float,
    serving: ShardServing | None = None,
    on_check: Callable[[int], None] | None = None,
) -> Any:
    """The index at ``path`` following its newest generation (query.live_index.LiveIndex), checked
    every ``reload_interval`` seconds: loaded in this process, or with ``serving`` in Ray shard
    actors (Ray initialised), a set per generation, stopped once no request uses it. ``on_check``:
    told the generation served after each check (a Serve replica's generation board seat)."""
    from core.location import location_of
    from index.live.generations import latest_number
    from query.live_index import LiveIndex

    location = location_of(path, serving.stage.endpoint_url if serving is not None else None)
    if serving is not None:
        placement = dataclasses.replace(serving.placement, sets=2)  # the next set starts before the last stops
        serving = dataclasses.replace(serving, placement=placement)
        return LiveIndex(
            lambda n, _served: serve_sharded(path, serving, generation=n),
            lambda: latest_number(location),
            reload_interval,
            close_generation=lambda index: index.backend.close(),
            on_check=on_check,
        )

    def opened(number: int | None, served: Any | None) -> Any:  # the served generation's unchanged segments kept
        return load_index(path, generation=number, served=served)

    return LiveIndex(opened, lambda: latest_number(location), reload_interval, on_check=on_check)


# Ray Serve: replicas of the same app. Replicas reserve no CPU by default: with --ray-shards the
# shard actors already hold the cluster's CPUs (see cluster.serve.serve_sharded).
REPLICA_CPUS = 0.0
REPLICA_GPUS = 1.0  # --device cuda: each replica's GPU (its AMES model and scoring tables live there)


def replica_index(
    spec: ServeSpec, shard_actors: list[list[Any]] | None, serving: ShardServing | None, seat: Any
) -> Any:
    """The index one Serve replica serves (see ``ray_app``), its generation written to ``seat``
    (cluster.generation_board.BoardSeat) once opened and, where it follows the index, after each
    check for a newer one."""
    path = str(spec.index)
    if shard_actors:
        index = serve_sharded(path, serving, actors=shard_actors)
    elif spec.reload.interval > 0:
        index = follow_index(path, spec.reload.interval, on_check=seat.served)
    else:
        index = load_index(path)
    seat.report(index.generation)
    return index


def ray_app(
    spec: ServeSpec,
    shard_actors: list[list[Any]] | None = None,
    replica_cpus: float = REPLICA_CPUS,
    serving: ShardServing | None = None,
    limits: ServiceLimits | None = None,
    board: Any = None,
):
    """The app of ``spec`` as a bound Ray Serve deployment (``serve.run(ray_app(...))``; Ray must
    be initialised) of ``spec.listen.replicas`` replicas, each serving ``spec.index`` (a path every
    node reads, or an s3:// prefix).

    Each replica opens the index itself; with ``shard_actors`` (from ``serve_sharded``) every replica
    is a coordinator in front of the same shard actors, which hold the index (``serving``: their
    ShardServing, for the request timeout). A replica's ``check_health`` fails while
    a shard has no live replica. ``spec.rerank.device``: where each replica re-ranks; "cuda"
    reserves a GPU per replica (Ray hides the GPUs from actors that reserve none, so "auto" there is
    the CPU). ``limits``: each replica's webapi.limits.ServiceLimits (request sizes, Host, the
    concurrency gate; default: the spec's). ``spec.reload.interval``: each replica loading the index
    itself follows its generations (seconds between checks; 0: never); replicas in front of shared
    shard actors serve the generation those hold. Every replica writes the generation it serves
    to ``board`` (cluster.generation_board; None: a new one owned by this process) and /health
    reports the minimum over the live replicas.
    """
    from fastapi import FastAPI
    from ray import serve

    from cluster.generation_board import start_board
    from webapi.query_service import QueryService
    from webapi.webapp import check_shards, create_app

    gpus = REPLICA_GPUS if spec.rerank.device == "cuda" else 0
    options = {"num_cpus": replica_cpus, "num_gpus": gpus}

    @serve.deployment(name="needle", num_replicas=spec.listen.replicas, ray_actor_options=options)
    @serve.ingress()
    class NeedleDeployment:
        def __init__(
            self,
            spec: ServeSpec,
            shard_actors: list[list[Any]] | None,
            serving: ShardServing | None,
            limits: ServiceLimits | None,
            board: Any,
        ):
            from cluster.generation_board import BoardSeat
            from cluster.serve import replica_index

            self.seat = BoardSeat(board)  # on the board before the index is opened
            index = replica_index(spec, shard_actors, serving, self.seat)
            rerank = spec.rerank.to_config()
            self.service = QueryService(index, spec.files, rerank, spec.rerank.device, limits or spec.service_limits())
            self.page = spec.page_config()

        def __serve_build_asgi_app__(self) -> FastAPI:
            return create_app(self.service, self.page, self.seat.generations)

        def check_health(self) -> None:
            """Serve's health probe: raises while a shard has no live replica."""
            check_shards(self.service)

        def __del__(self) -> None:
            """Serve's graceful stop: this replica's generation no longer counts."""
            seat = getattr(self, "seat", None)  # None: __init__ failed before it had one
            if seat is not None:
                seat.leave()

    board = board if board is not None else start_board()
    return NeedleDeployment.bind(spec, shard_actors, serving, limits, board)
