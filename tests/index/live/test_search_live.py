"""Deleted rows skipped by over-fetching (index/live/deletes.py ``search_live``): the same best live
candidates as FAISS's IDSelector finds, whether the over-fetch holds enough live rows, the probed
lists run out, or deletes gathered around a query send it back to the selector."""

import faiss
import numpy as np
import pytest

from index.build.merge import sort_by_score, tie_margin
from index.live.deletes import OVERFETCH_MAX_SHARE, DeleteSet, search_live
from index.shard import with_selector
from tests.support.index import clustered_unit_vectors

D = 32
N = 4000


@pytest.fixture(scope="module", params=["IVF32,PQ8x4fsr", "IVF32,PQ8x4", "IDMap,Flat"])
def segment(request):
    xb = clustered_unit_vectors(N, D, seed=1, clusters=30).astype(np.float32)
    index = faiss.index_factory(D, request.param, faiss.METRIC_INNER_PRODUCT)
    index.train(xb)
    ids = (np.int64(7) << 32) + np.arange(N, dtype=np.int64) * 2  # row ids as the index stores them
    index.add_with_ids(xb, ids)
    return index, xb, ids


def is_ivf(index) -> bool:
    try:
        faiss.extract_index_ivf(index)
    except RuntimeError:
        return False
    return True


def searcher(index, xq, nprobe, deletes, calls):
    def search(k, rows, skip_deleted):
        calls.append((k, None if rows is None else rows.tolist(), skip_deleted))
        params = faiss.SearchParametersIVF(nprobe=nprobe) if index.ntotal and is_ivf(index) else None
        if skip_deleted:
            params = with_selector(params, deletes)
        return index.search(xq if rows is None else xq[rows], k, params=params)

    return search


def reference(index, xq, nprobe, deletes, wanted, kk):
    D_ref, I_ref = searcher(index, xq, nprobe, deletes, [])(wanted, None, True)
    return sort_by_score(D_ref, I_ref, kk)


def check(index, xq, nprobe, deleted, kk=40):
    deletes = DeleteSet(np.sort(deleted), len(deleted))
    wanted = kk + tie_margin(kk)
    calls = []
    D_live, I_live = search_live(searcher(index, xq, nprobe, deletes, calls), wanted, index.ntotal, deletes)
    assert not np.isin(I_live, deleted).any()
    D_found, I_found = sort_by_score(D_live, I_live, kk)
    D_ref, I_ref = reference(index, xq, nprobe, deletes, wanted, kk)
    np.testing.assert_array_equal(I_found, I_ref)
    np.testing.assert_array_equal(D_found, D_ref)
    return calls


def test_random_deletes_need_no_selector(segment):
    index, xb, ids = segment
    xq = xb[:12] + 0.01
    deleted = np.random.default_rng(0).choice(ids, N // 5, replace=False)
    calls = check(index, xq, 8, deleted)
    assert [skip for _, _, skip in calls] == [False]  # one search, over-fetched, no selector
    assert calls[0][0] > 60  # more than wanted (40 + 20) were asked


def test_deletes_around_a_query_send_it_back_to_the_selector(segment):
    index, xb, ids = segment
    xq = xb[:6] + 0.01
    params = faiss.SearchParametersIVF(nprobe=32) if index.ntotal and is_ivf(index) else None
    _, near = index.search(xq[2:3], 600, params=params)  # every row near query 2 deleted, and a few more
    deleted = np.union1d(near[0][near[0] >= 0], np.random.default_rng(1).choice(ids, 200, replace=False))
    calls = check(index, xq, 32, deleted)
    assert calls[0][2] is False and calls[1:] == [(60, [2], True)]  # only query 2 searched again


def test_probed_lists_that_run_out_are_answered_as_found(segment):
    index, xb, ids = segment
    if not is_ivf(index):
        pytest.skip("a flat index has no lists")
    xq = xb[:8] + 0.01
    deleted = np.random.default_rng(2).choice(ids, N // 3, replace=False)
    calls = check(index, xq, 1, deleted, kk=200)  # one list of ~130 rows: fewer than asked
    assert [skip for _, _, skip in calls] == [False]


def test_most_rows_deleted_or_none(segment):
    index, xb, ids = segment
    xq = xb[:5] + 0.01
    many = np.random.default_rng(3).choice(ids, int(N * (OVERFETCH_MAX_SHARE + 0.1)), replace=False)
    assert [skip for _, _, skip in check(index, xq, 16, many)] == [True]  # the selector at once
    assert [skip for _, _, skip in check(index, xq, 16, np.zeros(0, np.int64))] == [False]


@pytest.mark.parametrize(
    ("share", "queries", "scans"), [(0.7, 5, False), (0.7, 40, True), (0.2, 40, False), (0.2, 200, True)]
)
def test_a_flat_segment_with_deletes_answers_a_batch_exactly_by_scanning_its_live_rows(
    tmp_path, monkeypatch, share, queries, scans
):
    """A flat segment holding deleted rows answers a batch by scanning its live rows
    (Shard.scans_live_rows) past OVERFETCH_MAX_SHARE deleted, or where the batch's queries x deleted
    rows pay for the gathering; otherwise, and for fewer than LIVE_SCAN_MIN_QUERIES, through its
    FAISS index: both exactly the brute force over the live rows."""
    from index.build.stage import IndexConfig
    from index.build.stage import main as build
    from index.live.delete_rows import DeleteConfig
    from index.live.delete_rows import main as delete
    from index.shard import LIVE_SCAN_MIN_QUERIES, LIVE_SCAN_PAYBACK, Shard
    from tests.support.index import write_descriptor_file
    from tests.support.live import Live, assert_exact

    assert 5 < LIVE_SCAN_MIN_QUERIES <= 40 and 40 * 0.2 < LIVE_SCAN_PAYBACK * 0.8 <= 200 * 0.2  # both sides
    xb = clustered_unit_vectors(N, D, seed=5, clusters=30)
    live = Live()
    write_descriptor_file(tmp_path / "desc", "t0", 0, xb)
    live.add_file("t0", 0, xb)
    index_dir = build(IndexConfig(kind="flat"), tmp_path / "desc", tmp_path / "index")
    doomed = [f"t0/{i:05d}" for i in np.random.default_rng(6).choice(N, int(N * share), replace=False)]
    delete(DeleteConfig(), doomed, index_dir)
    for key in doomed:
        del live.rows[key]
    calls = []
    real = Shard.scan
    monkeypatch.setattr(Shard, "scan", lambda self, *a, **k: calls.append(k.get("device")) or real(self, *a, **k))
    assert_exact(index_dir, live, clustered_unit_vectors(queries, D, seed=7, clusters=30).astype(np.float32), k=20)
    assert calls == (["cpu"] if scans else [])
