"""Running ``needle serve``'s app until it is stopped: uvicorn in this process, or a Ray Serve
deployment (Ray and Serve started, the deployment run, SIGTERM/SIGINT handled, Serve and Ray shut
down in order). The app itself is webapi.webapp's; the index service cluster.serve's.

The request and connection bounds (webapi.limits.ServiceLimits, the ``--max-*`` and ``--*-timeout``
flags) apply to both: the app's own (sizes, Host, Content-Type, the concurrency gate) in every
replica; the connection bounds (``--header-timeout``, ``--max-header-kb``, ``--max-connections``:
webapi.connections) under uvicorn only, since under ``--ray`` Serve's proxy owns the connections."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import NeedleInputError
from webapi.limits import ANY_HOST, ServiceLimits

log = logging.getLogger(__name__)
TRANSPORTS = ("direct", "ray")  # how the coordinator calls shard actors (shards/direct.py, cluster/ray_shards.py)


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"  # address to listen on (127.0.0.1: this machine only)
    port: int = 8000  # HTTP port
    ray_shards: bool = False  # serve the shards from Ray actors
    ray: bool = False  # run the app as a Ray Serve deployment (Serve's HTTP proxy on --host:--port)
    replicas: int = 1  # --ray: replicas of the app
    address: str | None = None  # Ray cluster for --ray / --ray-shards (default: $RAY_ADDRESS, else local)
    shard_replicas: int = 1  # --ray-shards: actors per shard (requests spread over them; one may die)
    shard_concurrency: int = 4  # --ray-shards: concurrent calls per shard actor
    shards_per_actor: int = 1  # --ray-shards: consecutive shards one actor serves (one Ray call per actor and request)
    shard_cpus: float | None = None  # --ray-shards: CPUs per shard actor, its shards' threads (default: a share, <= 1)
    shard_timeout: float = 10.0  # --ray-shards: seconds a request waits for the shards, then 503 (or partial)
    # --ray-shards: how the coordinator calls shard actors: "direct" (a TCP channel to each, its key
    # handed out through Ray; Ray where a channel fails) or "ray" (Ray calls only)
    shard_transport: str = "direct"
    cache_dir: str | None = (
        None  # --ray-shards: each node's local dir for staged shards ({node}: node id); default <tmp>
    )
    s3_endpoint_url: str | None = None  # S3-compatible endpoint for an s3:// --index
    reload_interval: float = 2.0  # seconds between checks for a newer generation of the index (0: never switch)
    stage_local: bool = (
        True  # --ray-shards: copy a local --index's shards to each node's cache (--no-stage-local: serve it in place)
    )


def shard_serving(conf: ServeConfig, tar_dirs: tuple[str, ...] = ()) -> Any:
    """The --ray-shards settings of ``conf`` (cluster.serve.ShardServing); ``tar_dirs``: the
    directories (on every node) where shard actors look for tars ingestion recorded no URL of."""
    from cluster.ray_shards import ShardPlacement
    from cluster.serve import ShardServing
    from ingest.source_images import SourceImagesConfig
    from shards.staging import StageConfig

    if conf.shard_timeout <= 0:
        raise NeedleInputError(f"--shard-timeout must be positive, got {conf.shard_timeout}")
    if conf.shard_transport not in TRANSPORTS:
        choices = ", ".join(TRANSPORTS)
        raise NeedleInputError(f"--shard-transport must be one of {choices}, got {conf.shard_transport!r}")
    if conf.shard_cpus is not None and conf.shard_cpus <= 0:
        raise NeedleInputError(f"--shard-cpus must be positive, got {conf.shard_cpus}")
    return ShardServing(
        ShardPlacement(
            replicas=conf.shard_replicas,
            concurrency=conf.shard_concurrency,
            cpus=conf.shard_cpus,
            shards_per_actor=conf.shards_per_actor,
        ),
        StageConfig(conf.cache_dir, conf.s3_endpoint_url, conf.stage_local),
        conf.shard_timeout,
        SourceImagesConfig(tuple(tar_dirs), conf.s3_endpoint_url) if tar_dirs or conf.s3_endpoint_url else None,
        conf.shard_transport,
    )


def served_limits(conf: ServeConfig, limits: ServiceLimits | None) -> ServiceLimits:
    """``limits`` (checked) with the bound address among the Host names answered; a warning where the
    server listens on every interface but answers only this machine's names."""
    import dataclasses

    limits = (limits or ServiceLimits()).check()
    if conf.host in ("0.0.0.0", "::", ""):
        if not limits.allow_hosts:
            log.warning(
                "--host %s: requests are answered only for Host localhost/127.0.0.1/::1; give the names "
                "clients use with --allow-host NAME (or --allow-host '*' behind a proxy that checks Host)",
                conf.host,
            )
        return limits
    if ANY_HOST in limits.allow_hosts or conf.host in limits.allow_hosts:
        return limits
    return dataclasses.replace(limits, allow_hosts=(*limits.allow_hosts, conf.host))


def run(
    conf: ServeConfig,
    index: str | Path,
    files: Any = None,
    rerank: Any = None,
    page: Any = None,
    device: str = "cpu",
    limits: ServiceLimits | None = None,
) -> None:
    """Serve ``index`` (with QueryFiles ``files``, RerankConfig ``rerank`` and the web page's
    PageConfig ``page``) until stopped: in this process, or with Ray Serve under ``conf.ray``;
    re-ranking on ``device`` (``--device``: this process's, or each Serve replica's); every
    request and connection within ``limits`` (default ServiceLimits())."""
    if str(index).startswith("s3://") and not conf.ray_shards:
        raise NeedleInputError(
            f"--index {index} is on S3: serve it with --ray-shards (each shard actor stages its shard)"
        )
    limits = served_limits(conf, limits)
    if rerank is not None and rerank.shortlist > limits.max_k_total:  # every re-ranked query would be a 413
        raise NeedleInputError(
            f"--shortlist {rerank.shortlist} is over --max-k-total {limits.max_k_total} (a re-ranked query "
            "counts its shortlist): raise --max-k-total or lower --shortlist"
        )
    if conf.ray:
        run_ray_serve(conf, index, files, rerank, page, device, limits)
        return
    import uvicorn

    from cluster.serve import open_index
    from webapi.connections import guarded_protocol
    from webapi.query_service import QueryService
    from webapi.webapp import create_app

    tar_dirs = tuple(page.shard_dirs) if page is not None else ()
    serving = shard_serving(conf, tar_dirs) if conf.ray_shards else None
    if conf.reload_interval < 0:
        raise NeedleInputError(f"--reload-interval must be >= 0 seconds, got {conf.reload_interval}")
    search_index = open_index(index, conf.ray_shards, conf.address, serving, conf.reload_interval)
    app = create_app(QueryService(search_index, files, rerank, device, limits), page)
    log.info(
        "serving %s on http://%s:%d (%d vectors; API docs at /docs)", index, conf.host, conf.port, search_index.ntotal
    )
    uvicorn.run(app, host=conf.host, port=conf.port, log_level="info", http=guarded_protocol(limits))


def run_ray_serve(
    conf: ServeConfig,
    index: str | Path,
    files: Any = None,
    rerank: Any = None,
    page: Any = None,
    device: str = "cpu",
    limits: ServiceLimits | None = None,
) -> None:
    """The same app as a Ray Serve deployment of ``conf.replicas`` replicas, behind Serve's HTTP proxy
    on host:port (in front of one set of shard actors with ``conf.ray_shards``), until SIGTERM or
    SIGINT; then the deployment is deleted (on a shared cluster) or Serve shut down, and Ray."""
    import os
    import signal
    import time

    import ray
    from ray import serve

    from cluster.connect import connect_ray
    from cluster.serve import ray_app

    if conf.replicas < 1:
        raise NeedleInputError(f"--replicas must be at least 1, got {conf.replicas}")
    shared_cluster = bool(conf.address or os.environ.get("RAY_ADDRESS"))
    connect_ray(conf.address)
    actors, serving = None, None
    if conf.ray_shards:
        from cluster.serve import serve_sharded

        serving = shard_serving(conf, tuple(page.shard_dirs) if page is not None else ())
        actors = serve_sharded(index, serving).backend.actors
        if conf.reload_interval > 0:
            log.warning(
                "--ray with --ray-shards: the replicas share one set of shard actors and serve the generation "
                "it holds; restart to serve a newer one (without --ray, --ray-shards follows the index)"
            )
    serve.start(http_options={"host": conf.host, "port": conf.port})
    location = str(index) if str(index).startswith("s3://") else str(Path(index).resolve())
    serve.run(
        ray_app(
            location,
            files,
            rerank,
            page,
            actors,
            conf.replicas,
            serving=serving,
            device=device,
            limits=limits,
            reload_interval=conf.reload_interval,
        ),
        name="needle",
        route_prefix="/",
    )
    log.info(
        "serving %s with Ray Serve (%d replicas) on http://%s:%d (API docs at /docs)",
        index,
        conf.replicas,
        conf.host,
        conf.port,
    )

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # after Ray's own handler: stop Serve, then Ray, in order
    signal.signal(signal.SIGINT, stop)  # also where a non-interactive shell started us with SIGINT ignored
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        if shared_cluster:  # leave the cluster's other Serve applications alone
            serve.delete("needle")
        else:
            serve.shutdown()
        ray.shutdown()
