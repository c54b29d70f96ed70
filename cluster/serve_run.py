"""Running ``needle serve``'s app until it is stopped: uvicorn in this process, or a Ray Serve
deployment (Ray and Serve started, the deployment run, SIGTERM/SIGINT handled, Serve and Ray shut
down in order). The app itself is cluster.webapp's; the index service cluster.serve's."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import NeedleInputError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"  # address to listen on (127.0.0.1: this machine only)
    port: int = 8000  # HTTP port
    ray_shards: bool = False  # serve the shards from Ray actors
    ray: bool = False  # run the app as a Ray Serve deployment (Serve's HTTP proxy on --host:--port)
    replicas: int = 1  # --ray: replicas of the app
    address: str | None = None  # Ray cluster for --ray / --ray-shards (default: $RAY_ADDRESS, else local)


def run(conf: ServeConfig, index: str | Path, files: Any = None, rerank: Any = None, page: Any = None) -> None:
    """Serve ``index`` (with QueryFiles ``files``, RerankConfig ``rerank`` and the web page's
    PageConfig ``page``) until stopped: in this process, or with Ray Serve under ``conf.ray``."""
    if conf.ray:
        run_ray_serve(conf, index, files, rerank, page)
        return
    import uvicorn

    from cluster.serve import QueryService, open_index
    from cluster.webapp import create_app

    search_index = open_index(index, conf.ray_shards, conf.address)
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
    from cluster.webapp import ray_app

    if conf.replicas < 1:
        raise NeedleInputError(f"--replicas must be at least 1, got {conf.replicas}")
    shared_cluster = bool(conf.address or os.environ.get("RAY_ADDRESS"))
    connect_ray(conf.address)
    actors = None
    if conf.ray_shards:
        from cluster.serve import serve_sharded

        actors = serve_sharded(index).actors
    serve.start(http_options={"host": conf.host, "port": conf.port})
    serve.run(
        ray_app(str(Path(index).resolve()), files, rerank, page, actors, conf.replicas), name="needle", route_prefix="/"
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
