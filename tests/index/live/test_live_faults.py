"""Nothing lost, whatever fails (issue 55): every storage call of ``needle index add``,
``add --replace``, ``delete`` and ``compact --keep 1``, locally and on S3 (moto), made to fail in
turn: an error before the call, an error after it took effect (a PUT applied whose answer was
lost), and a SIGKILL at it. After each, the index opens at the parent or the new generation with
exactly that generation's live rows, an index opened before keeps answering, running the command
again converges on the change made once, and compaction then leaves only what the newest
generation names. The kill points of tests/index/live/test_live_kill.py are the named steps; these
are every call.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import index.live.retrain as retrain_module
import index.live.writer as writer_module
from core.location import location_of
from core.storage import s3_client
from index.generation import Generation
from index.live.add_rows import AddConfig
from index.live.add_rows import main as add
from index.live.compact import CompactConfig
from index.live.compact import main as compact
from index.live.delete_rows import DeleteConfig
from index.live.delete_rows import main as delete
from index.live.generations import (
    GENERATIONS_DIR,
    PublishOutcomeUnknown,
    latest_number,
    manifest_name,
    read_manifest,
)
from index.live.inspect import live_keys
from index.search import load_index
from tests.support.faults import Faults, FaultyLocation, Halted
from tests.support.index import clustered_unit_vectors, write_descriptor_file
from tests.support.indexes import LIVE_FLAT
from tests.support.live import D, Live, assert_exact

COMMANDS = ("add", "replace", "delete", "compact")
DELETED = ["t1/00003", "t1/00004", "t0/00010"]
WRITES = ("create_exclusive", "replace", "upload", "remove", "write_json", "commit_file")
XQ = clustered_unit_vectors(6, D, seed=41).astype(np.float32)


@dataclass
class Base:
    tmp: Path
    index: Path  # generation 1: the build, then two keys deleted (so that compact has work)
    live: Live  # its live rows
    more: np.ndarray  # the vectors ``add`` adds (file t5)
    again: np.ndarray  # the vectors ``add --replace`` adds (file t9: two live keys, one new)
    replaced: list[str]


@pytest.fixture(scope="module")
def base(synthetic_indexes, tmp_path_factory) -> Base:
    tmp = tmp_path_factory.mktemp("faults")
    index, xb = synthetic_indexes.copy(LIVE_FLAT, tmp)
    live = Live.of_files(LIVE_FLAT.parts(xb))
    delete(DeleteConfig(), ["t0/00001", "t2/00007"], index)
    for key in ("t0/00001", "t2/00007"):
        del live.rows[key]
    more = clustered_unit_vectors(12, D, seed=5)
    write_descriptor_file(tmp / "more", "t5", 5, more)
    replaced = ["t0/00002", "t2/00011", "t9/new"]
    again = clustered_unit_vectors(3, D, seed=77)
    write_descriptor_file(tmp / "again", "t9", 9, again, keys=replaced)
    return Base(tmp, index, live, more, again, replaced)


def run(command: str, url: str, base: Base, endpoint: str | None) -> None:
    if command == "add":
        add(AddConfig(s3_endpoint_url=endpoint), base.tmp / "more", url)
    elif command == "replace":
        add(AddConfig(replace=True, s3_endpoint_url=endpoint), base.tmp / "again", url)
    elif command == "delete":
        delete(DeleteConfig(s3_endpoint_url=endpoint), DELETED, url)
    elif command == "retrain":  # compact --retrain always: phase A unlocked, phase B carries and publishes
        compact(CompactConfig(keep=1, retrain="always", s3_endpoint_url=endpoint), url)
    else:
        compact(CompactConfig(keep=1, s3_endpoint_url=endpoint), url)


def after(command: str, base: Base) -> Live:
    out = Live()
    out.rows = dict(base.live.rows)
    if command == "add":
        out.add_file("t5", 5, base.more)
    if command == "replace":
        out.add_file("t9", 9, base.again, keys=base.replaced)
    if command == "delete":
        for key in DELETED:
            del out.rows[key]
    return out


class Backend:
    """Where each case's copy of the base index lives, and how it is checked."""

    endpoint: str | None = None

    def fresh(self, case: str) -> str: ...

    def check(self, url: str, expected: Live) -> None:
        """The index at ``url`` opens at its newest generation with exactly ``expected``'s live rows."""


class LocalBackend(Backend):
    def __init__(self, base: Base, root: Path):
        self.base, self.root = base, root

    def fresh(self, case: str) -> str:
        target = self.root / case
        shutil.copytree(self.base.index, target, ignore=shutil.ignore_patterns("writer.lock"))
        return str(target)

    def check(self, url: str, expected: Live) -> None:
        assert_exact(Path(url), expected, XQ)  # its answers equal a brute force over the live rows


class S3Backend(Backend):
    def __init__(self, base: Base, endpoint: str | None, bucket: str):
        self.base, self.endpoint, self.bucket = base, endpoint, bucket
        self.client = s3_client(endpoint)
        self.client.create_bucket(Bucket=bucket)

    def fresh(self, case: str) -> str:
        for path in self.base.index.rglob("*"):
            if path.is_file() and path.name != "writer.lock":
                key = f"{case}/{path.relative_to(self.base.index)}"
                self.client.put_object(Bucket=self.bucket, Key=key, Body=path.read_bytes())
        return f"s3://{self.bucket}/{case}"

    def check(self, url: str, expected: Live) -> None:
        """Its live keys (each segment's ids and delete set, as ``needle index keys`` reads them),
        and every file each segment's ``shard_infos.json`` lists there with its size (one listing):
        what opening it reads. Its answers are compared in test_live_kill.py's S3 runs."""
        location = location_of(url, self.endpoint)
        assert sorted(live_keys(location)) == sorted(expected.rows)
        prefix = url.removeprefix(f"s3://{self.bucket}/") + "/"
        sizes = {
            item["Key"][len(prefix) :]: item["Size"]
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            for item in page.get("Contents", [])
        }
        for segment in read_manifest(location).segments:
            infos = json.loads(location.read_required(f"{segment.name}/shard_infos.json"))
            for file, recorded in infos["checksums"].items():
                assert sizes.get(f"{segment.name}/{file}") == recorded["bytes"], (segment.name, file)


def with_faults(monkeypatch, faults: Faults) -> None:
    """Every location a writer opens goes through ``faults``: the writer's, and a retrain's phase A
    (it reads the generation it started on, and re-encodes its rows, before it takes the lock)."""
    for module in (writer_module, retrain_module):
        real = module.location_of
        monkeypatch.setattr(module, "location_of", lambda *a, _real=real, **k: FaultyLocation(_real(*a, **k), faults))


def killed_at(action: Callable[[], None]) -> int:
    """Run ``action`` in a forked child; the signal that ended it (0: it exited)."""
    pid = os.fork()
    if pid == 0:  # the child: as a writer process, killed by its fault (or exiting without cleanup)
        try:
            action()
        finally:
            os._exit(0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("the faulted writer hung")


def count_calls(backend: Backend, command: str, base: Base, monkeypatch) -> list[str]:
    faults = Faults()
    with monkeypatch.context() as patch:
        with_faults(patch, faults)
        url = backend.fresh(f"{command}-count")
        run(command, url, base, backend.endpoint)
    return faults.calls


def assert_only_the_newest_remains(url: str, backend: Backend) -> None:
    """After ``compact --keep 1``: the index holds the newest generation's files and nothing else
    (no orphan of a failed writer, no scratch, no temporary file)."""
    location = location_of(url, backend.endpoint)
    newest = read_manifest(location)
    named = {s.name for s in newest.segments} | {s.deleted.file for s in newest.segments if s.deleted}
    top = set(location.list(""))
    assert top - {"deletes"} <= {"index_infos.json", "CURRENT.json", GENERATIONS_DIR} | named, top
    assert {n for n in top if n.startswith(("seg_", "shard_"))} == {s.name for s in newest.segments}
    assert set(location.list("deletes")) == {s.deleted.file for s in newest.segments if s.deleted}
    assert not [n for n in location.list(GENERATIONS_DIR) if n.endswith(".tmp") or "/." in n]


def check_case(backend: Backend, command: str, number: int, kind: str, base: Base, monkeypatch) -> None:
    """The case: storage call ``number`` of ``command`` fails as ``kind``."""
    url = backend.fresh(f"{command}-{number}-{kind}")
    held = load_index(Path(url)) if isinstance(backend, LocalBackend) else None
    faults = Faults(number, kind)
    unknown = False  # the writer could not tell whether it published: its files are kept
    with monkeypatch.context() as patch:
        with_faults(patch, faults)
        if kind == "kill":
            assert killed_at(lambda: run(command, url, base, backend.endpoint)) == signal.SIGKILL
        elif kind == "halt":
            with pytest.raises(Halted):
                run(command, url, base, backend.endpoint)
        else:
            try:
                run(command, url, base, backend.endpoint)
            except Exception as exc:  # the failure is the writer's to report; what is left is checked below
                assert "injected fault" in str(exc) or "injected fault" in str(exc.__cause__), exc
                unknown = isinstance(exc, PublishOutcomeUnknown)
    generation = latest_number(location_of(url, backend.endpoint))
    assert generation in (1, 2), (command, number, kind, generation)
    backend.check(url, after(command, base) if generation == 2 else base.live)
    if held is not None:  # a server that opened the parent answers from it all along
        _, I_ref = base.live.brute_force(XQ, 10)
        np.testing.assert_array_equal(held.search(XQ, 10)[1], I_ref)
    run(command, url, base, backend.endpoint)  # again, without faults: the change made once
    backend.check(url, after(command, base))
    if kind in ("kill", "halt") or unknown or command in ("compact", "retrain"):  # leftovers: compaction's
        if command not in ("compact", "retrain"):
            compact(CompactConfig(keep=1, s3_endpoint_url=backend.endpoint), url)
            backend.check(url, after(command, base))
        assert_only_the_newest_remains(url, backend)
    else:  # the writer removed what it wrote: no file that no manifest names
        assert_no_orphans(url, backend)


def assert_no_orphans(url: str, backend: Backend) -> None:
    location = location_of(url, backend.endpoint)
    named: set[str] = set()
    for number in range(latest_number(location) + 1):
        manifest = read_manifest(location, number)
        named |= {s.name for s in manifest.segments} | {s.deleted.file for s in manifest.segments if s.deleted}
    present = {n for n in location.list("") if n.startswith(("seg_", "shard_"))} | set(location.list("deletes"))
    assert present <= named, present - named
    assert not location.list(".writer-scratch")
    assert not [n for n in location.list("") if n.startswith(".retrain-")]  # a retrain's scratch: removed on error


def cases(calls: list[str], local: bool) -> list[tuple[int, str]]:
    """Locally: an error before every call, an error after every write, and a SIGKILL (a forked
    writer) at every call, as a local writer also writes files in place between calls.

    On S3, where every byte goes through a call: an error after every write, a halt (a kill as
    storage sees it: in-process, nothing from that call on reaches storage) at every write, which
    leaves every state a kill can leave (a kill at a read leaves what a kill at the next write
    does), and an error before every call from the first write on (before it, any failing read
    leaves the same: nothing written, nothing to remove; the first read stands for them). Real
    SIGKILLs of S3 writers, at the named points: test_live_kill.py."""
    out = []
    first_write = next((i for i, c in enumerate(calls, 1) if c.split()[0] in WRITES), len(calls))
    for number, call in enumerate(calls, 1):
        write = call.split()[0] in WRITES
        if local:
            out += [(number, "error"), (number, "kill")] + [(number, "error_after")] * write
        elif number == 1 or number >= first_write:
            out += [(number, "error")] + [(number, "halt"), (number, "error_after")] * write
    return out


def check_every_call(backend: Backend, command: str, base: Base, monkeypatch) -> None:
    calls = count_calls(backend, command, base, monkeypatch)
    assert calls, "the writer made no storage call through its location"
    for number, kind in cases(calls, local=isinstance(backend, LocalBackend)):
        try:
            check_case(backend, command, number, kind, base, monkeypatch)
        except BaseException as exc:
            raise AssertionError(f"{command}: {kind} at storage call {number} ({calls[number - 1]}): {exc}") from exc


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_every_storage_call_of_a_local_writer_may_fail(base, tmp_path, monkeypatch, command):
    check_every_call(LocalBackend(base, tmp_path), command, base, monkeypatch)


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "replace"])
def test_every_storage_call_of_an_s3_writer_may_fail(base, monkeypatch, command):
    """moto in-process (every request ~5 ms, not ~30 through its server): the same S3 semantics,
    conditional writes included. Not ``add --replace``: its storage calls are an add's and a
    delete's (its delete set), each failed here at every call, and its own at every call locally
    (it took a minute of the suite)."""
    from moto import mock_aws

    with mock_aws():
        check_every_call(S3Backend(base, None, f"faults-{command}"), command, base, monkeypatch)


@pytest.mark.slow
def test_every_storage_call_of_a_local_retrain_may_fail(base, tmp_path, monkeypatch):
    """``compact --retrain always`` (here flat to flat: the re-encoding and publishing, no tuning)."""
    check_every_call(LocalBackend(base, tmp_path), "retrain", base, monkeypatch)


def test_a_manifest_published_by_a_request_whose_answer_was_lost_is_kept(base, tmp_path, monkeypatch):
    """The publish itself applied, its caller told it failed: the writer reads the manifest back,
    finds its own, and reports success; nothing it wrote is removed (the fast test of the case the
    suite covers for every call)."""
    backend = LocalBackend(base, tmp_path)
    calls = count_calls(backend, "delete", base, monkeypatch)
    number = next(i for i, c in enumerate(calls, 1) if c.startswith("create_exclusive generations/"))
    url = backend.fresh("lost-answer")
    with monkeypatch.context() as patch:
        with_faults(patch, Faults(number, "error_after"))
        change = delete(DeleteConfig(), DELETED, url)
    assert change["generation"] == 2
    assert_exact(Path(url), after("delete", base), XQ)


def test_a_pointer_that_cannot_be_written_loses_nothing(base, tmp_path, monkeypatch):
    """Writing CURRENT.json fails after the manifest is published (a full disk): the command
    reports the generation it published, and every file that generation names is there."""
    backend = LocalBackend(base, tmp_path)
    calls = count_calls(backend, "add", base, monkeypatch)
    number = next(i for i, c in enumerate(calls, 1) if c == "replace CURRENT.json")
    url = backend.fresh("no-pointer")
    with monkeypatch.context() as patch:
        with_faults(patch, Faults(number, "error"))
        change = add(AddConfig(), base.tmp / "more", url)
    assert change["generation"] == 2
    manifest = Generation.from_json(
        (Path(url) / manifest_name(2)).read_bytes(), "m", 2
    )  # the new segments are all there
    assert all((Path(url) / s.name / "shard_infos.json").is_file() for s in manifest.segments)
    assert_exact(Path(url), after("add", base), XQ)
