"""Joining Ray: the one way every needle command that runs on Ray (ingestion, the parallel index
build, the living index's ``--ray`` writers, shard actors and Ray Serve) connects to a cluster or
starts a local instance on loopback."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def connect_ray(address: str | None) -> None:
    """Join ``address`` or $RAY_ADDRESS; otherwise start a local instance listening on 127.0.0.1
    only (Ray alone would put the machine's external address in its place: see
    cluster.local_ray; checked here, a RuntimeError where it did not hold), with token
    authentication set explicitly and its token in a file only this user can read
    (``cluster.local_ray.local_ray_with_token``).

    Never Ray's implicit auto-detection: a stale record of a dead cluster would make it hang.
    """
    import ray

    from cluster.local_ray import local_ray_on_loopback, local_ray_with_token

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        return
    local_ray_on_loopback()
    token = local_ray_with_token()  # explicit, and readable by this user only (not Ray's 0644 default)
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False)
    log.info("started a local Ray instance; its auth token is in %s (mode 0600)", token)
    node_ip = ray.util.get_node_ip_address()
    if node_ip != "127.0.0.1":
        ray.shutdown()
        raise RuntimeError(
            f"the local Ray instance took node IP {node_ip}, not 127.0.0.1: it would listen beyond loopback"
        )
