"""Job submission through Ray's JobSubmissionClient against a stand-in Ray dashboard on 127.0.0.1:
it waits, bounded, for a head whose job agent is still starting, sends the head's token, and
reports how the job ended."""

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
