"""Running ``needle serve``'s app until it is stopped: uvicorn in this process, or a Ray Serve
deployment (Ray and Serve started, the deployment run, SIGTERM/SIGINT handled, Serve and Ray shut
down in order). The app itself is webapi.webapp's; the index service cluster.serve's.

The request and connection bounds (webapi.limits.ServiceLimits, the ``--max-*`` and ``--*-timeout``
flags) apply to both: the app's own (sizes, Host, Content-Type, the concurrency gate) in every
replica; the connection bounds (``--header-timeout``, ``--max-header-kb``, ``--max-connections``:
webapi.connections) under uvicorn only, since under ``--ray`` Serve's proxy owns the connections."""

from __future__ import annotations

import errno
import logging
import socket
from typing import Any

from core.errors import NeedleInputError
from core.location import location_of
from core.storage import canonical_url
from webapi.limits import ANY_HOST, ServiceLimits
from webapi.spec import TRANSPORTS, Listen, ServeSpec, Shards

log = logging.getLogger(__name__)


def shard_serving(shards: Shards, tar_dirs: tuple[str, ...] = ()) -> Any:
    """The --ray-shards settings of the spec's ``shards`` (cluster.serve.ShardServing); ``tar_dirs``:
    the directories (on every node) where shard actors look for tars ingestion recorded no URL of."""
    from cluster.ray_shards import ShardPlacement
    from cluster.serve import ShardServing
    from ingest.source_images import SourceImagesConfig
    from shards.staging import StageConfig

    if shards.timeout <= 0:
        raise NeedleInputError(f"--shard-timeout must be positive, got {shards.timeout}")
    if shards.transport not in TRANSPORTS:
        choices = ", ".join(TRANSPORTS)
        raise NeedleInputError(f"--shard-transport must be one of {choices}, got {shards.transport!r}")
    if shards.cpus is not None and shards.cpus <= 0:
        raise NeedleInputError(f"--shard-cpus must be positive, got {shards.cpus}")
    return ShardServing(
        ShardPlacement(
            replicas=shards.replicas,
            concurrency=shards.concurrency,
            cpus=shards.cpus,
            shards_per_actor=shards.per_actor,
        ),
        StageConfig(shards.cache_dir, shards.s3_endpoint_url, shards.stage_local),
        shards.timeout,
        SourceImagesConfig(tuple(tar_dirs), shards.s3_endpoint_url) if tar_dirs or shards.s3_endpoint_url else None,
        shards.transport,
    )


def served_limits(listen: Listen, limits: ServiceLimits | None) -> ServiceLimits:
    """``limits`` (checked) with the bound address among the Host names answered; a warning where the
    server listens on every interface but answers only this machine's names."""
    import dataclasses

    limits = (limits or ServiceLimits()).check()
    if listen.host in ("0.0.0.0", "::", ""):
        if not limits.allow_hosts:
            log.warning(
                "--host %s: requests are answered only for Host localhost/127.0.0.1/::1; give the names "
                "clients use with --allow-host NAME (or --allow-host '*' behind a proxy that checks Host)",
                listen.host,
            )
        return limits
    if ANY_HOST in limits.allow_hosts or listen.host in limits.allow_hosts:
        return limits
    return dataclasses.replace(limits, allow_hosts=(*limits.allow_hosts, listen.host))


def run(spec: ServeSpec) -> None:
    """Serve ``spec.index`` until stopped: in this process, or with Ray Serve under
    ``spec.listen.ray``; re-ranking on ``spec.rerank.device`` (this process's, or each Serve
    replica's); every request and connection within the spec's limits."""
    index = spec.served_index()
    if location_of(index).local_root is None and not spec.shards.ray:
        raise NeedleInputError(
            f"--index {index} is on S3: serve it with --ray-shards (each shard actor stages its shard)"
        )
    limits = served_limits(spec.listen, spec.service_limits())
    rerank = spec.rerank.to_config()
    if rerank is not None and rerank.shortlist > limits.max_k_total:  # every re-ranked query would be a 413
        raise NeedleInputError(
            f"--shortlist {rerank.shortlist} is over --max-k-total {limits.max_k_total} (a re-ranked query "
            "counts its shortlist): raise --max-k-total or lower --shortlist"
        )
    if spec.listen.ray:
        run_ray_serve(spec, limits)
        return
    import uvicorn

    from cluster.serve import open_index
    from webapi.connections import guarded_protocol
    from webapi.query_service import QueryService
    from webapi.webapp import create_app

    listen = spec.listen
    serving = shard_serving(spec.shards, spec.page.shard_dirs) if spec.shards.ray else None
    if spec.reload.interval < 0:
        raise NeedleInputError(f"--reload-interval must be >= 0 seconds, got {spec.reload.interval}")
    sock = listening_socket(listen.host, listen.port)  # before the index loads and "serving" is logged
    search_index = open_index(index, spec.shards.ray, listen.address, serving, spec.reload.interval)
    service = QueryService(search_index, spec.files, rerank, spec.rerank.device, limits)
    app = create_app(service, spec.page_config())
    log.info(
        "serving %s on http://%s:%d (%d vectors; API docs at /docs)",
        index,
        listen.host,
        listen.port,
        search_index.ntotal,
    )
    config = uvicorn.Config(app, host=listen.host, port=listen.port, log_level="info", http=guarded_protocol(limits))
    uvicorn.Server(config).run(sockets=[sock])


class PortInUseError(NeedleInputError):
    """``--host``/``--port`` that cannot be bound (in use, or not an address of this machine)."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, for uvicorn to serve on: bound here so that a busy port is
    one line naming it (exit 2), before anything says "serving" (uvicorn bound it only after)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)  # uvicorn's backlog
    except socket.gaierror as exc:
        raise PortInUseError(f"--host {host}: not an address of this machine ({exc.strerror})") from exc
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"--port {port}: {host}:{port} is in use by another process; choose another --port"
            ) from exc
        raise PortInUseError(f"--host {host} --port {port}: cannot listen there ({exc.strerror})") from exc


def run_ray_serve(spec: ServeSpec, limits: ServiceLimits) -> None:
    """The same app as a Ray Serve deployment of ``spec.listen.replicas`` replicas, behind Serve's
    HTTP proxy on host:port (in front of one set of shard actors with ``spec.shards.ray``), until
    SIGTERM or SIGINT; then the deployment is deleted (on a shared cluster) or Serve shut down, and
    Ray. ``limits``: the spec's, with the bound address among the Host names (served_limits)."""
    import dataclasses
    import os

    from ray import serve

    from cluster.connect import connect_ray
    from cluster.serve import ray_app

    listen, index = spec.listen, str(spec.index)
    if listen.replicas < 1:
        raise NeedleInputError(f"--replicas must be at least 1, got {listen.replicas}")
    shared_cluster = bool(listen.address or os.environ.get("RAY_ADDRESS"))
    connect_ray(listen.address)
    actors, serving = None, None
    if spec.shards.ray:
        from cluster.serve import serve_sharded

        serving = shard_serving(spec.shards, spec.page.shard_dirs)
        actors = serve_sharded(index, serving).backend.actors
        if spec.reload.interval > 0:
            log.warning(
                "--ray with --ray-shards: the replicas share one set of shard actors and serve the generation "
                "it holds; restart to serve a newer one (without --ray, --ray-shards follows the index)"
            )
    from cluster.generation_board import start_board

    serve.start(http_options={"host": listen.host, "port": listen.port})
    location = canonical_url(index)
    served = dataclasses.replace(spec, index=location)
    board = start_board(detached=True)  # lives as long as the app: killed with it below, not with this process
    serve.run(ray_app(served, actors, serving=serving, limits=limits, board=board), name="needle", route_prefix="/")
    log.info(
        "serving %s with Ray Serve (%d replicas) on http://%s:%d (API docs at /docs)",
        index,
        listen.replicas,
        listen.host,
        listen.port,
    )
    _serve_until_stopped(shared_cluster, board)


def _serve_until_stopped(shared_cluster: bool, board: Any) -> None:
    """Wait for SIGTERM or SIGINT, then delete the deployment (a shared cluster) or shut Serve down,
    then its generation board (cluster.generation_board), and Ray."""
    import signal
    import time

    import ray
    from ray import serve

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
        ray.kill(board)  # detached: it would outlive the app on a shared cluster
        ray.shutdown()
