"""index/gpu/engine.py: exact search over memory-mapped chunks equals FAISS's flat search on every
backend (the torch one also runs on the CPU here) and its merge breaks ties by the smaller id.
Tests marked ``gpu`` run the CUDA backends (and the GPU build) and compare them with the CPU."""

import sys

import faiss
import numpy as np
import pytest

from core.errors import NeedleInputError
from index.build.stage import IndexConfig, main
from index.build.train import assigning_with
from index.gpu.engine import (
    WORST,
    FaissCpu,
    TorchBackend,
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
from index.gpu.resident import ResidentDatabase
from index.gpu.stream import search_streamed
from index.search import load_index
from tests.support.exact_search import (
    CPU_BACKENDS,
    assert_same_neighbours,
    flat_search,
    list_assignment,
    random_data,
    reference,
)
from tests.support.index import clustered_unit_vectors, write_descriptor_file


def cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


needs_cuda = pytest.mark.skipif(not cuda(), reason="no CUDA GPU")


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
    import index.build.train as build_module

    parts = [clustered_unit_vectors(5000, 32, seed=s) for s in range(2)]
    for s, xb in enumerate(parts):
        write_descriptor_file(tmp_path / "desc", f"{s:06d}", s, xb)
    xb = np.concatenate(parts).astype(np.float32)
    xq = xb[::50]
    conf = IndexConfig(recall_target=None, factory=factory, nprobe=64, refine_factor=8)
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
