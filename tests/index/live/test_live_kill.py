"""Nothing lost (issue 43): a writer killed with SIGKILL at any step of ``needle index add``,
``delete`` or ``compact`` leaves an index that opens at its last published generation and answers
from it; running the command again completes the change exactly once. Locally and on S3 (moto).

Each kill point (core.kill_points) is a place in the writer: after the new segments are encoded
(``parts_added``), after a segment or a delete set is stored (``segment_written``,
``deletes_written``), just before the manifest (``before_publish``), between the manifest and the
pointer (``published``), and while compaction removes old files (``removing``).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core.location import location_of
from core.storage import s3_client
from index.live.generations import latest_number
from index.search import load_index
from tests.support.index import clustered_unit_vectors, write_descriptor_file
from tests.support.indexes import LIVE_FLAT
from tests.support.live import D, Live, assert_exact

ROOT = Path(__file__).resolve().parents[3]
POINTS = {
    "add": ["parts_added", "segment_written", "before_publish", "published"],
    "delete": ["deletes_written", "before_publish", "published"],
    "compact": ["segment_written", "before_publish", "published", "removing"],
}
CASES = [(command, point) for command, points in POINTS.items() for point in points]


def needle(args: list[str], kill_at: str | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("NEEDLE_KILL_AT", None)
    if kill_at:
        env["NEEDLE_KILL_AT"] = kill_at
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=env, input=stdin, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def made(synthetic_indexes, tmp_path_factory):
    """A flat index of 2 shards over 3 files, one delete already published (so that compact has
    work), the files to add, the keys to delete, and the live rows after each command."""
    tmp = tmp_path_factory.mktemp("kill")
    index, xb = synthetic_indexes.copy(LIVE_FLAT, tmp)
    live = Live.of_files(LIVE_FLAT.parts(xb))
    xb = clustered_unit_vectors(30, D, seed=5)
    write_descriptor_file(tmp / "more", "t5", 5, xb)
    (tmp / "first.txt").write_text("t0/00001\nt2/00007\n")
    assert needle(["index", "delete", "--index", str(index), "--keys", str(tmp / "first.txt")]).returncode == 0
    for key in ("t0/00001", "t2/00007"):
        del live.rows[key]
    (tmp / "keys.txt").write_text("t1/00003\nt1/00004\nt0/00010\n")
    return tmp, index, live, xb


def command_args(command: str, index: str, tmp: Path, endpoint: str | None = None) -> list[str]:
    extra = ["--s3-endpoint-url", endpoint] if endpoint else []
    if command == "add":
        return ["index", "add", "--index", index, "--descriptors", str(tmp / "more"), *extra]
    if command == "delete":
        return ["index", "delete", "--index", index, "--keys", str(tmp / "keys.txt"), *extra]
    return ["index", "compact", "--index", index, "--keep", "1", *extra]


def expected_after(command: str, live: Live, added: np.ndarray) -> Live:
    after = Live()
    after.rows = dict(live.rows)
    if command == "add":
        after.add_file("t5", 5, added)
    if command == "delete":
        for key in ("t1/00003", "t1/00004", "t0/00010"):
            del after.rows[key]
    return after


def check_killed_then_rerun(command, point, index_arg, run, reopen, live, added):
    """Kill the writer at ``point``; the index opens at the last published generation (the
    parent, or the new one where it died after publishing) with exactly its answers; then the
    command again completes the change once."""
    xq = clustered_unit_vectors(8, D, seed=31).astype(np.float32)
    done = run(kill_at=point)
    assert done.returncode == -9, (point, done.returncode, done.stderr[-2000:])
    generation = load_index(reopen()).generation
    published = point == "published" or (command == "compact" and point == "removing")
    assert generation == (2 if published else 1), (point, generation)
    after = expected_after(command, live, added)
    assert_exact(reopen(), after if published else live, xq)
    again = run()
    assert again.returncode == 0, again.stderr[-2000:]
    assert_exact(reopen(), after, xq)  # exactly once: no row added twice, none deleted twice
    assert load_index(reopen()).generation in (2, 3)
    if command != "compact":  # compact --keep 1 then leaves no unreferenced file behind
        final = needle(["index", "compact", "--index", index_arg, "--keep", "1", *run.extra])
        assert final.returncode == 0, final.stderr[-2000:]
        assert_exact(reopen(), after, xq)


@pytest.mark.slow
@pytest.mark.parametrize(("command", "point"), CASES)
def test_a_local_writer_killed_at_any_point_loses_nothing(made, tmp_path, command, point):
    tmp, built, live, added = made
    index_dir = tmp_path / "index"
    shutil.copytree(built, index_dir)

    def run(kill_at=None):
        return needle(command_args(command, str(index_dir), tmp), kill_at)

    run.extra = []
    check_killed_then_rerun(command, point, str(index_dir), run, lambda: index_dir, live, added)
    names = {p.name for p in index_dir.iterdir()}
    if command == "compact":
        assert not any(n.startswith("shard_") for n in names)  # --keep 1 removed the build's directories
        referenced = {s for s in names if s.startswith("seg_")}
        assert len(referenced) == 2, names  # one segment per shard, the orphan of the killed run removed


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.parametrize(("command", "point"), CASES)
def test_an_s3_writer_killed_at_any_point_loses_nothing(made, tmp_path, s3_endpoint, command, point):
    tmp, built, live, added = made
    client = s3_client(s3_endpoint)
    bucket = f"kill-{command}-{point}".replace("_", "-")
    client.create_bucket(Bucket=bucket)
    for path in built.rglob("*"):
        if path.is_file() and "writer.lock" not in path.name:
            client.upload_file(str(path), bucket, f"idx/{path.relative_to(built)}")
    url = f"s3://{bucket}/idx"

    def run(kill_at=None):
        return needle(command_args(command, url, tmp, s3_endpoint), kill_at)

    run.extra = ["--s3-endpoint-url", s3_endpoint]
    copies = iter(range(100))

    def reopen():
        target = tmp_path / f"copy{next(copies)}"
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="idx/"):
            for item in page.get("Contents", []):
                local = target / item["Key"][len("idx/") :]
                local.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, item["Key"], str(local))
        return target

    check_killed_then_rerun(command, point, url, run, reopen, live, added)
    assert latest_number(location_of(url, s3_endpoint)) == load_index(reopen()).generation
