"""The OpenBLAS kernels FAISS's matrix products run on.

The faiss-cpu wheel bundles OpenBLAS 0.3.15, which does not know recent Intel Xeons (family 6
model 207 here) and falls back to its generic "Prescott" (SSE3) kernels: the coarse quantizer's
assignment of 8,000 x 4,096 x 512 took 2.35 CPU seconds on one thread, 0.29 s with the AVX-512
("SkylakeX") kernels the CPU can run (numpy's own OpenBLAS: 0.58 s and 0.30 s). That product is
most of a FAISS add (the build's and ``needle index add``'s), of k-means training, and of every
search's list assignment. OpenBLAS reads its choice from ``OPENBLAS_CORETYPE`` when it loads, so
the ``needle`` command sets it, before anything imports FAISS, from the CPU's own flags, and only
where the user has not set it (setting it is the way to choose other kernels or none).

The second setting here is FAISS's own: from how many queries its exact scans take the matrix
product at all (``prefer_blas_for_batches``, below).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from pathlib import Path

log = logging.getLogger(__name__)

CORETYPE = "OPENBLAS_CORETYPE"
AVX512 = {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}  # what OpenBLAS's SkylakeX kernels use
AVX2 = {"avx2", "fma"}  # ... its Haswell kernels


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first CPU's feature flags (x86 Linux), empty where the file is missing or has none."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return set(value.split())
    return set()


def core_for(flags: set[str]) -> str | None:
    """The OpenBLAS kernels for a CPU with ``flags``: the widest vectors it runs (None: leave it to OpenBLAS)."""
    if flags >= AVX512:
        return "SKYLAKEX"
    if flags >= AVX2:
        return "HASWELL"
    return None


def choose_openblas_core(
    environ: MutableMapping[str, str] = os.environ, cpuinfo: Path = Path("/proc/cpuinfo")
) -> str | None:
    """Set ``OPENBLAS_CORETYPE`` in ``environ`` from the CPU's flags unless it is set; returns the
    kernels set (None: nothing set). Takes effect for an OpenBLAS loaded later (FAISS's, and Ray
    workers started from this process)."""
    if environ.get(CORETYPE):
        return None
    core = core_for(cpu_flags(cpuinfo))
    if core is not None:
        environ[CORETYPE] = core
        log.debug("%s=%s (from the CPU's flags)", CORETYPE, core)
    return core


# --- from how many queries FAISS takes the matrix product (a process setting) ------------------
#
# FAISS computes a batch of exact scores (a flat index's scan, ``faiss.knn``, an IVF's assignment to
# its lists) either query by query with its own SIMD loop or as one matrix product. Since FAISS 1.14
# (its pull request 5022) it takes the product only from nq x d >= 128,000
# (``faiss.cvar.distance_compute_blas_threshold``), i.e. from 1,000 queries at d = 128 and 250 at
# d = 512. That was tuned for many OpenMP threads, over which the query-by-query loop spreads the
# queries; on one thread the product is faster from ~4 queries at any d. Measured here (AMD EPYC,
# one thread, FAISS 1.15.1, ``faiss.knn`` k = 20, ms per query, loop / product):
#
#     d = 128, 60k rows:  2 queries 1.90 / 3.61,  4: 2.06 / 1.76,  16: 1.73 / 0.63,  100: 1.89 / 0.26
#     d = 512, 30k rows:  2 queries 3.18 / 5.03,  4: 3.61 / 2.31,  16: 3.69 / 0.98
#     d = 768, 20k rows:  2 queries 3.88 / 4.96,  4: 3.75 / 2.02,  16: 3.80 / 1.06
#
# FAISS's own open pull request 5109 scales the threshold with the threads for that reason. So
# ``prefer_blas_for_batches`` sets it to ``PER_THREAD`` x FAISS's threads, where FAISS's default is in
# effect: a value the user set, or an older FAISS's rule (a query count, default 20), is left as it is.
# It is a setting of the process's FAISS, made where a shard is opened (``index.shard.make_shard``):
# in ``needle serve``, a Ray shard actor, ``needle query``.

FAISS_DEFAULT = 128_000  # FAISS >= 1.14: BLAS from nq x d >= this
# nq x d from which one thread takes the product: 8 queries at d = 128, 2 at d = 512 (the loop is
# faster below ~4 queries at any d; a single value of nq x d cannot follow that exactly)
PER_THREAD = 1024


def blas_threshold_for(threads: int) -> int:
    """The nq x d from which FAISS on ``threads`` OpenMP threads should take the matrix product."""
    return min(FAISS_DEFAULT, PER_THREAD * max(1, threads))


def prefer_blas_for_batches() -> int | None:
    """Set FAISS's BLAS threshold for its current thread count where FAISS's default is in effect;
    returns the value set (None: left as it was)."""
    import faiss

    if faiss.cvar.distance_compute_blas_threshold != FAISS_DEFAULT:
        return None
    value = blas_threshold_for(faiss.omp_get_max_threads())
    faiss.cvar.distance_compute_blas_threshold = value
    log.debug("FAISS takes BLAS from nq x d >= %d (%d threads)", value, faiss.omp_get_max_threads())
    return value
