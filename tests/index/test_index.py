"""Index build and search: flat equals exact search, IVF-PQ is sane, bad inputs are refused."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pytest

from core.errors import NeedleInputError
from index.build.merge import search_params
from index.build.stage import IDS_FILE, INFOS_FILE, IndexConfig, main
from index.errors import IndexFileError, UnknownKeyError
from index.search import load_index
from index.shard_files import read_ids
from ingest.descriptors import DescriptorFileError, make_row_id
from tests.support.index import clustered_unit_vectors, write_descriptor_file
from tests.support.indexes import EXACT_DESCRIPTORS


@pytest.fixture
def collection(synthetic_indexes):
    """(the descriptors, their vectors), shared read-only."""
    return synthetic_indexes.get(EXACT_DESCRIPTORS)


def test_flat_search_equals_exact_search(tmp_path, collection):
    desc, xb = collection
    index = load_index(main(IndexConfig(), desc, tmp_path / "index"))
    assert index.infos["kind"] == "flat" and index.ntotal == len(xb)
    rows = np.array([make_row_id(s, i) for s in range(3) for i in range(150)])
    xq = xb[::37]
    k = 25
    D, I = index.search(xq, k)
    exact_scores = xq @ xb.T
    for q in range(len(xq)):
        order = np.argsort(-exact_scores[q], kind="stable")[:k]
        np.testing.assert_allclose(D[q], exact_scores[q, order], rtol=1e-5, atol=1e-5)
        # Equal ids wherever scores are not tied.
        distinct = np.r_[np.diff(exact_scores[q, order]) != 0, True] & np.r_[True, np.diff(exact_scores[q, order]) != 0]
        np.testing.assert_array_equal(I[q][distinct], rows[order][distinct])


def exact_topk(xq, xb, k):
    scores = xq @ xb.T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, 1), order


IVF = IndexConfig(recall_target=None, kind="ivfpq", nlist=8, pq_bytes=4, points_per_list=50, nprobe=8, refine_factor=4)


def test_ivfpq_with_refine_matches_exact_search(tmp_path, collection):
    desc, xb = collection
    index = load_index(main(IVF, desc, tmp_path / "index"))
    assert index.infos["factory"] == "IVF8,PQ8x4fsr" and index.infos["reasons"]
    xq = xb[::9]
    k = 20
    D, I = index.search(xq, k)
    _D_exact, order = exact_topk(xq, xb, k)
    rows = np.array([make_row_id(s, i) for s in range(3) for i in range(150)])
    recall = np.mean([len(set(I[q]) & set(rows[order[q]])) / k for q in range(len(xq))])
    assert recall >= 0.95
    # Refined scores are exact: equal to the true inner products of the returned rows.
    positions = index.positions_of_rows(I)
    np.testing.assert_allclose(D, np.einsum("qd,qkd->qk", xq, xb[positions]), rtol=1e-3, atol=1e-3)
    # Without refine the PQ scores are approximate and recall is lower or equal.
    _D_pq, I_pq = index.search(xq, k, refine=False)
    recall_pq = np.mean([len(set(I_pq[q]) & set(rows[order[q]])) / k for q in range(len(xq))])
    assert recall_pq <= recall


def test_sharded_flat_equals_single(tmp_path, collection):
    from dataclasses import replace

    desc, xb = collection
    single = load_index(main(IndexConfig(), desc, tmp_path / "single"))
    sharded = load_index(main(replace(IndexConfig(), shards=3), desc, tmp_path / "sharded"))
    assert len(sharded.shards) == 3 and sharded.ntotal == single.ntotal == 450
    xq = xb[::11]
    D1, I1 = single.search(xq, 15)
    D3, I3 = sharded.search(xq, 15)
    np.testing.assert_array_equal(I1, I3)
    np.testing.assert_array_equal(D1, D3)


def test_sharded_ivfpq_equals_single(tmp_path, collection):
    """Shards re-score their own shortlists, the coordinator keeps the shortlist a single index would
    take: the same rows and scores as the single index, also where that shortlist misses."""
    from dataclasses import replace

    desc, xb = collection
    conf = replace(IVF, refine_factor=2, nprobe=2)  # a tight shortlist, so that it sometimes misses
    single = load_index(main(conf, desc, tmp_path / "single"))
    sharded = load_index(main(replace(conf, shards=3), desc, tmp_path / "sharded"))
    xq = xb[::5].astype(np.float32)
    k = 15
    for nprobe, factor in ((2, 2), (8, 4), (1, 1)):
        D1, I1 = single.search(xq, k, nprobe, refine_factor=factor)
        D3, I3 = sharded.search(xq, k, nprobe, refine_factor=factor)
        np.testing.assert_array_equal(I1, I3)
        np.testing.assert_array_equal(D1, D3)
    rows = np.array([make_row_id(s, i) for s in range(3) for i in range(150)])
    _, order = exact_topk(xq, xb, k)
    D1, I1 = single.search(xq, k)
    misses = sum(set(I1[q]) != set(rows[order[q]]) for q in range(len(xq)))
    assert 0 < misses < len(xq)  # the comparison covers approximate answers, not only exact ones


def test_parallel_parts_equal_one_part(tmp_path, collection):
    from dataclasses import replace

    desc, xb = collection
    one = load_index(main(IVF, desc, tmp_path / "one"))
    three = load_index(main(replace(IVF, parts=3), desc, tmp_path / "three"))
    np.testing.assert_array_equal(one.search(xb[:20], 10)[1], three.search(xb[:20], 10)[1])


def test_dimension_mismatch_names_file_and_dims(tmp_path):
    write_descriptor_file(tmp_path / "d", "000000", 0, clustered_unit_vectors(10, 32))
    bad = write_descriptor_file(tmp_path / "d", "000001", 1, clustered_unit_vectors(10, 16))
    with pytest.raises(DescriptorFileError, match=rf"{bad.name}.*16.*32"):
        main(IndexConfig(), tmp_path / "d", tmp_path / "index")


def test_non_finite_descriptors_rejected_and_counted(tmp_path):
    xb = clustered_unit_vectors(20, 8)
    xb[3, 0] = np.nan
    xb[7, 2] = np.inf
    write_descriptor_file(tmp_path / "d", "000000", 0, xb)
    index = load_index(main(IndexConfig(), tmp_path / "d", tmp_path / "index"))
    assert index.ntotal == 18 and index.infos["rejected_non_finite"] == 2 and index.infos["rows"] == 20
    with pytest.raises(UnknownKeyError, match="no valid descriptor"):
        index.vector_of("000000/00003")
    _D, I = index.search(xb[:1].astype(np.float32), 20)
    assert len(I[0]) == 18 and "000000/00003" not in index.keys_of(I)[0]


def test_inconsistent_or_missing_index_files_are_refused(tmp_path, collection):
    desc, _ = collection
    out = main(IndexConfig(), desc, tmp_path / "index")
    shard = out / "shard_000"
    table = read_ids(shard / IDS_FILE)  # memory-mapped: write a new file and swap it in
    with pa.OSFile(str(tmp_path / "ids.tmp"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table.slice(0, 10))
    (tmp_path / "ids.tmp").replace(shard / IDS_FILE)
    with pytest.raises(IndexFileError, match=rf"shard_000.*{IDS_FILE} has \d+ bytes"):
        load_index(out)
    (shard / IDS_FILE).unlink()
    with pytest.raises(IndexFileError, match=rf"shard_000.*{IDS_FILE} is missing"):
        load_index(out)


def test_infos_disagreeing_with_the_shards_are_refused(tmp_path, collection):
    desc, _ = collection
    out = main(IndexConfig(), desc, tmp_path / "index")
    infos = json.loads((out / INFOS_FILE).read_text())
    (out / INFOS_FILE).write_text(json.dumps({**infos, "rows": infos["rows"] + 1}))
    with pytest.raises(IndexFileError, match="inconsistent"):
        load_index(out)


def test_corrupted_index_file_is_refused(tmp_path, collection):
    desc, _ = collection
    out = main(IndexConfig(), desc, tmp_path / "index")
    (out / "shard_000" / "index.faiss").write_bytes(b"garbage")
    with pytest.raises(IndexFileError, match=r"shard_000.*index\.faiss"):
        load_index(out)


def test_wrong_query_dimension_is_refused(tmp_path, collection):
    from core.errors import NeedleInputError

    desc, _ = collection
    index = load_index(main(IndexConfig(), desc, tmp_path / "index"))
    with pytest.raises(NeedleInputError, match=r"\(nq, 32\)"):
        index.search(np.zeros((2, 31), np.float32), 5)


def test_infos_record_how_it_was_made(tmp_path, collection):
    desc, _ = collection
    out = main(IndexConfig(), desc, tmp_path / "index")
    infos = json.loads((out / INFOS_FILE).read_text())
    assert infos["ntotal"] == 450 and infos["dim"] == 32 and infos["metric"] == "inner_product"


def test_plan_follows_size_and_budget():
    from index.build.factory import parse_bytes, plan_index

    assert plan_index(50_000, 512, parse_bytes("8GB")).factory == "IDMap2,Flat"
    big = plan_index(100_000_000, 512, parse_bytes("8GB"))
    assert big.factory == "OPQ64_512,IVF32768_HNSW32,PQ64x4fsr" and big.estimated_bytes <= parse_bytes("8GB")
    tight = plan_index(100_000_000, 512, parse_bytes("3GB"))
    assert tight.code_bytes < big.code_bytes  # a smaller budget buys smaller codes
    with pytest.raises(Exception, match="do not fit"):
        plan_index(100_000_000, 512, parse_bytes("500MB"))
    assert len(big.reasons) >= 4


def test_hnsw_quantizer_plan_builds_and_searches(tmp_path, collection):
    desc, xb = collection
    conf = IndexConfig(recall_target=None, factory="IVF16_HNSW32,PQ8x4fsr", nprobe=16, points_per_list=20)
    index = load_index(main(conf, desc, tmp_path / "index"))
    _D, I = index.search(xb[:5], 3)
    assert [keys[0] for keys in index.keys_of(I)] == [index.keys_of(index.rows[None, :5])[0][q] for q in range(5)]
    # The build's HNSW search depth is saved with the quantizer and recorded; queries never explore
    # fewer graph candidates than the lists they want.
    import faiss

    from index.build.stage import hnsw_quantizer

    assert index.infos["quantizer_ef"] == conf.quantizer_ef == 128
    graph = hnsw_quantizer(faiss.read_index(str(tmp_path / "index" / "shard_000" / "index.faiss")))
    assert graph is not None and graph.hnsw.efSearch == 128
    assert search_params(index.shards[0].index, 300, index.infos["quantizer_ef"]).referenced_objects[0].efSearch == 300


def test_query_time_refine_factor(tmp_path, collection):
    desc, xb = collection
    index = load_index(main(IVF, desc, tmp_path / "index"))
    xq = xb[::9].astype(np.float32)
    rows = np.array([make_row_id(s, i) for s in range(3) for i in range(150)])
    _, order = exact_topk(xq, xb, 10)
    recalls = []
    for factor in (1, 45):  # 45 * 10 candidates: the whole index, re-scored exactly
        _, I = index.search(xq, 10, refine_factor=factor)
        recalls.append(np.mean([len(set(I[q]) & set(rows[order[q]])) / 10 for q in range(len(xq))]))
    assert recalls[0] < recalls[1] == 1.0  # a longer shortlist re-scored exactly finds what PQ misranked
    for bad in (0, -2, 1.5, True):
        with pytest.raises(NeedleInputError, match="refine_factor"):
            index.search(xq, 10, refine_factor=bad)


def test_process_memory_reads_linux_accounting():
    from index.memory import process_memory

    memory = process_memory()
    assert memory["rss"] > 10 * 2**20 and 0 < memory["pss_anon"] <= memory["pss"] <= memory["rss"]
    assert process_memory(pid=2**22 + 7) == {}  # no such process


@pytest.mark.parametrize("url", ["s3:/bucket/idx", "gs://bucket/idx"])
def test_url_output_is_refused_not_written_to_a_local_directory(tmp_path, collection, url, monkeypatch):
    desc, _ = collection
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NeedleInputError, match="is a URL"):
        main(IndexConfig(), desc, url)
    assert not any(tmp_path.glob("*:*"))  # no local directory named "s3:" or "gs:"
