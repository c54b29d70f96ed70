"""index/gpu.py: exact search over memory-mapped chunks equals FAISS's flat search on every
backend (the torch one also runs on the CPU here), its merge breaks ties by the smaller id, a flat
shard's scan equals its FAISS index, and the GPU add keeps the index as the CPU builds it.
Tests marked ``gpu`` run the CUDA backends and compare them with the CPU."""

import sys

import faiss
import numpy as np
import pytest
from helpers_index import clustered_unit_vectors, write_descriptor_file

import index.shard as search_module
from core.errors import NeedleInputError
from index.build import IndexConfig, main
from index.build_train import assigning_with, hnsw_quantizer, train
from index.factory import IndexPlan
from index.gpu import (
    WORST,
    FaissCpu,
    TorchBackend,
    assignment_quantizer,
    choose_backend,
    chunks_at,
    chunks_of,
    exact_search,
    faiss_gpus,
    gpu_backend_available,
    merge_sorted,
    sort_candidates,
    torch_cuda_available,
)
from index.gpu_resident import ResidentDatabase, fits_on_device, keep_resident, resident_nbytes
from index.gpu_stream import search_streamed
from index.gpu_topk import GROUP, grouped_topk, plan_blocks
from index.search import load_index

CPU_BACKENDS = ("faiss-cpu", "torch")  # torch on the CPU: the CUDA backend's code, run in CI


def cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


needs_cuda = pytest.mark.skipif(not cuda(), reason="no CUDA GPU")


def flat_search(xq, xb, k, metric):
    index = faiss.IndexFlatIP(xb.shape[1]) if metric == "ip" else faiss.IndexFlatL2(xb.shape[1])
    index.add(np.ascontiguousarray(xb, dtype=np.float32))
    return index.search(np.ascontiguousarray(xq, dtype=np.float32), k)


def reference(xq, xb, k, metric):
    """Brute force in float64, best first, ties to the smaller id, FAISS's padding."""
    xq, xb = np.asarray(xq, np.float64), np.asarray(xb, np.float64)
    scores = xq @ xb.T if metric == "ip" else ((xq[:, None, :] - xb[None, :, :]) ** 2).sum(-1)
    key = -scores if metric == "ip" else scores
    ids = np.broadcast_to(np.arange(len(xb)), scores.shape)
    order = np.lexsort((ids, key), axis=-1)[:, :k]
    D = np.full((len(xq), k), WORST[metric], np.float32)
    I = np.full((len(xq), k), -1, np.int64)
    D[:, : order.shape[1]] = np.take_along_axis(scores, order, 1)
    I[:, : order.shape[1]] = order
    return D, I


def assert_same_neighbours(D, I, D_ref, I_ref, atol):
    """Scores within ``atol``; ids equal except among scores within 2 * atol of each other."""
    np.testing.assert_allclose(D, D_ref, atol=atol, rtol=1e-6)
    for q, j in zip(*np.nonzero(I_ref != I)):
        close = np.abs(D_ref[q] - D_ref[q, j]) <= 2 * atol
        close[j] = False
        assert close.any() or abs(D_ref[q, j] - D_ref[q, -1]) <= 2 * atol, (q, j, D_ref[q, j], I[q, j], I_ref[q, j])


def random_data(n, d, nq, dtype, seed=0):
    rng = np.random.default_rng(seed)
    xb = rng.standard_normal((n, d)).astype(dtype)
    xq = rng.standard_normal((nq, d)).astype(np.float32)
    return xq, xb


# --- exact_search on the CPU ------------------------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("rows", [1, 7, 64, 203, 1000])
def test_exact_search_equals_faiss_flat(backend, metric, dtype, rows):
    xq, xb = random_data(203, 24, 6, dtype)  # 203 = 3 * 64 + 11: an uneven last chunk
    k = 10
    D_ref, I_ref = flat_search(xq, xb, k, metric)
    D, I = exact_search(xq, chunks_of(xb, rows), k, metric, device="cpu", backend=backend)
    assert D.dtype == np.float32 and I.dtype == np.int64 and D.shape == I.shape == (6, k)
    np.testing.assert_array_equal(I, I_ref)
    np.testing.assert_allclose(D, D_ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_k_larger_than_database_is_padded_as_faiss_pads(backend, metric):
    xq, xb = random_data(9, 8, 3, np.float16)
    D_ref, I_ref = flat_search(xq, xb, 15, metric)
    D, I = exact_search(xq, chunks_of(xb, 4), 15, metric, device="cpu", backend=backend)
    np.testing.assert_array_equal(I, I_ref)
    assert (I[:, 9:] == -1).all() and (D[:, 9:] == WORST[metric]).all() and (D_ref[:, 9:] == WORST[metric]).all()
    np.testing.assert_allclose(D[:, :9], D_ref[:, :9], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("rows", [1, 5, 50, 333])
def test_ties_go_to_the_smaller_id(backend, metric, rows):
    """Small integers: every score is exact in float16/float32, and many tie (tie groups far
    larger than the margin asked of each chunk, so the deeper re-search runs)."""
    rng = np.random.default_rng(1)
    xb = rng.integers(-1, 2, size=(333, 4)).astype(np.float16)
    xb[::3] = xb[0]  # 111 copies of one vector
    xq = np.concatenate([xb[:1], rng.integers(-2, 3, size=(7, 4))]).astype(np.float32)
    k = 40
    D_ref, I_ref = reference(xq, xb, k, metric)
    D, I = exact_search(xq, chunks_of(xb, rows), k, metric, device="cpu", backend=backend)
    np.testing.assert_array_equal(I, I_ref)
    np.testing.assert_array_equal(D, D_ref)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_merge_equals_brute_force_argsort(backend):
    xq, xb = random_data(500, 16, 20, np.float32, seed=3)
    for k in (1, 17, 499, 500, 600):
        D_ref, I_ref = reference(xq, xb, k, "ip")
        for rows in (1, 13, 100, 499):
            D, I = exact_search(xq, chunks_of(xb, rows), k, device="cpu", backend=backend)
            assert_same_neighbours(D, I, D_ref, I_ref, atol=1e-5)


def test_sort_candidates_orders_pads_and_cuts():
    D = np.array([[0.5, 0.75, 0.5, WORST["ip"]]], np.float32)
    I = np.array([[7, 3, 2, -1]])
    D_out, I_out = sort_candidates(D, I, "ip", 6)
    np.testing.assert_array_equal(I_out, [[3, 2, 7, -1, -1, -1]])
    np.testing.assert_array_equal(D_out, [[0.75, 0.5, 0.5] + [WORST["ip"]] * 3])
    D_out, I_out = sort_candidates(D, I, "l2", 2)
    np.testing.assert_array_equal(I_out, [[2, 7]])


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_merge_sorted_equals_a_full_sort(metric):
    """Two sorted lists (ties in id order, padding last, the second's ids larger), merged."""
    rng = np.random.default_rng(2)
    for _ in range(20):
        k = int(rng.integers(1, 12))
        lists = []
        for first_id, n_real in ((0, int(rng.integers(0, k + 1))), (100, int(rng.integers(1, k + 1)))):
            D = rng.integers(0, 4, size=(3, n_real)).astype(np.float32)  # many ties
            I = np.broadcast_to(first_id + rng.permutation(50)[:n_real], D.shape).copy()
            lists.append(sort_candidates(D, I, metric, k if first_id == 0 else n_real))
        (D1, I1), (D2, I2) = lists
        expected = sort_candidates(np.concatenate([D1, D2], 1), np.concatenate([I1, I2], 1), metric, k)
        for got, want in zip(merge_sorted(D1, I1, D2, I2, metric, k), expected):
            np.testing.assert_array_equal(got, want)


def test_empty_chunks_no_queries_and_empty_database():
    xq, xb = random_data(30, 8, 4, np.float16)
    empty = xb[:0]
    _D_ref, I_ref = exact_search(xq, [xb], 5, device="cpu")
    D, I = exact_search(xq, [empty, xb[:10], empty, xb[10:], empty], 5, device="cpu")
    np.testing.assert_array_equal(I, I_ref)
    D, I = exact_search(xq[:0], [xb], 5, device="cpu")
    assert D.shape == I.shape == (0, 5)
    D, I = exact_search(xq, [empty], 3, device="cpu")
    assert (I == -1).all() and (WORST["ip"] == D).all()
    D, I = exact_search(xq, xb, 5, device="cpu")  # one array: chunked for the caller
    np.testing.assert_array_equal(I, I_ref)


def test_memory_mapped_chunks(tmp_path):
    xq, xb = random_data(1000, 32, 5, np.float16)
    np.save(tmp_path / "xb.npy", xb)
    mapped = np.load(tmp_path / "xb.npy", mmap_mode="r")
    chunks = list(chunks_of(mapped, 300))
    assert [len(c) for c in chunks] == [300, 300, 300, 100] and all(np.shares_memory(c, mapped) for c in chunks)
    D_ref, I_ref = flat_search(xq, xb, 20, "ip")
    for backend in CPU_BACKENDS:
        D, I = exact_search(xq, chunks_of(mapped, 300), 20, device="cpu", backend=backend)
        np.testing.assert_array_equal(I, I_ref)
        np.testing.assert_allclose(D, D_ref, rtol=1e-5, atol=1e-4)


def test_chunks_at_gathers_only_where_rows_are_skipped(tmp_path):
    xb = np.arange(40, dtype=np.float32).reshape(20, 2)
    np.save(tmp_path / "xb.npy", xb)
    mapped = np.load(tmp_path / "xb.npy", mmap_mode="r")
    positions = np.array([0, 1, 2, 3, 5, 6, 7, 8, 9, 19])
    chunks = list(chunks_at(mapped, positions, 4))
    np.testing.assert_array_equal(np.concatenate(chunks), xb[positions])
    assert [np.shares_memory(c, mapped) for c in chunks] == [True, True, False]  # 0-3, 5-8: views; 9, 19: a copy
    assert list(chunks_at(mapped, np.zeros(0, np.int64), 4)) == []
    with pytest.raises(NeedleInputError, match="ascend"):
        list(chunks_at(mapped, np.array([3, 2]), 4))


def test_bad_inputs_name_what_is_wrong():
    xq, xb = random_data(10, 8, 2, np.float16)
    with pytest.raises(NeedleInputError, match=r"chunk 1 has shape \(4, 8\) and dtype float64"):
        exact_search(xq, [xb, xb[:4].astype(np.float64)], 3, device="cpu")
    with pytest.raises(NeedleInputError, match=r"chunk 0 has shape \(10, 7\)"):
        exact_search(xq, [xb[:, :7]], 3, device="cpu")
    with pytest.raises(NeedleInputError, match=r"chunk 0 has shape \(8,\)"):
        exact_search(xq, list(xb), 3, device="cpu")  # rows, not chunks of rows
    with pytest.raises(NeedleInputError, match="k must be"):
        exact_search(xq, [xb], 0)
    with pytest.raises(NeedleInputError, match="NaN"):
        exact_search(np.full((1, 8), np.nan), [xb], 3)
    with pytest.raises(NeedleInputError, match="metric 'cos'"):
        exact_search(xq, [xb], 3, metric="cos")
    with pytest.raises(NeedleInputError, match="device 'tpu'"):
        exact_search(xq, [xb], 3, device="tpu")
    with pytest.raises(NeedleInputError, match="backend 'numpy'"):
        exact_search(xq, [xb], 3, backend="numpy")
    with pytest.raises(NeedleInputError, match="chunk rows"):
        list(chunks_of(xb, 0))
    with pytest.raises(NeedleInputError, match="2-D"):
        list(chunks_of(xb[0], 2))


@pytest.mark.skipif(gpu_backend_available(), reason="this machine has a GPU backend")
def test_without_a_gpu_auto_is_faiss_cpu_and_cuda_is_refused():
    assert faiss_gpus() == 0 and not torch_cuda_available()
    assert isinstance(choose_backend("auto"), FaissCpu)
    assert isinstance(choose_backend("auto", backend="torch"), TorchBackend)
    xq, xb = random_data(10, 8, 2, np.float16)
    with pytest.raises(NeedleInputError, match="device 'cuda'"):
        exact_search(xq, [xb], 3, device="cuda")
    with pytest.raises(NeedleInputError, match="faiss-gpu"):
        exact_search(xq, [xb], 3, backend="faiss-gpu")


def test_gpu_probes_never_raise(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # import faiss fails
    monkeypatch.setitem(sys.modules, "torch", None)
    assert faiss_gpus() == 0 and torch_cuda_available() is False


# --- a flat shard's scan ----------------------------------------------------------------------


@pytest.fixture
def flat_index(tmp_path):
    """Three files, one descriptor of the second rejected (NaN): the scan must skip its row."""
    parts = [clustered_unit_vectors(150, 32, seed=s) for s in range(3)]
    parts[1][40, 3] = np.nan
    for s, xb in enumerate(parts):
        write_descriptor_file(tmp_path / "desc", f"{s:06d}", s, xb)
    out = main(IndexConfig(kind="flat", shards=3), tmp_path / "desc", tmp_path / "index")
    return out, np.concatenate(parts).astype(np.float32)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_flat_shard_scan_equals_its_faiss_index(flat_index, backend):
    out, xb = flat_index
    index = load_index(out)
    xq = np.nan_to_num(xb[::29])
    for shard in index.shards:
        assert not shard.scans_on_gpu(10_000) or shard.gpu_present
        D_ref, I_ref = search_module.sort_by_score(*shard.index.search(xq, shard.ntotal), 20)
        D, I = shard.scan(xq, 20, device="cpu", backend=backend)
        assert_same_neighbours(D, I, D_ref, I_ref, atol=1e-5)
        positions, _ = shard.scan_layout
        assert len(positions) == shard.ntotal
    assert 150 + 40 not in np.concatenate([s.scan_layout[0] for s in index.shards])


def test_search_routes_large_flat_searches_through_the_scan(flat_index, monkeypatch):
    """With the thresholds lowered and a (pretend) GPU, ``SearchIndex.search`` takes the scan
    path (run here on the CPU), and answers as the FAISS path does."""
    out, xb = flat_index
    xq = np.nan_to_num(xb[::7])
    D_ref, I_ref = load_index(out, device="cpu").search(xq, 30)
    calls = []

    def cpu_exact_search(*args, **kwargs):
        calls.append(args[2])
        return exact_search(*args[:4], device="cpu", backend="torch")

    monkeypatch.setattr(search_module, "exact_search", cpu_exact_search)
    monkeypatch.setattr(search_module, "GPU_EXACT_MIN_VECTORS", 10)
    monkeypatch.setattr(search_module, "GPU_EXACT_MIN_QUERIES", 2)
    monkeypatch.setattr(search_module, "gpu_backend_available", lambda: True)
    index = load_index(out)
    assert index.shards[0].scans_on_gpu(len(xq)) and not index.shards[0].scans_on_gpu(1)
    D, I = index.search(xq, 30)
    assert calls == [30, 30, 30]  # one scan per shard
    assert_same_neighbours(D, I, D_ref, I_ref, atol=1e-5)
    assert not load_index(out, device="cpu").shards[0].scans_on_gpu(len(xq))


def test_nprobe_beyond_the_lists_probes_them_all(tmp_path):
    """search.py clamps nprobe to nlist: FAISS's fast-scan IVF with residual codes returned
    unrelated rows when asked to probe more lists than it has."""
    for s in range(2):
        write_descriptor_file(tmp_path / "desc", f"{s:06d}", s, clustered_unit_vectors(2000, 32, seed=s))
    index = load_index(main(IndexConfig(factory="IVF32,PQ16x4fsr", nprobe=32), tmp_path / "desc", tmp_path / "index"))
    xq = clustered_unit_vectors(10, 32, seed=7).astype(np.float32)
    D, I = index.search(xq, 10)
    for nprobe in (33, 64, 1000):
        D_more, I_more = index.search(xq, 10, nprobe=nprobe)
        np.testing.assert_array_equal(I_more, I)
        np.testing.assert_array_equal(D_more, D)


@pytest.mark.parametrize("factory", ["IVF32,PQ16x4fsr", "OPQ8_32,IVF64_HNSW32,PQ16x4fsr"])
def test_concurrent_searches_with_their_own_nprobe_equal_sequential_ones(tmp_path, factory):
    """Request threads share one index: each search's nprobe (and HNSW depth) travels with the
    call, never through the index, so a thread never searches with another's settings."""
    from concurrent.futures import ThreadPoolExecutor

    for s in range(2):
        write_descriptor_file(tmp_path / "desc", f"{s:06d}", s, clustered_unit_vectors(2000, 32, seed=s))
    index = load_index(main(IndexConfig(factory=factory, nprobe=4), tmp_path / "desc", tmp_path / "index"))
    ivf = faiss.extract_index_ivf(index.shards[0].index)
    before = ivf.nprobe
    xq = clustered_unit_vectors(40, 32, seed=9).astype(np.float32)
    jobs = [(q, nprobe) for q in range(len(xq)) for nprobe in (1, 2, 64)]
    sequential = [index.search(xq[q : q + 1], 10, nprobe=nprobe) for q, nprobe in jobs]
    assert any((a[1] != b[1]).any() for a, b in zip(sequential[0::3], sequential[2::3]))  # nprobe matters here
    with ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            concurrent = list(pool.map(lambda job: index.search(xq[job[0] : job[0] + 1], 10, nprobe=job[1]), jobs))
            for (D_a, I_a), (D_b, I_b) in zip(concurrent, sequential):
                np.testing.assert_array_equal(I_a, I_b)
                np.testing.assert_array_equal(D_a, D_b)
    assert ivf.nprobe == before  # the index itself was left as loaded


def test_device_is_checked_when_loading(flat_index):
    out, _ = flat_index
    with pytest.raises(NeedleInputError, match="device 'gpu'"):
        load_index(out, device="gpu")
    if not gpu_backend_available():
        with pytest.raises(NeedleInputError, match="device 'cuda'"):
            load_index(out, device="cuda")


# --- adding through a stand-in quantizer (the GPU add's mechanics, its base index on the CPU) ---


def trained(factory, n=2000, d=32, seed=0):
    xt = clustered_unit_vectors(n, d, seed=seed).astype(np.float32)
    nlist = int(factory.split("IVF")[1].split("_")[0].split(",")[0])
    return train(IndexPlan(factory, "ivfpq", nlist, 0, n), xt)


def list_assignment(index, n):
    """Each id's inverted list (ids 0..n-1)."""
    ivf = faiss.extract_index_ivf(index)
    lists = np.full(n, -1, np.int64)
    for list_no in range(ivf.nlist):
        lists[faiss.rev_swig_ptr(ivf.invlists.get_ids(list_no), ivf.invlists.list_size(list_no)).copy()] = list_no
    return lists


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
    import index.build_train as build_module

    for s in range(2):
        write_descriptor_file(tmp_path / "desc", f"{s:06d}", s, clustered_unit_vectors(1500, 32, seed=s))
    conf = IndexConfig(kind="ivfpq", nlist=16, pq_bytes=8, nprobe=16)
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


# --- a database kept on the device, and the streamed engine (run here on the CPU) ----------------


def searched_both_ways(xq, xb, k, metric, rows=None, score_bytes=None):
    """(D, I) of a ResidentDatabase (of the array, and of its chunks) and of search_streamed."""
    chunks = list(chunks_of(xb, rows or len(xb) or 1))
    results = [
        ResidentDatabase(xb, "cpu", metric, score_bytes=score_bytes).search(xq, k),
        ResidentDatabase(chunks, "cpu", metric, score_bytes=score_bytes).search(xq, k),
        ResidentDatabase(iter(chunks), "cpu", metric, rows=len(xb), score_bytes=score_bytes).search(xq, k),
        search_streamed(xq, iter(chunks), k, metric, "cpu", score_bytes=score_bytes),
    ]
    for D, I in results:
        assert D.dtype == np.float32 and I.dtype == np.int64 and D.shape == I.shape == (len(xq), k)
    return results


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("rows, score_bytes", [(None, None), (97, None), (None, 3000), (250, 5000)])
def test_resident_and_streamed_equal_faiss_flat_and_exact_search(metric, dtype, rows, score_bytes):
    """float32 on the CPU: the ids of FAISS's flat search and of exact_search on faiss-cpu, scores
    to 1e-5; a small score budget splits the queries into blocks and the rows into device chunks
    (merged on the device)."""
    xq, xb = random_data(1003, 24, 13, dtype, seed=5)
    k = 10
    if score_bytes:
        queries, device_rows = plan_blocks(len(xq), len(xb), k, metric, score_bytes)
        assert queries < len(xq) and device_rows < (rows or len(xb))  # several blocks, several chunks
    D_flat, I_flat = flat_search(xq, xb, k, metric)
    D_ref, I_ref = exact_search(xq, chunks_of(xb, 128), k, metric, device="cpu", backend="faiss-cpu")
    np.testing.assert_array_equal(I_ref, I_flat)
    for D, I in searched_both_ways(xq, xb, k, metric, rows, score_bytes):
        np.testing.assert_array_equal(I, I_ref)
        np.testing.assert_allclose(D, D_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(D, D_flat, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_resident_pads_past_the_end_and_answers_no_queries(metric):
    xq, xb = random_data(9, 8, 3, np.float16)
    D_ref, I_ref = flat_search(xq, xb, 15, metric)
    for D, I in searched_both_ways(xq, xb, 15, metric, rows=4):
        np.testing.assert_array_equal(I, I_ref)
        assert (I[:, 9:] == -1).all() and (D[:, 9:] == WORST[metric]).all()
        np.testing.assert_allclose(D[:, :9], D_ref[:, :9], rtol=1e-5, atol=1e-5)
    for D, I in searched_both_ways(xq[:0], xb, 5, metric):
        assert D.shape == I.shape == (0, 5)
    for D, I in searched_both_ways(xq, xb[:0], 3, metric):
        assert (I == -1).all() and (WORST[metric] == D).all()


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("score_bytes", [None, 2000])
def test_resident_ties_go_to_the_smaller_id(metric, score_bytes):
    """Tie groups far larger than the margin of each device chunk: the exact re-search answers."""
    rng = np.random.default_rng(1)
    xb = rng.integers(-1, 2, size=(333, 4)).astype(np.float16)
    xb[::3] = xb[0]  # 111 copies of one vector
    xq = np.concatenate([xb[:1], rng.integers(-2, 3, size=(7, 4))]).astype(np.float32)
    for k in (1, 40, 150, 400):
        D_ref, I_ref = reference(xq, xb, k, metric)
        for D, I in searched_both_ways(xq, xb, k, metric, rows=50, score_bytes=score_bytes):
            np.testing.assert_array_equal(I, I_ref)
            np.testing.assert_array_equal(D, D_ref)


@pytest.mark.parametrize("largest", [True, False])
def test_grouped_topk_equals_topk(largest):
    import torch

    rng = np.random.default_rng(7)
    for n in (16 * 300, 16 * 300 + 5, 999):  # whole groups, a tail of 5 columns, too few groups
        s = torch.from_numpy(rng.standard_normal((9, n)).astype(np.float32))
        D, I = grouped_topk(s, 50, largest)  # unsorted
        D_ref = torch.topk(s, 50, dim=1, largest=largest).values
        np.testing.assert_array_equal(D.sort(dim=1, descending=largest).values.numpy(), D_ref.numpy())
        np.testing.assert_array_equal(s.gather(1, I).numpy(), D.numpy())


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_resident_over_many_groups_with_ties(metric):
    """Device chunks wide enough for grouped_topk, with tie groups spanning several groups."""
    rng = np.random.default_rng(8)
    xb = rng.integers(-2, 3, size=(6007, 6)).astype(np.float16)
    xb[::5] = xb[3]
    xq = np.concatenate([xb[3:4], rng.integers(-2, 3, size=(11, 6))]).astype(np.float32)
    assert 6007 // GROUP >= 4 * (40 + 16)
    for k in (1, 40):
        D_ref, I_ref = reference(xq, xb, k, metric)
        for D, I in searched_both_ways(xq, xb, k, metric, rows=4000):
            np.testing.assert_array_equal(I, I_ref)
            np.testing.assert_array_equal(D, D_ref)
    xq, xb = random_data(6007, 16, 20, np.float32, seed=9)
    D_ref, I_ref = flat_search(xq, xb, 30, metric)
    for D, I in searched_both_ways(xq, xb, 30, metric):
        np.testing.assert_array_equal(I, I_ref)
        np.testing.assert_allclose(D, D_ref, rtol=1e-5, atol=1e-5)


def test_exact_search_on_torch_is_the_streamed_engine():
    xq, xb = random_data(500, 16, 20, np.float32, seed=3)
    for k in (1, 17, 600):
        D_ref, I_ref = search_streamed(xq, chunks_of(xb, 99), k, device="cpu")
        D, I = exact_search(xq, chunks_of(xb, 99), k, device="cpu", backend="torch")
        np.testing.assert_array_equal(I, I_ref)
        np.testing.assert_array_equal(D, D_ref)


def test_resident_bad_inputs_name_what_is_wrong():
    xq, xb = random_data(10, 8, 2, np.float16)
    db = ResidentDatabase(xb, "cpu")
    assert len(db) == 10 and db.d == 8 and db.nbytes == 10 * 8 * 4  # float32 on the CPU
    with pytest.raises(NeedleInputError, match="queries have d=7; this database has d=8"):
        db.search(xq[:, :7], 3)
    with pytest.raises(NeedleInputError, match="k must be an integer >= 1, got 0"):
        db.search(xq, 0)
    with pytest.raises(NeedleInputError, match="NaN"):
        db.search(np.full((1, 8), np.nan), 3)
    with pytest.raises(NeedleInputError, match=r"chunk 0 has shape \(10, 8\) and dtype float64"):
        ResidentDatabase(xb.astype(np.float64), "cpu")
    with pytest.raises(NeedleInputError, match=r"chunk 1 has shape \(4, 7\)"):
        ResidentDatabase([xb, xb[:4, :7]], "cpu")
    with pytest.raises(NeedleInputError, match="metric 'cos'"):
        ResidentDatabase(xb, "cpu", "cos")
    with pytest.raises(NeedleInputError, match="device 'tpu'"):
        ResidentDatabase(xb, "tpu")
    with pytest.raises(NeedleInputError, match="dtype 'int8'"):
        ResidentDatabase(xb, "cpu", dtype="int8")
    with pytest.raises(NeedleInputError, match="hold 10 rows, not rows=12"):
        ResidentDatabase([xb], "cpu", rows=12)
    with pytest.raises(NeedleInputError, match="more rows than rows=5"):
        ResidentDatabase([xb], "cpu", rows=5)
    with pytest.raises(NeedleInputError, match="score_bytes must be an integer >= 1, got 0"):
        ResidentDatabase(xb, "cpu", score_bytes=0)
    with pytest.raises(NeedleInputError, match=r"chunk 0 has shape \(8,\)"):
        search_streamed(xq, list(xb), 3, device="cpu")
    with pytest.raises(NeedleInputError, match="headroom"):
        fits_on_device(1, "cpu", headroom=1.5)


def test_fit_rule_and_the_warning_when_it_does_not_fit(caplog):
    xq, xb = random_data(100, 8, 3, np.float16)
    assert resident_nbytes(100, 8, "cpu") == 3200 and resident_nbytes(100, 8, "cpu", "l2") == 3600
    assert fits_on_device(3200, "cpu") and not fits_on_device(1 << 60, "cpu")
    kept = keep_resident(lambda: chunks_of(xb, 30), 100, 8, "cpu")
    assert kept is not None and len(kept.parts) == 1  # one block of the announced rows
    np.testing.assert_array_equal(kept.search(xq, 5)[1], flat_search(xq, xb, 5, "ip")[1])
    with caplog.at_level("WARNING", logger="index.gpu_resident"):
        assert keep_resident(lambda: chunks_of(xb, 30), 1 << 50, 8, "cpu", label="big shard") is None
    assert "big shard" in caplog.text and "do not fit" in caplog.text and "streams them" in caplog.text


def test_flat_shard_on_cuda_keeps_its_vectors_resident(flat_index, monkeypatch):
    """The wiring, on the CPU: a shard of device "cuda" searches its resident vectors when they fit
    (kept once), and streams them through exact_search's torch backend when they do not."""
    out, xb = flat_index
    xq = np.nan_to_num(xb[::13])
    built, streamed = [], []
    real_exact_search = exact_search

    def keep_on_cpu(chunks, n, d, device="cuda", **kwargs):
        built.append(n)
        return keep_resident(chunks, n, d, "cpu", **kwargs) if fits else None

    def stream_on_cpu(xq, chunks, k, metric, device, backend):
        streamed.append(backend)
        return real_exact_search(xq, chunks, k, metric, "cpu", backend)

    monkeypatch.setattr(search_module, "torch_cuda_available", lambda: True)
    monkeypatch.setattr(search_module, "keep_resident", keep_on_cpu)
    monkeypatch.setattr(search_module, "exact_search", stream_on_cpu)
    for fits in (True, False):
        index = load_index(out, device="cpu")
        for shard in index.shards:
            shard.device = "cuda"
            D_ref, I_ref = search_module.sort_by_score(*shard.index.search(xq, shard.ntotal), 20)
            for _ in range(2):
                D, I = shard.scan(xq, 20)
                assert_same_neighbours(D, I, D_ref, I_ref, atol=1e-5)
            assert (shard.resident is not False) == fits and shard.resident_vectors("cpu") is None
        assert built[-3:] == [s.ntotal for s in index.shards]  # once per shard
        assert streamed == ([] if fits else ["torch"] * 6)


# --- GPU ------------------------------------------------------------------------------------


def gpu_comparison(backend, device="cuda", metric="ip", dtype=np.float16):
    xq, xb = random_data(20_011, 96, 50, dtype, seed=4)
    xb /= np.linalg.norm(xb.astype(np.float32), axis=1, keepdims=True).astype(dtype)
    D_ref, I_ref = exact_search(xq, chunks_of(xb, 4096), 100, metric, device="cpu")
    D, I = exact_search(xq, chunks_of(xb, 4096), 100, metric, device=device, backend=backend)
    assert_same_neighbours(D, I, D_ref, I_ref, atol=1e-3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param("faiss-gpu", marks=pytest.mark.skipif(faiss_gpus() == 0, reason="faiss without GPU support")),
    ],
)
@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_gpu_backends_equal_cpu(backend, metric, dtype):
    gpu_comparison(backend, metric=metric, dtype=dtype)


@pytest.mark.gpu
@needs_cuda
def test_cuda_device_auto_backend_and_ties():
    gpu_comparison(None)
    rng = np.random.default_rng(1)
    xb = rng.integers(-1, 2, size=(5000, 4)).astype(np.float16)
    xq = rng.integers(-2, 3, size=(9, 4)).astype(np.float32)
    _D_ref, I_ref = reference(xq, xb, 40, "ip")
    for backend in ("torch", "faiss-gpu") if faiss_gpus() else ("torch",):
        _D, I = exact_search(xq, chunks_of(xb, 1000), 40, device="cuda", backend=backend)
        np.testing.assert_array_equal(I, I_ref)


@pytest.mark.gpu
@needs_cuda
def test_flat_index_scans_on_the_gpu(flat_index):
    out, xb = flat_index
    xq = np.nan_to_num(xb[::3])
    D_ref, I_ref = load_index(out, device="cpu").search(xq, 50)
    index = load_index(out, device="cuda")
    assert all(s.scans_on_gpu(1) for s in index.shards)
    D, I = index.search(xq, 50)
    assert_same_neighbours(D, I, D_ref, I_ref, atol=1e-3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(faiss_gpus() == 0, reason="faiss without GPU support")
@pytest.mark.parametrize("factory", ["IVF32,PQ16x4fsr", "OPQ8_32,IVF64_HNSW32,PQ16x4fsr"])
def test_gpu_kmeans_and_add_match_the_cpu(tmp_path, monkeypatch, factory):
    """A build with k-means and list assignment on the GPU finds the exact neighbours about as
    often as one on the CPU; from one trained index, (almost) every vector lands in the same
    list whether assigned on the GPU or by the CPU quantizer."""
    import index.build_train as build_module

    parts = [clustered_unit_vectors(5000, 32, seed=s) for s in range(2)]
    for s, xb in enumerate(parts):
        write_descriptor_file(tmp_path / "desc", f"{s:06d}", s, xb)
    xb = np.concatenate(parts).astype(np.float32)
    xq = xb[::50]
    conf = IndexConfig(factory=factory, nprobe=64, refine_factor=8)
    gpu_out = main(conf, tmp_path / "desc", tmp_path / "gpu")
    with monkeypatch.context() as patch:
        patch.setattr(build_module, "faiss_gpus", lambda: 0)
        cpu_out = main(conf, tmp_path / "desc", tmp_path / "cpu")
    D_ref, _ = reference(xq, xb, 10, "ip")
    found = [(np.abs(load_index(out).search(xq, 10)[0] - D_ref) < 1e-5).mean() for out in (gpu_out, cpu_out)]
    assert found[0] >= found[1] - 0.05 and found[0] > 0.7, found  # 0.80 / 0.92 on the CPU

    on_gpu, on_cpu = (faiss.read_index(str(gpu_out / "shard_000" / "index.faiss")) for _ in range(2))
    ids = np.arange(len(xb), dtype=np.int64)
    for index in (on_gpu, on_cpu):
        index.reset()
    with assigning_with(on_gpu, build_module.add_quantizer(on_gpu)):
        on_gpu.add_with_ids(xb, ids)
    on_cpu.add_with_ids(xb, ids)
    assert (list_assignment(on_gpu, len(xb)) == list_assignment(on_cpu, len(xb))).mean() >= 0.99


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_resident_and_streamed_on_cuda_equal_the_cpu(metric):
    """200k x 64 float16 unit vectors against the float32 CPU reference: resident on the GPU
    (float16 rows, float16-rounded queries, float32 sums) up to float16 rounding; streamed with the
    copy overlapped (each query split in two float16 parts) and float32 rows kept on the GPU to
    about float32 rounding; ties exactly."""
    xq, xb = random_data(200_000, 64, 300, np.float16, seed=6)
    xb /= np.linalg.norm(xb.astype(np.float32), axis=1, keepdims=True).astype(np.float16)
    xq /= np.linalg.norm(xq, axis=1, keepdims=True)
    k = 100
    D_ref, I_ref = exact_search(xq, chunks_of(xb, 50_000), k, metric, device="cpu", backend="faiss-cpu")
    resident = ResidentDatabase(xb, "cuda", metric)
    assert resident.nbytes == xb.nbytes + (4 * len(xb) if metric == "l2" else 0)
    for D, I in (
        resident.search(xq, k),
        ResidentDatabase(xb, "cuda", metric, score_bytes=1 << 22).search(xq, k),  # several device chunks
    ):
        assert_same_neighbours(D, I, D_ref, I_ref, atol=2e-3)
    for D, I in (
        search_streamed(xq, chunks_of(xb, 30_000), k, metric, "cuda"),
        search_streamed(xq, chunks_of(xb, 30_000), k, metric, "cuda", score_bytes=1 << 22),
        exact_search(xq, chunks_of(xb, 30_000), k, metric, device="cuda", backend="torch"),
    ):
        assert_same_neighbours(D, I, D_ref, I_ref, atol=5e-5)
    D, I = ResidentDatabase(xb, "cuda", metric, dtype="float32").search(xq, k)
    assert_same_neighbours(D, I, D_ref, I_ref, atol=1e-5)
    rng = np.random.default_rng(1)
    xb = rng.integers(-1, 2, size=(5000, 4)).astype(np.float16)
    xb[::3] = xb[0]
    xq = np.concatenate([xb[:1], rng.integers(-2, 3, size=(8, 4))]).astype(np.float32)
    D_ref, I_ref = reference(xq, xb, 400, metric)
    for D, I in (
        ResidentDatabase(xb, "cuda", metric).search(xq, 400),
        search_streamed(xq, chunks_of(xb, 700), 400, metric),
    ):
        np.testing.assert_array_equal(I, I_ref)
        np.testing.assert_array_equal(D, D_ref)


def test_cpu_memory_counts_the_page_cache_the_kernel_can_drop(tmp_path):
    """A warm page cache (an index's files read once) leaves few free pages: what fits is
    MemAvailable's, not MemFree's; without /proc/meminfo, the free pages."""
    from index.memory import cpu_available_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         2000000 kB\nMemAvailable:   20000000 kB\n")
    assert cpu_available_bytes(2_048_000_000, str(meminfo)) == 20_000_000 * 1024
    assert cpu_available_bytes(123, str(tmp_path / "missing")) == 123
    meminfo.write_text("MemTotal:       24000000 kB\n")  # an old kernel: no MemAvailable
    assert cpu_available_bytes(456, str(meminfo)) == 456
