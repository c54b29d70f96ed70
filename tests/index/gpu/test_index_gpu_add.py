"""The GPU add's mechanics with its base index on the CPU (index.build.train.assigning_with):
adding through a stand-in quantizer builds the index the CPU builds, and a stand-in of other
centroids is refused."""

import faiss
import numpy as np
import pytest

from core.errors import NeedleInputError
from index.build.factory import IndexPlan
from index.build.stage import IndexConfig, main
from index.build.train import assigning_with, hnsw_quantizer, train
from index.gpu.engine import assignment_quantizer
from index.search import load_index
from tests.support.exact_search import list_assignment
from tests.support.index import clustered_unit_vectors, write_descriptor_file

# --- adding through a stand-in quantizer (the GPU add's mechanics, its base index on the CPU) ---


def trained(factory, n=2000, d=32, seed=0):
    xt = clustered_unit_vectors(n, d, seed=seed).astype(np.float32)
    nlist = int(factory.split("IVF")[1].split("_")[0].split(",")[0])
    return train(IndexPlan(factory, "ivfpq", nlist, 0, n), xt)


def test_adding_through_the_stand_in_quantizer_builds_the_same_index():
    index = trained("IVF16,PQ8x4fsr")
    xb = clustered_unit_vectors(3000, 32, seed=5).astype(np.float32)
    ids = np.arange(3000, dtype=np.int64) * 3
    plain = faiss.clone_index(index)
    plain.add_with_ids(xb, ids)
    own = faiss.extract_index_ivf(index).quantizer.this
    copy = assignment_quantizer(faiss.extract_index_ivf(index).quantizer, gpu=False)
    with assigning_with(index, copy) as same:
        assert same is index and faiss.extract_index_ivf(index).quantizer.this == copy.this
        index.add_with_ids(xb, ids)
    assert faiss.extract_index_ivf(index).quantizer.this == own  # its own quantizer is back
    np.testing.assert_array_equal(faiss.serialize_index(index), faiss.serialize_index(plain))


def test_the_stand_in_for_an_hnsw_quantizer_assigns_exactly():
    index = trained("OPQ8_32,IVF64_HNSW32,PQ16x4fsr")
    xb = clustered_unit_vectors(3000, 32, seed=6).astype(np.float32)
    quantizer = faiss.extract_index_ivf(index).quantizer
    centroids = quantizer.reconstruct_n(0, quantizer.ntotal)
    with assigning_with(index, assignment_quantizer(quantizer, gpu=False)):
        index.add_with_ids(xb, np.arange(3000, dtype=np.int64))
    assert hnsw_quantizer(index) is not None  # the graph is back, saved with the index
    faiss.serialize_index(index)
    rotated = faiss.downcast_VectorTransform(index.chain.at(0)).apply(xb)
    if quantizer.metric_type == faiss.METRIC_INNER_PRODUCT:
        expected = np.argmax(rotated @ centroids.T, axis=1)
    else:
        expected = np.argmin(((rotated[:, None] - centroids[None]) ** 2).sum(-1), axis=1)
    np.testing.assert_array_equal(list_assignment(index, 3000), expected)


def test_build_adds_through_the_stand_in_where_faiss_has_gpus(tmp_path, monkeypatch):
    """``main``'s parts add through ``add_quantizer``'s stand-in (here with its base on the CPU,
    as if FAISS had GPUs): the same index as the plain CPU build, with its own quantizer saved."""
    import index.build.train as build_module

    for s in range(2):
        write_descriptor_file(tmp_path / "desc", f"{s:06d}", s, clustered_unit_vectors(1500, 32, seed=s))
    conf = IndexConfig(recall_target=None, kind="ivfpq", nlist=16, pq_bytes=8, nprobe=16)
    plain = main(conf, tmp_path / "desc", tmp_path / "plain")
    stand_ins = []

    def cpu_stand_in(index):
        stand_ins.append(assignment_quantizer(faiss.extract_index_ivf(index).quantizer, gpu=False))
        return stand_ins[-1]

    monkeypatch.setattr(build_module, "add_quantizer", cpu_stand_in)
    through = main(conf, tmp_path / "desc", tmp_path / "through")
    assert len(stand_ins) == 1
    a, b = (faiss.read_index(str(out / "shard_000" / "index.faiss")) for out in (plain, through))
    assert (
        type(faiss.downcast_index(faiss.extract_index_ivf(b).quantizer)).__name__ == "IndexFlatIP"
    )  # not the stand-in
    np.testing.assert_array_equal(
        faiss.serialize_index(a), faiss.serialize_index(b)
    )  # the same training, the same lists
    xq = clustered_unit_vectors(20, 32, seed=9).astype(np.float32)
    D_a, I_a = load_index(plain).search(xq, 10)
    D_b, I_b = load_index(through).search(xq, 10)
    np.testing.assert_array_equal(I_a, I_b)
    np.testing.assert_array_equal(D_a, D_b)


def test_assigning_with_refuses_other_centroids():
    index = trained("IVF16,PQ8x4fsr")
    with (
        pytest.raises(NeedleInputError, match="holds 0 x 32 centroids, the index 16 x 32"),
        assigning_with(index, faiss.IndexFlatIP(32)),
    ):
        pass
    assert faiss.extract_index_ivf(index).quantizer.ntotal == 16
