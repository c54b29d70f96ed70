"""What ``needle index delete`` costs per key (issue 55): it was quadratic (200k keys 8.5 s, 800k
keys 108 s); a million keys must take seconds.

Writes ``--n`` synthetic rows (``--dim``, small by default: the vectors' size does not enter a
delete's lookups, only the gather of the found rows' vectors), builds a flat index over them in
``--shards`` shards (``needle index build``), then runs ``needle index delete --keys -`` once per
size in ``--sizes``, each time with keys not deleted before (drawn at random), one generation
each. Prints a JSON line per delete (``keys``, ``seconds`` wall, ``cpu_s``, ``keys_per_s``) and a
last line with them all (``deletes``) and the largest's figures.

    OMP_NUM_THREADS=1 python bench/live_delete.py --n 1200000 --sizes 10000,100000,1000000 --out R.json
    python bench/live_delete.py --dry-run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from live_index import bench_parser, log, make_vectors, needle, run_bench, write_files  # noqa: E402


def run(args: argparse.Namespace) -> dict:
    sizes = [int(s) for s in args.sizes.split(",")]
    if sum(sizes) > args.n:
        raise SystemExit(f"--sizes {args.sizes} delete {sum(sizes)} keys, more than the {args.n} rows")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="needle-live-delete-"))
    keys = write_files(work / "desc", 0, make_vectors(args.n, args.dim, 1, args.clusters))
    index_dir = work / "index"
    _, build_s, _ = needle(["index", "build", "--descriptors", str(work / "desc"), "--out", str(index_dir),
                            "--kind", "flat", "--shards", str(args.shards)], args.threads)  # fmt: skip
    log({"phase": "build", "n": args.n, "seconds": round(build_s, 2)})
    order = np.random.default_rng(7).permutation(len(keys))
    deletes, start = [], 0
    for size in sizes:
        text = "".join(keys[i] + "\n" for i in order[start : start + size])
        start += size
        change, seconds, cpu = needle(["index", "delete", "--index", str(index_dir), "--keys", "-"], args.threads,
                                      stdin=text)  # fmt: skip
        if change is None or change["deleted"] != size or change["unknown"]:
            raise RuntimeError(f"a delete of {size} keys deleted {change and change['deleted']}: {change}")
        record = {"keys": size, "seconds": round(seconds, 3), "cpu_s": round(cpu, 3),
                  "keys_per_s": round(size / seconds), "generation": change["generation"]}  # fmt: skip
        log({"phase": "delete", **record})
        deletes.append(record)
    largest = max(deletes, key=lambda d: d["keys"])
    return {"n": args.n, "dim": args.dim, "shards": args.shards, "threads": args.threads, "deletes": deletes,
            "keys": largest["keys"], "seconds": largest["seconds"], "keys_per_s": largest["keys_per_s"]}  # fmt: skip


def main() -> None:
    parser = bench_parser(__doc__, 1_200_000)
    parser.set_defaults(dim=16, shards=4, clusters=100)
    parser.add_argument("--sizes", default="10000,100000,1000000", help="keys deleted per command, comma-separated")
    args = parser.parse_args()
    if args.dry_run:
        args.n, args.sizes, args.shards = 20_000, "10,100,1000", 2  # two files of FILE_ROWS
    run_bench(args, run)


if __name__ == "__main__":
    main()
