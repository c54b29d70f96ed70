"""Index at a scale this machine cannot run (100M x 512): memory and build time extrapolated from
measured ``bench/index_scale.py`` runs, component by component. Prints one JSON line.

The plan is what ``needle index build`` would choose (``index.build.factory.plan_index``). Every other
figure comes from the measured runs, taking the least favourable run for each term:

- index bytes per vector = the plan's code bytes + the measured overhead beyond the code (ids,
  fast-scan block padding: ``bytes_per_vector - code_bytes``);
- serving anonymous memory = the index bytes + (shards + 1) x the measured per-process overhead
  (actor and coordinator, beyond their index bytes). File-backed pages (memory-mapped ids and
  refine vectors) are page cache the kernel can drop, reported apart;
- build peak = max(training: measured bytes per training float x the plan's sample size,
  adding: measured part baseline + one part's codes), with ``--parts`` parts added one at a time;
- build time = k-means seconds scaled by sample size x lists, add seconds scaled by N.

    python bench/index_extrapolate.py bench/results/index_scale_1m.json bench/results/index_scale_10m.json \\
        --n 100000000 --memory-budget 8GB --shards 8 --parts 16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GB = 2**30


def load_runs(paths: list[str]) -> list[dict]:
    runs = []
    for path in paths:
        lines = [line for line in Path(path).read_text().splitlines() if line.startswith("{")]
        if not lines:
            raise SystemExit(f"{path}: no JSON result line")
        run = json.loads(lines[-1])
        missing = [
            key for key in ("code_bytes", "build_memory", "build_timings", "serve_pss_anon_gb") if key not in run
        ]
        if missing:
            raise SystemExit(f"{path}: a run without {missing} (made by an older bench/index_scale.py)")
        runs.append(run)
    return runs


def extrapolate(runs: list[dict], n: int, d: int, budget: str, shards: int, parts: int) -> dict:
    from index.build.factory import parse_bytes, plan_index

    plan = plan_index(n, d, parse_bytes(budget))
    overhead_per_vector = max(r["bytes_per_vector"] - r["code_bytes"] for r in runs)
    bytes_per_vector = plan.code_bytes + overhead_per_vector
    index_bytes = n * bytes_per_vector
    per_process = max((r["serve_pss_anon_gb"] * GB - r["n"] * r["bytes_per_vector"]) / (r["shards"] + 1) for r in runs)
    serve_anon = index_bytes + (shards + 1) * per_process

    train_bytes_per_float = max(
        r["build_memory"]["peak_rss_after_training_gb"] * GB / (r["n_train"] * r["d"] * 4) for r in runs
    )
    train_peak = train_bytes_per_float * plan.n_train * d * 4
    part_baseline = max(
        r["build_memory"]["part_rss_gb"] * GB - r["n"] / r["shards"] * r["bytes_per_vector"] for r in runs
    )
    add_peak = part_baseline + n / parts * bytes_per_vector
    largest = max(runs, key=lambda r: r["n"])
    train_s = (
        largest["build_timings"]["train_s"] * (plan.n_train * plan.nlist) / (largest["n_train"] * largest["nlist"])
    )
    add_s = largest["build_timings"]["add_s"] * n / largest["n"]
    return {
        "n": n,
        "d": d,
        "memory_budget": budget,
        "shards": shards,
        "parts": parts,
        "plan": {
            "factory": plan.factory,
            "nlist": plan.nlist,
            "code_bytes": plan.code_bytes,
            "n_train": plan.n_train,
            "reasons": plan.reasons,
        },
        "from_runs": [{"n": r["n"], "factory": r["factory"]} for r in runs],
        "index_bytes_per_vector": round(bytes_per_vector, 1),
        "index_gb": round(index_bytes / GB, 2),
        "serve_anon_gb": round(serve_anon / GB, 2),
        "serve_per_process_overhead_gb": round(per_process / GB, 3),
        "refine_vectors_gb_on_disk": round(n * d * 2 / GB, 1),
        "build_train_peak_gb": round(train_peak / GB, 2),
        "build_add_peak_gb": round(add_peak / GB, 2),
        "build_peak_rss_gb": round(max(train_peak, add_peak) / GB, 2),
        "build_train_s_this_machine": round(train_s),
        "build_add_s_this_machine": round(add_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="files whose last JSON line is a bench/index_scale.py result")
    parser.add_argument("--n", type=int, default=100_000_000)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--memory-budget", default="8GB")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--parts", type=int, default=16)
    args = parser.parse_args()
    print(json.dumps(extrapolate(load_runs(args.results), args.n, args.d, args.memory_budget, args.shards, args.parts)))


if __name__ == "__main__":
    main()
