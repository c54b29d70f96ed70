"""Small segments searched as one FAISS index (index/live/segment_merge.py): a living index answers as
when each segment is searched by itself (``merge_small=False``), to the bit, for the index kinds
the build makes, with deleted rows skipped; each member's part holds only its own rows."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from index.build.stage import IndexConfig
from index.build.stage import main as build
from index.live.add_rows import AddConfig
from index.live.add_rows import main as add
from index.live.delete_rows import DeleteConfig
from index.live.delete_rows import main as delete
from index.live.row_map import row_column
from index.live.segment_merge import SMALL_SHARE, merged_groups, owners_of
from index.search import load_index
from ingest.descriptors import ROW_SHARD_SHIFT
from tests.support.index import clustered_unit_vectors, write_descriptor_file

D = 32


def living_index(tmp_path, factory: str | None = None):
    """2 shards of 1,600 rows, then 5 adds of 150-270 rows (one file each: a small segment each),
    then deletes in a base segment and in two added ones."""
    conf = IndexConfig(
        recall_target=None,
        kind="ivfpq",
        nlist=32,
        pq_bytes=8,
        points_per_list=60,
        nprobe=6,
        refine_factor=2,
        shards=2,
        factory=factory,
    )
    pool = clustered_unit_vectors(5000, D, seed=0, clusters=40)
    for i in range(4):
        write_descriptor_file(tmp_path / "desc", f"t{i}", i, pool[i * 800 : (i + 1) * 800])
    index_dir = build(conf, tmp_path / "desc", tmp_path / "index")
    start = 3200
    for j in range(5):
        rows = 150 + 30 * j
        write_descriptor_file(tmp_path / f"more{j}", f"a{j}", 10 + j, pool[start : start + rows])
        add(AddConfig(), tmp_path / f"more{j}", index_dir)
        start += rows
    doomed = [f"t0/{i:05d}" for i in range(0, 800, 3)] + [f"a1/{i:05d}" for i in range(60)]
    delete(DeleteConfig(), doomed + [f"a3/{i:05d}" for i in range(0, 240, 2)], index_dir)
    return index_dir


@pytest.mark.parametrize("factory", [None, "IVF32,PQ8x4", "OPQ8,IVF32,PQ16x4fsr", "IVF32_HNSW8,PQ8x4fsr"])
def test_merged_small_segments_answer_as_each_segment_alone(tmp_path, factory):
    index = load_index(living_index(tmp_path, factory))
    index.warm()
    assert len(index.shards) == 7
    groups = index.merged_segments
    assert [len(g.members) for g in groups] == [5]  # the five added segments, in one coarse stage
    largest = max(s.index.ntotal for s in index.shards)
    assert all(index.shards[m].index.ntotal < SMALL_SHARE * largest for m in groups[0].members)
    # the merged copy holds the members' live rows only: its searches skip nothing
    assert len(groups[0].deletes) == 0
    assert (
        groups[0].stage.ivf.ntotal
        == sum(index.shards[m].ntotal for m in groups[0].members)
        < sum(index.shards[m].index.ntotal for m in groups[0].members)
    )
    alone = dataclasses.replace(index, merge_small=False)
    assert alone.merged_segments == []
    xq = clustered_unit_vectors(9, D, seed=5).astype(np.float32)
    deleted = np.concatenate([s.deletes.rows for s in index.shards])
    for nprobe in (None, 3, 32):
        for k in (1, 20, 300):
            for queries in (xq[:1], xq):
                D_merged, I_merged = index.search(queries, k, nprobe=nprobe)
                D_alone, I_alone = alone.search(queries, k, nprobe=nprobe)
                np.testing.assert_array_equal(I_merged, I_alone)
                np.testing.assert_array_equal(D_merged, D_alone)
                assert not np.isin(I_merged, deleted).any()
                if nprobe == 32:  # every list probed, k live rows remain: k answers
                    assert (I_merged >= 0).all()


def test_each_member_part_is_its_own_rows_of_the_groups_best(tmp_path):
    index = load_index(living_index(tmp_path))
    (group,) = index.merged_segments
    xq = clustered_unit_vectors(6, D, seed=7).astype(np.float32)
    kk = 40
    for queries in (xq[:1], xq):
        parts = group.candidates(queries, kk, 8)
        assert len(parts) == len(group.members)
        for q in range(len(queries)):
            found = np.concatenate([I[q][I[q] >= 0] for _, I in parts])
            assert len(found) == len(set(found.tolist())) == kk  # the group's best kk, each once
        for member, (Dp, Ip) in zip(group.members, parts):
            own = set(row_column(index.shards[member].files.ids).tolist())
            assert set(Ip[Ip >= 0].tolist()) <= own
            for scores, rows in zip(Dp, Ip):  # best first, padding after
                found = rows >= 0
                assert not (found[1:] & ~found[:-1]).any() and (np.diff(scores[found]) <= 0).all()


def shard_of_rows(rows: list[int]) -> SimpleNamespace:
    return SimpleNamespace(files=SimpleNamespace(ids=pa.table({"row": pa.array(rows, pa.int64())})))


def test_owners_table_and_a_file_in_two_segments():
    file_row = lambda f, r: (f << ROW_SHARD_SHIFT) | r  # noqa: E731
    owners = owners_of([shard_of_rows([file_row(3, 0), file_row(3, 5)]), shard_of_rows([file_row(7, 1)])])
    assert owners.tolist() == [-1, -1, -1, 0, -1, -1, -1, 1]
    with pytest.raises(ValueError, match=r"Parquet files \[3\] in two segments"):
        owners_of([shard_of_rows([file_row(3, 0)]), shard_of_rows([file_row(3, 1)])])


def test_segments_that_cannot_be_merged_are_searched_alone(tmp_path, monkeypatch, caplog):
    import index.live.segment_merge as segment_merge

    def refuse(shards):
        raise ValueError("Parquet files [10] in two segments")

    monkeypatch.setattr(segment_merge, "owners_of", refuse)
    index = load_index(living_index(tmp_path))
    assert merged_groups(index.shards) == [] and "not merged for search" in caplog.text
    xq = clustered_unit_vectors(4, D, seed=9).astype(np.float32)
    D_alone, I_alone = dataclasses.replace(index, merge_small=False).search(xq, 30)
    D_found, I_found = index.search(xq, 30)
    np.testing.assert_array_equal(I_found, I_alone)
    np.testing.assert_array_equal(D_found, D_alone)


def test_a_shard_group_searches_its_small_segments_as_one(tmp_path):
    """--ray-shards: the segments one actor serves (a ShardGroup, here in this process) search
    their small ones as one index, and the group's answers merge to the in-process index's."""
    from core.location import location_of
    from index.build.merge import merge_shortlists
    from index.live.generations import read_view
    from shards.messages import answer_request, pack_request, unpack_answers
    from shards.shard_group import ShardGroup
    from shards.staging import StageConfig

    index_dir = living_index(tmp_path)
    entries = read_view(location_of(index_dir)).as_infos()["shards"]
    group = ShardGroup(str(index_dir), entries, StageConfig(str(tmp_path / "cache")))
    assert [len(g.members) for g in group.merged] == [5]
    index = load_index(index_dir)
    xq = clustered_unit_vectors(5, D, seed=11).astype(np.float32)
    for k, nprobe in ((10, None), (200, 32)):
        kk = index.shortlist_size(k)
        calls = [(member, (xq, kk, nprobe, True)) for member in range(len(entries))]
        answers = unpack_answers(answer_request(group.answer, pack_request("search", calls), len(entries)))
        assert all(status == "ok" for status, _ in answers)
        D_group, I_group = merge_shortlists([value[:3] for _, value in answers], kk, k)
        D_one, I_one = index.search(xq, k, nprobe=nprobe)
        np.testing.assert_array_equal(I_group, I_one)
        np.testing.assert_array_equal(D_group, D_one)
        for _, (_, I, _, keys) in answers:  # each member's keys are its own rows'
            assert [len(row) for row in keys] == [I.shape[1]] * len(xq)


def test_a_row_its_owner_does_not_hold_is_an_error_not_a_wrong_score(tmp_path, monkeypatch):
    from index.errors import IndexFileError

    index = load_index(living_index(tmp_path))
    (group,) = index.merged_segments
    xq = clustered_unit_vectors(1, D, seed=13).astype(np.float32)
    D_best, I_best = group.best(xq, 20, 8)
    assert np.isfinite(group.exact_scores(xq, D_best, I_best)[I_best >= 0]).all()
    for shard in group.shards:  # as if a member's row map had lost its rows
        monkeypatch.setattr(shard, "positions_of_rows", lambda I: np.full(np.shape(I), -1, np.int64))
    with pytest.raises(IndexFileError, match="of the merged segments is not in"):
        group.exact_scores(xq, D_best, I_best)
