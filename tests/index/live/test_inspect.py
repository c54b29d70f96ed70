"""``needle index info`` and ``needle index keys`` (index/live/inspect.py): an index's state and its
live keys, after adds and deletes, from a directory and from S3 (issue 57: no command showed them)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cli.main import main as needle
from core.location import location_of
from index.live.add_rows import main as add
from index.live.compact import CompactConfig
from index.live.compact import main as compact
from index.live.config import AddConfig, DeleteConfig
from index.live.delete_rows import main as delete
from index.live.generations import read_view
from index.search import load_index
from tests.support.index import clustered_unit_vectors, write_descriptor_file
from tests.support.indexes import SERVED_IVFPQ
from tests.support.s3 import upload_tree

DELETED = ["t0/00003", "t2/00039"]


def run(capsys, *argv: str) -> str:
    assert needle(list(argv)) == 0
    return capsys.readouterr().out


@pytest.fixture
def changed(live_flat_index, tmp_path):
    """LIVE_FLAT (t0-t2, 40 rows each, 2 shards) with two keys deleted, then file t5 of 20 rows added."""
    delete(DeleteConfig(), DELETED, live_flat_index)
    write_descriptor_file(tmp_path / "more", "t5", 5, clustered_unit_vectors(20, 16, seed=5))
    add(AddConfig(), tmp_path / "more", live_flat_index)
    return live_flat_index


def test_info_reports_the_newest_generation(changed, capsys):
    info = json.loads(run(capsys, "index", "info", "--index", str(changed)))
    view = read_view(location_of(changed))
    assert info["generation"] == 2 == view.number and info["kind"] == "flat" and info["dim"] == 16
    assert (info["rows"], info["live_rows"], info["deleted_rows"]) == (140, 138, 2)
    assert info["live_ntotal"] == load_index(changed).ntotal == 138
    assert info["shards"] == 2 and info["segments_per_shard"] == [len(g) for g in view.shard_segments]
    assert sum(info["segments_per_shard"]) == 3  # the build's two and the add's one
    assert sum(s["live_rows"] for s in info["per_shard"]) == 138 and info["bytes"] > 0
    assert info["last_change"]["command"] == "add" and info["drift"] is None  # flat: no quantizer to drift from
    assert "nprobe" in info and info["index"] == str(changed)


def test_keys_are_the_live_keys_one_per_line(changed, capsys):
    out = run(capsys, "index", "keys", "--index", str(changed))
    keys = out.splitlines()
    expected = {f"t{f}/{i:05d}" for f in range(3) for i in range(40)} - set(DELETED)
    expected |= {f"t5/{i:05d}" for i in range(20)}
    assert len(keys) == len(set(keys)) == 138 and set(keys) == expected and out.endswith("\n")
    index = load_index(changed)
    assert all(index.position_of(k) >= 0 for k in keys[::17])  # each one a key the index answers for


def test_info_carries_the_drift_of_the_newest_add(synthetic_indexes, tmp_path, capsys):
    index_dir = synthetic_indexes.copy(SERVED_IVFPQ, tmp_path)[0]
    before = json.loads(run(capsys, "index", "info", "--index", str(index_dir)))
    assert before["generation"] == 0 and before["drift"] is None and before["kind"] == "ivfpq"
    assert before["nprobe"] == load_index(index_dir).infos["nprobe"]
    far = np.random.default_rng(7).normal(size=(60, 32)).astype(np.float32) * 5  # unlike the trained rows
    write_descriptor_file(tmp_path / "far", "far", 9, far / np.linalg.norm(far, axis=1, keepdims=True))
    change = add(AddConfig(), tmp_path / "far", index_dir)
    delete(DeleteConfig(), ["far/00001"], index_dir)  # a later change that reports no drift
    info = json.loads(run(capsys, "index", "info", "--index", str(index_dir)))
    assert info["generation"] == 2 and info["last_change"]["command"] == "delete"
    assert info["drift"] == {**change["drift"], "generation": 1}
    delete(DeleteConfig(), ["far/00002"], index_dir)
    delete(DeleteConfig(), ["far/00003"], index_dir)
    compact(CompactConfig(keep=1, retrain="never"), index_dir)  # generations 1-4 become tombstones
    after = json.loads(run(capsys, "index", "info", "--index", str(index_dir)))  # once refused: "was removed"
    assert after["generation"] == 5 and after["drift"] is None


def test_a_directory_that_is_no_index_is_one_line(tmp_path, caplog):
    assert needle(["index", "info", "--index", str(tmp_path)]) == 2
    assert needle(["index", "keys", "--index", str(tmp_path)]) == 2
    assert "is not an index (no index_infos.json)" in caplog.text


@pytest.mark.s3
def test_info_and_keys_of_an_index_on_s3(changed, s3_endpoint, capsys):
    from core.storage import s3_client

    client = s3_client(s3_endpoint)
    client.create_bucket(Bucket="inspect")
    url = upload_tree(client, "inspect", "idx", changed)
    info = json.loads(run(capsys, "index", "info", "--index", url, "--s3-endpoint-url", s3_endpoint))
    local = json.loads(run(capsys, "index", "info", "--index", str(changed)))
    assert info == {**local, "index": url}
    remote = run(capsys, "index", "keys", "--index", url, "--s3-endpoint-url", s3_endpoint)
    assert remote == run(capsys, "index", "keys", "--index", str(changed))
