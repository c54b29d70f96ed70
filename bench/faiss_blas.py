"""FAISS's two ways of scoring a batch of queries exactly, and which one needle's processes take.

FAISS scores nq queries against a flat set of rows query by query (its SIMD loop) or as one matrix
product (BLAS), by ``faiss.cvar.distance_compute_blas_threshold`` (FAISS >= 1.14: the product from
nq x d on). ``core/blas.py`` sets it to 1,024 per thread in every process that opens a shard.
This script times ``faiss.knn`` both ways, per d and nq, on ``--threads`` threads (OMP and BLAS
pinned, as the servers of the other benches run), and prints one JSON object: per case the ms per
query of each way, which one FAISS's default and needle's setting take, and ``needle_vs_best``
(needle's time over the faster way's; ``default_vs_best`` the same for FAISS's default).

    python bench/faiss_blas.py                # d 128, 512, 768; nq 1 to 256
    python bench/faiss_blas.py --dry-run      # tiny sizes, in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def pin_threads(threads: int) -> None:
    """Every pool FAISS may use, before FAISS loads."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[name] = str(threads)


def best_seconds(call: Any, repeats: int) -> float:
    """The fastest of ``repeats`` calls (the box's noise only ever adds)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def case(faiss: Any, np: Any, d: int, rows: int, nq: int, k: int, repeats: int, thresholds: dict[str, int]) -> dict:
    """One (d, nq): ms per query of the loop and of the product, and the way each threshold takes."""
    rng = np.random.default_rng(d * 1000 + nq)
    xb = rng.standard_normal((rows, d)).astype(np.float32)
    xq = rng.standard_normal((nq, d)).astype(np.float32)
    ms = {}
    for way, threshold in (("loop", 2**31 - 1), ("product", 1)):
        faiss.cvar.distance_compute_blas_threshold = threshold
        ms[way] = 1e3 * best_seconds(lambda: faiss.knn(xq, xb, k, faiss.METRIC_INNER_PRODUCT), repeats) / nq
    takes = {name: "loop" if nq * d < value else "product" for name, value in thresholds.items()}
    best = min(ms.values())
    return {
        "d": d, "rows": rows, "nq": nq,
        "loop_ms_per_query": round(ms["loop"], 4), "product_ms_per_query": round(ms["product"], 4),
        "faiss_default_takes": takes["default"], "needle_takes": takes["needle"],
        "default_vs_best": round(ms[takes["default"]] / best, 3),
        "needle_vs_best": round(ms[takes["needle"]] / best, 3),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dims", default="128,512,768")
    parser.add_argument("--queries", default="1,2,4,8,16,32,64,256", help="batch sizes nq")
    parser.add_argument("--work", type=float, default=8e6, help="rows x d per case (rows = work / d)")
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, in seconds")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.dims, args.queries, args.work, args.repeats = "64,256", "1,8", 2e5, 1
    pin_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    import faiss
    import numpy as np

    from core.blas import FAISS_DEFAULT, blas_threshold_for

    faiss.omp_set_num_threads(args.threads)
    thresholds = {"default": FAISS_DEFAULT, "needle": blas_threshold_for(args.threads)}
    cases = [
        case(faiss, np, d, int(args.work // d), nq, args.k, args.repeats, thresholds)
        for d in (int(x) for x in args.dims.split(","))
        for nq in (int(x) for x in args.queries.split(","))
    ]
    record = {
        "bench": "faiss_blas", "faiss": faiss.__version__, "threads": args.threads, "k": args.k,
        "thresholds": thresholds, "cases": cases,
        "needle_vs_best_max": max(c["needle_vs_best"] for c in cases),
        "default_vs_best_max": max(c["default_vs_best"] for c in cases),
    }  # fmt: skip
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
