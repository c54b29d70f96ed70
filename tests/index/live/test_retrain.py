"""Retraining as a generation (issue 56): ``compact --retrain`` makes the index what a fresh build of
its live rows would be, carries the changes published while it ran, and the search defaults are
chosen for a recall target on the index's own rows."""

import json

import faiss
import numpy as np
import pytest

from index.build.stage import IndexConfig
from index.build.stage import main as build
from index.build.tune import exact_answers, recall_at
from index.live.add_rows import AddConfig
from index.live.add_rows import main as add
from index.live.compact import CompactConfig
from index.live.compact import main as compact
from index.live.delete_rows import DeleteConfig
from index.live.delete_rows import main as delete
from index.live.generations import read_manifest
from index.live.retrain import detached, prepare, publish_retrained, retrain_reason
from index.search import load_index
from tests.support.index import clustered_unit_vectors, write_descriptor_file
from tests.support.live import Live, assert_exact

D = 32
TUNE = {"recall_ks": (10, 50), "tune_queries": 60}  # small: the choice itself is tested below


def write_files(directory, live, pool, first, count, per_file):
    for i in range(first, first + count):
        xb = pool[i * per_file : (i + 1) * per_file]
        write_descriptor_file(directory, f"t{i}", i, xb)
        live.add_file(f"t{i}", i, xb)


def fresh_build(tmp_path, live, conf, name="fresh"):
    """A build over the live rows (their keys, two files)."""
    keys = sorted(live.rows)
    vectors = np.stack([live.rows[k][1] for k in keys])
    half = len(keys) // 2
    write_descriptor_file(tmp_path / f"{name}_desc", "f0", 0, vectors[:half], keys[:half])
    write_descriptor_file(tmp_path / f"{name}_desc", "f1", 1, vectors[half:], keys[half:])
    return load_index(build(conf, tmp_path / f"{name}_desc", tmp_path / name))


def key_recall(index, xq, live, k, nprobe, factor):
    _, truth_rows = live.brute_force(xq, k)
    row_key = {row: key for key, (row, _) in live.rows.items()}
    truth = [{row_key[r] for r in rows} for rows in truth_rows]
    found = index.keys_of(index.search(xq, k, nprobe, True, factor)[1])
    return float(np.mean([len(set(f) & t) / len(t) for f, t in zip(found, truth)]))


def test_a_flat_index_that_outgrew_its_plan_is_retrained_to_ivf_and_recalls_as_a_fresh_build(tmp_path):
    pool = clustered_unit_vectors(4 * 600 + 300, D, seed=0, clusters=30)
    live = Live()
    write_files(tmp_path / "desc", live, pool, 0, 2, 600)
    conf = IndexConfig(kind="auto", flat_threshold=2000, shards=2)
    index_dir = build(conf, tmp_path / "desc", tmp_path / "index")
    assert load_index(index_dir).infos["kind"] == "flat"
    write_files(tmp_path / "more", live, pool, 2, 2, 600)
    add(AddConfig(), tmp_path / "more", index_dir)
    doomed = [f"t0/{i:05d}" for i in range(0, 600, 3)]
    delete(DeleteConfig(), doomed, index_dir)
    for key in doomed:
        del live.rows[key]
    assert "plan" in retrain_reason(CompactConfig(), index_dir)
    change = compact(CompactConfig(keep=1, **TUNE), index_dir)
    assert change["retrained"] and change["plan"]["kind"] == "ivfpq" and change["search"]["reached"]
    retrained = load_index(index_dir)
    assert retrained.infos["factory"] == change["plan"]["factory"] and retrained.ntotal == len(live.rows)
    assert retrained.infos["nprobe"] == change["search"]["nprobe"]  # the loader serves the chosen defaults
    manifest = read_manifest_of(index_dir)
    assert manifest.training is not None and manifest.training.generation == change["generation"]
    fresh = fresh_build(tmp_path, live, IndexConfig(factory=change["plan"]["factory"], shards=2))
    xq = pool[-300:].astype(np.float32)  # held out of every file
    for k in (10, 50):  # the same plan, nprobe and shortlist: the same recall, within the noise of k-means
        ours, theirs = key_recall(retrained, xq, live, k, 8, 8), key_recall(fresh, xq, live, k, 8, 8)
        assert abs(ours - theirs) <= 0.03, (k, ours, theirs)
    assert not set(doomed) & {k for row in retrained.keys_of(retrained.search(xq, 50)[1]) for k in row}


def test_a_retrain_that_keeps_the_plan_answers_as_a_fresh_index_of_its_trained_quantizer(tmp_path):
    pool = clustered_unit_vectors(4 * 500 + 20, D, seed=1, clusters=30)
    live = Live()
    write_files(tmp_path / "desc", live, pool, 0, 4, 500)
    conf = IndexConfig(kind="ivfpq", nlist=16, pq_bytes=8, points_per_list=60, nprobe=4, refine_factor=2, shards=2)
    index_dir = build(conf, tmp_path / "desc", tmp_path / "index")
    delete(DeleteConfig(), [f"t1/{i:05d}" for i in range(100)], index_dir)
    for i in range(100):
        del live.rows[f"t1/{i:05d}"]
    change = compact(CompactConfig(retrain="always", recall_target=None), index_dir)
    assert change["retrain_reason"].startswith("asked") and change["plan"]["factory"] == "IVF16,PQ16x4fsr"
    index = load_index(index_dir)
    trained = faiss.read_index(str(index_dir / read_manifest_of(index_dir).training.index))
    # the same index a fresh build would add to that quantizer: every live row, its vector, its id
    rows = np.array([r for r, _ in live.rows.values()])
    vectors = np.stack([v for _, v in live.rows.values()]).astype(np.float32)
    trained.add_with_ids(vectors, rows)
    xq = pool[-20:].astype(np.float32)
    k, kk = 10, 20
    params = faiss.SearchParametersIVF(nprobe=4)
    _, I_pq = trained.search(xq, kk, params=params)  # the shortlist (refine factor 2), re-scored exactly
    by_row = dict(zip(rows.tolist(), vectors))
    expected = [sorted(r, key=lambda row, q=q: -float(q @ by_row[row]))[:k] for q, r in zip(xq, I_pq.tolist())]
    _, I = index.search(xq, k, 4, True, 2)
    same = [set(a) == set(b) for a, b in zip(I.tolist(), expected)]
    overlap = np.mean([len(set(a) & set(b)) / k for a, b in zip(I.tolist(), expected)])
    # equal but where two candidates tie at the shortlist's edge (fast-scan scores are coarse: ties are common)
    assert np.mean(same) >= 0.8 and overlap >= 0.98, (np.mean(same), overlap)
    # and each re-encoded segment is, to the byte, the trained index with its live rows added in row order
    from index.shard_files import read_ids

    for segment in read_manifest_of(index_dir).segments:
        seg_rows = read_ids(index_dir / segment.name / "ids.arrow")["row"].to_numpy()
        alone = faiss.read_index(str(index_dir / read_manifest_of(index_dir).training.index))
        alone.add_with_ids(np.stack([by_row[r] for r in seg_rows.tolist()]), seg_rows)
        assert faiss.serialize_index(alone).tobytes() == (index_dir / segment.name / "index.faiss").read_bytes()


def read_manifest_of(index_dir):
    from core.location import location_of

    return read_manifest(location_of(index_dir))


def test_changes_published_during_a_retrain_are_carried_onto_it(tmp_path):
    """Phase A (no lock) runs; meanwhile an add, an add --replace, a delete and a plain compaction
    are published; phase B carries them all: every answer is a brute force over the live rows."""
    pool = clustered_unit_vectors(6 * 100, 16, seed=2)
    live = Live()
    for i in range(3):
        write_descriptor_file(tmp_path / "desc", f"t{i}", i, pool[i * 100 : (i + 1) * 100])
        live.add_file(f"t{i}", i, pool[i * 100 : (i + 1) * 100])
    index_dir = build(IndexConfig(kind="flat", shards=2), tmp_path / "desc", tmp_path / "index")
    conf = CompactConfig(retrain="always")
    with detached(index_dir, None) as writer:
        prepared = prepare(conf, writer)  # the long work, without the writer lock
        write_descriptor_file(tmp_path / "more", "t3", 3, pool[300:400])
        add(AddConfig(), tmp_path / "more", index_dir)
        live.add_file("t3", 3, pool[300:400])
        delete(DeleteConfig(), ["t0/00005", "t3/00007", "t1/00000"], index_dir)
        for key in ("t0/00005", "t3/00007", "t1/00000"):
            del live.rows[key]
        again = pool[400:402]
        write_descriptor_file(tmp_path / "again", "t4", 4, again, keys=["t2/00003", "t4/new"])
        add(AddConfig(replace=True), tmp_path / "again", index_dir)
        live.add_file("t4", 4, again, keys=["t2/00003", "t4/new"])
        compact(CompactConfig(retrain="never"), index_dir)  # rows moved, none changed
        delete(DeleteConfig(), ["t2/00050"], index_dir)
        del live.rows["t2/00050"]
        change = publish_retrained(conf, index_dir, prepared, "asked")
    assert change["started_from"] == 0 and change["carried"]["from_generations"] == 5
    assert change["carried"]["deleted_rows"] == 4 and change["carried"]["added_rows"] == 100 - 1 + 2
    xq = clustered_unit_vectors(8, 16, seed=99).astype(np.float32)
    assert_exact(index_dir, live, xq, k=len(live.rows))  # every live row, no deleted one, each once
    assert sorted(load_index(index_dir).keys_of(load_index(index_dir).search(xq, len(live.rows))[1])[0]) == sorted(
        live.rows
    )
    compact(CompactConfig(keep=1, retrain="never"), index_dir)  # the carried deletes compact away too
    assert_exact(index_dir, live, xq, k=len(live.rows))


def test_a_retrain_moves_the_trained_index_and_drift_baseline_and_adds_encode_with_them(tmp_path):
    pool = clustered_unit_vectors(5 * 400, D, seed=3, clusters=30)
    live = Live()
    write_files(tmp_path / "desc", live, pool, 0, 3, 400)
    conf = IndexConfig(kind="ivfpq", nlist=16, pq_bytes=8, points_per_list=60, nprobe=4, shards=2)
    index_dir = build(conf, tmp_path / "desc", tmp_path / "index")
    write_files(tmp_path / "more", live, pool, 3, 2, 400)  # 800 added to 1200: past 30 %
    first = add(AddConfig(), tmp_path / "more", index_dir)
    reason = retrain_reason(CompactConfig(), index_dir)
    assert reason is not None and "800 rows added since training" in reason
    assert retrain_reason(CompactConfig(retrain="never"), index_dir) is None
    assert retrain_reason(CompactConfig(retrain_share=0.9), index_dir) is None
    change = compact(CompactConfig(keep=1, **TUNE), index_dir)
    training = read_manifest_of(index_dir).training
    assert training.added_rows == 0 and training.trained_rows == 2000
    assert json.loads((index_dir / training.drift).read_text())["rows"] > 0
    assert retrain_reason(CompactConfig(), index_dir) is None  # nothing added since
    write_descriptor_file(tmp_path / "last", "t9", 9, clustered_unit_vectors(50, D, seed=3, clusters=30))
    second = add(AddConfig(), tmp_path / "last", index_dir)
    assert second["drift"]["mean_error_trained"] != first["drift"]["mean_error_trained"]  # the new baseline
    segment = index_dir / second["segments"][0] / "shard_infos.json"
    from core.hashing import file_sha256

    assert json.loads(segment.read_text())["trained_sha256"] == file_sha256(index_dir / training.index)
    assert read_manifest_of(index_dir).training.added_rows == 50 and change["generation"] == 2


@pytest.mark.parametrize("target", [0.9, 0.97])
def test_the_chosen_search_defaults_reach_the_recall_target_on_held_out_queries(tmp_path, target):
    pool = clustered_unit_vectors(4 * 800 + 300, D, seed=4, clusters=40)
    live = Live()
    write_files(tmp_path / "desc", live, pool, 0, 4, 800)
    conf = IndexConfig(kind="ivfpq", nlist=32, pq_bytes=8, shards=2, recall_target=target, **TUNE)
    index = load_index(build(conf, tmp_path / "desc", tmp_path / "index"))
    tuning = index.infos["search_tuning"]
    assert tuning["reached"] and (index.infos["nprobe"], index.infos["refine_factor"]) == (
        tuning["nprobe"],
        tuning["refine_factor"],
    )
    xq = pool[-300:].astype(np.float32)  # queries from outside the index: tuned on its own rows, reported here
    for k in (10, 50):
        got = recall_at(index.search(xq, k)[1], exact_answers(index, xq, k))  # the served defaults
        assert got >= target, (k, got, tuning)
    # a request still overrides them
    assert not np.array_equal(index.search(xq, 10, 1, True, 1)[1], index.search(xq, 10)[1])


def test_an_nprobe_or_refine_factor_given_is_served_as_given_not_tuned(tmp_path):
    """A target must not silently replace what the user asked for (a bench's ``--nprobe 16`` was
    once served as nprobe 1024, every list, and a 16 x shortlist)."""
    pool = clustered_unit_vectors(4 * 400, D, seed=6, clusters=40)
    write_files(tmp_path / "desc", Live(), pool, 0, 4, 400)
    conf = IndexConfig(kind="ivfpq", nlist=32, pq_bytes=8, shards=2, nprobe=5, **TUNE)
    infos = load_index(build(conf, tmp_path / "desc", tmp_path / "index")).infos
    assert (infos["nprobe"], infos["refine_factor"]) == (5, IndexConfig().refine_factor)
    assert "search_tuning" not in infos


def test_an_unreachable_target_serves_the_cheapest_setting_within_a_hundredth_of_the_best(tmp_path, caplog):
    """No nprobe and shortlist reach recall@10 1.0 through 2-byte codes: what is served is the
    cheapest pair whose recall is within UNREACHED_SLACK of the best pair's, not every list with
    the largest shortlist (which made a 1M-row index answer five times slower)."""
    from index.build.tune import (
        REFINE_FACTORS,
        UNREACHED_SLACK,
        choose_search,
        cost,
        lower_bound,
        per_query_recall,
        sample_queries,
        without_self,
    )

    pool = np.random.default_rng(8).standard_normal((4 * 1500, D)).astype(np.float32)  # no clusters: hard for PQ
    pool /= np.linalg.norm(pool, axis=1, keepdims=True)
    write_files(tmp_path / "desc", Live(), pool, 0, 4, 1500)
    conf = IndexConfig(kind="ivfpq", nlist=32, pq_bytes=2, shards=2, nprobe=4, refine_factor=2)
    index = load_index(build(conf, tmp_path / "desc", tmp_path / "index"))
    with caplog.at_level("WARNING"):
        choice = choose_search(index, 1.0, (10,), queries=100)
    assert not choice.reached and "no nprobe and refine factor reach" in caplog.text
    xq, own = sample_queries(index, 100)
    truth = without_self(exact_answers(index, xq, 11), own, 10)

    def low(nprobe, factor):
        found = without_self(index.search(xq, 11, nprobe, True, factor)[1], own, 10)
        return lower_bound(per_query_recall(found, truth))

    best = max(low(32, factor) for factor in REFINE_FACTORS)  # every list: the most each shortlist gets
    assert low(choice.nprobe, choice.refine_factor) >= best - UNREACHED_SLACK
    assert cost(index, choice.nprobe, choice.refine_factor, (10,), 32) < cost(index, 32, REFINE_FACTORS[-1], (10,), 32)
