"""needle's living index against its peers on the Big-ANN streaming track's runbooks (issue 56).

The model. A *runbook* is the track's list of steps: insert the ids ``[start, end)`` (a point's tag
is its id), delete tags, replace tags by other ids' vectors, search (the same queries every time,
k = 10). Ground truth per search step: the exact k nearest of the live rows (L2 on unit vectors);
recall@10 counts a returned live row within 1e-6 of the 10th distance (the track's ties), averaged
over queries, then over search steps. Two runbooks:

- ``generated``: the scored runbook's recipe (the track's README in ``../shared/streaming``) on N
  rows: C clusters of unequal size (contiguous ids), each split into 5 shares from
  Dirichlet(100, 15, 10, 5, 3) shuffled per cluster; per round, for each cluster insert its next
  share and search; then for each cluster delete 50-90 % of its live rows from the oldest end and
  search.
- ``final`` (or any track runbook file, ``PATH[:dataset]``): the track's own steps with every id
  range scaled by N / (the dataset's rows); the clusters are the id ranges its inserts chain.

The data: one cluster per id range, a unit centre plus anisotropic Gaussian noise, normalised and
rounded to float16 (dim 128); queries from the same mixture. Only ``--max-searches`` search steps
are kept (evenly spaced, the last kept; dropping a search changes no state), and the change steps
between two kept searches are merged per kind into one *phase*, as a scheduled job batches them:
needle runs one command per phase (``bench/streaming_needle.py``: build, add, delete, compact
every few changes, served by ``needle serve`` over HTTP; ``needle`` with the build's defaults, and
``needle-ivfpq`` built ``--kind ivfpq``: an IVF-PQ plan for the first insert's rows, trained on
them only, the case a retrain exists for), each peer one library call per phase
(``bench/streaming_peers.py``: FAISS IVF-PQ trained once, FAISS IVF-Flat, hnswlib, diskannpy with
the track's baseline settings). Every system runs in its own process with one thread
(OMP_NUM_THREADS=1), one after another, on the same phases; hnswlib and diskannpy are installed by
this bench into a throwaway folder (``pip install --target``) put on their process's path only.

Prints JSON: a line per system as it finishes, then the record ``{"runs": [{"runbook": {"name",
"n", "dim", "steps", ...}, "systems": [{"system", "recall_at_10_mean", "recall_at_10_per_search",
"qps", "total_s", "rss_peak_mb", "deleted_returned", ...}], "targets": {...}}]}``; needle's entry
also ``fresh_recall_at_10_per_search`` (a ``needle index build`` over each search step's live rows).

    python bench/streaming.py --runbook generated --n 300000 --out bench/results/streaming.json
    python bench/streaming.py --runbook final --n 300000 --append --out bench/results/streaming.json
    python bench/streaming.py --dry-run      # tiny sizes, both runbooks, peers only if importable
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import streaming_runbook as rb  # noqa: E402
from record import save_result  # noqa: E402
from streaming_report import plot, system_entry, targets  # noqa: E402
from streaming_truth import kth_distance  # noqa: E402

log = logging.getLogger("streaming")
RUNBOOKS = ROOT.parent / "shared" / "streaming" / "runbooks"  # the track's files, read where they lie (../shared)
INSTALLED = {"hnswlib": "hnswlib", "diskannpy": "diskannpy"}  # peers pip installs into --peers-dir


def make_runbook(spec: str, args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    """The runbook's steps at ``args.n`` rows, its clusters' boundaries and its description."""
    if spec == "generated":
        steps, bounds = rb.generated_runbook(args.n, args.clusters, args.rounds, rng)
        name, source = f"generated-clustered-{args.clusters}c-{args.rounds}r", "the scored runbook's recipe"
    else:
        path, _, dataset = spec.partition(":")
        path = str(RUNBOOKS / "final_runbook.yaml") if path == "final" else path
        name, track_steps = rb.read_track_runbook(Path(path), dataset or None)
        rows = rb.dataset_rows(name, track_steps)
        steps = rb.scale_steps(track_steps, rows, args.n)
        bounds, source = rb.clusters_of(steps, args.n), f"{Path(path).name}, ids scaled by {args.n}/{rows}"
    kept = rb.keep_searches(steps, args.max_searches)
    count = {op: sum(s.op == op for s in steps) for op in ("insert", "delete", "replace", "search")}
    book = {"name": name, "n": args.n, "dim": args.dim, "steps": len(steps), "source": source,
            "clusters": len(bounds), "step_counts": count, "searches_kept": sum(s.op == "search" for s in kept),
            "queries": args.queries}  # fmt: skip
    return {"book": book, "phases": rb.phases(kept), "bounds": bounds}


def ground_truth(phases: list[dict[str, Any]], data: np.ndarray, queries: np.ndarray, k: int) -> list[dict[str, Any]]:
    """Per kept search: the tag -> id map then (``vec``) and the exact k-th distance per query."""
    state, truth = rb.LiveState(len(data)), []
    for phase in phases:
        if phase["op"] == "search":
            live = state.live_tags()
            truth.append({"vec": state.vec.copy(), "kth": kth_distance(data, state.vec[live], queries, k)})
        else:
            for step in phase["steps"]:
                state.apply(step)
    return truth


def peer_path(system: str, args: argparse.Namespace) -> tuple[str | None, str]:
    """(extra sys.path for the system's process, or None where it cannot run; why not). A dry run
    installs nothing: a peer not importable is skipped."""
    if system not in INSTALLED or importlib.util.find_spec(INSTALLED[system]):
        return "", ""
    target = Path(args.peers_dir)
    probe = [sys.executable, "-c", f"import {INSTALLED[system]}"]
    if subprocess.run(probe, env={**os.environ, "PYTHONPATH": str(target)}, capture_output=True).returncode == 0:
        return str(target), ""
    if args.dry_run or args.no_install:
        return None, "not importable; a dry run installs nothing"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target", str(target),
           INSTALLED[system]]  # fmt: skip
    done = subprocess.run(pip, capture_output=True, text=True)
    if done.returncode != 0 or subprocess.run(probe, env={**os.environ, "PYTHONPATH": str(target)}).returncode:
        return None, f"pip install --target failed: {done.stderr[-300:]}"
    return str(target), ""


def run_system(system: str, work: Path, extra_path: str) -> dict[str, Any]:
    """The system's replay in its own process, one thread; its result.json."""
    script = "streaming_needle.py" if system.startswith("needle") else "streaming_peers.py"
    argv = [sys.executable, str(ROOT / "bench" / script), str(work), system]
    path = os.pathsep.join(p for p in (extra_path, str(ROOT)) if p)  # the peers' numpy first
    threads = dict.fromkeys(("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"), "1")
    env = {**os.environ, **threads, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    with open(work / f"{system}.log", "w") as errors:
        done = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=errors)
    if done.returncode != 0:
        tail = (work / f"{system}.log").read_text()[-2000:]
        raise RuntimeError(f"{system} exited {done.returncode}: {tail}")
    result = json.loads((work / system / "result.json").read_text())
    result["wall_s"] = time.perf_counter() - start
    return result


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """Every system's settings, as the plan hands them to its process."""
    needle = {"build_args": args.needle_build_args.split(), "compact_every": args.compact_every,
              "reload_interval": args.reload_interval, "max_queries": 1000, "fresh": not args.no_fresh,
              "retrain": args.retrain}  # fmt: skip
    return {
        "needle": needle,
        "needle-ivfpq": {**needle, "build_args": args.needle_ivfpq_args.split()},
        "faiss-ivfpq": {"factory": f"IVF{{nlist}},PQ{args.dim // 4}x4fsr,RFlat", "nlist": args.faiss_nlist,
                        "nprobe": args.faiss_nprobe, "refine": args.faiss_refine},
        "faiss-ivfflat": {"factory": "IVF{nlist},Flat", "nlist": args.faiss_nlist, "nprobe": args.faiss_nprobe,
                          "refine": 0},
        "hnswlib": {"M": 16, "ef_construction": 200, "ef": 64},
        "diskannpy": {"R": 50, "L": 50, "search_L": 70},
    }  # fmt: skip


def run_book(spec: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One runbook: data, ground truth, every system in turn, their entries and the targets."""
    rng = np.random.default_rng(args.seed)
    book = make_runbook(spec, args, rng)
    data, queries = rb.clustered_data(args.n, args.dim, book["bounds"], args.queries, rng)
    np.save(work / "data.npy", data)
    np.save(work / "queries.npy", queries)
    start = time.perf_counter()
    truth = ground_truth(book["phases"], data, queries, args.k)
    log.info("%s: %d phases, ground truth of %d searches in %.1f s", spec, len(book["phases"]), len(truth),
             time.perf_counter() - start)  # fmt: skip
    capacity = sum(
        s["end"] - s["start"] for p in book["phases"] if p["op"] in ("insert", "replace") for s in p["steps"]
    )
    plan = {"phases": book["phases"], "k": args.k, "capacity": max(1, capacity), "settings": settings(args)}
    (work / "plan.json").write_text(json.dumps(plan))
    systems, skipped = [], {}
    for system in args.systems.split(","):
        extra, why = peer_path(system, args)
        if extra is None:
            skipped[system] = why
            continue
        try:
            result = run_system(system, work, extra)
        except RuntimeError as error:
            log.error("%s", error)
            skipped[system] = f"failed: {str(error)[-500:]}"
            continue
        entry = system_entry(result, work, truth, data, queries, args.k)
        print(json.dumps({"runbook": book["book"]["name"], **entry}), flush=True)
        systems.append(entry)
    return {"runbook": book["book"], "systems": systems, "skipped": skipped, "targets": targets(systems)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runbook", action="append", help="generated | final | PATH[:dataset] (repeat for several)")
    p.add_argument("--n", type=int, default=300_000, help="rows generated (every id range scaled to them)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--clusters", type=int, default=64, help="generated runbook: clusters")
    p.add_argument("--rounds", type=int, default=5, help="generated runbook: rounds (at most 5)")
    p.add_argument("--queries", type=int, default=1000, help="the query set every search step runs")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--max-searches", type=int, default=20, help="search steps kept, evenly spaced (0: all)")
    p.add_argument("--systems", default="needle,needle-ivfpq,faiss-ivfpq,faiss-ivfflat,hnswlib,diskannpy")
    p.add_argument("--needle-build-args", default="", help="needle: extra `needle index build` flags (none)")
    p.add_argument("--needle-ivfpq-args", default="--kind ivfpq", help="needle-ivfpq: its build flags (fresh too)")
    p.add_argument("--compact-every", type=int, default=4, help="needle: compact after this many changes")
    p.add_argument("--reload-interval", type=float, default=0.5, help="needle serve --reload-interval")
    p.add_argument("--retrain", default=None, help="needle index compact --retrain (where the CLI has it)")
    p.add_argument("--no-fresh", action="store_true", help="skip needle's fresh build per search step")
    p.add_argument("--faiss-nlist", type=int, default=1024)
    p.add_argument("--faiss-nprobe", type=int, default=16)
    p.add_argument("--faiss-refine", type=int, default=2)
    p.add_argument("--peers-dir", default=None, help="pip --target of hnswlib, diskannpy")
    p.add_argument("--no-install", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None, help="record the result there (bench/record.py)")
    p.add_argument("--append", action="store_true", help="keep --out's other runbooks' runs, replace this one's")
    p.add_argument("--plot", default=None, help="the recall plot (default: --out with .png)")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes, both runbooks, in seconds")
    args = p.parse_args(argv)
    if args.dry_run:
        # 20k rows of d 32: the smallest at which both first inserts train an IVF-PQ (needle-ivfpq)
        args.n, args.dim, args.clusters, args.queries, args.max_searches = 20_000, 32, 8, 40, 2
        args.faiss_nlist, args.compact_every = 16, 2
    args.runbook = args.runbook or (["generated", "final"] if args.dry_run else ["generated"])
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse(argv)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[name] = "1"
    own = args.workdir is None
    work = Path(args.workdir or tempfile.mkdtemp(prefix="needle-streaming-"))
    args.peers_dir = args.peers_dir or str(work / "peers")
    runs = []
    try:
        for spec in args.runbook:
            folder = work / spec.replace("/", "_").replace(":", "_")
            folder.mkdir(parents=True, exist_ok=True)
            runs.append(run_book(spec, args, folder))
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    record = {"bench": "streaming", "dry_run": args.dry_run, "load_average": list(os.getloadavg()),
              "cpus": os.cpu_count(), "threads_per_system": 1, "runs": runs}  # fmt: skip
    if args.out:
        out = Path(args.out)
        if args.append and out.is_file():
            names = {r["runbook"]["name"] for r in runs}
            runs = [r for r in json.loads(out.read_text())["runs"] if r["runbook"]["name"] not in names] + runs
            record["runs"] = runs
        save_result(record, out)
        record["plot"] = str(plot(runs, Path(args.plot or out.with_suffix(".png"))))
    elif args.plot:
        record["plot"] = str(plot(runs, Path(args.plot)))
    print(json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    main()
