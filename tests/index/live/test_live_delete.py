"""``needle index delete`` at scale and as key files store keys (issue 55).

The vectorised lookup gives the delete sets a per-key reference gives (several segments, rows
deleted already, unknown keys, failed and all-zero rows); a segment's vectors read from S3 in
runs equal the local ones; keys are read split on newlines only.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import index.live.keys as live_keys
import index.live.writer as live_writer
from core.location import location_of
from core.storage import s3_client
from index.build.stage import IndexConfig
from index.build.stage import main as build
from index.keys import KeyStore
from index.live.add_rows import AddConfig, DuplicateKeyError
from index.live.add_rows import main as add
from index.live.compact import CompactConfig
from index.live.compact import main as compact
from index.live.delete_rows import DeleteConfig, read_keys
from index.live.delete_rows import main as delete
from index.live.generations import latest_number, read_infos_at, read_manifest
from index.live.keys import ParentKeys
from index.live.writer import ID_FILES, Writer, writing
from index.search import load_index
from index.shard import is_valid_descriptor
from index.shard_files import read_ids
from tests.support.index import clustered_unit_vectors, write_descriptor_file
from tests.support.indexes import LIVE_FLAT_4
from tests.support.live import D

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def segmented(synthetic_indexes, tmp_path):
    """LIVE_FLAT_4 after an add of a file with a failed row and two all-zero ok rows (a new segment
    per shard it reaches) and a delete of some keys: (index, every key)."""
    out, _ = synthetic_indexes.copy(LIVE_FLAT_4, tmp_path)
    xb = clustered_unit_vectors(30, D, seed=4)
    xb[[3, 4]] = 0
    path = write_descriptor_file(tmp_path / "more", "t4", 4, xb)
    table = pq.read_table(path)
    status = ["failed" if i == 5 else "ok" for i in range(len(table))]
    pq.write_table(table.set_column(table.schema.get_field_index("status"), "status", pa.array(status)), path)
    add(AddConfig(), tmp_path / "more", out)
    keys = [f"t{f}/{i:05d}" for f in range(4) for i in range(40)] + [f"t4/{i:05d}" for i in range(30)]
    delete(DeleteConfig(), keys[::7], out)
    return out, keys


def reference_deletes(writer: Writer, keys: list[str]) -> dict[int, tuple[list[int], int]]:
    """The delete sets a key at a time: the first segment holding a live row of the key."""
    out: dict[int, tuple[list[int], int]] = {}
    for key in keys:
        for number, entry in enumerate(writer.parent.segments):
            directory = writer.segment_dir(entry.name, ID_FILES)
            position = KeyStore(directory).position_of(key)
            if position < 0:
                continue
            table = read_ids(directory / "ids.arrow")
            row = table["row"][position].as_py()
            if row in set(writer.deleted_rows(entry).tolist()):
                continue
            vector = writer.row_vectors(entry.name, position, 1)[0]
            rows, indexed = out.get(number, ([], 0))
            valid = is_valid_descriptor(np.asarray(vector, np.float32), table["status"][position].as_py())
            out[number] = (sorted([*rows, row]), indexed + int(valid))
            break
    return out


@pytest.mark.parametrize("ratio", [0, 10**9])  # the Arrow pass over every segment; a binary search per key
def test_vectorised_deletes_equal_a_per_key_reference(segmented, monkeypatch, ratio):
    index_dir, keys = segmented
    monkeypatch.setattr(live_keys, "BINARY_SEARCH_RATIO", ratio)
    asked = [*keys[::3], "no/such-key", keys[1]]
    with writing(index_dir) as writer:
        parent = ParentKeys(writer)
        found = parent.find_many(asked)
        got = {n: (rows.tolist(), indexed) for n, (rows, indexed) in parent.deletes_of(writer, found).items()}
        want = reference_deletes(writer, asked)
    assert got == want
    assert len(writer.parent.segments) > 2 and sum(i for _, i in want.values()) < sum(len(r) for r, _ in want.values())
    missing = {asked[i] for i in found.missing(len(asked))}
    assert missing == {"no/such-key"} | {k for k in keys[::7] if k in asked}


@pytest.mark.s3
@pytest.mark.parametrize("gap", [0, 1 << 20])  # a ranged read per run of rows; the whole file
def test_vectors_read_from_s3_in_runs_equal_the_local_ones(segmented, s3_endpoint, monkeypatch, tmp_path, gap):
    index_dir, _ = segmented
    monkeypatch.setattr(live_writer, "VECTORS_MERGE_GAP", gap)
    client = s3_client(s3_endpoint)
    bucket = f"vectors-{gap}"
    client.create_bucket(Bucket=bucket)
    for path in index_dir.rglob("*"):
        if path.is_file() and "writer.lock" not in path.name:
            client.upload_file(str(path), bucket, f"idx/{path.relative_to(index_dir)}")
    local, remote = location_of(index_dir), location_of(f"s3://{bucket}/idx", s3_endpoint)
    a = Writer(local, read_infos_at(local), read_manifest(local), tmp_path / "a")
    b = Writer(remote, read_infos_at(remote), read_manifest(remote), tmp_path / "b")
    positions = np.array([17, 3, 4, 30, 2, 39, 18])
    name = a.parent.segments[0].name
    np.testing.assert_array_equal(b.vectors_at(name, positions), a.vectors_at(name, positions))
    np.testing.assert_array_equal(a.vectors_at(name, positions), a.row_vectors(name, 0, 40)[positions])
    assert b.vectors_at(name, np.zeros(0, np.int64)).shape == (0, D)


ODD = ["a\x85b", "c\u2028d", "e\x0bf", "g\x0ch", "i\x1cj", "k\x1dl", "m\x1en", " spaced "]


def test_keys_are_read_split_on_newlines_only(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_bytes(("\n".join(ODD) + "\r\nlast\r\n\nlast\n").encode())
    assert read_keys(str(path)) == [*ODD, "last"]


def test_keys_holding_unicode_line_breaks_are_deleted_through_the_command(flat_odd, tmp_path):
    index_dir, keys = flat_odd
    path = tmp_path / "takedown.txt"
    path.write_bytes(("\r\n".join(ODD) + "\r\n").encode())
    done = run_needle(["index", "delete", "--index", str(index_dir), "--keys", str(path)])
    assert done.returncode == 0, done.stderr
    change = json.loads(done.stdout)
    assert change["deleted"] == len(ODD) and change["unknown"] == 0
    assert load_index(index_dir).ntotal == len(keys) - len(ODD)


def test_strict_refuses_unknown_keys_and_publishes_nothing(flat_odd, tmp_path):
    index_dir, keys = flat_odd
    huge = "x" * 100_000
    path = tmp_path / "takedown.txt"
    path.write_text("\n".join([keys[0], huge, *(f"gone/{i}" for i in range(30))]) + "\n")
    done = run_needle(["index", "delete", "--index", str(index_dir), "--keys", str(path), "--strict"])
    assert done.returncode == 2 and "31 of 32 keys are not in" in done.stderr and huge not in done.stderr
    assert latest_number(location_of(index_dir)) == 0
    # without --strict: deleted, the unknown ones reported, at most 20, each cut short
    change = delete(DeleteConfig(), read_keys(str(path)), index_dir)
    assert change["deleted"] == 1 and change["unknown"] == 31 and len(change["unknown_keys"]) == 20
    assert change["unknown_keys"][0] == huge[:197] + "..."
    manifest = index_dir / "generations" / "000001.json"
    assert manifest.stat().st_size < 20_000
    # a re-run of the same list (a takedown after a partial failure) converges: nothing left to do
    again = delete(DeleteConfig(), read_keys(str(path)), index_dir)
    assert again["generation"] is None and again["unknown"] == 32


@pytest.fixture
def flat_odd(tmp_path):
    """A flat index of 2 shards whose keys hold characters str.splitlines splits at."""
    xb = clustered_unit_vectors(len(ODD) + 10, D, seed=3)
    keys = [*ODD, *(f"plain/{i}" for i in range(10))]
    write_descriptor_file(tmp_path / "desc", "o0", 0, xb[:9], keys=keys[:9])
    write_descriptor_file(tmp_path / "desc", "o1", 1, xb[9:], keys=keys[9:])
    build(IndexConfig(kind="flat", shards=2), tmp_path / "desc", tmp_path / "index")
    return tmp_path / "index", keys


def run_needle(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_add_accepts_a_repeated_key_written_as_an_error_row_as_build_does(synthetic_indexes, tmp_path):
    """Ingest writes a tar's repeated sample key as an error row with the same key: the build accepts
    such a file, and so does add (the error row kept, not indexed); two ok rows with one key are refused."""
    out, _ = synthetic_indexes.copy(LIVE_FLAT_4, tmp_path)
    xb = clustered_unit_vectors(6, D, seed=6)
    xb[5] = 0
    keys = [f"t6/{i:05d}" for i in range(5)] + ["t6/00002"]
    path = write_descriptor_file(tmp_path / "dup", "t6", 6, xb, keys=keys)
    table = pq.read_table(path)
    status = pa.array(["ok"] * 5 + ["error"])
    pq.write_table(table.set_column(table.schema.get_field_index("status"), "status", status), path)
    build(IndexConfig(kind="flat", shards=1), tmp_path / "dup", tmp_path / "built")  # the build accepts it
    change = add(AddConfig(), tmp_path / "dup", out)
    assert change["generation"] == 1 and change["rows"] == 6 and change["vectors"] == 5
    index = load_index(out)
    assert index.ntotal == 160 + 5
    np.testing.assert_array_equal(index.vector_of("t6/00002"), xb[2].astype(np.float32))
    write_descriptor_file(tmp_path / "twice", "t7", 7, xb, keys=[f"t7/{i % 5:05d}" for i in range(6)])
    with pytest.raises(DuplicateKeyError, match="more than one added row"):
        add(AddConfig(), tmp_path / "twice", out)


def test_all_zero_ok_rows_are_counted_alike_by_build_add_delete_and_compact(tmp_path):
    """All-zero vectors with status ok (ingest.descriptors.valid_descriptors: not indexed) through add, delete
    and compact: every total and answer equals a fresh build over the live rows."""
    files = {}
    for f in range(3):
        xb = clustered_unit_vectors(20, D, seed=20 + f)
        xb[[2, 9]] = 0
        files[f] = (xb, [f"z{f}/{i:05d}" for i in range(20)])
    for f in (0, 1):
        write_descriptor_file(tmp_path / "desc", f"z{f}", f, *files[f])
    build(IndexConfig(kind="flat", shards=2), tmp_path / "desc", tmp_path / "index")
    write_descriptor_file(tmp_path / "more", "z2", 2, *files[2])
    add(AddConfig(), tmp_path / "more", tmp_path / "index")
    gone = {"z0/00002", "z1/00009", "z2/00002", "z0/00005", "z2/00011"}  # three zero rows, two others
    delete(DeleteConfig(), sorted(gone), tmp_path / "index")
    for f, (xb, keys) in files.items():  # the live rows, under their own keys and row ids' files
        live = [i for i, key in enumerate(keys) if key not in gone]
        write_descriptor_file(tmp_path / "fresh_desc", f"z{f}", f, xb[live], [keys[i] for i in live])
    build(IndexConfig(kind="flat", shards=2), tmp_path / "fresh_desc", tmp_path / "fresh")
    fresh = load_index(tmp_path / "fresh")
    assert fresh.ntotal == 60 - 6 - 2  # two zero rows per file, less the three deleted, and two more
    xq = clustered_unit_vectors(4, D, seed=1).astype(np.float32)

    def answers(index):
        scores, rows = index.search(xq, 100)
        return index.ntotal, index.keys_of(rows), np.round(scores, 3).tolist()

    assert answers(load_index(tmp_path / "index")) == answers(fresh)
    compact(CompactConfig(), tmp_path / "index")
    assert answers(load_index(tmp_path / "index")) == answers(fresh)
