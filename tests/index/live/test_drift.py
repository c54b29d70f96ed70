"""The drift report's coarse assignment (index/live/drift.py): a flat quantizer's lists by one matrix
product per block equal FAISS's own search of the quantizer, for inner-product and L2 quantizers,
with and without an OPQ rotation; a graph quantizer keeps FAISS's search."""

import faiss
import numpy as np
import pytest

from index.live.drift import coarse_assign, nearest_rows
from tests.support.index import clustered_unit_vectors


@pytest.mark.parametrize("metric", [faiss.METRIC_INNER_PRODUCT, faiss.METRIC_L2])
@pytest.mark.parametrize("factory", ["IVF64,PQ8x4fsr", "OPQ4,IVF64,PQ4x4", "IVF64_HNSW8,PQ4x4"])
def test_coarse_assignment_equals_the_quantizers_search(metric, factory):
    xb = clustered_unit_vectors(4000, 32, seed=1).astype(np.float32)
    x = clustered_unit_vectors(3000, 32, seed=2).astype(np.float32) * 1.3
    index = faiss.index_factory(32, factory, metric)
    index.train(xb)
    lists, errors = coarse_assign(index, x)
    xt = index.chain.at(0).apply(x) if isinstance(index, faiss.IndexPreTransform) else x
    ivf = faiss.extract_index_ivf(index)
    _, own = ivf.quantizer.search(xt, 1)
    assert (lists == own[:, 0]).mean() > 0.999  # equal but for float ties between two centroids
    np.testing.assert_allclose(errors, ((xt - ivf.quantizer.reconstruct_batch(lists)) ** 2).sum(1), rtol=1e-5)


def test_nearest_rows_by_blocks():
    rng = np.random.default_rng(0)
    table, x = rng.normal(size=(50, 8)).astype(np.float32), rng.normal(size=(301, 8)).astype(np.float32)
    for inner_product in (True, False):
        scores = x @ table.T if inner_product else -((x[:, None, :] - table[None]) ** 2).sum(2)
        np.testing.assert_array_equal(nearest_rows(x, table, inner_product, block=64), scores.argmax(1))
    assert coarse_assign(faiss.IndexFlatIP(8), x) is None


def test_sampled_rows_equal_the_whole_batch_widened_then_sampled(tmp_path):
    """``needle index add`` reads only the drawn rows of its segments: the same rows, in the same
    order, as widening every row, dropping the zero rows (images that failed; -0.0 too) and drawing."""
    from index.live.add_rows import sample_indexed_rows
    from index.live.drift import sample_positions

    rng = np.random.default_rng(3)
    parts = []
    for n, path in ((700, "a.npy"), (0, "b.npy"), (450, "c.npy")):
        block = rng.normal(size=(n, 16)).astype(np.float16)
        block[rng.random(n) < 0.2] = 0
        block[rng.random(n) < 0.05] = np.float16(-0.0)
        np.save(tmp_path / path, block)
        parts.append(np.load(tmp_path / path, mmap_mode="r"))
    whole = np.concatenate([np.asarray(p, np.float32) for p in parts])
    whole = whole[np.abs(whole).sum(1) > 0]
    for size in (0, 10, 500, 5000):
        expected = whole[sample_positions(len(whole), size, seed=1)]
        np.testing.assert_array_equal(sample_indexed_rows(parts, size, 16), expected)
    assert sample_indexed_rows([], 10, 16).shape == (0, 16)
