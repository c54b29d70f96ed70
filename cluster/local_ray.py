"""A local Ray head for the demo: started bound to 127.0.0.1, stopped by its own PID.

Never ``ray stop``: it kills every Ray process on the machine, including other users' clusters.
The head runs ``ray start --head --block`` in its own process group, so stopping that group stops
exactly the processes this head started. Token authentication stays on: a fresh token is made for
the head and passed to every client through the environment (``RAY_AUTH_MODE=token``).
"""

from __future__ import annotations

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
        str(bin_dir() / "ray"), "start", "--head", "--block",
        "--node-ip-address=127.0.0.1", f"--port={port}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
        "--disable-usage-stats",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    try:
        process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        if log_file:
            out.close()  # the child holds its own descriptor
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


def submit_job(dashboard_url: str, entrypoint: list[str], env: dict[str, str] | None = None) -> int:
    """``ray job submit`` an entrypoint to the cluster at ``dashboard_url`` and wait for it.

    ``env``: the client environment (a head started here passes its token); default: ours, with
    this interpreter's scripts on PATH. Returns the job's exit status.
    """
    cmd = [str(bin_dir() / "ray"), "job", "submit", "--address", dashboard_url, "--", *entrypoint]
    log.info("submitting: %s", " ".join(cmd))
    if env is None:
        env = {**os.environ, "PATH": f"{bin_dir()}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(cmd, env=env).returncode
