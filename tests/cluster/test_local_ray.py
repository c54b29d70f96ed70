"""Job submission through Ray's JobSubmissionClient against a stand-in Ray dashboard on 127.0.0.1:
it waits, bounded, for a head whose job agent is still starting, sends the head's token, and
reports how the job ended. A local Ray started by needle (the demo's head, connect_ray's instance)
listens on loopback only, the head's ports are free ones beside another Ray, and a port another
process holds is named."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from cluster.local_ray import JobSubmitError, RayHeadError, job_client, submit_job, submit_when_agent_ready

pytestmark = pytest.mark.slow  # imports Ray's job client (seconds)


class _Dashboard(BaseHTTPRequestHandler):
    refusals = 0  # submissions answered "no agent" before one is accepted (-1: always)
    reply_500 = "No available agent to submit job, please try again later."
    final = ("SUCCEEDED", "Job finished successfully.")  # (status, message) of every job
    submitted: ClassVar[list[dict]] = []
    authorizations: ClassVar[list[str]] = []

    def log_message(self, *args):  # quiet
        pass

    def _reply(self, code: int, body: str, kind: str = "application/json") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        type(self).authorizations.append(self.headers.get("Authorization", ""))
        if self.path == "/api/version":
            import ray

            return self._reply(
                200,
                json.dumps({"version": "4", "ray_version": ray.__version__, "ray_commit": "x", "session_name": "s"}),
            )
        if self.path.startswith("/api/jobs/") and not self.path.endswith("/tail"):
            status, message = type(self).final
            job = {"type": "SUBMISSION", "status": status, "message": message, "entrypoint": "echo"}
            return self._reply(200, json.dumps({**job, "submission_id": self.path.split("/")[3]}))
        self._reply(404, "")  # no log stream (websocket): the job's status still decides

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        if cls.refusals != 0:
            cls.refusals -= 1 if cls.refusals > 0 else 0
            return self._reply(500, cls.reply_500, "text/plain")
        cls.submitted.append(body)
        self._reply(200, json.dumps({"job_id": body["submission_id"], "submission_id": body["submission_id"]}))


@pytest.fixture
def dashboard():
    _Dashboard.submitted, _Dashboard.authorizations = [], []
    _Dashboard.refusals, _Dashboard.final = 0, ("SUCCEEDED", "Job finished successfully.")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Dashboard)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_submission_waits_for_the_job_agent(dashboard):
    _Dashboard.refusals, _Dashboard.reply_500 = 2, "No available agent to submit job, please try again later."
    client = job_client(dashboard, {"RAY_AUTH_TOKEN": "tok"})
    submit_when_agent_ready(client, ["echo", "hi"], "needle-test", ready_timeout=120, retry_s=0.1)
    assert [s["submission_id"] for s in _Dashboard.submitted] == ["needle-test"]  # once, after two refusals
    assert _Dashboard.submitted[0]["entrypoint"] == "echo hi"
    assert set(_Dashboard.authorizations) == {"Bearer tok"}  # the head's token, not this process's


def test_the_entrypoint_reaches_the_shell_as_given(dashboard):
    client = job_client(dashboard, {})
    submit_when_agent_ready(client, ["needle", "ingest", "--shards", "/d/{0..1}.tar", "a b"], "needle-q", 60)
    assert _Dashboard.submitted[0]["entrypoint"] == "needle ingest --shards '/d/{0..1}.tar' 'a b'"


def test_a_head_that_never_gets_an_agent_is_a_bounded_error_naming_its_log(dashboard, tmp_path):
    _Dashboard.refusals, _Dashboard.reply_500 = -1, "No available agent to submit job, please try again later."
    with pytest.raises(RayHeadError, match=r"no job agent ready after 1s \(the head's log: .*ray_head\.log"):
        submit_when_agent_ready(
            job_client(dashboard, {}),
            ["echo"],
            "needle-x",
            ready_timeout=1,
            head_log=tmp_path / "ray_head.log",
            retry_s=0.2,
        )
    assert not _Dashboard.submitted


def test_other_refusals_are_not_retried(dashboard):
    _Dashboard.refusals, _Dashboard.reply_500 = 1, "Traceback: something else broke"
    with pytest.raises(JobSubmitError, match="something else broke"):
        submit_when_agent_ready(job_client(dashboard, {}), ["echo"], "needle-y", ready_timeout=60, retry_s=0.1)


@pytest.mark.parametrize("final", [("SUCCEEDED", "Job finished successfully."), ("FAILED", "exit code 1")])
def test_submit_job_reports_how_the_job_ended(dashboard, final):
    _Dashboard.final = final
    outcome = submit_job(dashboard, ["echo", "hi"], {"RAY_AUTH_TOKEN": "tok"})
    assert outcome.submission_id == _Dashboard.submitted[0]["submission_id"]
    assert (outcome.status, outcome.message, outcome.ok) == (*final, final[0] == "SUCCEEDED")


def test_no_job_server_is_an_error_naming_the_address():
    from cluster.local_ray import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(JobSubmitError, match=url):
        job_client(url, {})


# --- loopback only, every port free, a clash named -----------------------------------------------


def test_a_port_another_process_holds_is_named():
    import os
    import socket

    from cluster.local_ray import port_clashes

    held = socket.create_server(("127.0.0.1", 0))
    port = held.getsockname()[1]
    with held:
        found = port_clashes({"--dashboard-agent-listen-port": port, "--port": free_port_now()})
        assert found == [f"--dashboard-agent-listen-port {port}: held by pid {os.getpid()} ({psutil_name()})"]
        assert port_clashes({"--port": port}, head_session=os.getsid(os.getpid())) == []  # the head's own


def free_port_now() -> int:
    from cluster.local_ray import free_port

    return free_port()


def psutil_name() -> str:
    import os

    import ray  # noqa: F401

    # isort: split
    import psutil

    return psutil.Process(os.getpid()).name()


def test_no_job_agent_and_a_held_port_says_which(dashboard):
    """A head whose job agent never came, one of its ports held by another process: the error
    names the port, its flag and who holds it."""
    import os
    import socket
    import subprocess
    import sys

    from cluster.local_ray import LocalRayHead

    _Dashboard.refusals, _Dashboard.reply_500 = -1, "No available agent to submit job, please try again later."
    held = socket.create_server(("127.0.0.1", 0))
    port = held.getsockname()[1]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    head = LocalRayHead(other, "127.0.0.1:1", dashboard, {}, {"--dashboard-agent-listen-port": port})
    try:
        with (
            held,
            pytest.raises(
                RayHeadError, match=rf"port clash: --dashboard-agent-listen-port {port}: held by pid {os.getpid()}"
            ),
        ):
            submit_when_agent_ready(job_client(dashboard, {}), ["echo"], "needle-z", 1, retry_s=0.2, head=head)
    finally:
        other.kill()
        other.wait()


CONNECT_AND_LIST = """
import json, os, sys
import ray  # before connect_ray: Ray has read its settings already
from cluster.connect import connect_ray
sys.path.insert(0, {root!r})
from tests.support.ports import non_loopback_listeners

connect_ray(None)

@ray.remote
class Channel:
    def open(self):
        from cluster.ray_shards import node_address
        from shards.direct import DirectServer
        self.server = DirectServer(lambda message: bytes(message), node_address())
        return self.server.endpoint.host, self.server.endpoint.port

channel = Channel.remote()
host, port = ray.get(channel.open.remote())
import psutil
me = psutil.Process()
beyond, ports = non_loopback_listeners([me.pid] + [p.pid for p in me.children(recursive=True)])
print(json.dumps({{"node_ip": ray.util.get_node_ip_address(), "channel": [host, port], "beyond": beyond,
                  "ports": ports}}))
ray.shutdown()
"""


@pytest.mark.ray
@pytest.mark.slow
def test_a_local_ray_started_by_needle_listens_on_loopback_only(tmp_path):
    """connect_ray's local instance (`needle serve --ray-shards`, ingest and index jobs without a
    cluster): Ray alone would take the machine's external address; every process of it, a shard
    channel included, listens on loopback only."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = str(root)
    script = CONNECT_AND_LIST.format(root=str(root))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["node_ip"] == "127.0.0.1" and found["channel"][0] == "127.0.0.1"
    assert found["channel"][1] in found["ports"]
    assert not found["beyond"], f"listening beyond loopback: {found['beyond']}"


CONNECT_AND_WAIT = """
import json, os, stat, sys
import ray  # before connect_ray: Ray has read its settings already (connect_ray reads them again)
from cluster.connect import connect_ray

connect_ray(None)
path = os.environ["RAY_AUTH_TOKEN_PATH"]
modes = [oct(stat.S_IMODE(os.stat(p).st_mode)) for p in (path, os.path.dirname(path))]
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address, "token": path, "modes": modes}), flush=True)
sys.stdin.read()
ray.shutdown()
"""

JOIN = """
import sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False)
print("answer", ray.get(ray.remote(lambda: 41 + 1).remote()), flush=True)
"""


@pytest.mark.ray
@pytest.mark.slow
def test_a_local_ray_started_by_needle_refuses_clients_without_its_token(tmp_path):
    """connect_ray's local instance uses token authentication set explicitly (not Ray's default,
    which leaves ~/.ray/auth_token readable by every local user: mode 0644 here), its token in a
    file only its owner can read; a client without the token is refused, one with it joins."""
    import json
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PYTHONPATH=str(root), HOME=str(tmp_path), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    head = subprocess.Popen(
        [sys.executable, "-c", CONNECT_AND_WAIT], env=env, cwd=tmp_path, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        found = json.loads(head.stdout.readline())
        assert found["modes"] == ["0o600", "0o700"]
        assert not (tmp_path / ".ray" / "auth_token").exists()  # Ray's default file was never written
        stranger = subprocess.Popen(
            [sys.executable, "-c", JOIN, found["gcs"]], env=env, cwd=tmp_path,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        refused, deadline = False, time.monotonic() + 60
        while not refused and time.monotonic() < deadline and stranger.poll() is None:
            refused = "Authentication token is missing or incorrect" in stranger.stderr.readline()
        stranger.kill()
        assert refused and "answer" not in stranger.communicate()[0]
        member = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": found["token"]}
        joined = subprocess.run(
            [sys.executable, "-c", JOIN, found["gcs"]], env=member, cwd=tmp_path, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert "answer 42" in joined.stdout, joined.stderr[-2000:]
    finally:
        head.stdin.close()
        head.wait(60)


def test_the_auth_token_directory_is_removed_when_the_process_exits(tmp_path):
    """One ``needle-ray-auth-*`` directory per run would pile up in the temporary directory."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = "from cluster.local_ray import local_ray_with_token as t; p = t(); print(p); assert p.is_file()"
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    token = Path(done.stdout.strip().splitlines()[-1])
    assert token.parent.name.startswith("needle-ray-auth-") and token.parent.parent == tmp_path
    assert not token.parent.exists() and list(tmp_path.iterdir()) == []
