"""What a living index's state costs a search (issue 43): the same queries, each searched on every
generation back to back, so that the box's drift (±25 % within minutes on the 2-core VM) falls on
all of them alike.

Builds an IVF-PQ index over ``--n`` synthetic rows in ``--shards`` shards, adds ``--adds`` rounds of
``--add-rows`` rows (small segments: index/live/segment_merge.py searches them as one), then deletes
``--delete-rows`` random keys (delete sets: index/live/deletes.py skips them by over-fetching). Then, in
this process, for each query (k=100) in turn it times one search of each variant, in an order that
alternates:

- ``build``: generation 0;
- ``added``: after the adds;
- ``deleted``: after the adds and the deletes, as served;
- ``deleted_selector``: the same generation with every deleted row skipped by FAISS's IDSelector
  (what searches did before the over-fetch; its answers are checked equal to ``deleted``'s).

Prints a JSON line per variant and a last line with p50/p99 (ms) per variant, ``paired_ratio``
(each variant's median of per-query time ratios against ``build``), and ``same_answers``.

    OMP_NUM_THREADS=1 python bench/generation_cost.py --n 1000000 --adds 5 --add-rows 20000 --delete-rows 100000
    python bench/generation_cost.py --dry-run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from live_index import FILE_ROWS, bench_parser, log, make_vectors, needle, run_bench, write_files  # noqa: E402

from core.location import location_of  # noqa: E402
from index.live.generations import latest_number  # noqa: E402


def make_index(args: argparse.Namespace, work: Path) -> tuple[Path, dict[str, int]]:
    """The index and its generations: build, after the adds, after the deletes."""
    base = make_vectors(args.n, args.dim, 1, args.clusters)
    keys = write_files(work / "desc", 0, base)
    del base
    index_dir = work / "index"
    needle(["index", "build", "--descriptors", str(work / "desc"), "--out", str(index_dir), "--kind", "ivfpq",
            "--shards", str(args.shards), "--nprobe", str(args.nprobe),
            "--recall-target", "0"], args.threads)  # fmt: skip
    generations = {"build": latest_number(location_of(index_dir))}
    next_id = args.n // FILE_ROWS + 1
    for number in range(args.adds):
        round_dir = work / f"add{number}"
        keys += write_files(round_dir, next_id, make_vectors(args.add_rows, args.dim, 100 + number, args.clusters))
        next_id += (args.add_rows + FILE_ROWS - 1) // FILE_ROWS
        needle(["index", "add", "--index", str(index_dir), "--descriptors", str(round_dir)], args.threads)
    generations["added"] = latest_number(location_of(index_dir))
    doomed = np.random.default_rng(7).choice(len(keys), min(args.delete_rows, len(keys) - 1), replace=False)
    text = "\n".join(keys[i] for i in doomed) + "\n"
    needle(["index", "delete", "--index", str(index_dir), "--keys", "-"], args.threads, stdin=text)
    generations["deleted"] = latest_number(location_of(index_dir))
    return index_dir, generations


def timed(search, xq: np.ndarray) -> tuple[float, tuple[np.ndarray, np.ndarray]]:
    start = time.perf_counter()
    found = search(xq)
    return time.perf_counter() - start, found


def run(args: argparse.Namespace) -> dict:
    import index.live.deletes as deletes
    from index.search import load_index

    work = Path(args.workdir or tempfile.mkdtemp(prefix="needle-generation-cost-"))
    index_dir, generations = make_index(args, work)
    xq = make_vectors(args.queries, args.dim, 2, args.clusters).astype(np.float32)
    opened = {name: load_index(str(index_dir), generation=g) for name, g in generations.items()}
    for index in opened.values():
        index.warm()
    overfetch_share = deletes.OVERFETCH_MAX_SHARE

    def with_selector(q: np.ndarray):
        deletes.OVERFETCH_MAX_SHARE = -1.0  # every deleted row skipped by FAISS's selector, as before
        try:
            return opened["deleted"].search(q, 100)
        finally:
            deletes.OVERFETCH_MAX_SHARE = overfetch_share

    variants = {name: (lambda q, index=index: index.search(q, 100)) for name, index in opened.items()}
    variants["deleted_selector"] = with_selector
    names = list(variants)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    same = True
    for rep in range(args.reps):
        for i in range(len(xq)):
            found = {}
            for name in names if (i + rep) % 2 == 0 else names[::-1]:
                took, found[name] = timed(variants[name], xq[i : i + 1])
                seconds[name].append(took)
            same &= all(np.array_equal(a, b) for a, b in zip(found["deleted"], found["deleted_selector"]))
    base = np.array(seconds["build"])
    out: dict = {"n": args.n, "dim": args.dim, "shards": args.shards, "adds": args.adds, "add_rows": args.add_rows,
                 "delete_rows": args.delete_rows, "nprobe": args.nprobe, "threads": args.threads,
                 "searches_per_variant": len(base), "generations": generations, "same_answers": bool(same)}  # fmt: skip
    for name in names:
        ms = np.array(seconds[name]) * 1000
        point = {"p50_ms": round(float(np.median(ms)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3),
                 "paired_ratio": round(float(np.median(ms / 1000 / base)), 3)}  # fmt: skip
        log({"phase": "variant", "variant": name, **point})
        out[name] = point
    return out


def main() -> None:
    p = bench_parser(__doc__, 300_000)
    p.add_argument("--adds", type=int, default=5, help="rounds of adding --add-rows rows")
    p.add_argument("--add-rows", type=int, default=20_000)
    p.add_argument("--delete-rows", type=int, default=30_000, help="random keys deleted after the adds")
    p.add_argument("--reps", type=int, default=10, help="passes over the queries")
    args = p.parse_args()
    if args.dry_run:
        args.n, args.dim, args.shards, args.adds, args.add_rows, args.delete_rows = 24_000, 32, 2, 2, 1_000, 3_000
        args.nprobe, args.clusters, args.queries, args.reps = 8, 20, 10, 2
    run_bench(args, run)


if __name__ == "__main__":
    main()
