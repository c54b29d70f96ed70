"""A local Ray head for the demo: started bound to 127.0.0.1, stopped by its own PID.

Never ``ray stop``: it kills every Ray process on the machine, including other users' clusters.
The head runs ``ray start --head --block`` in its own process group, so stopping that group stops
exactly the processes this head started. Token authentication stays on: a fresh token is made for
the head and passed to every client through the environment (``RAY_AUTH_MODE=token``).

Loopback only. Asked for node IP 127.0.0.1, Ray 2.60 puts the machine's external address in its
place (``ray._private.services.resolve_ip_for_localhost``) and its processes then listen there, or
on every interface, unless multi-node clusters are off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``:
``ray_constants.ENABLE_RAY_CLUSTER``): then the node IP stays 127.0.0.1 and every Ray process of
the instance binds it (checked by tests/cluster/test_local_ray.py, listing the sockets each listens on).
``LOOPBACK_ENV`` carries that to ``ray start`` and its processes; ``local_ray_on_loopback`` to a
``ray.init`` of a new local instance in this process (cluster.connect.connect_ray).

Ports. Every port of the head is chosen free (``HEAD_PORT_FLAGS``, and the two metrics ports Ray
takes only from the environment), since Ray's fixed defaults clash with any other Ray on the
machine (a test's ``ray.init``, a user's cluster): the job agent then dies and no job starts. A
start that still fails names the ports another process holds (``port_clashes``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient

log = logging.getLogger(__name__)


class RayHeadError(RuntimeError):
    """The local Ray head did not come up."""


# Ray's switch off for multi-node clusters: node IP 127.0.0.1 stays 127.0.0.1 (see above).
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# The ports `ray start --head` takes as flags (Ray 2.60, `ray start --help`); worker ports apart.
HEAD_PORT_FLAGS = (
    "--port",
    "--dashboard-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--metrics-export-port",
    "--runtime-env-agent-port",
    "--ray-client-server-port",
    "--node-manager-port",
    "--object-manager-port",
)
# Ports Ray reads from the environment only (fixed 44217 and 44227 otherwise).
HEAD_PORT_ENV = ("AUTOSCALER_METRIC_PORT", "DASHBOARD_METRIC_PORT")


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now (all held until all are chosen)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


def private_auth_token() -> Path:
    """A fresh Ray token in a file only this user can read (0600, in a 0700 directory of its own).
    Why not Ray's default: a ``ray.init()`` that starts a cluster writes ``~/.ray/auth_token`` with
    the process's umask (0644 here: any local user could read it, then run code as this user)."""
    directory = Path(tempfile.mkdtemp(prefix="needle-ray-auth-"))  # mode 0700
    path = directory / "auth_token"
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(secrets.token_hex(32))
    return path


def local_ray_with_token() -> Path:
    """Token authentication, set explicitly, for a Ray instance this process starts and its
    processes (they inherit the environment): ``RAY_AUTH_MODE=token`` and a private token file
    (``RAY_AUTH_TOKEN_PATH``); a token in ``RAY_AUTH_TOKEN`` would win over the file, so it is
    dropped. Returns the file: a client joining the instance needs its token. Its directory is
    removed when this process exits (registered before ``ray.init``, whose own exit handler, run
    first, stops the instance): one per run would otherwise pile up in the temporary directory."""
    path = private_auth_token()
    atexit.register(shutil.rmtree, path.parent, True)
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        log.warning("RAY_AUTH_MODE=%s ignored: a local Ray that needle starts uses token authentication",
                    os.environ["RAY_AUTH_MODE"])  # fmt: skip
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(path))
    os.environ.pop("RAY_AUTH_TOKEN", None)
    from ray._raylet import Config

    Config.initialize("")  # Ray read its settings at import: read them again (as Ray's own token setup does)
    return path


def local_ray_on_loopback() -> None:
    """Make a Ray instance this process starts (``ray.init(address="local")``) keep node IP
    127.0.0.1: Ray's switch in the environment (for the processes it starts) and in
    ``ray_constants``, which Ray reads once at its import, maybe before this."""
    os.environ.update(LOOPBACK_ENV)
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def port_clashes(ports: Mapping[str, int], head_session: int | None = None) -> list[str]:
    """``"<name> <port>: held by pid N (its name)"`` for each of ``ports`` (name -> port) a process
    listens on that is not one of the head's (session ``head_session``, the ``ray start``
    process's pid; None: any process)."""
    import ray  # noqa: F401  (puts Ray's own psutil on the path)

    # isort: split
    import psutil

    wanted = {port: name for name, port in ports.items()}
    found: dict[int, str] = {}
    for conn in psutil.net_connections(kind="inet"):
        if conn.status != psutil.CONN_LISTEN or conn.laddr.port not in wanted or conn.laddr.port in found:
            continue
        if conn.pid is not None and head_session is not None and _session(conn.pid) == head_session:
            continue
        found[conn.laddr.port] = f"{wanted[conn.laddr.port]} {conn.laddr.port}: held by {_process(conn.pid)}"
    return [found[port] for port in sorted(found)]


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:  # gone, or not ours to ask
        return None


def _process(pid: int | None) -> str:
    if pid is None:
        return "another user's process"
    import psutil

    try:
        return f"pid {pid} ({psutil.Process(pid).name()})"
    except psutil.Error:
        return f"pid {pid}"


def clash_note(head: LocalRayHead) -> str:
    """What ``port_clashes`` finds for ``head``'s ports, as a sentence for an error ('' if none)."""
    try:
        clashes = port_clashes(head.ports, head.process.pid)
    except Exception as exc:  # the note must not hide the error it explains
        return f" (its ports could not be checked: {exc})"
    return f"; port clash: {'; '.join(clashes)}" if clashes else ""


def bin_dir() -> Path:
    """The directory of this interpreter's console scripts (``ray``, ``needle``)."""
    return Path(sys.executable).parent


@dataclass
class LocalRayHead:
    process: subprocess.Popen
    gcs_address: str  # for ray.init(address=...)
    dashboard_url: str  # for job submission (submit_job)
    env: dict[str, str] = field(repr=False)  # environment every client of this head must use
    ports: dict[str, int] = field(default_factory=dict)  # what it was asked to listen on: flag or variable -> port

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout)
        except ProcessLookupError:
            pass
        self._forget_as_current_cluster()
        log.info("stopped the local Ray head (pid %d)", self.process.pid)

    def _forget_as_current_cluster(self) -> None:
        # `ray start` records its address for `ray.init()` auto-detection and a killed head never
        # removes it: leave no record of this head that would make later clients wait on it.
        import tempfile

        record = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        try:
            if record.read_text().strip() == self.gcs_address:
                record.unlink()
        except OSError:
            pass


def client_env(token: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=token,
        **LOOPBACK_ENV,
        HF_HUB_OFFLINE="1",
        # Nothing runs on a demo head when it stops: skip the 30 s drain of `ray start --block`.
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
        PATH=f"{bin_dir()}{os.pathsep}{env.get('PATH', '')}",
    )
    env.update(extra or {})
    return env


def _dashboard_answers(head: LocalRayHead) -> bool:
    request = urllib.request.Request(
        f"{head.dashboard_url}/api/version", headers={"Authorization": f"Bearer {head.env['RAY_AUTH_TOKEN']}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True  # it answered (an auth refusal still means the server is up)
    except OSError:
        return False


def start_head(num_cpus: int | None = None, log_file: Path | None = None, timeout: float = 120.0) -> LocalRayHead:
    """Start a Ray head on 127.0.0.1 only, with the dashboard (job submission), every port free
    (RayHeadError naming the ports another process holds where it does not come up)."""
    ports = dict(zip((*HEAD_PORT_FLAGS, *HEAD_PORT_ENV), free_ports(len(HEAD_PORT_FLAGS) + len(HEAD_PORT_ENV))))
    env = client_env(secrets.token_hex(24), {name: str(ports[name]) for name in HEAD_PORT_ENV})
    cmd = [
        str(bin_dir() / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        *(f"{flag}={ports[flag]}" for flag in HEAD_PORT_FLAGS),
        # workers: ports the system picks, never a range another Ray on the machine uses too
        "--min-worker-port=0",
        "--max-worker-port=0",
        "--disable-usage-stats",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    # the child keeps its own descriptor of the log: ours is closed once it has started
    with open(log_file, "ab") if log_file else contextlib.nullcontext(subprocess.DEVNULL) as out:
        process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    head = LocalRayHead(
        process, f"127.0.0.1:{ports['--port']}", f"http://127.0.0.1:{ports['--dashboard-port']}", env, ports
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RayHeadError(f"ray start exited with code {process.returncode} (log: {log_file}){clash_note(head)}")
        if _dashboard_answers(head):
            log.info("local Ray head up (pid %d), dashboard %s", process.pid, head.dashboard_url)
            return head
        time.sleep(1.0)
    note = clash_note(head)
    head.stop()
    raise RayHeadError(f"the Ray dashboard did not answer within {timeout:.0f}s (log: {log_file}){note}")


# What the dashboard answers while the head node's job agent has not registered yet (Ray waits 10 s
# for it per request); on a busy machine the agent comes up well after the dashboard does.
AGENT_NOT_READY = "No available agent to submit job"


class JobSubmitError(RuntimeError):
    """The job server could not be reached, or refused a job for a reason other than a job agent
    still starting."""


@dataclass(frozen=True)
class JobOutcome:
    """How a submitted job ended."""

    submission_id: str
    status: str  # SUCCEEDED, FAILED or STOPPED
    message: str = ""  # the job server's word on it, first line (e.g. the entrypoint's exit code)

    @property
    def ok(self) -> bool:
        return self.status == "SUCCEEDED"


def job_client(dashboard_url: str, env: Mapping[str, str] | None = None) -> JobSubmissionClient:
    """A Jobs API client of the cluster at ``dashboard_url``, sending the ``RAY_AUTH_TOKEN`` of
    ``env`` (default: our environment), if any.

    The token goes as an explicit header: Ray's own lookup reads this process's environment and
    ~/.ray, not the client environment of a head started here (``LocalRayHead.env``).
    """
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    token = (os.environ if env is None else env).get("RAY_AUTH_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else None
    override = os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")
    if override and override.rstrip("/") != dashboard_url.rstrip("/"):
        log.warning(
            "Ray's job client goes to $RAY_API_SERVER_ADDRESS/$RAY_ADDRESS (%s), not %s", override, dashboard_url
        )
    try:
        return JobSubmissionClient(dashboard_url, headers=headers)
    except (ConnectionError, RuntimeError, AuthenticationError) as exc:
        raise JobSubmitError(f"no Ray job server answers at {dashboard_url}: {exc}") from exc


def submit_job(
    dashboard_url: str,
    entrypoint: list[str],
    env: Mapping[str, str] | None = None,
    *,
    ready_timeout: float = 180.0,
    head_log: str | Path | None = None,
    head: LocalRayHead | None = None,
) -> JobOutcome:
    """Submit an entrypoint as a job to the cluster at ``dashboard_url``, write its logs to stdout
    as they come, and return how it ended.

    The submission is retried while the head answers that its job agent is not up yet, for at most
    ``ready_timeout`` seconds (RayHeadError naming ``head_log`` after that, and the ports of
    ``head``, a head started here, that another process holds). ``env``: the client environment
    whose token authenticates (a head started here: ``head.env``); default: ours.
    """
    client = job_client(dashboard_url, env)
    submission_id = f"needle-{secrets.token_hex(8)}"
    submit_when_agent_ready(client, entrypoint, submission_id, ready_timeout, head_log, head=head)
    follow_logs(client, submission_id)
    outcome = wait_for_job(client, submission_id)
    log.info("job %s: %s %s", submission_id, outcome.status, outcome.message)
    return outcome


def submit_when_agent_ready(
    client: JobSubmissionClient,
    entrypoint: list[str],
    submission_id: str,
    ready_timeout: float,
    head_log: str | Path | None = None,
    retry_s: float = 2.0,
    head: LocalRayHead | None = None,
) -> None:
    """Submit ``entrypoint`` under ``submission_id``, again while the job agent is starting."""
    # Quoted: the job server runs the entrypoint through a shell, which must not re-split or expand it.
    command = shlex.join(entrypoint)
    address = client.get_address()
    log.info("submitting to %s as %s: %s", address, submission_id, command)
    deadline = time.monotonic() + ready_timeout
    while not _try_submit(client, command, submission_id):
        if time.monotonic() + retry_s > deadline:
            where = f"the head's log: {head_log}; " if head_log else ""
            raise RayHeadError(
                f"the Ray head at {address} had no job agent ready after {ready_timeout:.0f}s "
                f"({where}the agent's own log: dashboard_agent.log in the Ray session's logs directory)"
                f"{clash_note(head) if head is not None else ''}"
            )
        log.info("the Ray head's job agent is not up yet; submitting again in %.0fs", retry_s)
        time.sleep(retry_s)


def _try_submit(client: JobSubmissionClient, command: str, submission_id: str) -> bool:
    """True once submitted; False while the head's job agent is not up (JobSubmitError otherwise)."""
    from ray.exceptions import AuthenticationError

    try:
        client.submit_job(entrypoint=command, submission_id=submission_id)
    except (RuntimeError, OSError, AuthenticationError) as exc:
        if AGENT_NOT_READY in str(exc):
            return False
        raise JobSubmitError(
            f"the job server at {client.get_address()} refused job {submission_id}: {str(exc)[-2000:]}"
        ) from exc
    return True


def follow_logs(client: JobSubmissionClient, submission_id: str) -> None:
    """Write the job's logs to stdout as it produces them, until it ends.

    Best effort: a lost stream is logged, and the job's status still decides (:func:`wait_for_job`).
    """
    import aiohttp

    async def tail() -> None:
        async for chunk in client.tail_job_logs(submission_id):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    try:
        asyncio.run(tail())
    except (RuntimeError, OSError, aiohttp.ClientError) as exc:
        log.warning(
            "lost the log stream of job %s (%s); waiting for its status (its logs: ray job logs --address %s %s)",
            submission_id,
            exc,
            client.get_address(),
            submission_id,
        )


def wait_for_job(client: JobSubmissionClient, submission_id: str, poll_s: float = 1.0) -> JobOutcome:
    """The job's final status, polled until final (the log stream normally ends with the job; a
    head that goes away raises)."""
    while True:
        info = client.get_job_info(submission_id)
        if info.status.is_terminal():
            # its first line: the rest repeats the tail of the logs already followed
            return JobOutcome(submission_id, str(info.status), (info.message or "").split("\n", 1)[0])
        time.sleep(poll_s)
