"""A local Ray head for the demo: started bound to 127.0.0.1, stopped by its own PID.

Never ``ray stop``: it kills every Ray process on the machine, including other users' clusters.
The head runs ``ray start --head --block`` in its own process group, so stopping that group stops
exactly the processes this head started. Token authentication stays on: a fresh token is made for
the head and passed to every client through the environment (``RAY_AUTH_MODE=token``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bin_dir() -> Path:
    """The directory of this interpreter's console scripts (``ray``, ``needle``)."""
    return Path(sys.executable).parent


@dataclass
class LocalRayHead:
    process: subprocess.Popen
    gcs_address: str  # for ray.init(address=...)
    dashboard_url: str  # for job submission (submit_job)
    env: dict[str, str] = field(repr=False)  # environment every client of this head must use

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
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
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
    """Start a Ray head on 127.0.0.1 with the dashboard (job submission) and the ports Ray would
    otherwise fix on free ones."""
    port, dashboard_port = free_port(), free_port()
    env = client_env(secrets.token_hex(24))
    cmd = [
        str(bin_dir() / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}",
        # Ray's fixed defaults (agent 52365, client server 10001) clash with any other Ray on the
        # machine (a test's ray.init, a user's cluster): its job agent then dies and no job can start.
        f"--dashboard-agent-listen-port={free_port()}",
        f"--ray-client-server-port={free_port()}",
        "--disable-usage-stats",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    # the child keeps its own descriptor of the log: ours is closed once it has started
    with open(log_file, "ab") if log_file else contextlib.nullcontext(subprocess.DEVNULL) as out:
        process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    head = LocalRayHead(process, f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard_port}", env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RayHeadError(f"ray start exited with code {process.returncode} (log: {log_file})")
        if _dashboard_answers(head):
            log.info("local Ray head up (pid %d), dashboard %s", process.pid, head.dashboard_url)
            return head
        time.sleep(1.0)
    head.stop()
    raise RayHeadError(f"the Ray dashboard did not answer within {timeout:.0f}s (log: {log_file})")


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
) -> JobOutcome:
    """Submit an entrypoint as a job to the cluster at ``dashboard_url``, write its logs to stdout
    as they come, and return how it ended.

    The submission is retried while the head answers that its job agent is not up yet, for at most
    ``ready_timeout`` seconds (RayHeadError naming ``head_log`` after that). ``env``: the client
    environment whose token authenticates (a head started here: ``head.env``); default: ours.
    """
    client = job_client(dashboard_url, env)
    submission_id = f"needle-{secrets.token_hex(8)}"
    submit_when_agent_ready(client, entrypoint, submission_id, ready_timeout, head_log)
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
