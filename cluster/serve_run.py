"""Running ``needle serve``'s app until it is stopped: uvicorn in this process, or a Ray Serve
deployment (Ray and Serve started, the deployment run, SIGTERM/SIGINT handled, Serve and Ray shut
down in order). The app itself is webapi.webapp's; the index service cluster.serve's."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import NeedleInputError

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


def run(conf: ServeConfig, index: str | Path, files: Any = None, rerank: Any = None, page: Any = None) -> None:
    """Serve ``index`` (with QueryFiles ``files``, RerankConfig ``rerank`` and the web page's
    PageConfig ``page``) until stopped: in this process, or with Ray Serve under ``conf.ray``."""
    if str(index).startswith("s3://") and not conf.ray_shards:
        raise NeedleInputError(
            f"--index {index} is on S3: serve it with --ray-shards (each shard actor stages its shard)"
        )
    if conf.ray:
        run_ray_serve(conf, index, files, rerank, page)
        return
    import uvicorn

    from cluster.serve import open_index
    from webapi.query_service import QueryService
    from webapi.webapp import create_app

    tar_dirs = tuple(page.shard_dirs) if page is not None else ()
    serving = shard_serving(conf, tar_dirs) if conf.ray_shards else None
    search_index = open_index(index, conf.ray_shards, conf.address, serving)
    app = create_app(QueryService(search_index, files, rerank), page)
    log.info(
        "serving %s on http://%s:%d (%d vectors; API docs at /docs)", index, conf.host, conf.port, search_index.ntotal
    )
    uvicorn.run(app, host=conf.host, port=conf.port, log_level="info")


def run_ray_serve(
    conf: ServeConfig, index: str | Path, files: Any = None, rerank: Any = None, page: Any = None
) -> None:
    """The same app as a Ray Serve deployment of ``conf.replicas`` replicas, behind Serve's HTTP proxy
    on host:port (in front of one set of shard actors with ``conf.ray_shards``), until SIGTERM or
    SIGINT; then the deployment is deleted (on a shared cluster) or Serve shut down, and Ray."""
    import os
    import signal
    import time

    import ray
    from ray import serve

    from cluster.ingest_job import connect_ray
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
    serve.start(http_options={"host": conf.host, "port": conf.port})
    location = str(index) if str(index).startswith("s3://") else str(Path(index).resolve())
    serve.run(
        ray_app(location, files, rerank, page, actors, conf.replicas, serving=serving), name="needle", route_prefix="/"
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
