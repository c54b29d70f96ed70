"""index/generation.py: a generation's files read, checked and written back unchanged, and each
malformed field refused with an IndexFileError naming it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from core.location import location_of
from index.errors import IndexFileError, OldIndexLayoutError
from index.generation import Generation, IndexInfos
from index.layout import INFOS_FILE
from index.live.add_rows import AddConfig
from index.live.add_rows import main as add
from index.live.delete_rows import DeleteConfig
from index.live.delete_rows import main as delete
from index.live.generations import manifest_name, read_manifest, read_view
from index.search import load_index
from tests.support.index import clustered_unit_vectors, to_old_layout, write_descriptor_file
from tests.support.indexes import LIVING, build_synthetic

D = 16


@pytest.fixture(scope="module")
def living(tmp_path_factory):
    """A flat index of 2 shards with an add (generation 1) and a delete (generation 2) published."""
    tmp = tmp_path_factory.mktemp("living")
    index_dir, _ = build_synthetic(LIVING, tmp)
    write_descriptor_file(tmp / "more", "t7", 7, clustered_unit_vectors(20, D, seed=7))
    add(AddConfig(), tmp / "more", index_dir)
    delete(DeleteConfig(), ["t0/00003", "t7/00001", "t2/00010"], index_dir)
    return index_dir


def written_like_the_writer(record: dict) -> bytes:
    """A manifest's bytes as every writer has written them (index.live.generations.publish before
    the typed model: ``json.dumps(manifest, indent=1, sort_keys=True)``)."""
    return (json.dumps(record, indent=1, sort_keys=True) + "\n").encode()


def test_a_published_manifest_reads_and_writes_back_byte_identical(living):
    for number in (1, 2):
        name = manifest_name(number)
        data = (living / name).read_bytes()
        generation = Generation.from_json(data, name, number)
        assert generation.to_json() == data
    two = Generation.from_json((living / manifest_name(2)).read_bytes(), "2", 2)
    assert two.parent == 1 and two.totals.deleted_rows == 3 and two.totals.live_rows == 90 + 20 - 3
    assert sum(s.deleted_rows for s in two.segments) == 3 and len(two.segments) == 3


def test_the_builds_index_infos_reads_and_writes_back_byte_identical(living):
    data = (living / INFOS_FILE).read_bytes()
    infos = IndexInfos.from_json(data, INFOS_FILE)
    assert [s.name for s in infos.shards] == ["shard_000", "shard_001"]
    assert (json.dumps(infos.to_json(), indent=2, sort_keys=True) + "\n").encode() == data  # core.atomic's format


def test_a_manifest_written_before_the_model_opens_unchanged():
    """Fields the model does not name (a later writer's, or a segment's) are kept as written."""
    record = {
        "format": 1,
        "generation": 3,
        "parent": 2,
        "created_unix": 1732800000.125,
        "writer": {"host": "h", "pid": 7, "token": "0a1b2c3d"},
        "change": {"command": "delete", "deleted": 1, "unknown": 0, "unknown_keys": [], "generation": None},
        "shards": [
            {
                "shard": 0,
                "segments": [
                    {"name": "shard_000", "rows": 10, "ntotal": 9, "parquet_shard_ids": [0], "bytes": 100,
                     "deleted": {"file": "deletes/000003_shard_000_0a1b2c3d.npy", "rows": 1, "indexed": 1},
                     "note": "kept"},
                ],
            }
        ],
        "totals": {"rows": 10, "ntotal": 9, "deleted_rows": 1, "live_rows": 9, "live_ntotal": 8},
        "future": {"field": [1, 2]},
    }  # fmt: skip
    data = written_like_the_writer(record)
    generation = Generation.from_json(data, "m.json", 3)
    assert generation.segments[0].extra == {"note": "kept"}
    assert generation.extra == {"future": {"field": [1, 2]}}
    assert generation.to_json() == data


def test_an_index_built_before_shard_directories_is_refused_unchanged(living, tmp_path):
    old = to_old_layout(living, tmp_path / "old")
    before = (old / INFOS_FILE).read_bytes()
    with pytest.raises(OldIndexLayoutError, match=f"index {old} was built before shard directories"):
        IndexInfos.from_json(before, f"{old}/{INFOS_FILE}")
    with pytest.raises(OldIndexLayoutError, match=f"rebuild it with `needle index build --descriptors .* --out {old}`"):
        read_view(location_of(old))
    assert (old / INFOS_FILE).read_bytes() == before and not (old / "generations").exists()


def test_the_view_reads_index_infos_once_and_reports_the_old_infos(living):
    location = location_of(living)
    view = read_view(location)
    infos = view.as_infos()
    assert infos["generation"] == 2 and sorted(len(g) for g in infos["shard_segments"]) == [1, 2]
    assert [e["shard"] for e in infos["shards"]] == [i for i, g in enumerate(infos["shard_segments"]) for _ in g]
    assert infos["live_ntotal"] == load_index(living).ntotal == 107 and infos["deleted_rows"] == 3
    zero = read_view(location, number=0).as_infos()
    built = json.loads((living / INFOS_FILE).read_text())
    assert zero["rows"] == built["rows"] and [e["deleted"] for e in zero["shards"]] == [None, None]
    assert read_manifest(location, 0).change == {"command": "build"}


MANIFEST = {
    "format": 1,
    "generation": 1,
    "parent": 0,
    "change": {"command": "add"},
    "shards": [
        {
            "shard": 0,
            "segments": [
                {"name": "shard_000", "rows": 5, "ntotal": 5, "parquet_shard_ids": [0], "bytes": 10, "deleted": None}
            ],
        }
    ],
}


def broken(path: str, value: object) -> dict:
    """MANIFEST with the field at ``path`` (dot-separated; digits index lists) set to ``value``."""
    record = json.loads(json.dumps(MANIFEST))
    *parents, last = path.split(".")
    at = record
    for part in parents:
        at = at[int(part)] if part.isdigit() else at[part]
    if value is KeyError:
        del at[last]
    else:
        at[last] = value
    return record


SEGMENT = "shards.0.segments.0"


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        ("shards", {"0": 1}, "'shards'"),
        ("shards.0.shard", 1, "'shards'"),  # shards numbered 1: not 0, 1, ...
        ("shards.0.shard", "0", "'shard'"),
        ("shards.0.segments", None, "'segments'"),
        (f"{SEGMENT}.name", "", "'name'"),
        (f"{SEGMENT}.name", KeyError, "'name'"),
        (f"{SEGMENT}.rows", -1, "'rows'"),
        (f"{SEGMENT}.rows", "5", "'rows'"),
        (f"{SEGMENT}.ntotal", True, "'ntotal'"),
        (f"{SEGMENT}.bytes", 1.5, "'bytes'"),
        (f"{SEGMENT}.parquet_shard_ids", [0, "1"], "'parquet_shard_ids'"),
        (f"{SEGMENT}.parquet_shard_ids", 0, "'parquet_shard_ids'"),
        (f"{SEGMENT}.deleted", [], "'deleted'"),
        (f"{SEGMENT}.deleted", {"file": "deletes/000001_shard_000_ab.npy", "rows": 1}, "'indexed'"),
        (f"{SEGMENT}.deleted", {"file": 3, "rows": 1, "indexed": 1}, "'file'"),
        ("parent", -2, "'parent'"),
        ("change", "add", "'change'"),
        ("writer", {"host": "h", "pid": "7", "token": "t"}, "'pid'"),
        ("created_unix", "now", "'created_unix'"),
        ("totals", {"rows": 6}, "'totals'"),
    ],
)
def test_each_malformed_manifest_field_is_refused_naming_it(path, value, named):
    data = written_like_the_writer(broken(path, value))
    with pytest.raises(IndexFileError, match=rf"m\.json.*{named}"):
        Generation.from_json(data, "m.json", 1)


HOSTILE_NAMES = [
    (f"{SEGMENT}.name", "/etc", "not a segment name"),
    (f"{SEGMENT}.name", "../other_index/shard_000", "not a segment name"),
    (f"{SEGMENT}.name", "shard_000/../../x", "not a segment name"),
    (f"{SEGMENT}.name", "seg_000001_s000_abc/..", "not a segment name"),
    (f"{SEGMENT}.name", "shard_000\n", "not a segment name"),
    (f"{SEGMENT}.name", "seg_000002_s000_ab", "written for a later one"),  # generation 1 cannot name it
    (f"{SEGMENT}.deleted", {"file": "/root/.ssh/authorized_keys", "rows": 1, "indexed": 1}, "not a delete set"),
    (f"{SEGMENT}.deleted", {"file": "deletes/../../.bashrc", "rows": 1, "indexed": 1}, "not a delete set"),
    (
        f"{SEGMENT}.deleted",
        {"file": "deletes/000001_shard_001_ab.npy", "rows": 1, "indexed": 1},
        "of segment shard_000",
    ),
    (f"{SEGMENT}.deleted", {"file": "deletes/000001_shard_000_ab.npy", "rows": 1, "indexed": 2}, "'indexed'"),
    (f"{SEGMENT}.deleted", {"file": "deletes/000001_shard_000_ab.npy", "rows": 9, "indexed": 0}, "inconsistent"),
    (f"{SEGMENT}.ntotal", 6, "inconsistent"),
    ("parent", 1, "'parent'"),
]


@pytest.mark.parametrize(("path", "value", "message"), HOSTILE_NAMES)
def test_a_manifest_naming_anything_outside_its_own_files_is_refused(path, value, message):
    """Names are read from storage: a crafted manifest must not make a writer or a stager touch a
    path outside the index (absolute, ``..``), another segment's delete set, or a later generation's files."""
    data = written_like_the_writer(broken(path, value))
    with pytest.raises(IndexFileError, match=rf"m\.json.*{message}"):
        Generation.from_json(data, "m.json", 1)


def test_a_manifest_naming_a_segment_twice_is_refused():
    record = json.loads(json.dumps(MANIFEST))
    segment = record["shards"][0]["segments"][0]
    record["shards"][0]["segments"].append(dict(segment))
    with pytest.raises(IndexFileError, match=r"m\.json names 'shard_000' more than once"):
        Generation.from_json(written_like_the_writer(record), "m.json", 1)


def test_a_manifest_of_another_number_or_format_or_not_json_is_refused():
    data = written_like_the_writer(MANIFEST)
    assert Generation.from_json(data, "m.json", 1).to_json() != data  # written with its totals
    with pytest.raises(IndexFileError, match="not a generation-2 manifest"):
        Generation.from_json(data, "m.json", 2)
    with pytest.raises(IndexFileError, match="not a generation-1 manifest"):
        Generation.from_json(written_like_the_writer({**MANIFEST, "format": 2}), "m.json", 1)
    with pytest.raises(IndexFileError, match=r"m\.json is not JSON"):
        Generation.from_json(b"{", "m.json", 1)
    with pytest.raises(IndexFileError, match="not a JSON object"):
        Generation.from_json(b"[]", "m.json", 1)


def infos_record() -> dict:
    return {
        "layout": "shard-directories",
        "rows": 7,
        "ntotal": 6,
        "dim": 4,
        "shards": [
            {"name": "shard_000", "rows": 3, "ntotal": 3, "parquet_shard_ids": [0], "bytes": 1},
            {"name": "shard_001", "rows": 4, "ntotal": 3, "parquet_shard_ids": [1, 2], "bytes": 1},
        ],
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rows": 8}, "inconsistent: its shards hold 7 rows, 6 vectors; it says 8, 6"),
        ({"ntotal": "6"}, "'ntotal'"),
        ({"shards": []}, "lists no shards"),
        ({"shards": "shard_000"}, "'shards'"),
    ],
)
def test_a_malformed_index_infos_is_refused_naming_the_field(change, message):
    data = json.dumps({**infos_record(), **change})
    with pytest.raises(IndexFileError, match=rf"i\.json.*{message}"):
        IndexInfos.from_json(data, "i.json")


def test_a_shard_entry_of_index_infos_is_checked_like_a_segment():
    record = infos_record()
    record["shards"][1]["parquet_shard_ids"] = [1, None]
    with pytest.raises(IndexFileError, match=r"segment shard_001.*'parquet_shard_ids'"):
        IndexInfos.from_json(json.dumps(record), "i.json")
    record = infos_record()
    record["shards"][0]["deleted"] = {"file": "deletes/000001_shard_000_ab.npy", "rows": 1, "indexed": 1}
    with pytest.raises(IndexFileError, match="only a manifest"):
        IndexInfos.from_json(json.dumps(record), "i.json")


def test_a_view_totals_count_each_delete_set_once(living):
    view = read_view(location_of(living))
    assert view.rows == 110 and view.ntotal == 110
    assert view.generation.totals.live_ntotal == view.ntotal - sum(s.deleted_indexed for s in view.segments)
    assert np.array_equal(np.sort([s.rows for s in view.segments]), np.sort([30, 60, 20]))


def test_the_builds_records_round_trip(living):
    from index.build.records import BuildFields, PartStats
    from index.locals import SegmentInfo

    shard_infos = json.loads((living / "shard_000" / "shard_infos.json").read_text())
    fields = BuildFields.of(shard_infos)
    assert fields.to_json() == {k: shard_infos[k] for k in fields.to_json()} and fields.kind == "flat"
    stats = PartStats(10, 1, 123, SegmentInfo("locals_000.tokens.bin", "locals_000.offsets.npy", 0, 10, 40, 7))
    assert PartStats.from_json(json.loads(json.dumps(stats.to_json()))) == stats
    assert PartStats.from_json({"added": 3, "rejected_non_finite": 0}) == PartStats(3, 0, 0)  # no rss_bytes: 0
