"""The OpenBLAS kernels chosen for FAISS (core/blas.py): from the CPU's flags, never over the user's
own ``OPENBLAS_CORETYPE``, and taken by FAISS's bundled OpenBLAS when it loads."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.blas import CORETYPE, choose_openblas_core, core_for, cpu_flags

AVX512_FLAGS = "fpu sse2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl"


def cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(
        f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n"
    )
    return path


def test_kernels_follow_the_widest_vectors_the_cpu_runs():
    assert core_for(set(AVX512_FLAGS.split())) == "SKYLAKEX"
    assert core_for({"avx2", "fma", "avx512f"}) == "HASWELL"  # AVX-512 without BW/DQ/VL: not SkylakeX's
    assert core_for({"sse2", "avx"}) is None
    assert core_for(set()) is None


def test_flags_from_cpuinfo(tmp_path):
    assert cpu_flags(cpuinfo(tmp_path, "avx2 fma")) == {"avx2", "fma"}
    assert cpu_flags(tmp_path / "missing") == set()
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    assert cpu_flags(tmp_path / "arm") == set()


def test_set_only_where_the_user_has_not(tmp_path):
    environ: dict[str, str] = {}
    assert choose_openblas_core(environ, cpuinfo(tmp_path, AVX512_FLAGS)) == "SKYLAKEX"
    assert environ == {CORETYPE: "SKYLAKEX"}
    own = {CORETYPE: "Haswell"}
    assert choose_openblas_core(own, cpuinfo(tmp_path, AVX512_FLAGS)) is None and own == {CORETYPE: "Haswell"}
    nothing: dict[str, str] = {}
    assert choose_openblas_core(nothing, cpuinfo(tmp_path, "sse2")) is None and nothing == {}


def faiss_blas_core(environ: dict[str, str]) -> str:
    """The kernels FAISS's OpenBLAS chose in a fresh process started with ``environ``."""
    code = (
        "import ctypes, os, faiss; lib = ctypes.CDLL(os.path.join(os.path.dirname(faiss.__file__), "
        "'_swigfaiss.abi3.so')); f = lib.openblas_get_corename; f.restype = ctypes.c_char_p; print(f().decode())"
    )
    done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.skip(f"FAISS's OpenBLAS does not tell its kernels: {done.stderr[-300:]}")
    return done.stdout.strip()


def test_faiss_openblas_takes_the_choice():
    environ = {k: v for k, v in os.environ.items() if k != CORETYPE}
    chosen = choose_openblas_core(environ)
    if chosen is None:
        pytest.skip("this CPU has neither AVX-512 nor AVX2: nothing is chosen")
    assert faiss_blas_core(environ).lower() == chosen.lower()
