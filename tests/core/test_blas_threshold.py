"""FAISS's BLAS threshold (core/blas.py): set from FAISS's default for its threads, never over
a value someone else chose, and exact either way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from core.blas import FAISS_DEFAULT, PER_THREAD, blas_threshold_for

ROOT = Path(__file__).resolve().parents[2]  # the probe imports core/ from the project, wherever pytest runs

PROBE = """
import faiss
from core.blas import prefer_blas_for_batches
{before}
faiss.omp_set_num_threads({threads})
print(prefer_blas_for_batches(), faiss.cvar.distance_compute_blas_threshold)
"""


def fresh_process(threads: int, before: str = "") -> tuple[str, int]:
    """(what prefer_blas_for_batches returned, the threshold after) in a new process."""
    code = PROBE.format(before=before, threads=threads)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    returned, after = done.stdout.split()
    return returned, int(after)


def test_the_threshold_follows_the_threads_and_stops_at_faiss_default():
    assert blas_threshold_for(1) == PER_THREAD
    assert blas_threshold_for(4) == 4 * PER_THREAD
    assert blas_threshold_for(0) == PER_THREAD
    assert blas_threshold_for(10_000) == FAISS_DEFAULT


def test_a_process_with_faiss_default_takes_blas_from_small_batches():
    import faiss

    if tuple(int(part) for part in faiss.__version__.split(".")[:2]) < (1, 14):  # it counts queries (20)
        assert fresh_process(1) == ("None", 20)
        return
    assert fresh_process(1) == (str(PER_THREAD), PER_THREAD)
    assert fresh_process(2) == (str(2 * PER_THREAD), 2 * PER_THREAD)


def test_a_threshold_set_before_is_left_alone():
    assert fresh_process(1, "faiss.cvar.distance_compute_blas_threshold = 5000") == ("None", 5000)


def test_a_flat_scan_is_exact_on_both_sides_of_the_threshold():
    """Batches under and over the threshold agree with the brute force over the float32 rows."""
    import faiss

    index = faiss.IndexFlatIP(64)
    xb = np.random.default_rng(0).standard_normal((3000, 64)).astype(np.float32)
    index.add(xb)
    threshold = faiss.cvar.distance_compute_blas_threshold
    for nq in (1, max(2, threshold // 64 + 1)):
        xq = np.random.default_rng(nq).standard_normal((nq, 64)).astype(np.float32)
        D, I = index.search(xq, 10)
        expected = np.argsort(-(xq @ xb.T), axis=1, kind="stable")[:, :10]
        np.testing.assert_array_equal(I, expected)
        np.testing.assert_allclose(D, np.take_along_axis(xq @ xb.T, expected, 1), rtol=1e-5)
