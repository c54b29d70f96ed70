"""What each segment of a living index costs a search (issue 43): the query latency of one index as
``needle index add`` gives it more small segments, against its row count, then after ``compact``.

Builds an IVF-PQ index over ``--n`` synthetic rows in ``--shards`` shards, then adds ``--adds``
files of ``--file-rows`` rows one at a time (each add writes one new segment). After the build and
after each add, it opens the current generation in this process (``load_index``) and times
single-query searches (k=100) for ``--seconds``, twice: as served (the small segments searched as
one FAISS index: index/live/segment_merge.py) and each segment by itself (``merge_small=False``), and
checks that both give the same answers; last, it compacts (``compact --keep 1``: small
segments merged) and times the result. Every generation is timed again in a second pass, in the
same order, so that the box's drift shows. One process, ``--threads`` threads: the searches alone,
no writer running while they are timed.

Prints a JSON line per generation and timing pass, and a last line with ``ms_per_segment`` (the
median latency of the last add's generation less its compaction's, the same rows in fewer
segments, per segment merged away), the same searching each segment by itself
(``by_segment_ms_per_segment``), ``p50_ratio_last_vs_compacted`` and the build's, the last
add's and the compaction's segments, rows and p50/p99.

    OMP_NUM_THREADS=1 python bench/segment_cost.py --n 300000 --adds 12 --out R.json
    python bench/segment_cost.py --dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from live_index import bench_parser, log, make_vectors, needle, run_bench, write_files  # noqa: E402

from core.location import location_of  # noqa: E402
from index.live.generations import latest_number  # noqa: E402

TIMES = ("p50_ms", "p99_ms", "by_segment_p50_ms", "by_segment_p99_ms")


def latency(index, xq: np.ndarray, seconds: float) -> dict:
    """p50/p99 (ms) of one-query searches, k=100, for ``seconds``."""
    times, i = [], 0
    index.search(xq[:1], 100)  # the first search maps the pages it needs
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        index.search(xq[i % len(xq) : i % len(xq) + 1], 100)
        times.append(time.perf_counter() - start)
        i += 1
    ms = np.array(times) * 1000
    return {
        "searches": len(ms),
        "p50_ms": round(float(np.median(ms)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
    }


def shape_of(index_dir: Path, generation: int) -> tuple[int, int]:
    """(segments, rows) of ``generation`` (its manifest; generation 0: the build's shards)."""
    manifest = index_dir / "generations" / f"{generation:06d}.json"
    if not manifest.exists():
        infos = json.loads((index_dir / "index_infos.json").read_text())
        return len(infos["shards"]), int(infos["ntotal"])
    shards = json.loads(manifest.read_text())["shards"]
    return sum(len(s["segments"]) for s in shards), sum(int(g["rows"]) for s in shards for g in s["segments"])


def run(args: argparse.Namespace) -> dict:
    from index.search import load_index

    work = Path(args.workdir or tempfile.mkdtemp(prefix="needle-segment-cost-"))
    index_dir = work / "index"
    write_files(work / "desc", 0, make_vectors(args.n, args.dim, 1, args.clusters))
    xq = make_vectors(args.queries, args.dim, 2, args.clusters).astype(np.float32)
    build = ["index", "build", "--descriptors", str(work / "desc"), "--out", str(index_dir), "--kind", "ivfpq",
             "--shards", str(args.shards), "--nprobe", str(args.nprobe), "--recall-target", "0"]  # fmt: skip
    needle(build, args.threads)
    generations = [latest_number(location_of(index_dir))]
    first_id = args.n // args.file_rows + 10
    for a in range(args.adds):
        new = work / f"add_{a:03d}"
        write_files(new, first_id + a, make_vectors(args.file_rows, args.dim, 100 + a, args.clusters))
        needle(["index", "add", "--index", str(index_dir), "--descriptors", str(new)], args.threads)
        generations.append(latest_number(location_of(index_dir)))
    needle(["index", "compact", "--index", str(index_dir), "--keep", str(args.adds + 2)], args.threads)
    compacted = latest_number(location_of(index_dir))
    points: dict[int, list[dict]] = {}
    for timing_pass in range(2):
        for generation in [*generations, compacted]:
            index = load_index(str(index_dir), generation=generation)
            index.warm()
            alone = dataclasses.replace(index, merge_small=False)  # every segment searched by itself
            segments, rows = shape_of(index_dir, generation)
            point = {"generation": generation, "pass": timing_pass, "segments": segments, "rows": rows,
                     "merged_groups": [len(g.members) for g in index.merged_segments]}  # fmt: skip
            point.update(latency(index, xq, args.seconds))
            point.update({f"by_segment_{k}": v for k, v in latency(alone, xq, args.seconds).items()})
            answers = zip(index.search(xq, 100), alone.search(xq, 100))
            point["same_answers"] = all(np.array_equal(a, b) for a, b in answers)
            points.setdefault(generation, []).append(point)
            log({"phase": "timed", **point})
            del index
    return summarize(args, [p for runs in points.values() for p in runs], generations, compacted, factory_of(index_dir))


def factory_of(index_dir: Path) -> str | None:
    return json.loads((index_dir / "index_infos.json").read_text()).get("factory")


def summarize(args: argparse.Namespace, timed: list[dict], generations: list[int], compacted: int, factory) -> dict:
    """The last line: each generation's two passes averaged. ``ms_per_segment`` compares the last
    add's generation with its compaction (the same rows in fewer segments): the rows' own cost
    cancels, where a fit over the adds could not tell segments from rows (each add brings both)."""
    runs: dict[int, list[dict]] = {}
    for point in timed:
        runs.setdefault(point["generation"], []).append(point)
    mean = {g: {**r[0], **{f: float(np.mean([x[f] for x in r])) for f in TIMES}} for g, r in runs.items()}
    base, last, after = mean[generations[0]], mean[generations[-1]], mean[compacted]
    merged_away = last["segments"] - after["segments"]
    per_segment = (last["by_segment_p50_ms"] - after["by_segment_p50_ms"]) / merged_away if merged_away else None
    by_segment = {
        "by_segment_ms_per_segment": round(per_segment, 4) if per_segment is not None else None,
        "by_segment_p50_ms_build_last_compacted": [round(x["by_segment_p50_ms"], 3) for x in (base, last, after)],
        "by_segment_p99_ms_build_last_compacted": [round(x["by_segment_p99_ms"], 3) for x in (base, last, after)],
        "p50_ratio_last_merged_vs_by_segment": round(last["p50_ms"] / last["by_segment_p50_ms"], 3),
        "same_answers": all(p["same_answers"] for p in timed),
    }
    return {
        "n": args.n, "dim": args.dim, "shards": args.shards, "adds": args.adds, "file_rows": args.file_rows,
        "nprobe": args.nprobe, "threads": args.threads, "factory": factory,
        "ms_per_segment": round((last["p50_ms"] - after["p50_ms"]) / merged_away, 4) if merged_away else None,
        "segments_build_last_compacted": [base["segments"], last["segments"], after["segments"]],
        "rows_build_last_compacted": [base["rows"], last["rows"], after["rows"]],
        "p50_ms_build_last_compacted": [round(base["p50_ms"], 3), round(last["p50_ms"], 3), round(after["p50_ms"], 3)],
        "p99_ms_build_last_compacted": [round(base["p99_ms"], 3), round(last["p99_ms"], 3), round(after["p99_ms"], 3)],
        "p50_ratio_last_vs_build": round(last["p50_ms"] / base["p50_ms"], 3),
        "p50_ratio_compacted_vs_build": round(after["p50_ms"] / base["p50_ms"], 3),
        "p50_ratio_last_vs_compacted": round(last["p50_ms"] / after["p50_ms"], 3),
        **by_segment,
    }  # fmt: skip


def main() -> None:
    p = bench_parser(__doc__, 300_000)
    p.add_argument("--adds", type=int, default=12, help="adds of one file each (one new segment each)")
    p.add_argument("--file-rows", type=int, default=10_000)
    p.add_argument("--seconds", type=float, default=6.0, help="searches timed per generation and pass")
    args = p.parse_args()
    if args.dry_run:
        args.n, args.dim, args.shards, args.adds, args.file_rows = 24_000, 32, 2, 3, 500
        args.nprobe, args.seconds = 8, 0.3
        args.clusters, args.queries = 20, 10
    run_bench(args, run)


if __name__ == "__main__":
    main()
