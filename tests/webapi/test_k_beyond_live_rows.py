"""A k larger than the live rows answers the rows there are (issue 55), and an emptied index (every
row deleted) answers empty results: over HTTP, through ``needle query``'s search, in one process
and from shards. The bound on k (``max_k_total``) stays."""

import numpy as np
import pytest

from index.live.delete_rows import DeleteConfig
from index.live.delete_rows import main as delete
from index.search import load_index
from query.retrieve import QueryConfig, query
from tests.support.index import clustered_unit_vectors
from tests.support.indexes import LIVE_FLAT_4
from tests.support.live import D
from tests.support.serve_shards import coordinator
from tests.support.service import app_client

KEYS = [f"t{f}/{i:05d}" for f in range(4) for i in range(40)]


@pytest.fixture
def shrunk(synthetic_indexes, tmp_path):
    """LIVE_FLAT_4 (160 rows) with all but 5 rows deleted."""
    out, _ = synthetic_indexes.copy(LIVE_FLAT_4, tmp_path)
    delete(DeleteConfig(), KEYS[5:], out)
    return out, tmp_path


def xq() -> np.ndarray:
    return clustered_unit_vectors(2, D, seed=5).astype(np.float32)


def every_way(index_dir, cache):
    """The index in one process and as a coordinator of shards (ShardActor objects in this process)."""
    return {"in_process": load_index(index_dir), "sharded": coordinator(index_dir, cache)}


def test_k_past_the_live_rows_returns_them_all(shrunk):
    index_dir, tmp = shrunk
    for name, index in every_way(index_dir, tmp / "cache").items():
        _, I = index.search(xq(), 50)
        assert I.shape == (2, 5) and (I >= 0).all(), name
        assert sorted(k for k in index.keys_of(I)[0]) == sorted(KEYS[:5]), name
    results = query(load_index(index_dir), QueryConfig(k=50), vectors=xq())
    assert [len(r["results"]) for r in results] == [5, 5]
    with app_client(load_index(index_dir), max_k_total=1000) as client:
        answer = client.post("/search", json={"vectors": xq().tolist(), "k": 50})
        assert answer.status_code == 200 and [len(r["results"]) for r in answer.json()] == [5, 5]
        too_many = client.post("/search", json={"vectors": xq().tolist(), "k": 600})  # 2 x 600 > max_k_total
        assert too_many.status_code == 413 and "--max-k-total" in too_many.text


def test_an_emptied_index_answers_empty_results(shrunk):
    index_dir, tmp = shrunk
    delete(DeleteConfig(), KEYS[:5], index_dir)
    for name, index in every_way(index_dir, tmp / "cache").items():
        assert index.ntotal == 0, name
        D_, I = index.search(xq(), 10)
        assert D_.shape == I.shape == (2, 0), name
    results = query(load_index(index_dir), QueryConfig(k=10), vectors=xq())
    assert [r["results"] for r in results] == [[], []]
    with app_client(load_index(index_dir)) as client:
        answer = client.post("/search", json={"vectors": xq().tolist(), "k": 10})
        assert answer.status_code == 200 and [r["results"] for r in answer.json()] == [[], []]
