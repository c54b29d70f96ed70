"""A living index under load (issues 43, 56): IVF-PQ in shards, served by ``needle serve``, while rounds of
``needle index add`` and ``needle index delete`` change it, then ``needle index compact``.

Writes synthetic clustered descriptors (one distribution: the base files, each round's added files
and the held-out queries), builds the index (``needle index build --kind ivfpq --shards S``), starts
``needle serve --reload-interval R`` on 127.0.0.1 and a client process that sends a steady stream of
``POST /search`` (vectors, k=100). Then: an idle phase; ``--rounds`` rounds of adding
``--round-rows`` rows (without --wait-for: the time from the command's return to ``/health``
reporting its generation is measured) and deleting as many live keys (with ``--wait-for``: a delete
is visible when the command returns, and from then on no answer may hold a deleted key); a
retrain round (bench/live_retrain.py: ``compact --retrain always`` under the load, an add and a
delete published while it runs, the server's peak RSS through the switch); then
``compact --keep 1``. Between the idle phase and the rounds, as long as the idle phase, one more
process keeps a core busy at the writers' nice and changes nothing (``p99_ratio_busy_core``: on a
2-vCPU box, what any work beside the server and its client costs the answers). Last,
recall@1000 of the served index and of a fresh build over the same live rows against a
brute-force search, and the memory (RSS) of a process that opened each and answered the queries.
Every process runs with ``--threads`` threads (OMP_NUM_THREADS): the build's add rate and the live
add rate are per core alike.

The driver's own work during the rounds (each round's files, the keys it deletes) runs at
``--writer-nice``, as the commands do. Prints JSON lines (one per phase; ``latency_by_span``: p50
and p99 of the answers by what ran when each started) and a last line with ``n``, ``deleted_returned``,
``add_rate_vs_build``, ``visible_after_return_s``, ``p99_ratio_during_changes``,
``recall_gap_vs_fresh`` and ``compact_rss_vs_fresh``.

    python bench/live_index.py --n 1000000 --dim 512 --shards 4 --rounds 5 --round-rows 20000 --out R.json
    python bench/live_index.py --dry-run     # tiny sizes: every step, in about a minute
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from live_load import Load, busy_core, get_json, latency_by_span, wait_generation  # noqa: E402
from live_retrain import RetrainContext, retrain_latency, retrain_round  # noqa: E402

from webapi.packed_vectors import pack_vectors  # noqa: E402

FILE_ROWS = 10_000  # rows per descriptor file (a tar's worth)
REFINE_FACTOR = 2  # the build's default: the served and the fresh recall@1000 are measured with it


def log(record: dict) -> None:
    print(json.dumps(record), flush=True)


def env_for(threads: int) -> dict[str, str]:
    """The commands' environment: ``threads`` for every BLAS/OpenMP pool, bytecode cached as on an
    installed machine (a sandbox's PYTHONDONTWRITEBYTECODE made every command compile our ~50
    modules again: ~0.1 s of CPU each, a twentieth of a 20k-row add)."""
    inherited = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    return {
        **inherited,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "OPENBLAS_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
    }


def needle(args: list[str], threads: int, stdin: str | None = None, nice: int = 0) -> tuple[dict | None, float, float]:
    """Run ``needle ARGS`` (at ``nice``); (its JSON output where it prints one, wall seconds, its
    CPU seconds: user + system, what it took of the cores whatever else ran)."""
    start, used = time.monotonic(), cpu_of_children()
    done = subprocess.run(
        ["nice", "-n", str(nice), sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=env_for(threads),
        input=stdin, capture_output=True, text=True,
    )  # fmt: skip
    seconds, cpu = time.monotonic() - start, cpu_of_children() - used
    if done.returncode != 0:
        raise RuntimeError(f"needle {' '.join(args[:2])} failed ({done.returncode}): {done.stderr[-3000:]}")
    out = done.stdout.strip()
    return (json.loads(out) if out.startswith("{") else None), seconds, cpu


def cpu_of_children() -> float:
    """User + system seconds of this process's finished children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def make_vectors(n: int, d: int, seed: int, clusters: int) -> np.ndarray:
    """``n`` unit vectors around ``clusters`` fixed centres (the same centres for every seed)."""
    centres = np.random.default_rng(12345).normal(size=(clusters, d)).astype(np.float32)
    rng = np.random.default_rng(seed)
    x = centres[rng.integers(0, clusters, n)] + 0.6 * rng.normal(size=(n, d)).astype(np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)


def write_files(directory: Path, first_id: int, vectors: np.ndarray) -> list[str]:
    """Descriptor files of FILE_ROWS rows from Parquet shard id ``first_id`` on; returns the keys."""
    from tests.support.index import write_descriptor_file

    keys = []
    for start in range(0, len(vectors), FILE_ROWS):
        shard_id = first_id + start // FILE_ROWS
        block = vectors[start : start + FILE_ROWS]
        names = [f"f{shard_id:06d}/{i:05d}" for i in range(len(block))]
        write_descriptor_file(directory, f"f{shard_id:06d}", shard_id, block, names)
        keys.extend(names)
    return keys


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory_of(index: Path, queries: Path, threads: int) -> dict:
    """RSS of a fresh process that opened ``index`` and answered ``queries`` at k=1000."""
    code = (
        "import json, sys, numpy as np; from index.search import load_index; from index.memory import process_memory;"
        f"i = load_index({str(index)!r}); xq = np.load({str(queries)!r}).astype(np.float32);"
        "i.search(xq, 1000); m = process_memory(); print(json.dumps({'rss': m.get('rss', 0)}))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env_for(threads), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def recall(found: list[list[str | None]], truth: list[list[str]]) -> float:
    return float(np.mean([len(set(f) & set(t)) / len(t) for f, t in zip(found, truth)]))


def brute_force_keys(vectors: dict[str, np.ndarray], xq: np.ndarray, k: int) -> list[list[str]]:
    keys = sorted(vectors)
    scores = np.zeros((len(xq), len(keys)), np.float32)
    for start in range(0, len(keys), 100_000):
        block = np.stack([vectors[key] for key in keys[start : start + 100_000]]).astype(np.float32)
        scores[:, start : start + len(block)] = xq @ block.T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return [[keys[i] for i in row] for row in order]


@dataclass
class Changes:
    """What the rounds measured: rates per round, when each change became visible, and the
    windows of the load (time.monotonic, one clock for every process)."""

    add_rates: list[float] = field(default_factory=list)  # rows per wall second of each add
    add_cpu_rates: list[float] = field(default_factory=list)  # rows per CPU second of each add command
    phase_rates: list[float] = field(default_factory=list)  # rows per CPU second of each add's add phase
    visible: list[float] = field(default_factory=list)  # seconds from each add's return to its generation served
    delete_visible: list[tuple[float, set[str]]] = field(default_factory=list)  # (returned at, keys) per delete
    spans: list[tuple[str, float, float]] = field(default_factory=list)  # (what ran, start, end)
    windows: dict[str, float] = field(default_factory=dict)  # idle/busy/changes start and end


def run(args: argparse.Namespace) -> dict:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="needle-live-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    live, xq, build_rate = prepare(args, work)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve_cmd = [sys.executable, "-m", "cli.main", "serve", "--index", str(work / "index"), "--port", str(port),
                 "--reload-interval", str(args.reload_interval), "--max-k-total", "100000",
                 "--max-rescored", "10000000"]  # fmt: skip
    server = subprocess.Popen(serve_cmd, cwd=ROOT, env=env_for(args.threads), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_generation(url, 0, timeout=300)
        load = Load(url, work / "queries.npy", 100, work / "load.json")
        load.start()
        changes = change_rounds(args, work, url, live)
        retrain, retrain_window = retrain_round(retrain_context(args, work, url, live, changes), server.pid)
        log({"phase": "retrain", **retrain})
        change, compact_s, _ = needle(["index", "compact", "--index", str(work / "index"), "--keep", "1", "--wait-for",
                                    url], args.threads)  # fmt: skip
        time.sleep(1.0)
        load.finish()
        log({"phase": "compact", "seconds": round(compact_s, 1), "generation": change["generation"]})
        w = changes.windows
        retrain.update(retrain_latency(load, retrain_window, (w["idle_start"], w["idle_end"])))
        log({"phase": "latency_by_span", **latency_by_span(load, changes.spans, w["idle_end"], w["changes_end"])})
        # at the fresh build's settings (a retrain chose its own defaults for the recall target: recorded)
        body = {"vectors": pack_vectors(xq), "k": 1000, "nprobe": args.nprobe, "refine_factor": REFINE_FACTOR}
        search = get_json(f"{url}/search", body, timeout=600)
        served = [[r["key"] for r in q["results"]] for q in search]
    finally:
        server.terminate()
        server.wait(60)
    record = {
        **{name: getattr(args, name) for name in ("n", "dim", "shards", "rounds", "round_rows", "threads")},
        "live_rows": len(live),
        "queries_during_run": len(load.records),
        "query_errors": load.errors,
        "deleted_returned": deleted_returned(load, changes.delete_visible),
        **rate_figures(changes, build_rate, args.writer_nice),
        "visible_after_return_s": round(max(changes.visible), 3),
        "reload_interval_s": args.reload_interval,
        **latency_figures(load, changes.windows, args.idle_s),
        **against_fresh(args, work, live, xq, served),
        "nprobe": args.nprobe,
        "retrain": retrain,
    }
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return record


def retrain_context(
    args: argparse.Namespace, work: Path, url: str, live: dict[str, np.ndarray], changes: Changes
) -> RetrainContext:
    rounds_files = args.rounds * ((args.round_rows + FILE_ROWS - 1) // FILE_ROWS)
    return RetrainContext(
        args, work, url, live, args.n // FILE_ROWS + 1 + rounds_files, changes.delete_visible, env_for(args.threads),
        lambda command, stdin=None: needle(command, args.threads, stdin=stdin, nice=args.writer_nice),
        make_vectors, write_files, get_json,
    )  # fmt: skip


def prepare(args: argparse.Namespace, work: Path) -> tuple[dict[str, np.ndarray], np.ndarray, float]:
    """The base descriptors, the queries and the build: (key -> vector of every live row, the
    queries, the build's add rate in rows per second of its add phase)."""
    base = make_vectors(args.n, args.dim, 1, args.clusters)
    base_keys = write_files(work / "desc", 0, base)
    live = dict(zip(base_keys, base))
    del base
    xq = make_vectors(args.queries, args.dim, 2, args.clusters).astype(np.float32)
    np.save(work / "queries.npy", xq)
    log({"phase": "descriptors", "n": args.n, "dim": args.dim, "files": len(base_keys) // FILE_ROWS + 1})
    build_args = ["index", "build", "--descriptors", str(work / "desc"), "--out", str(work / "index"),
                  "--kind", "ivfpq", "--shards", str(args.shards), "--nprobe", str(args.nprobe),
                  "--recall-target", "0"]  # fmt: skip
    _, build_s, _ = needle(build_args, args.threads)
    infos = json.loads((work / "index" / "index_infos.json").read_text())
    build_rate = infos["ntotal"] / infos["timings"]["add_s"]
    log(
        {
            "phase": "build",
            "seconds": round(build_s, 1),
            "factory": infos["factory"],
            "add_rows_per_s": round(build_rate),
        }
    )
    return live, xq, build_rate


def change_rounds(args: argparse.Namespace, work: Path, url: str, live: dict[str, np.ndarray]) -> Changes:
    """The idle window, the busy-core window, then ``args.rounds`` rounds of an add (its generation
    awaited on ``/health``) and a delete ``--wait-for`` the server; ``live`` follows the changes."""
    rng = np.random.default_rng(0)
    out = Changes()
    # from here the driver's own work (each round's files, choosing the keys to delete) stands for
    # the world outside the server, as the writers do: at their nice (the client process keeps 0)
    os.nice(args.writer_nice)
    idle_start = time.monotonic()
    time.sleep(args.idle_s)
    idle_end = time.monotonic()
    busy_start, busy_end = busy_core(args.idle_s, args.writer_nice)
    idle_end = max(idle_end, busy_start)  # the changes' window starts after the busy core's
    next_id = args.n // FILE_ROWS + 1  # past the base files' Parquet shard ids
    index = str(work / "index")
    for round_number in range(args.rounds):
        new = make_vectors(args.round_rows, args.dim, 100 + round_number, args.clusters)
        shutil.rmtree(work / "round", ignore_errors=True)
        new_keys = write_files(work / "round", next_id, new)
        next_id += (args.round_rows + FILE_ROWS - 1) // FILE_ROWS
        started = time.monotonic()
        change, seconds, cpu = needle(["index", "add", "--index", index, "--descriptors", str(work / "round")],
                                      args.threads, nice=args.writer_nice)  # fmt: skip
        returned = time.monotonic()
        out.visible.append(wait_generation(url, change["generation"]) - returned)
        out.spans += [("add", started, returned), ("add_to_visible", returned, returned + out.visible[-1])]
        out.add_rates.append(args.round_rows / seconds)
        out.add_cpu_rates.append(args.round_rows / cpu)
        out.phase_rates.append(args.round_rows / max(change["timings"]["add_cpu_s"], 1e-6))
        live.update(zip(new_keys, new))
        doomed = [str(k) for k in rng.choice(sorted(live), args.round_rows, replace=False)]
        started = time.monotonic()
        change, _, _ = needle(["index", "delete", "--index", index, "--keys", "-", "--wait-for", url], args.threads,
                              stdin="\n".join(doomed) + "\n", nice=args.writer_nice)  # fmt: skip
        out.delete_visible.append((time.monotonic(), set(doomed)))
        out.spans.append(("delete_until_visible", started, out.delete_visible[-1][0]))
        for key in doomed:
            del live[key]
        log({"phase": "round", "round": round_number, "add_s": round(seconds, 2),
             "add_rows_per_s": round(out.add_rates[-1]), "add_rows_per_cpu_s": round(out.add_cpu_rates[-1]),
             "visible_after_return_s": round(out.visible[-1], 3), "deleted": change["deleted"]})  # fmt: skip
    out.windows = {"idle_start": idle_start, "idle_end": idle_end, "busy_start": busy_start, "busy_end": busy_end,
                   "changes_end": time.monotonic()}  # fmt: skip
    return out


def deleted_returned(load: Load, delete_visible: list[tuple[float, set[str]]]) -> int:
    """Deleted keys in the answers that started after their delete returned (with --wait-for: visible)."""
    gone_by: list[set[str]] = []  # the keys deleted by the end of each delete, cumulated
    for _, keys in delete_visible:
        gone_by.append((gone_by[-1] if gone_by else set()) | keys)
    times = [at for at, _ in delete_visible]
    count = 0
    for started, _, keys in load.records:
        done = bisect.bisect_right(times, started)  # deletes that had returned when it started
        if done:
            count += len(gone_by[done - 1].intersection(keys))
    return count


def rate_figures(changes: Changes, build_rate: float, writer_nice: int) -> dict:
    """The add rates against the build's add phase (rows per second on one thread, alone)."""
    median = {name: float(np.median(getattr(changes, name))) for name in ("add_rates", "add_cpu_rates", "phase_rates")}
    return {
        "build_add_rows_per_s": round(build_rate),
        "live_add_rows_per_s": round(median["add_rates"]),
        "live_add_rows_per_cpu_s": round(median["add_cpu_rates"]),
        # per core: the add command's rows per CPU second (its whole process: start, key checks,
        # encoding, files, drift) against the build's add phase on one thread, alone on the machine
        "add_rate_vs_build": round(median["add_cpu_rates"] / build_rate, 3),
        # the add phase alone (reading, encoding, writing the segment: the command's timings.add_cpu_s)
        # against the build's, like for like: what the command's fixed work (start, imports, key
        # checks, drift report, publishing) leaves out
        "add_phase_rate_vs_build": round(median["phase_rates"] / build_rate, 3),
        # per wall second, while sharing the cores with the loaded server
        "add_rate_vs_build_wall": round(median["add_rates"] / build_rate, 3),
        "writer_nice": writer_nice,  # the add/delete commands' and, during the rounds, the driver's
    }


def latency_figures(load: Load, windows: dict[str, float], idle_s: float) -> dict:
    """p50/p99 (ms) idle, with one more core busy and no change, and during the rounds."""
    idle = load.latencies(windows["idle_start"], windows["idle_start"] + idle_s)
    busy = load.latencies(windows["busy_start"], windows["busy_end"])
    during = load.latencies(windows["busy_end"], windows["changes_end"])

    def ms(seconds: np.ndarray, q: int) -> float:
        return round(float(np.percentile(seconds, q)) * 1000, 2)

    return {
        "p50_idle_ms": ms(idle, 50),
        "p99_idle_ms": ms(idle, 99),
        "p50_during_changes_ms": ms(during, 50),
        "p99_during_changes_ms": ms(during, 99),
        "p99_ratio_during_changes": round(float(np.percentile(during, 99) / np.percentile(idle, 99)), 3),
        # no change, one process busy at the writers' nice: what any work beside the server costs it
        # on this box, the floor of the ratio above (2 vCPUs: the server, its client and one more)
        "p50_busy_core_ms": ms(busy, 50),
        "p99_busy_core_ms": ms(busy, 99),
        "p99_ratio_busy_core": round(float(np.percentile(busy, 99) / np.percentile(idle, 99)), 3),
    }


def against_fresh(
    args: argparse.Namespace, work: Path, live: dict[str, np.ndarray], xq: np.ndarray, served: list[list[str]]
) -> dict:
    """Recall@1000 of the served answers and of a fresh build over the same live rows (against
    brute force), and the RSS of a process that opened each and answered the queries."""
    from index.search import load_index
    from tests.support.index import write_descriptor_file

    truth = brute_force_keys(live, xq, 1000)
    fresh_keys = sorted(live)
    fresh_vectors = np.stack([live[k] for k in fresh_keys])
    shutil.rmtree(work / "fresh_desc", ignore_errors=True)
    for number, start in enumerate(range(0, len(fresh_keys), FILE_ROWS)):
        write_descriptor_file(work / "fresh_desc", f"g{number:06d}", number, fresh_vectors[start : start + FILE_ROWS],
                   fresh_keys[start : start + FILE_ROWS])  # fmt: skip
    needle(["index", "build", "--descriptors", str(work / "fresh_desc"), "--out", str(work / "fresh"),
            "--kind", "ivfpq", "--shards", str(args.shards), "--nprobe", str(args.nprobe),
            "--recall-target", "0"], args.threads)  # fmt: skip
    fresh = load_index(work / "fresh")
    _, I = fresh.search(xq, 1000, args.nprobe, True, REFINE_FACTOR)
    recall_fresh, recall_served = recall(fresh.keys_of(I), truth), recall(served, truth)
    rss_live = memory_of(work / "index", work / "queries.npy", args.threads)["rss"]
    rss_fresh = memory_of(work / "fresh", work / "queries.npy", args.threads)["rss"]
    return {
        "recall_at_1000_served": round(recall_served, 4),
        "recall_at_1000_fresh": round(recall_fresh, 4),
        "recall_gap_vs_fresh": round(recall_fresh - recall_served, 4),
        "compact_rss_bytes": rss_live,
        "fresh_rss_bytes": rss_fresh,
        "compact_rss_vs_fresh": round(rss_live / rss_fresh, 3),
    }


def bench_parser(doc: str | None, n: int) -> argparse.ArgumentParser:
    """The flags the living-index benches share: the synthetic rows and queries, the index, the
    threads, where the data and the last record go, and ``--dry-run``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=n, help="rows of the first build")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--nprobe", type=int, default=64)
    parser.add_argument("--clusters", type=int, default=1000)
    parser.add_argument("--queries", type=int, default=100, help="held-out queries")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads of every process")
    parser.add_argument("--workdir", help="keep the data and indexes here (default: a temporary directory)")
    parser.add_argument("--out", help="also write the last record to this JSON file")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes: every step, quickly")
    return parser


def run_bench(args: argparse.Namespace, run: Any) -> None:
    """``run(args)`` with this process's threads and BLAS kernels those of ``needle`` (core/blas.py:
    set before FAISS loads here), its record printed last and saved to ``--out`` (bench/record.py:
    the run it replaces is appended to the benchmark's history)."""
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from core.blas import choose_openblas_core

    choose_openblas_core()
    record = run(args)
    if args.out:
        from record import save_result  # the run it replaces goes to the benchmark's history

        save_result(record, args.out)
    log(record)


def main() -> None:
    parser = bench_parser(__doc__, 1_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-rows", type=int, default=20_000, help="rows added, then deleted, per round")
    parser.add_argument("--reload-interval", type=float, default=2.0)
    parser.add_argument(
        "--writer-nice", type=int, default=0, help="nice of the writers, and of this driver once the load runs"
    )
    parser.add_argument("--idle-s", type=float, default=20.0, help="seconds of load before any change")
    args = parser.parse_args()
    if args.dry_run:
        args.n, args.dim, args.shards, args.rounds, args.round_rows = 24_000, 32, 2, 2, 2_000
        args.queries, args.clusters, args.nprobe, args.idle_s, args.reload_interval = 10, 50, 8, 2.0, 0.5
    run_bench(args, run)


if __name__ == "__main__":
    main()
