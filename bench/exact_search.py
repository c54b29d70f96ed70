"""Exact k-NN over a memory-mapped float16 database (the ILIAS baseline) with each backend of
index/gpu/engine.py: ``faiss-cpu`` (faiss.knn per chunk), ``torch`` on the CPU, and where a GPU exists
``torch`` on CUDA and ``faiss-gpu`` (knn_gpu).

Writes an n x d float16 ``.npy`` of random unit vectors (in blocks, never all in memory; queries
are noisy copies of database rows), maps it with ``np.load(mmap_mode="r")`` and searches nq queries
for their k nearest by inner product, chunk by chunk. The file was just written, so its pages are
in the page cache: this measures the scan, not the disk. Prints one JSON line: per backend the
milliseconds of the whole query batch (best of ``--repeats``), the database bytes scanned per
second, and the max abs difference of its scores (and the share of equal ids) against the first
backend run.

    .venv/bin/python bench/exact_search.py --n 200000 [--d 768 --nq 1000 --k 100]
        [--chunk-rows R] [--device auto|cpu|cuda] [--threads 1] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BLOCK_ROWS = 65_536  # rows generated at a time while writing the database


def write_database(path: Path, n: int, d: int, seed: int) -> None:
    """An (n, d) float16 .npy of random unit vectors, written block by block."""
    rng = np.random.default_rng(seed)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(n, d))
    for start in range(0, n, BLOCK_ROWS):
        x = rng.standard_normal((min(BLOCK_ROWS, n - start), d), dtype=np.float32)
        out[start : start + len(x)] = x / np.linalg.norm(x, axis=1, keepdims=True)
    out.flush()
    del out


def make_queries(xb: np.ndarray, nq: int, seed: int) -> np.ndarray:
    """Noisy copies of random database rows (each has a clear nearest neighbour), unit norm."""
    rng = np.random.default_rng(seed + 1)
    rows = np.sort(rng.choice(len(xb), size=nq, replace=nq > len(xb)))
    x = np.asarray(xb[rows], dtype=np.float32) + 0.05 * rng.standard_normal((nq, xb.shape[1]), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def backends(device: str) -> list[tuple[str, str, str | None]]:
    """(label, exact_search device, backend) of every backend available for ``device``."""
    from index.gpu.engine import faiss_gpus, torch_cuda_available

    runs = []
    if device in ("auto", "cpu"):
        runs += [("faiss-cpu", "cpu", "faiss-cpu"), ("torch-cpu", "cpu", "torch")]
    if device in ("auto", "cuda"):
        if torch_cuda_available():
            runs.append(("torch-cuda", "cuda", "torch"))
        if faiss_gpus() > 0:
            runs.append(("faiss-gpu", "cuda", "faiss-gpu"))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="database vectors")
    parser.add_argument("--d", type=int, default=768, help="dimension")
    parser.add_argument("--nq", type=int, default=1000, help="queries (one batch)")
    parser.add_argument("--k", type=int, default=100, help="neighbours per query")
    parser.add_argument("--chunk-rows", type=int, default=None, help="rows per chunk (default: ~256 MB)")
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: every available backend"
    )
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch, FAISS/OpenMP)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per backend (best is reported)")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write the database (default: a temporary directory)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import faiss
    import torch

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    from index.gpu.engine import chunks_of, default_chunk_rows, exact_search

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "xb.f16.npy"
        start = time.perf_counter()
        write_database(path, args.n, args.d, args.seed)
        write_s = time.perf_counter() - start
        xb = np.load(path, mmap_mode="r")
        xq = make_queries(xb, args.nq, args.seed)
        rows = args.chunk_rows or default_chunk_rows(xb)
        results, first = {}, None
        for label, device, backend in backends(args.device):
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                D, I = exact_search(xq, chunks_of(xb, rows), args.k, "ip", device, backend)
                best = min(best, time.perf_counter() - start)
            first = first or (label, D, I)
            results[label] = {
                "ms_per_batch": round(1000 * best, 1),
                "ms_per_query": round(1000 * best / args.nq, 3),
                "database_gb_per_s": round(xb.nbytes / best / 1e9, 3),
                "max_abs_diff_D_vs_" + first[0]: float(np.abs(D - first[1]).max()),
                "equal_ids_vs_" + first[0]: float((first[2] == I).mean()),
            }
    print(
        json.dumps(
            {
                "n": args.n,
                "d": args.d,
                "nq": args.nq,
                "k": args.k,
                "chunk_rows": rows,
                "threads": args.threads,
                "database_bytes": args.n * args.d * 2,
                "write_s": round(write_s, 2),
                "backends": results,
                "machine": platform.processor() or platform.machine(),
                "faiss": faiss.__version__,
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
