"""Index scale: build under a memory budget, then recall@1000 / latency / QPS for the sharded Ray
service and for a single index, over an nprobe x refine-factor sweep. Prints one JSON line last.

N synthetic clustered unit vectors (seeded, generated file by file, never all in memory) are
written as schema-v1 Parquet parts while the exact top-1000 of 100 queries (drawn from the same
distribution) is kept up to date by chunked brute force. The index is built by ``needle index
build`` in a child process (its peak RSS is the build's) with the default plan for the budget, as
``--shards`` shards served by one Ray actor each; the single index is the merge of those shards
(same codes), so both answer from identical data.

Memory: ``build_peak_rss_gb`` is the build process's peak; ``serve_*`` sum the coordinator and
its shard actors after the sweep (RSS, PSS, and PSS split into anonymous and file-backed pages:
mapped index shards and refine vectors are file pages the kernel may drop). ``peak_rss_gb`` is the
larger of the build peak and the serving RSS sum.

With ``--workdir`` the generated data, the ground truth and the built index are kept and reused
by later runs with the same parameters (``--rebuild`` forces a new build), so sweeps are cheap.

    python bench/index_scale.py --n 1000000 --d 512 [--memory-budget 8GB] [--shards 4]
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import shutil
import subprocess
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
    table = pa.table(
        {
            "key": [f"{name}/{i:07d}" for i in range(n)],
            "shard": [name] * n,
            "row": pa.array([make_row_id(shard_id, i) for i in range(n)], pa.int64()),
            "global": fixed_size_list(xb, pa.float16()),
            "width": pa.array(np.zeros(n, np.int32)),
            "height": pa.array(np.zeros(n, np.int32)),
            "status": ["ok"] * n,
            "error": [""] * n,
        },
        schema=descriptor_schema(d),
    )
    write_parquet_atomic(table, directory / f"{name}.parquet")


def update_topk(D: np.ndarray, I: np.ndarray, scores: np.ndarray, ids: np.ndarray, k: int):
    D = np.concatenate([D, scores], axis=1)
    I = np.concatenate([I, np.broadcast_to(ids, scores.shape)], axis=1)
    keep = np.argpartition(-D, k - 1, axis=1)[:, :k]
    return np.take_along_axis(D, keep, 1), np.take_along_axis(I, keep, 1)


def measure(index, xq, gt: list[set[int]], k: int, nprobe: int, refine_factor: int) -> dict[str, float]:
    """Recall of one-query-at-a-time searches and their latency; QPS of the whole batch at once."""
    index.search(xq[:1], k, nprobe, refine_factor=refine_factor)  # warm: list pages, thread pools
    latencies = []
    found = 0
    for q in range(len(xq)):
        start = time.perf_counter()
        _, I = index.search(xq[q : q + 1], k, nprobe, refine_factor=refine_factor)
        latencies.append(time.perf_counter() - start)
        found += len(gt[q] & set(I[0].tolist()))
    start = time.perf_counter()
    index.search(xq, k, nprobe, refine_factor=refine_factor)
    batch_s = time.perf_counter() - start
    return {
        "nprobe": nprobe,
        "refine_factor": refine_factor,
        "recall_at_1000": round(found / (k * len(xq)), 4),
        "p50_ms": round(1000 * float(np.median(latencies)), 2),
        "p90_ms": round(1000 * float(np.percentile(latencies, 90)), 2),
        "qps": round(len(xq) / batch_s, 1),
    }


def generate(args, work: Path) -> tuple[np.ndarray, np.ndarray, float]:
    """Parquet parts of N vectors in ``work/desc`` and the exact top-k of the queries; reused when
    ``work/ground_truth.npz`` was made with the same parameters."""
    meta = {
        "n": args.n,
        "d": args.d,
        "seed": args.seed,
        "queries": args.queries,
        "k": args.k,
        "per_file": args.per_file,
    }
    saved = work / "ground_truth.npz"
    if saved.is_file():
        data = np.load(saved)
        if json.loads(str(data["meta"])) == meta:
            logging.info("reusing the generated vectors and ground truth in %s", work)
            return data["xq"], data["I_gt"], float(data["generate_s"])
    shutil.rmtree(work / "desc", ignore_errors=True)
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
    logging.info("generated %d vectors and exact top-%d in %.0fs", args.n, args.k, generate_s)
    np.savez(saved, xq=xq, I_gt=I_gt, generate_s=generate_s, meta=json.dumps(meta))
    return xq, I_gt, generate_s


def build(args, work: Path) -> dict:
    """``needle index build`` in a child process; its time and peak RSS (reused like the data)."""
    out = work / "sharded"
    params = [
        "--memory-budget",
        args.memory_budget,
        "--shards",
        str(args.shards),
        "--points-per-list",
        str(args.points_per_list),
    ]
    record = work / "build.json"
    if not args.rebuild and record.is_file() and (out / "index_infos.json").is_file():
        built = json.loads(record.read_text())
        if built["params"] == params:
            logging.info("reusing the index in %s", out)
            return built
    shutil.rmtree(out, ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "cli.main",
        "index",
        "build",
        "--descriptors",
        str(work / "desc"),
        "--out",
        str(out),
        *params,
    ]
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT)
    built = {
        "params": params,
        "build_s": round(time.perf_counter() - start, 1),
        # ru_maxrss of waited-for children: the build is the only child so far
        "build_peak_rss_gb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2),
    }
    record.write_text(json.dumps(built))
    return built


def gb(x: float) -> float:
    return round(x / 2**30, 2)


def merged_single(single: Path, infos: dict, shard_dirs: list[Path]) -> Path:
    """An index of one shard directory holding every shard's rows: their FAISS files merged, their
    vectors, ids and keys concatenated in shard order (what ``needle index build --shards 1`` would
    write with the same trained index)."""
    import pyarrow as pa
    import pyarrow.ipc

    from core.hashing import file_sha256
    from index.build.shard import concatenate_vectors, merge_parts, write_keys_of_ids
    from index.build.stage import IDS_FILE, INDEX_FILE, INFOS_FILE, SHARD_INFOS_FILE, VECTORS_FILE
    from index.keys import KEY_FILES
    from index.shard_files import read_ids

    if infos.get("locals"):
        raise SystemExit("the single-index comparison merges no local tokens: pass --no-single")
    shutil.rmtree(single, ignore_errors=True)
    directory = single / "shard_000"
    directory.mkdir(parents=True)
    ntotal = merge_parts([str(d / INDEX_FILE) for d in shard_dirs], directory / INDEX_FILE)
    rows = concatenate_vectors([d / VECTORS_FILE for d in shard_dirs], directory / VECTORS_FILE, infos["dim"])
    ids = pa.concat_tables([read_ids(d / IDS_FILE) for d in shard_dirs])
    with pa.OSFile(str(directory / IDS_FILE), "wb") as sink, pa.ipc.new_file(sink, ids.schema) as writer:
        writer.write_table(ids)
    write_keys_of_ids(directory / IDS_FILE, directory)
    shards = [json.loads((d / SHARD_INFOS_FILE).read_text()) for d in shard_dirs]
    offsets, base = {}, 0  # Parquet shard id -> first position, over all rows in shard order
    for shard in shards:
        offsets.update({k: base + v for k, v in shard["shard_offsets"].items()})
        base += shard["rows"]
    names = [INDEX_FILE, VECTORS_FILE, IDS_FILE, *KEY_FILES]
    checksums = {n: {"bytes": (directory / n).stat().st_size, "sha256": file_sha256(directory / n)} for n in names}
    shard_infos = {
        **shards[0],
        **{"shard": 0, "name": directory.name, "rows": rows, "ntotal": ntotal, "shard_offsets": offsets},
        "files": [f for shard in shards for f in shard["files"]],
        "rejected_non_finite": sum(shard["rejected_non_finite"] for shard in shards),
        "checksums": checksums,
    }
    (directory / SHARD_INFOS_FILE).write_text(json.dumps(shard_infos))
    entry = {
        "name": directory.name,
        "rows": rows,
        "ntotal": ntotal,
        "parquet_shard_ids": sorted(int(k) for k in offsets),
        "bytes": sum(c["bytes"] for c in checksums.values()),
    }
    single_infos = {**infos, "shards": [entry], "config": {**infos["config"], "shards": 1}}
    (single / INFOS_FILE).write_text(json.dumps(single_infos))
    return single


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--memory-budget", default="8GB")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--per-file", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--k", type=int, default=1000)
    parser.add_argument("--nprobe", default="16,32,64", help="comma-separated sweep")
    parser.add_argument("--refine-factor", default="2,4", help="comma-separated sweep")
    parser.add_argument("--points-per-list", type=int, default=64)
    parser.add_argument("--workdir", help="keep (and reuse) files here (default: a temporary directory)")
    parser.add_argument("--rebuild", action="store_true", help="build the index even if --workdir holds one")
    parser.add_argument("--no-single", action="store_true", help="skip the merged single-index comparison")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from index.build.stage import INFOS_FILE
    from index.memory import process_memory
    from index.search import load_index
    from index.shard_files import index_file_paths

    work = Path(args.workdir or tempfile.mkdtemp(prefix="needle-index-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    xq, I_gt, generate_s = generate(args, work)
    gt = [set(row.tolist()) for row in I_gt]
    built = build(args, work)
    infos = json.loads((work / "sharded" / INFOS_FILE).read_text())
    index_paths = index_file_paths(work / "sharded", infos)
    index_bytes = sum(path.stat().st_size for path in index_paths)
    sweep_points = [(int(p), int(r)) for p in args.nprobe.split(",") for r in args.refine_factor.split(",")]

    import ray

    from cluster.serve import ShardServing, serve_sharded
    from shards.staging import StageConfig

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    service = serve_sharded(work / "sharded", ShardServing(stage=StageConfig(copy_local=False)))  # mapped in place
    sweep = []
    for nprobe, factor in sweep_points:
        sweep.append({"index": "sharded_ray", **measure(service, xq, gt, args.k, nprobe, factor)})
        logging.info("%s", sweep[-1])
    memories = [
        process_memory(),
        *ray.get([a.memory.remote() for replicas in service.backend.actors for a in replicas]),
    ]
    serve = {
        f"serve_{name}_gb": gb(sum(m.get(name, 0) for m in memories)) for name in ("rss", "pss", "pss_anon", "pss_file")
    }
    del service
    ray.shutdown()

    if not args.no_single:  # the shards merged (same trained quantizer, same codes), in one shard directory
        single = merged_single(work / "single", infos, [path.parent for path in index_paths])
        single_index = load_index(single)
        for nprobe, factor in sweep_points:
            sweep.append({"index": "single", **measure(single_index, xq, gt, args.k, nprobe, factor)})
            logging.info("%s", sweep[-1])

    result = {
        "n": args.n,
        "d": args.d,
        "memory_budget": args.memory_budget,
        "factory": infos["factory"],
        "reasons": infos["reasons"],
        "shards": args.shards,
        "n_train": infos["n_train"],
        "nlist": infos["nlist"],
        "code_bytes": infos["code_bytes"],
        "quantizer_ef": infos.get("quantizer_ef"),
        "generate_s": round(generate_s, 1),
        "build_s": built["build_s"],
        "build_timings": infos.get("timings"),
        "build_memory": {name.replace("_bytes", "_gb"): gb(value) for name, value in infos.get("memory", {}).items()},
        "build_peak_rss_gb": built["build_peak_rss_gb"],
        **serve,
        "peak_rss_gb": max(built["build_peak_rss_gb"], serve["serve_rss_gb"]),
        "bytes_per_vector": round(index_bytes / args.n, 1),
        "refine_bytes_per_vector": 2 * args.d,
        "sweep": sweep,
    }
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
