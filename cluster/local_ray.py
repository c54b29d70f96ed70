"""A local Ray head for the demo: started bound to 127.0.0.1, stopped by its own PID.

Never ``ray stop``: it kills every Ray process on the machine, including other users' clusters.
The head runs ``ray start --head --block`` in its own process group, so stopping that group stops
exactly the processes this head started. Token authentication stays on: a fresh token is made for
the head and passed to every client through the environment (``RAY_AUTH_MODE=token``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

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
    dashboard_url: str  # for `ray job submit --address ...`
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
    """Start a Ray head on 127.0.0.1 with the dashboard (job submission) on a free port."""
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
TERMINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")


class JobSubmitError(RuntimeError):
    """``ray job submit`` was refused for a reason other than a job agent still starting."""


def submit_job(
    dashboard_url: str,
    entrypoint: list[str],
    env: dict[str, str] | None = None,
    *,
    ready_timeout: float = 180.0,
    head_log: str | Path | None = None,
) -> int:
    """``ray job submit`` an entrypoint to the cluster at ``dashboard_url``, stream its logs, and
    return its exit status (0: SUCCEEDED).

    The submission is retried while the head answers that its job agent is not up yet, for at most
    ``ready_timeout`` seconds (RayHeadError naming ``head_log`` after that). ``env``: the client
    environment (a head started here passes its token); default: ours, with this interpreter's
    scripts on PATH.
    """
    if env is None:
        env = {**os.environ, "PATH": f"{bin_dir()}{os.pathsep}{os.environ.get('PATH', '')}"}
    submission_id = f"needle-{secrets.token_hex(8)}"
    submit_when_agent_ready(dashboard_url, entrypoint, env, submission_id, ready_timeout, head_log)
    ray = str(bin_dir() / "ray")
    subprocess.run([ray, "job", "logs", "--address", dashboard_url, "--follow", submission_id], env=env)
    status = job_status(dashboard_url, submission_id, env)
    log.info("job %s: %s", submission_id, status)
    return 0 if status == "SUCCEEDED" else 1


def submit_when_agent_ready(
    dashboard_url: str,
    entrypoint: list[str],
    env: dict[str, str],
    submission_id: str,
    ready_timeout: float,
    head_log: str | Path | None = None,
    retry_s: float = 2.0,
) -> None:
    """``ray job submit --no-wait`` under ``submission_id``, again while the job agent is starting."""
    cmd = [
        str(bin_dir() / "ray"),
        "job",
        "submit",
        "--address",
        dashboard_url,
        "--submission-id",
        submission_id,
        "--no-wait",
        "--",
        *entrypoint,
    ]
    log.info("submitting: %s", " ".join(cmd))
    deadline = time.monotonic() + ready_timeout
    while True:
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        output = run.stdout + run.stderr
        if run.returncode == 0:
            sys.stdout.write(run.stdout)
            return
        if AGENT_NOT_READY not in output:
            raise JobSubmitError(f"ray job submit to {dashboard_url} failed (exit {run.returncode}): {output[-2000:]}")
        if time.monotonic() + retry_s > deadline:
            where = f"the head's log: {head_log}; " if head_log else ""
            raise RayHeadError(
                f"the Ray head at {dashboard_url} had no job agent ready after {ready_timeout:.0f}s "
                f"({where}the agent's own log: dashboard_agent.log in the Ray session's logs directory)"
            )
        log.info("the Ray head's job agent is not up yet; submitting again in %.0fs", retry_s)
        time.sleep(retry_s)


def job_status(dashboard_url: str, submission_id: str, env: dict[str, str]) -> str:
    """The job's final status from the Jobs REST API (``GET /api/jobs/<id>``), polled until final
    (the logs stream normally ends with the job; a head that goes away raises)."""
    headers = {"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"} if env.get("RAY_AUTH_TOKEN") else {}
    request = urllib.request.Request(f"{dashboard_url}/api/jobs/{submission_id}", headers=headers)
    while True:
        with urllib.request.urlopen(request, timeout=10) as response:
            status = json.loads(response.read())["status"]
        if status in TERMINAL_STATUSES:
            return status
        time.sleep(1.0)
