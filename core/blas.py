"""The OpenBLAS kernels FAISS's matrix products run on.

The faiss-cpu wheel bundles OpenBLAS 0.3.15, which does not know recent Intel Xeons (family 6
model 207 here) and falls back to its generic "Prescott" (SSE3) kernels: the coarse quantizer's
assignment of 8,000 x 4,096 x 512 took 2.35 CPU seconds on one thread, 0.29 s with the AVX-512
("SkylakeX") kernels the CPU can run (numpy's own OpenBLAS: 0.58 s and 0.30 s). That product is
most of a FAISS add (the build's and ``needle index add``'s), of k-means training, and of every
search's list assignment. OpenBLAS reads its choice from ``OPENBLAS_CORETYPE`` when it loads, so
the ``needle`` command sets it, before anything imports FAISS, from the CPU's own flags, and only
where the user has not set it (setting it is the way to choose other kernels or none).
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
