"""Index scale: build under a memory budget, then recall@1000 / latency / QPS for a single index
and for the sharded Ray service, over an nprobe sweep. Prints one JSON line last.

N synthetic clustered unit vectors (seeded, generated file by file, never all in memory) are
written as schema-v1 Parquet parts in a temporary directory while the exact top-1000 of 100
queries (drawn from the same distribution) is kept up to date by chunked brute force. The index
is built with the default plan for the budget as ``--shards`` shards; the single index is the
merge of those shards (same codes), so both answer from identical data.

    python bench/index_scale.py --n 1000000 --d 512 [--memory-budget 8GB] [--shards 4]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def synthetic_block(seed: int, n: int, d: int, centers: np.ndarray, spread: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = centers[rng.integers(0, len(centers), n)] + spread * rng.standard_normal((n, d), dtype=np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)


def write_part(directory: Path, shard_id: int, xb: np.ndarray) -> None:
    import pyarrow as pa

    from ingest.descriptors import descriptor_schema, fixed_size_list, make_row_id, write_parquet_atomic

    n, d = xb.shape
    name = f"{shard_id:06d}"
    table = pa.table({
        "key": [f"{name}/{i:07d}" for i in range(n)],
        "shard": [name] * n,
        "row": pa.array([make_row_id(shard_id, i) for i in range(n)], pa.int64()),
        "global": fixed_size_list(xb, pa.float16()),
        "width": pa.array(np.zeros(n, np.int32)),
        "height": pa.array(np.zeros(n, np.int32)),
        "status": ["ok"] * n,
        "error": [""] * n,
    }, schema=descriptor_schema(d))
    write_parquet_atomic(table, directory / f"{name}.parquet")


def update_topk(D: np.ndarray, I: np.ndarray, scores: np.ndarray, ids: np.ndarray, k: int):
    D = np.concatenate([D, scores], axis=1)
    I = np.concatenate([I, np.broadcast_to(ids, scores.shape)], axis=1)
    keep = np.argpartition(-D, k - 1, axis=1)[:, :k]
    return np.take_along_axis(D, keep, 1), np.take_along_axis(I, keep, 1)


def measure(index, xq, gt: list[set[int]], k: int, nprobe: int) -> dict[str, float]:
    latencies = []
    found = 0
    for q in range(len(xq)):
        start = time.perf_counter()
        _, I = index.search(xq[q : q + 1], k, nprobe)
        latencies.append(time.perf_counter() - start)
        found += len(gt[q] & set(I[0].tolist()))
    start = time.perf_counter()
    index.search(xq, k, nprobe)
    batch_s = time.perf_counter() - start
    return {"nprobe": nprobe, "recall_at_1000": round(found / (k * len(xq)), 4),
            "p50_ms": round(1000 * float(np.median(latencies)), 2), "qps": round(len(xq) / batch_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--memory-budget", default="8GB")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--per-file", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--k", type=int, default=1000)
    parser.add_argument("--nprobe", default="8,16,32,64")
    parser.add_argument("--points-per-list", type=int, default=64)
    parser.add_argument("--workdir", help="keep files here (default: a temporary directory)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from index.build import INDEX_FILE, INFOS_FILE, IndexConfig, merge_parts
    from index.build import main as build_index
    from index.search import load_index

    work = Path(args.workdir or tempfile.mkdtemp(prefix="needle-index-scale-"))
    rng = np.random.default_rng(args.seed)
    centers = rng.standard_normal((max(100, args.n // 2000), args.d), dtype=np.float32)
    spread = 1.0 / np.sqrt(args.d) * 4  # clusters overlap: a realistic, not trivially separable, collection
    xq = synthetic_block(args.seed + 10**6, args.queries, args.d, centers, spread).astype(np.float32)
    D_gt = np.full((args.queries, args.k), -np.inf, np.float32)
    I_gt = np.full((args.queries, args.k), -1, np.int64)

    start = time.perf_counter()
    for f, offset in enumerate(range(0, args.n, args.per_file)):
        n = min(args.per_file, args.n - offset)
        xb = synthetic_block(args.seed + f, n, args.d, centers, spread)
        write_part(work / "desc", f, xb)
        ids = (np.int64(f) << 32) + np.arange(n, dtype=np.int64)
        D_gt, I_gt = update_topk(D_gt, I_gt, xq @ xb.T.astype(np.float32), ids, args.k)
    generate_s = time.perf_counter() - start
    gt = [set(row.tolist()) for row in I_gt]
    logging.info("generated %d vectors and exact top-%d in %.0fs", args.n, args.k, generate_s)

    conf = IndexConfig(memory_budget=args.memory_budget, shards=args.shards, points_per_list=args.points_per_list)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    build_index(conf, work / "desc", work / "sharded")
    build_s = time.perf_counter() - start
    peak_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    infos = json.loads((work / "sharded" / INFOS_FILE).read_text())
    index_bytes = sum((work / "sharded" / name).stat().st_size for name in infos["index_files"])

    # The single index: the shards merged (same trained quantizer, same codes).
    single = work / "single"
    single.mkdir(exist_ok=True)
    merge_parts([str(work / "sharded" / name) for name in infos["index_files"]], single / INDEX_FILE)
    for name in ("ids.parquet", "vectors.f16.npy"):
        target = single / name
        if not target.exists():
            os.link(work / "sharded" / name, target)
    (single / INFOS_FILE).write_text(json.dumps({**infos, "index_files": [INDEX_FILE], "config": {**infos["config"], "shards": 1}}))

    import ray

    from cluster.serve import serve_sharded

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    service = serve_sharded(work / "sharded")
    single_index = load_index(single)
    sweep = []
    for nprobe in [int(x) for x in args.nprobe.split(",")]:
        sweep.append({"index": "single", **measure(single_index, xq, gt, args.k, nprobe)})
        sweep.append({"index": "sharded_ray", **measure(service, xq, gt, args.k, nprobe)})
        logging.info("nprobe %d: %s", nprobe, sweep[-2:])
    ray.shutdown()
    query_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    result = {
        "n": args.n, "d": args.d, "memory_budget": args.memory_budget, "factory": infos["factory"],
        "reasons": infos["reasons"], "shards": args.shards, "n_train": infos["n_train"],
        "generate_s": round(generate_s, 1), "build_s": round(build_s, 1),
        "peak_rss_gb": round(max(peak_rss_gb, rss_before / 2**20), 2), "peak_rss_gb_with_queries": round(query_rss_gb, 2),
        "bytes_per_vector": round(index_bytes / args.n, 1),
        "refine_bytes_per_vector": 2 * args.d, "refine_factor": infos["refine_factor"],
        "sweep": sweep,
    }
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
