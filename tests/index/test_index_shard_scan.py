"""A flat shard's exact scan (index/shard.py) equals its FAISS index and serves large searches;
nprobe is clamped to the lists and travels with each of concurrent calls; the device is checked
when an index is loaded."""

import faiss
import numpy as np
import pytest

import index.shard as search_module
from core.errors import NeedleInputError
from index.build.stage import IndexConfig, main
from index.gpu.engine import exact_search, gpu_backend_available
from index.search import load_index
from tests.support.exact_search import CPU_BACKENDS, assert_same_neighbours
from tests.support.index import clustered_unit_vectors, write_descriptor_file

# --- a flat shard's scan ----------------------------------------------------------------------


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
    index = load_index(
        main(
            IndexConfig(recall_target=None, factory="IVF32,PQ16x4fsr", nprobe=32), tmp_path / "desc", tmp_path / "index"
        )
    )
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
    index = load_index(
        main(IndexConfig(recall_target=None, factory=factory, nprobe=4), tmp_path / "desc", tmp_path / "index")
    )
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
