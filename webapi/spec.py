"""``needle serve``'s settings as one spec: a frozen dataclass per concern (listening, what one
request may ask, what the connections may hold, re-ranking, shards, live reload, the files given in
place of the index's, the web page), held by ``ServeSpec``. The same spec comes from the flags, from
a TOML file (``needle serve --config serve.toml``: webapi/spec_toml.py) or both (flags given win),
and ``--print-config`` writes it back. Ray-free and torch-free: cluster/serve_run.py runs it.

Each field's help is the flag's (core.settings.setting); cli/spec_flags.py maps flags to fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from core.errors import NeedleInputError
from core.settings import setting
from query.recorded import QueryFiles
from rerank.options import RerankOptions
from webapi.limits import ALLOW_HOSTS_HELP, ConnectionLimits, RequestLimits, ServiceLimits

TRANSPORTS = ("direct", "ray")  # how the coordinator calls shard actors (shards/direct.py, cluster/ray_shards.py)


@dataclass(frozen=True)
class Listen:
    """Where and how the app listens: uvicorn in this process, or replicas of a Ray Serve deployment."""

    host: str = setting("127.0.0.1", "address to listen on (127.0.0.1: this machine only)")
    port: int = setting(8000, "HTTP port")
    allow_hosts: tuple[str, ...] = setting((), ALLOW_HOSTS_HELP)
    ray: bool = setting(False, "run the app as a Ray Serve deployment (Serve's HTTP proxy on --host:--port)")
    replicas: int = setting(1, "--ray: replicas of the app")
    address: str | None = setting(None, "Ray cluster for --ray / --ray-shards (default: $RAY_ADDRESS, else local)")


@dataclass(frozen=True)
class Shards:
    """``--ray-shards``: the index's shards served from Ray actors, their placement and staging."""

    ray: bool = setting(False, "serve the shards from Ray actors")
    replicas: int = setting(1, "--ray-shards: actors per shard (requests spread over them; one may die)")
    concurrency: int = setting(4, "--ray-shards: concurrent calls per shard actor")
    per_actor: int = setting(
        1, "--ray-shards: consecutive shards one actor serves (one Ray call per actor and request)"
    )
    cpus: float | None = setting(
        None, "--ray-shards: CPUs per shard actor, its shards' threads (default: a share, <= 1)"
    )
    timeout: float = setting(10.0, "--ray-shards: seconds a request waits for the shards, then 503 (or partial)")
    transport: str = setting(
        "direct",
        '--ray-shards: how the coordinator calls shard actors: "direct" (a TCP channel to each, its key '
        'handed out through Ray; Ray where a channel fails) or "ray" (Ray calls only)',
    )
    cache_dir: str | None = setting(
        None, "--ray-shards: each node's local dir for staged shards ({node}: node id); default <tmp>"
    )
    s3_endpoint_url: str | None = setting(None, "S3-compatible endpoint for an s3:// --index")
    stage_local: bool = setting(
        True, "--ray-shards: copy a local --index's shards to each node's cache (--no-stage-local: serve it in place)"
    )


@dataclass(frozen=True)
class LiveReload:
    """Following the index as ``needle index add|delete|compact`` publish new generations."""

    interval: float = setting(2.0, "seconds between checks for a newer generation of the index (0: never switch)")


@dataclass(frozen=True)
class Page:
    """The web page at ``/`` (webapi.webpage.PageConfig, less its fixed settings)."""

    report: str | None = setting(None, "a `needle eval map` JSON report shown in the report section; None: no report")
    scaling_plot: str | None = setting(None, "a scaling PNG (`needle eval plot`) shown beside it; None: none")
    shard_dirs: tuple[str, ...] = setting(
        (), "directories searched for `<shard>.tar` when ingestion records no URL for it"
    )
    max_upload_mb: int = setting(16, "largest query image accepted")


@dataclass(frozen=True)
class ServeSpec:
    """Everything ``needle serve`` is told: the index and one section per concern."""

    index: str | None = setting(None, "index directory (with --ray-shards also an s3://bucket/prefix)")
    listen: Listen = field(default_factory=Listen)  # address, port, Host names, Ray Serve replicas
    request: RequestLimits = field(default_factory=RequestLimits)  # what one request may ask
    connection: ConnectionLimits = field(default_factory=ConnectionLimits)  # what all clients may hold
    rerank: RerankOptions = field(default_factory=RerankOptions)  # re-ranking the shortlist
    shards: Shards = field(default_factory=Shards)  # shards in Ray actors
    reload: LiveReload = field(default_factory=LiveReload)  # following new generations
    files: QueryFiles = field(default_factory=QueryFiles)  # files in place of those the index records
    page: Page = field(default_factory=Page)  # the web page

    def served_index(self) -> str:
        """The index to serve, or a NeedleInputError saying where to give it."""
        if not self.index:
            raise NeedleInputError('needle serve: give the index with --index DIR (or index = "DIR" in --config)')
        return self.index

    def service_limits(self) -> ServiceLimits:
        """The app's limits: both limit sections and the Host names answered, checked."""
        return ServiceLimits.of(self.request, self.connection, self.listen.allow_hosts).check()

    def page_config(self) -> Any:
        """The web page's webapi.webpage.PageConfig (imported here: it pulls in FastAPI)."""
        from webapi.webpage import PageConfig

        return PageConfig(
            report=self.page.report,
            scaling_plot=self.page.scaling_plot,
            shard_dirs=tuple(self.page.shard_dirs),
            max_upload_bytes=self.page.max_upload_mb << 20,
        )


def sections() -> dict[str, type]:
    """Section name -> its dataclass, in the spec's order (every field but ``index`` is one)."""
    defaults = ServeSpec()
    return {f.name: type(getattr(defaults, f.name)) for f in dataclasses.fields(ServeSpec) if f.name != "index"}
