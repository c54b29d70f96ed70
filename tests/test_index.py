"""Index build and search: flat equals exact search, IVF-PQ is sane, bad inputs are refused."""

import json

import numpy as np
import pytest

from helpers_index import clustered_unit_vectors, write_descriptor_file
from index.build import IDS_FILE, INFOS_FILE, IndexConfig, main
from index.search import IndexFileError, UnknownKeyError, load_index
from ingest.descriptors import DescriptorFileError, make_row_id


@pytest.fixture
def collection(tmp_path):
    parts = [clustered_unit_vectors(150, 32, seed=s) for s in range(3)]
    for s, xb in enumerate(parts):
        write_descriptor_file(tmp_path / "desc", f"{s:06d}", s, xb)
    return tmp_path / "desc", np.concatenate(parts).astype(np.float32)


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


def test_ivfpq_finds_itself(tmp_path, collection):
    desc, xb = collection
    conf = IndexConfig(kind="ivfpq", nlist=8, pq_bytes=16, train_points_per_list=40)
    index = load_index(main(conf, desc, tmp_path / "index"))
    assert index.infos["factory"] == "IVF8,PQ16"
    D, I = index.search(xb[:50], 10, nprobe=8)
    keys = index.keys_of(I)
    self_found = np.mean([index.keys[q] in keys[q] for q in range(50)])
    assert self_found >= 0.9
    assert (I >= 0).all()


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
    assert index.ntotal == 18 and index.infos["rejected_non_finite"] == 2
    with pytest.raises(UnknownKeyError):
        index.vector_of("000000/00003")


def test_inconsistent_or_missing_index_files_are_refused(tmp_path, collection):
    desc, _ = collection
    out = main(IndexConfig(), desc, tmp_path / "index")
    import pyarrow.parquet as pq

    table = pq.read_table(out / IDS_FILE)
    pq.write_table(table.slice(0, 10), out / IDS_FILE)
    with pytest.raises(IndexFileError, match="inconsistent"):
        load_index(out)
    (out / IDS_FILE).unlink()
    with pytest.raises(IndexFileError, match=IDS_FILE):
        load_index(out)


def test_corrupted_index_file_is_refused(tmp_path, collection):
    desc, _ = collection
    out = main(IndexConfig(), desc, tmp_path / "index")
    (out / "index.faiss").write_bytes(b"garbage")
    with pytest.raises(IndexFileError, match="index.faiss"):
        load_index(out)


def test_wrong_query_dimension_is_refused(tmp_path, collection):
    from ingest.errors import NeedleInputError

    desc, _ = collection
    index = load_index(main(IndexConfig(), desc, tmp_path / "index"))
    with pytest.raises(NeedleInputError, match=r"\(nq, 32\)"):
        index.search(np.zeros((2, 31), np.float32), 5)


def test_infos_record_how_it_was_made(tmp_path, collection):
    desc, _ = collection
    out = main(IndexConfig(), desc, tmp_path / "index")
    infos = json.loads((out / INFOS_FILE).read_text())
    assert infos["ntotal"] == 450 and infos["dim"] == 32 and infos["metric"] == "inner_product"
