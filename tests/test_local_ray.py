"""Job submission waits, bounded, for the head's job agent: `ray job submit` (the real CLI) against a
stand-in Ray dashboard on 127.0.0.1 that refuses jobs the way a head whose agent is still starting does."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from cluster.local_ray import JobSubmitError, RayHeadError, job_status, submit_when_agent_ready

pytestmark = pytest.mark.slow  # each `ray job submit` imports Ray (seconds)


class _Dashboard(BaseHTTPRequestHandler):
    refusals = 0  # submissions answered "no agent" before one is accepted (-1: always)
    reply_500 = "No available agent to submit job, please try again later."
    submitted: ClassVar[list[dict]] = []

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
        if self.path == "/api/version":
            import ray

            return self._reply(
                200,
                json.dumps({"version": "4", "ray_version": ray.__version__, "ray_commit": "x", "session_name": "s"}),
            )
        if self.path.startswith("/api/jobs/"):
            return self._reply(200, json.dumps({"status": "SUCCEEDED"}))
        self._reply(404, "")

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
    _Dashboard.submitted = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Dashboard)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _env():
    import os

    from cluster.local_ray import bin_dir

    return {**os.environ, "PATH": f"{bin_dir()}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_submission_waits_for_the_job_agent(dashboard):
    _Dashboard.refusals, _Dashboard.reply_500 = 2, "No available agent to submit job, please try again later."
    submit_when_agent_ready(dashboard, ["echo", "hi"], _env(), "needle-test", ready_timeout=120, retry_s=0.1)
    assert [s["submission_id"] for s in _Dashboard.submitted] == ["needle-test"]  # once, after two refusals
    assert _Dashboard.submitted[0]["entrypoint"] == "echo hi"
    assert job_status(dashboard, "needle-test", _env()) == "SUCCEEDED"


def test_a_head_that_never_gets_an_agent_is_a_bounded_error_naming_its_log(dashboard, tmp_path):
    _Dashboard.refusals, _Dashboard.reply_500 = -1, "No available agent to submit job, please try again later."
    with pytest.raises(RayHeadError, match=r"no job agent ready after 1s \(the head's log: .*ray_head\.log"):
        submit_when_agent_ready(
            dashboard, ["echo"], _env(), "needle-x", ready_timeout=1, head_log=tmp_path / "ray_head.log", retry_s=0.2
        )
    assert not _Dashboard.submitted


def test_other_refusals_are_not_retried(dashboard):
    _Dashboard.refusals, _Dashboard.reply_500 = 1, "Traceback: something else broke"
    with pytest.raises(JobSubmitError, match="something else broke"):
        submit_when_agent_ready(dashboard, ["echo"], _env(), "needle-y", ready_timeout=60, retry_s=0.1)
