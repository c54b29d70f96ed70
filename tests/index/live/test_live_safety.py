"""The living index trusts nothing it reads and never loses a file a published generation names
(issue 55): generation numbers are never published twice, a bad or missing pointer falls back to
the manifests, links inside an index are never followed, compaction stops on anything it cannot
read, removes only names of the index's own forms, and on S3 removes what it superseded; a
crafted manifest or shard_infos.json makes nothing write outside the index. Every storage call
failing in turn: test_live_faults.py."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

import index.live.rewrite as compact_module
from core.location import location_of
from core.storage import s3_client
from index.errors import IndexFileError
from index.live.add_rows import AddConfig
from index.live.add_rows import main as add
from index.live.compact import CompactConfig
from index.live.compact import main as compact
from index.live.delete_rows import DeleteConfig
from index.live.delete_rows import main as delete
from index.live.generations import (
    CURRENT_FILE,
    GenerationConflict,
    latest_number,
    manifest_name,
    publish,
    read_infos_at,
    read_manifest,
)
from index.live.writer import SCRATCH_PREFIX, Writer, make_scratch, next_shards
from index.search import load_index
from shards.staging import StageConfig, stage_shard
from tests.support.index import clustered_unit_vectors, write_descriptor_file
from tests.support.indexes import LIVE_FLAT
from tests.support.live import D, Live, assert_exact
from tests.support.s3 import upload_tree

XQ = clustered_unit_vectors(5, D, seed=61).astype(np.float32)


@pytest.fixture
def living(synthetic_indexes, tmp_path):
    """LIVE_FLAT copied, and its live rows."""
    index, xb = synthetic_indexes.copy(LIVE_FLAT, tmp_path)
    live = Live.of_files(LIVE_FLAT.parts(xb))
    return index, live, tmp_path


def forget(live: Live, keys: list[str]) -> None:
    for key in keys:
        del live.rows[key]


def test_a_paused_writer_never_publishes_a_retired_generation_number(living):
    """A delete paused at generation 1 while others published 2 and 3 and ``compact --keep 1``
    retired 1 and 2: it once published "generation 2" again (S3 has no lock), reported success,
    and its key stayed live. Now its publish is refused, by the latest-generation check and, were
    that raced, by the tombstone that keeps the number taken."""
    index, live, _ = living
    delete(DeleteConfig(), ["t0/00001"], index)
    location = location_of(index)
    paused = Writer(location, read_infos_at(location), read_manifest(location), index / ".paused")
    delete(DeleteConfig(), ["t0/00002"], index)
    delete(DeleteConfig(), ["t0/00003"], index)
    stale = read_manifest(location, 1)  # what the paused writer builds on
    compact(CompactConfig(keep=1), index)
    with pytest.raises(GenerationConflict, match="while this one ran"):
        paused.publish(next_shards(paused, {}, {}), {"command": "test"})
    # racing that check, the exclusive create of the retired number fails on its tombstone
    with pytest.raises(GenerationConflict):
        publish(location, type(stale)(2, 1, stale.shards, {"command": "test"}))
    assert json.loads((index / manifest_name(2)).read_text())["removed"] is True
    forget(live, ["t0/00001", "t0/00002", "t0/00003"])
    assert_exact(index, live, XQ)


BAD_POINTERS = ['{"generation": "x"}', '{"generation": null}', '{"generation": 1e400}', '{"generation": 7e1}',
                '{"generation": 99999999999999999999}', '{"generation": -1}', '{"generation": ' + "9" * 5000 + "}",
                "not json", "[]", ""]  # fmt: skip


@pytest.mark.parametrize("pointer", BAD_POINTERS)
def test_a_bad_pointer_falls_back_to_the_manifests(living, pointer):
    index, live, _ = living
    delete(DeleteConfig(), ["t1/00001"], index)
    delete(DeleteConfig(), ["t1/00002"], index)
    compact(CompactConfig(keep=1), index)  # generation 3; 1 and 2 retired, generation 0's shards removed
    (index / CURRENT_FILE).write_text(pointer)
    assert latest_number(location_of(index)) == 3
    forget(live, ["t1/00001", "t1/00002"])
    assert_exact(index, live, XQ)
    delete(DeleteConfig(), ["t1/00003"], index)  # a writer starts from the newest too
    assert latest_number(location_of(index)) == 4


def test_without_the_pointer_an_index_compacted_with_keep_opens_at_its_newest(living):
    """CURRENT.json was load-bearing after --keep: without it the index resolved to generation 0,
    whose files were gone."""
    index, live, _ = living
    delete(DeleteConfig(), ["t2/00005"], index)
    compact(CompactConfig(keep=1), index)
    (index / CURRENT_FILE).unlink()
    assert load_index(index).generation == 2
    forget(live, ["t2/00005"])
    assert_exact(index, live, XQ)


def test_a_linked_deletes_directory_is_refused_and_its_target_untouched(living, tmp_path):
    index, _, _ = living
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("mine")
    (index / "deletes").symlink_to(elsewhere)
    for command in (lambda: delete(DeleteConfig(), ["t0/00001"], index), lambda: compact(CompactConfig(keep=1), index)):
        with pytest.raises(IndexFileError, match="deletes is a symbolic link"):
            command()
    assert [p.name for p in elsewhere.iterdir()] == ["precious.txt"]


def test_a_linked_writer_lock_is_never_truncated(living, tmp_path):
    index, _, _ = living
    target = tmp_path / "notes.txt"
    target.write_text("do not truncate me")
    (index / "generations").mkdir(exist_ok=True)
    (index / "generations" / "writer.lock").symlink_to(target)
    with pytest.raises(IndexFileError, match=r"writer\.lock is a symbolic link"):
        delete(DeleteConfig(), ["t0/00001"], index)
    assert target.read_text() == "do not truncate me"


def test_compaction_removes_only_names_of_the_index_own_forms(living):
    index, _, _ = living
    delete(DeleteConfig(), ["t0/00004"], index)
    (index / "deletes" / "README.txt").write_text("an operator's note")
    (index / "seg_notes").mkdir()
    compact(CompactConfig(keep=1), index)
    assert (index / "deletes" / "README.txt").is_file() and (index / "seg_notes").is_dir()


def test_one_failed_read_of_a_kept_manifest_removes_nothing(living, monkeypatch):
    """Any error reading a kept manifest once counted as "already removed", and one EIO on the
    newest made ``compact --keep 1`` remove every segment, the one it had just written too."""
    index, live, _ = living
    delete(DeleteConfig(), ["t0/00005"], index)
    real = compact_module.read_manifest

    def failing(location, number=None, infos=None):
        if number is not None and number >= 2:
            raise OSError(5, "Input/output error")
        return real(location, number, infos)

    monkeypatch.setattr(compact_module, "read_manifest", failing)
    before = sorted(p.name for p in index.iterdir())
    with pytest.raises(OSError, match="Input/output error"):
        compact(CompactConfig(keep=1), index)
    assert set(before) <= {p.name for p in index.iterdir()}  # nothing removed (a new segment published)
    forget(live, ["t0/00005"])
    assert_exact(index, live, XQ)


@pytest.mark.parametrize("missing", ["delete set", "segment"])
def test_compacting_a_broken_index_fails_and_removes_nothing(living, missing):
    """``compact`` exited 0 on an index whose newest generation names a missing file."""
    index, _, _ = living
    delete(DeleteConfig(), ["t0/00006"], index)
    segments = read_manifest(location_of(index)).segments
    if missing == "delete set":  # read by the rewrite of its segment
        (index / next(s.deleted.file for s in segments if s.deleted)).unlink()
        expected = "delete set .* is missing"
    else:  # a segment compaction leaves as it is: checked before anything is removed
        (index / next(s.name for s in segments if not s.deleted) / "shard_infos.json").unlink()
        expected = "is broken: generation 2 names shard_00./shard_infos.json, which is missing"
    before = {str(p.relative_to(index)) for p in index.rglob("*")}
    with pytest.raises(IndexFileError, match=expected):
        compact(CompactConfig(keep=1), index)
    assert before <= {str(p.relative_to(index)) for p in index.rglob("*")}


def test_a_crafted_manifest_writes_nothing_outside_the_index(living, tmp_path):
    """A manifest naming ``../`` or absolute paths once made a plain delete create
    ``.ssh/authorized_keys`` from the manifest's content: now the manifest is refused as read."""
    index, _, _ = living
    delete(DeleteConfig(), ["t0/00007"], index)
    record = json.loads((index / manifest_name(1)).read_text())
    record["generation"], record["parent"] = 2, 1
    record["shards"][0]["segments"][0]["deleted"]["file"] = "../../.ssh/authorized_keys"
    (index / manifest_name(2)).write_text(json.dumps(record))
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(IndexFileError, match="not a delete set's file name"):
        delete(DeleteConfig(), ["t0/00008"], index)
    with pytest.raises(IndexFileError, match="not a delete set's file name"):
        load_index(index)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_staging_refuses_a_file_name_that_leaves_its_directory(living, tmp_path):
    index, _, _ = living
    infos_path = index / "shard_000" / "shard_infos.json"
    infos = json.loads(infos_path.read_text())
    infos["checksums"]["../../.bashrc"] = {"bytes": 3, "sha256": "0" * 64}
    infos_path.write_text(json.dumps(infos))
    cache = tmp_path / "cache"
    with pytest.raises(IndexFileError, match=r"'\.\./\.\./\.bashrc' is not a file name inside a segment"):
        stage_shard(str(index), "shard_000", StageConfig(cache_dir=str(cache)))
    with pytest.raises(IndexFileError, match="not a segment name"):
        stage_shard(str(index), "../shard_000", StageConfig(cache_dir=str(cache)))
    assert not (tmp_path / ".bashrc").exists() and not any(cache.rglob(".bashrc"))


def test_writers_work_when_the_temporary_directory_is_another_filesystem(living, tmp_path, monkeypatch):
    """delete and add --replace failed whenever $TMPDIR was on another filesystem than the index
    (a cross-device rename): a local writer's scratch is now inside the index."""
    other = Path("/dev/shm")
    if not other.is_dir() or other.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second filesystem to put the temporary directory on")
    scratch = Path(tempfile.mkdtemp(dir=other))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    try:
        index, live, tmp = living
        delete(DeleteConfig(), ["t0/00009"], index)
        xb = clustered_unit_vectors(2, D, seed=3)
        write_descriptor_file(tmp / "again", "t7", 7, xb, keys=["t0/00011", "t7/new"])
        add(AddConfig(replace=True), tmp / "again", index)
        forget(live, ["t0/00009"])
        live.add_file("t7", 7, xb, keys=["t0/00011", "t7/new"])
        assert_exact(index, live, XQ)
        assert not (index / ".writer-scratch").exists()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def test_a_killed_s3_writer_scratch_is_removed_by_the_next_writer(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)  # a pid no process has now
    stale = tmp_path / f"{SCRATCH_PREFIX}{dead}-x1"
    (stale / "fetched").mkdir(parents=True)
    (stale / "fetched" / "keys.bin").write_bytes(b"deleted keys")
    running = tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-x2"
    running.mkdir()
    mine = make_scratch(None)
    assert not stale.exists() and running.is_dir() and mine.name.startswith(f"{SCRATCH_PREFIX}{os.getpid()}-")


@pytest.mark.s3
def test_s3_compaction_removes_superseded_segments_and_every_deleted_byte(living, s3_endpoint):
    """``list("")`` listed ``prefix//`` on S3, so compaction never removed ``shard_000/`` there and
    its keys.bin kept the deleted key."""
    index, live, _ = living
    client = s3_client(s3_endpoint)
    client.create_bucket(Bucket="purge")
    url = upload_tree(client, "purge", "idx", index)
    victim = "t1/00017"
    vector = live.rows[victim][1]
    delete(DeleteConfig(s3_endpoint_url=s3_endpoint), [victim], url)
    change = compact(CompactConfig(keep=1, s3_endpoint_url=s3_endpoint), url)
    superseded = change["rewritten"][0]["from"]
    assert set(superseded) <= set(change["removed"])
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket="purge", Prefix="idx/")
            for o in page.get("Contents", [])]  # fmt: skip
    gone = (*(f"idx/{n}/" for n in superseded), "idx/deletes/")
    assert not [k for k in keys if k.startswith(gone)], keys
    for key in keys:
        data = client.get_object(Bucket="purge", Key=key)["Body"].read()
        assert vector.astype(np.float16).tobytes() not in data, key
        assert victim.encode() not in data or key.endswith(".json"), key


@pytest.mark.s3
def test_without_list_permission_a_missing_object_is_a_403_and_generations_still_resolve(living, s3_endpoint):
    """Without ``s3:ListBucket`` S3 answers a missing object with 403: every generation lookup
    (the next manifest is always missing) once failed on it."""
    from botocore.exceptions import ClientError

    index, _, _ = living
    client = s3_client(s3_endpoint)
    client.create_bucket(Bucket="nolist")
    url = upload_tree(client, "nolist", "idx", index)
    delete(DeleteConfig(s3_endpoint_url=s3_endpoint), ["t0/00012"], url)
    location = location_of(url, s3_endpoint)
    real_get = location.client.get_object

    def forbidden_when_missing(**kwargs):
        try:
            return real_get(**kwargs)
        except ClientError as exc:
            raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "GetObject") from exc

    def no_listing(*args, **kwargs):
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "ListObjectsV2")

    location.client.get_object = forbidden_when_missing
    location.client.get_paginator = no_listing
    assert latest_number(location) == 1
    location.client.delete_object(Bucket="nolist", Key=f"idx/{CURRENT_FILE}")
    assert latest_number(location) == 1  # forward from 0 through the manifests
    with pytest.raises(ClientError, match="AccessDenied"):
        location.read_bytes("generations/000009.json")  # only probes take a 403 for absent


def test_a_delete_set_of_another_size_than_recorded_is_refused(living):
    index, _, _ = living
    delete(DeleteConfig(), ["t0/00013", "t0/00014"], index)
    named = next(s.deleted.file for s in read_manifest(location_of(index)).segments if s.deleted)
    rows = np.load(index / named)
    np.save(index / named, rows[:1])  # one of the two deleted rows would come back
    with pytest.raises(IndexFileError, match="holds 1 rows, its manifest says 2"):
        load_index(index)
