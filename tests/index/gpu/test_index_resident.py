"""index/gpu/resident.py and index/gpu/stream.py, run here on the CPU: a database kept on the
device and the streamed engine equal FAISS's flat search and exact_search (padding and ties
included), and what fits on the device (or in CPU memory) decides between them."""

import numpy as np
import pytest

import index.shard as search_module
from core.errors import NeedleInputError
from index.gpu.engine import WORST, chunks_of, exact_search
from index.gpu.resident import ResidentDatabase, fits_on_device, keep_resident, resident_nbytes
from index.gpu.stream import search_streamed
from index.gpu.topk import GROUP, grouped_topk, plan_blocks
from index.search import load_index
from tests.support.exact_search import assert_same_neighbours, flat_search, random_data, reference

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
    with caplog.at_level("WARNING", logger="index.gpu.resident"):
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
