"""A living index (issue 43): add, delete and compact as generations, exact at every moment.

The flat index's answers after every change equal a brute-force search over the live rows; the
IVF-PQ index after 20 % churn keeps the recall of a fresh build over the same live rows.
"""

import json

import numpy as np
import pytest

from core.errors import NeedleInputError
from core.location import location_of
from index.build.stage import IndexConfig
from index.build.stage import main as build
from index.errors import UnknownKeyError
from index.live.add_rows import AddConfig, DuplicateKeyError
from index.live.add_rows import main as add
from index.live.compact import CompactConfig
from index.live.compact import main as compact
from index.live.delete_rows import DeleteConfig, read_keys
from index.live.delete_rows import main as delete
from index.live.generations import GenerationConflict, latest_number, read_infos_at, read_manifest
from index.live.writer import WriterBusy, writing
from index.search import load_index
from tests.support.index import clustered_unit_vectors, write_descriptor_file
from tests.support.indexes import LIVE_FLAT_4
from tests.support.live import D, Live, assert_exact


@pytest.fixture
def flat(synthetic_indexes, tmp_path):
    """A flat index of 2 shards over 4 files of 40 rows, and the files' vectors."""
    out, xb = synthetic_indexes.copy(LIVE_FLAT_4, tmp_path)
    live = Live.of_files(LIVE_FLAT_4.parts(xb))
    return out, live, tmp_path


def test_flat_answers_equal_brute_force_after_every_change(flat):
    index_dir, live, tmp = flat
    xq = clustered_unit_vectors(12, D, seed=99).astype(np.float32)
    assert_exact(index_dir, live, xq)
    more = tmp / "more"
    for i in (4, 5):
        xb = clustered_unit_vectors(30, D, seed=10 + i)
        write_descriptor_file(more, f"t{i}", i, xb)
        live.add_file(f"t{i}", i, xb)
    change = add(AddConfig(), more, index_dir)
    assert change["generation"] == 1 and change["rows"] == 60
    assert change["timings"]["add_s"] >= 0 and change["timings"]["add_cpu_s"] >= 0  # its add phase, as the build's
    assert_exact(index_dir, live, xq)
    rng = np.random.default_rng(0)
    doomed = sorted(rng.choice(sorted(live.rows), 50, replace=False).tolist())
    change = delete(DeleteConfig(), [*doomed, "no/such-key"], index_dir)
    assert change["deleted"] == 50 and change["unknown"] == 1 and change["unknown_keys"] == ["no/such-key"]
    for key in doomed:
        del live.rows[key]
    assert_exact(index_dir, live, xq)
    assert_exact(index_dir, live, xq, k=len(live.rows))  # every live row, none deleted
    change = compact(CompactConfig(), index_dir)
    assert change["generation"] == 3 and change["removed_rows"] == 50
    assert_exact(index_dir, live, xq)
    assert_exact(index_dir, live, xq, k=len(live.rows))
    # --replace: a new file re-adds two live keys (new vectors) and a deleted one
    replaced = [sorted(live.rows)[0], sorted(live.rows)[1], doomed[0]]
    xb = clustered_unit_vectors(3, D, seed=77)
    write_descriptor_file(tmp / "again", "t9", 9, xb, keys=replaced)
    with pytest.raises(DuplicateKeyError, match="already in the index"):
        add(AddConfig(), tmp / "again", index_dir)
    add(AddConfig(replace=True), tmp / "again", index_dir)
    live.add_file("t9", 9, xb, keys=replaced)
    assert_exact(index_dir, live, xq)
    index = load_index(index_dir)
    for key in replaced:
        np.testing.assert_array_equal(index.vector_of(key), live.rows[key][1].astype(np.float32))
    assert index.generation == 4


def test_deleted_keys_are_unknown_and_k_results_remain(flat):
    index_dir, live, _ = flat
    keys = sorted(live.rows)
    delete(DeleteConfig(), keys[:150], index_dir)  # all but 10 of 160
    index = load_index(index_dir)
    with pytest.raises(UnknownKeyError):
        index.vector_of(keys[0])
    with pytest.raises(UnknownKeyError):
        index.position_of(keys[0])
    xq = clustered_unit_vectors(3, D, seed=5).astype(np.float32)
    _, I = index.search(xq, 10)
    assert (I >= 0).all() and set(I.ravel()) <= {live.rows[k][0] for k in keys[150:]}
    again = delete(DeleteConfig(), keys[:3], index_dir)  # already deleted: unknown, nothing published
    assert again["generation"] is None and again["unknown"] == 3


def test_adding_the_same_files_again_adds_nothing(flat):
    index_dir, _, tmp = flat
    change = add(AddConfig(), tmp / "desc", index_dir)
    assert change["generation"] is None and len(change["skipped_files"]) == 4
    assert latest_number(location_of(index_dir)) == 0
    xb = clustered_unit_vectors(5, D, seed=3)
    write_descriptor_file(tmp / "clash", "other", 2, xb)  # Parquet shard id 2 from another file
    with pytest.raises(NeedleInputError, match="shard id 2"):
        add(AddConfig(), tmp / "clash", index_dir)


def test_fully_deleted_files_stay_known_after_compaction(flat):
    """Deleted rows never come back: re-adding the descriptors of a tar whose rows were all deleted
    and compacted away skips the file."""
    index_dir, live, tmp = flat
    delete(DeleteConfig(), [k for k in live.rows if k.startswith("t1/")], index_dir)
    compact(CompactConfig(), index_dir)
    change = add(AddConfig(), tmp / "desc", index_dir)
    assert change["generation"] is None and "t1.parquet" in change["skipped_files"]


def test_compact_removes_deleted_bytes_and_old_generations(flat):
    index_dir, live, _ = flat
    victim = sorted(live.rows)[7]
    vector = live.rows[victim][1]
    delete(DeleteConfig(), [victim], index_dir)
    change = compact(CompactConfig(keep=1), index_dir)
    assert change["removed"]  # the build's shard directory and the older manifest
    needle_bytes = vector.astype(np.float16).tobytes()
    for path in index_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert needle_bytes not in data, path
            assert vector.astype(np.float32).tobytes() not in data, path
            assert victim.encode() not in data or path.suffix == ".json", path
    del live.rows[victim]
    assert_exact(index_dir, live, clustered_unit_vectors(5, D, seed=8).astype(np.float32))
    retired = json.loads((index_dir / "generations" / "000001.json").read_text())
    assert retired == {"format": 1, "generation": 1, "removed": True}  # a tombstone: its number stays taken


def test_two_writers_the_second_fails_and_nothing_is_lost(flat):
    index_dir, live, tmp = flat
    keys = sorted(live.rows)
    with writing(index_dir), pytest.raises(WriterBusy, match="another writer"):
        delete(DeleteConfig(), keys[:1], index_dir)
    # two writers on S3-like terms (no lock): both start from generation 0, the second to publish loses
    from index.live.writer import Writer, next_shards

    location = location_of(index_dir)
    a = Writer(location, read_infos_at(location), read_manifest(location), tmp)
    b = Writer(location, a.infos, a.parent, tmp)
    a.publish(next_shards(a, {}, {}), {"command": "test"})
    with pytest.raises(GenerationConflict, match="another writer"):
        b.publish(next_shards(b, {}, {}), {"command": "test"})
    assert latest_number(location) == 1


def test_read_keys_from_a_file(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("a/1\n\nb/2\r\na/1\n")
    assert read_keys(str(path)) == ["a/1", "b/2"]
    with pytest.raises(NeedleInputError, match="cannot read"):
        read_keys(str(tmp_path / "missing.txt"))


def recall_at(I: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(I, truth)]))


@pytest.mark.slow
def test_ivfpq_recall_after_churn_matches_a_fresh_build_and_compaction_changes_no_answer(tmp_path):
    """20 % churn (10 % added, 10 % deleted) on IVF-PQ: recall@1000 within 0.01 of a fresh build
    over the same live rows at the same nprobe; compaction then leaves every answer as it was."""
    d, per_file, files = 32, 500, 8
    conf = IndexConfig(
        recall_target=None, kind="ivfpq", nlist=32, pq_bytes=8, points_per_list=60, nprobe=6, refine_factor=2, shards=2
    )
    live = Live()
    extra = per_file * files // 20
    pool = clustered_unit_vectors(per_file * files + 2 * extra + 20, d, seed=0, clusters=40)  # one distribution
    for i in range(files):
        xb = pool[i * per_file : (i + 1) * per_file]
        write_descriptor_file(tmp_path / "desc", f"t{i}", i, xb)
        live.add_file(f"t{i}", i, xb)
    index_dir = build(conf, tmp_path / "desc", tmp_path / "index")
    for j, i in enumerate((files, files + 1)):  # 10 % added
        xb = pool[per_file * files + j * extra : per_file * files + (j + 1) * extra]
        write_descriptor_file(tmp_path / "more", f"t{i}", i, xb)
        live.add_file(f"t{i}", i, xb)
    change = add(AddConfig(), tmp_path / "more", index_dir)
    assert change["drift"]["error_ratio"] < 1.1 and not change["drift"]["rebuild_recommended"]
    # rows of other clusters: the report says to rebuild
    write_descriptor_file(tmp_path / "other", "t20", 20, clustered_unit_vectors(300, d, seed=77, clusters=40))
    drifted = add(AddConfig(), tmp_path / "other", index_dir)
    assert drifted["drift"]["rebuild_recommended"] and drifted["drift"]["error_ratio"] > 1.25
    delete(DeleteConfig(), [f"t20/{i:05d}" for i in range(300)], index_dir)
    doomed = np.random.default_rng(1).choice(sorted(live.rows), per_file * files // 10, replace=False).tolist()
    delete(DeleteConfig(), doomed, index_dir)
    for key in doomed:
        del live.rows[key]
    # a fresh build over the same live rows (their keys; new row ids, two files)
    keys = sorted(live.rows)
    vectors = np.stack([live.rows[k][1] for k in keys])
    half = len(keys) // 2
    write_descriptor_file(tmp_path / "fresh_desc", "f0", 0, vectors[:half], keys[:half])
    write_descriptor_file(tmp_path / "fresh_desc", "f1", 1, vectors[half:], keys[half:])
    fresh = load_index(build(conf, tmp_path / "fresh_desc", tmp_path / "fresh"))
    xq = pool[-20:].astype(np.float32)  # held out of every file
    _, truth_rows = live.brute_force(xq, 1000)
    row_key = {row: key for key, (row, _) in live.rows.items()}
    truth = np.array([[row_key[r] for r in rows] for rows in truth_rows])
    living = load_index(index_dir)
    D_live, I_live = living.search(xq, 1000)
    _, I_fresh = fresh.search(xq, 1000)
    recall_live = recall_at(np.array(living.keys_of(I_live)), truth)
    recall_fresh = recall_at(np.array(fresh.keys_of(I_fresh)), truth)
    assert recall_live >= recall_fresh - 0.01, (recall_live, recall_fresh)
    assert not set(doomed) & {k for row in living.keys_of(I_live) for k in row}
    # the drifted add made --retrain auto retrain (test_retrain.py); compaction alone keeps every answer
    assert not compact(CompactConfig(retrain="never"), index_dir)["retrained"]
    D_after, I_after = load_index(index_dir).search(xq, 1000)
    np.testing.assert_array_equal(I_after, I_live)
    np.testing.assert_array_equal(D_after, D_live)


def test_an_index_built_before_shard_directories_is_refused_by_a_writer(flat, tmp_path):
    from index.errors import OldIndexLayoutError
    from tests.support.index import to_old_layout

    index_dir, live, _ = flat
    old = to_old_layout(index_dir, tmp_path / "old")
    with pytest.raises(OldIndexLayoutError, match=f"rebuild it with `needle index build --descriptors .* --out {old}`"):
        delete(DeleteConfig(), [sorted(live.rows)[0]], old)
    assert not (old / "generations").exists()  # nothing written, not even the writer lock
