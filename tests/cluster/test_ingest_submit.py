"""``needle ingest --submit ADDRESS``: the same command, less --submit, as a Ray job on the cluster
at ADDRESS; its exit status says how the job ended."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from cli.build import submitted_command
from cli.main import main
from cluster.local_ray import JobOutcome

URL = "http://127.0.0.1:8265"
INGEST = ["ingest", "--shards", "/d/{000000..000001}.tar", "--out", "/d/desc", "--workers", "2"]


@pytest.mark.parametrize(
    "given", [["--submit", URL], [f"--submit={URL}"], ["--sub", URL]], ids=["spaced", "equals", "prefix"]
)
def test_the_submitted_command_is_the_command_without_submit(given):
    argv = ["-v", *INGEST[:3], *given, *INGEST[3:]]
    assert submitted_command(argv) == ["needle", "-v", *INGEST]


class _Submitted(list):
    """The calls of cluster.local_ray.submit_job, each answered with a job that ended ``status``."""

    status = "SUCCEEDED"

    def __call__(self, address: str, entrypoint: list[str], env=None, **kwargs) -> JobOutcome:
        self.append((address, entrypoint))
        return JobOutcome("needle-0123", self.status, "" if self.status == "SUCCEEDED" else "exit code 3")


@pytest.fixture
def submitted(monkeypatch):
    calls = _Submitted()
    monkeypatch.setattr("cluster.local_ray.submit_job", calls)
    return calls


def test_ingest_submit_runs_the_command_on_the_cluster(monkeypatch, submitted):
    monkeypatch.setattr(sys, "argv", ["needle", *INGEST, "--submit", URL])
    assert main() == 0
    assert submitted == [(URL, ["needle", *INGEST])]


def test_a_failed_job_exits_1_naming_its_id_and_status(monkeypatch, submitted, caplog):
    submitted.status = "FAILED"
    monkeypatch.setattr(sys, "argv", ["needle", *INGEST, "--submit", URL])
    with caplog.at_level(logging.ERROR):
        assert main() == 1
    assert "needle-0123" in caplog.text and "FAILED" in caplog.text and "exit code 3" in caplog.text


def test_bad_flags_are_refused_here_before_any_job(monkeypatch, submitted):
    argv = [*INGEST, "--pretrained", "--random-init", "--submit", URL]
    monkeypatch.setattr(sys, "argv", ["needle", *argv])
    assert main() == 2 and not submitted


def test_an_in_process_command_line_other_than_this_process_is_refused(submitted):
    # main(argv) with sys.argv (pytest's) holding no --submit: nothing to submit faithfully
    assert main([*INGEST, "--submit", URL]) == 2 and not submitted


@pytest.mark.ray
@pytest.mark.slow
def test_ingest_submit_to_a_local_head(ray_local, tmp_path, tiny_shards):
    """`make demo`'s head beside another Ray instance (this session's ray.init): its ports are all
    free ones (none of Ray's defaults), every process of it listens on 127.0.0.1 only, and
    `needle ingest --submit` runs there and reports a failed job as failed."""
    from cluster.local_ray import HEAD_PORT_FLAGS, start_head
    from tests.support.ports import head_pids, non_loopback_listeners

    head = start_head(num_cpus=2, log_file=tmp_path / "ray_head.log")
    try:
        defaults = {6379, 8265, 10001, 52365, 44217, 44227}
        assert set(head.ports) >= set(HEAD_PORT_FLAGS) and not defaults & set(head.ports.values())
        ok = _needle_ingest(head, str(tmp_path / "{000000..000001}.tar"), tmp_path / "desc")
        failed = _needle_ingest(head, str(tmp_path / "missing" / "*.tar"), tmp_path / "desc2")
        beyond, ports = non_loopback_listeners(head_pids(head))
        assert not beyond, f"the demo head listens beyond loopback: {beyond}"
        assert head.ports["--port"] in ports and head.ports["--dashboard-port"] in ports
    finally:
        head.stop()
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-4000:]
    assert sorted(p.name for p in (tmp_path / "desc").glob("*.parquet")) == ["000000.parquet", "000001.parquet"]
    assert "ingest summary" in ok.stdout  # the job's logs, followed here
    assert failed.returncode == 1, failed.stdout[-2000:] + failed.stderr[-4000:]
    assert "ended FAILED" in failed.stderr and "needle-" in failed.stderr


def _needle_ingest(head, shards: str, out) -> subprocess.CompletedProcess:
    flags = ["--resolution", "160", "--batch-size", "8", "--cpus-per-worker", "1", "--workers", "1"]
    command = ["ingest", "--shards", shards, "--out", str(out), *flags, "--submit", head.dashboard_url]
    # head.env: the head's token; the job's own environment is the head's
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *command], env=head.env, capture_output=True, text=True, timeout=900
    )
