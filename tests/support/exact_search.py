"""Reference searches (FAISS's flat index; brute force in float64, ties to the smaller id), random
data and each id's inverted list, shared by the tests of exact search and of the GPU add (their
three-shard flat index: the ``flat_index`` fixture, tests/support/indexes.py)."""

import faiss
import numpy as np

from index.gpu.engine import WORST

CPU_BACKENDS = ("faiss-cpu", "torch")  # torch on the CPU: the CUDA backend's code, run in CI


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


def list_assignment(index, n):
    """Each id's inverted list (ids 0..n-1)."""
    ivf = faiss.extract_index_ivf(index)
    lists = np.full(n, -1, np.int64)
    for list_no in range(ivf.nlist):
        lists[faiss.rev_swig_ptr(ivf.invlists.get_ids(list_no), ivf.invlists.list_size(list_no)).copy()] = list_no
    return lists
