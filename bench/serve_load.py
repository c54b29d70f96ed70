"""Load on the ``needle serve`` app: uvicorn on 127.0.0.1, N concurrent clients against 1.

Builds a small synthetic IVF-PQ index in a temporary directory (or takes ``--index DIR``), starts
the app (webapi.webapp) with uvicorn on an ephemeral port of 127.0.0.1 in this process, and sends
a fixed number of ``POST /search`` requests, half by stored key and half by vector, first from
``--concurrency`` client threads (one keep-alive httpx client each, in a separate process), then
from one. Prints one JSON
line last: requests/s, p50/p99 latency (ms) and errors of each run, and their throughput ratio.

    python bench/serve_load.py [--index DIR] [--requests 400] [--concurrency 8] [--k 10]

``--mixed``: the server as ``needle serve`` runs it (webapi.connections' protocol, the default
webapi.limits.ServiceLimits), loaded for ``--duration`` s by ``--clients`` client threads of which
``--bad-fraction`` send only bad requests (malformed or out-of-range fields, JSON nested 100,000
deep, too many keys, a 400-megapixel PNG header, non-image bytes, a foreign Host or Origin, a
text/plain body, 700k JSON objects, 320k rows to re-score, a JPEG of 200 scans, a TIFF), the
others key and vector queries whose answers were recorded one by one before the load.
``--slowloris N`` adds N connections that trickle header lines throughout; ``--non-readers N``
N connections that pipeline 8 searches of ~1 MB answers each and never read (reopened when the
server closes them); ``--pipelined N`` N clients that pipeline oversized headers behind a
search, one connection after another (each must be closed). Prints one JSON line: requests/s,
p50/p99 of the good and the bad requests, status counts by class, answers that changed (must be
0), bad requests answered 5xx (must be 0), each hostile kind's connections (opened, closed by the
server, left open), and the server's open files (at most, and after).

    python bench/serve_load.py --mixed [--duration 30] [--clients 50] [--bad-fraction 0.2] [--slowloris 300]
        [--non-readers 20] [--pipelined 4]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.remove(str(ROOT / "bench")) if str(ROOT / "bench") in sys.path else None  # bench/rerank.py is no package


def bench_module(name: str):
    """A module of bench/ by its path (bench/ is no package, and its directory is off sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hostile_clients = bench_module("hostile_clients")  # at import: the spawned client process needs it too


def build_index(work: Path, n: int, d: int, parts: int = 4) -> Path:
    import importlib.util

    from index.build.stage import IndexConfig, main

    spec = importlib.util.spec_from_file_location("index_scale", ROOT / "bench" / "index_scale.py")
    index_scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(index_scale)
    synthetic_block, write_part = index_scale.synthetic_block, index_scale.write_part

    centers = np.random.default_rng(0).standard_normal((64, d)).astype(np.float32)
    for s in range(parts):
        write_part(work / "desc", s, synthetic_block(1 + s, n // parts, d, centers, 0.6))
    conf = IndexConfig(kind="ivfpq", nlist=64, pq_bytes=min(32, d // 4), points_per_list=64, nprobe=8, refine_factor=2)
    main(conf, work / "desc", work / "index")
    return work / "index"


def start_server(app, limits=None):
    """uvicorn on an ephemeral port of 127.0.0.1 in a thread; with ``limits`` (ServiceLimits) the
    connection bounds ``needle serve`` runs with (webapi.connections)."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = {"host": "127.0.0.1", "port": port, "log_level": "warning", "access_log": False}
    if limits is not None:
        from webapi.connections import uvicorn_config

        config = uvicorn_config(app, limits=limits, **options)
    else:
        config = uvicorn.Config(app, **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


def run_threads(threads: list[threading.Thread]) -> float:
    """Start every client thread, wait for all: the wall seconds they took together."""
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def run_load(url: str, bodies: list[dict], concurrency: int) -> dict:
    import httpx

    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    next_request = [0]

    def client() -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            while True:
                with lock:
                    i = next_request[0]
                    next_request[0] += 1
                if i >= len(bodies):
                    return
                t0 = time.perf_counter()
                try:
                    ok = http.post("/search", json=bodies[i]).status_code == 200
                except httpx.HTTPError:
                    ok = False
                dt = time.perf_counter() - t0
                with lock:
                    latencies.append(dt)
                    errors[0] += not ok

    wall = run_threads([threading.Thread(target=client) for _ in range(concurrency)])
    ms = np.asarray(latencies) * 1000
    return {
        "concurrency": concurrency,
        "requests": len(bodies),
        "errors": errors[0],
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(bodies) / wall, 1),
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
    }


# --- --mixed: good and bad clients, and slow ones ------------------------------------------------


def client_loop(url: str, jobs: list, expected: list | None, until: float, offset: int, out: dict) -> None:
    """Send ``jobs`` round-robin until ``until``: (kind, path, headers, body); with ``expected`` the
    answers of good ones are compared with it."""
    import httpx

    i = offset
    with httpx.Client(base_url=url, timeout=60) as http:
        while time.monotonic() < until:
            kind, path, headers, body = jobs[i % len(jobs)]
            t0 = time.perf_counter()
            try:
                response = http.post(path, content=body, headers=headers)
                status = response.status_code
            except httpx.HTTPError:
                status = 0
            out["ms"].append((time.perf_counter() - t0) * 1000)
            out["status"].append((kind, status))
            if expected is not None and status == 200 and response.json() != expected[i % len(jobs)]:
                out["changed"] += 1
            i += 1


def run_mixed(
    url: str, goods: list, expected: list, bads: list, clients: int, n_bad: int, duration: float, hostile: dict
):
    """The --mixed load (in the clients' process): good and bad client threads, the slowloris,
    clients that never read, and pipelined oversized headers (``hostile``: counts and requests)."""
    until = time.monotonic() + duration
    port = int(url.rsplit(":", 1)[1])
    good = {"ms": [], "status": [], "changed": 0}
    bad = {"ms": [], "status": [], "changed": 0}
    threads = [
        threading.Thread(target=client_loop, args=(url, bads, None, until, c, bad))
        if c < n_bad
        else threading.Thread(target=client_loop, args=(url, goods, expected, until, c * 7, good))
        for c in range(clients)
    ]
    stop = threading.Event()
    tallies = {name: {"opened": 0, "closed_by_server": 0, "refused": 0, "left_open": 0} for name in hostile}
    runs = {
        "slowloris": lambda n: (hostile_clients.trickle, (port, n, stop, tallies["slowloris"])),
        "non_readers": lambda n: (
            hostile_clients.non_readers,
            (port, n, hostile["non_reader_requests"], stop, tallies["non_readers"]),
        ),
    }
    others = [
        threading.Thread(target=target, args=args)
        for name, count in hostile.items()
        if name in runs and count
        for target, args in [runs[name](count)]
    ]
    for _ in range(hostile.get("pipelined", 0)):
        request = hostile["pipelined_request"]
        others.append(
            threading.Thread(
                target=hostile_clients.pipelined_big_headers, args=(port, request, stop, tallies["pipelined"])
            )
        )
    for thread in others:
        thread.start()
    wall = run_threads(threads)
    stop.set()
    for thread in others:
        thread.join(15)
    counts = {
        name: {"connections": hostile[name], **tallies[name]} for name in ("slowloris", "non_readers", "pipelined")
    }
    return {"wall_s": wall, "good": good, "bad": bad, **counts}


def summary(part: dict, wall: float) -> dict:
    ms = np.asarray(part["ms"] or [0.0])
    classes: dict[str, int] = {}
    for _, status in part["status"]:
        name = f"{status // 100}xx" if status else "failed"
        classes[name] = classes.get(name, 0) + 1
    return {
        "requests": len(part["ms"]),
        "requests_per_s": round(len(part["ms"]) / wall, 1),
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
        "status": dict(sorted(classes.items())),
    }


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def mixed_record(out: dict, meta: dict, samples: list[int], limits) -> dict:
    """The --mixed run's JSON line: throughput, latencies, status classes, the two invariants."""
    import dataclasses

    wall = out["wall_s"]
    statuses = out["good"]["status"] + out["bad"]["status"]
    by_kind: dict[str, dict[int, int]] = {}
    for kind, status in out["bad"]["status"]:
        by_kind.setdefault(kind, {}).setdefault(status, 0)
        by_kind[kind][status] += 1
    return {
        "bench": "serve_load_mixed",
        **meta,
        "duration_s": round(wall, 1),
        "requests": len(statuses),
        "requests_per_s": round(len(statuses) / wall, 1),
        "good": summary(out["good"], wall),
        "bad": {**summary(out["bad"], wall), "by_kind": by_kind},
        "answers_changed": out["good"]["changed"],  # must be 0
        "good_not_200": sum(status != 200 for _, status in out["good"]["status"]),
        # load shed: 503 with Retry-After past --max-inflight and --max-queue (bad requests too are
        # checked only once they hold a slot), counted apart from faults
        "shed_503": {part: sum(status == 503 for _, status in out[part]["status"]) for part in ("good", "bad")},
        "bad_5xx": sum((status >= 500 and status != 503) or status == 0 for _, status in out["bad"]["status"]),  # 0
        "slowloris": out["slowloris"],
        "non_readers": out["non_readers"],  # connections that never read their pipelined answers
        "pipelined": out["pipelined"],  # oversized headers pipelined behind a search: each closed
        "server_open_files": {"before": samples[0], "max": max(samples), "after": samples[-1]},
        "limits": dataclasses.asdict(limits),
    }


def mixed_main(args: argparse.Namespace) -> None:
    """The --mixed run: the answers recorded one by one, then the load, then one JSON line."""
    import multiprocessing

    from index.search import load_index
    from webapi.limits import ServiceLimits
    from webapi.query_service import QueryService
    from webapi.webapp import create_app

    with tempfile.TemporaryDirectory(prefix="needle-serve-load-") as tmp:
        path = Path(args.index) if args.index else build_index(Path(tmp), args.n, args.d)
        index = load_index(path)
        keys = index.ids["key"].to_pylist()
        picks = np.random.default_rng(0).choice(len(keys), 200, replace=len(keys) < 200)
        js = {"Content-Type": "application/json"}
        goods = [
            ("key", "/search", js, json.dumps({"keys": [keys[p]], "k": args.k}).encode())
            if i % 2 == 0
            else ("vector", "/search", js, json.dumps({"vectors": [index.vectors[p].tolist()], "k": args.k}).encode())
            for i, p in enumerate(picks)
        ]
        limits = ServiceLimits()
        server, thread, url = start_server(create_app(QueryService(index, limits=limits)), limits)
        samples, done = [open_files()], threading.Event()

        def sample() -> None:
            while not done.wait(0.25):
                samples.append(open_files())

        sampler = threading.Thread(target=sample, daemon=True)
        try:
            import httpx

            with httpx.Client(base_url=url, timeout=60) as http:  # the answers, one request at a time
                expected = [http.post(path_, content=body, headers=h).json() for _, path_, h, body in goods]
            n_bad = round(args.clients * args.bad_fraction)
            bads = hostile_clients.bad_requests(keys[0], index.d)
            sampler.start()
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                hostile = {
                    "slowloris": args.slowloris,
                    "non_readers": args.non_readers,
                    # 8 searches of 10 keys x k=1000 (within --max-k-total): ~5 MB of answers per connection
                    "non_reader_requests": hostile_clients.search_bytes({"keys": keys[:10], "k": 1000}) * 8,
                    "pipelined": args.pipelined,
                    "pipelined_request": hostile_clients.search_bytes({"keys": [keys[0]], "k": args.k}),
                }
                load = (url, goods, expected, bads, args.clients, n_bad, args.duration, hostile)
                out = pool.apply(run_mixed, load)
            time.sleep(limits.header_timeout + 1)  # the slowloris connections the server has not closed yet
            samples.append(open_files())
        finally:
            done.set()
            server.should_exit = True
            thread.join(10)
    meta = {
        "index": str(args.index or f"synthetic ivfpq n={args.n} d={args.d}"),
        "ntotal": index.ntotal,
        "cpus": os.cpu_count(),
        "clients": args.clients,
        "bad_clients": n_bad,
    }
    record = mixed_record(out, meta, samples, limits)
    print(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mixed", action="store_true", help="good and bad clients for --duration s (see above)")
    parser.add_argument("--duration", type=float, default=30.0, help="--mixed: seconds of load")
    parser.add_argument("--clients", type=int, default=50, help="--mixed: client threads")
    parser.add_argument(
        "--bad-fraction", type=float, default=0.2, help="--mixed: share of clients sending bad requests"
    )
    parser.add_argument("--slowloris", type=int, default=0, help="--mixed: connections trickling headers meanwhile")
    parser.add_argument(
        "--non-readers", type=int, default=0, help="--mixed: connections pipelining searches and never reading"
    )
    parser.add_argument(
        "--pipelined", type=int, default=0, help="--mixed: clients pipelining oversized headers behind a search"
    )
    parser.add_argument("--index", help="index directory (default: a synthetic one in a temporary directory)")
    parser.add_argument("--n", type=int, default=20000, help="synthetic index: vectors")
    parser.add_argument("--d", type=int, default=128, help="synthetic index: dimension")
    parser.add_argument("--requests", type=int, default=400, help="requests per run")
    parser.add_argument("--concurrency", type=int, default=8, help="client threads of the concurrent run")
    parser.add_argument("--k", type=int, default=10)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.mixed:
        mixed_main(args)
    else:
        throughput_main(args)


def throughput_main(args: argparse.Namespace) -> None:
    """The concurrent run against the single-client one (the default)."""
    from index.search import load_index
    from webapi.query_service import QueryService
    from webapi.webapp import create_app

    with tempfile.TemporaryDirectory(prefix="needle-serve-load-") as tmp:
        t0 = time.perf_counter()
        path = Path(args.index) if args.index else build_index(Path(tmp), args.n, args.d)
        build_s = time.perf_counter() - t0
        index = load_index(path)
        rng = np.random.default_rng(0)
        keys = index.ids["key"].to_pylist()
        picks = rng.choice(len(keys), args.requests, replace=len(keys) < args.requests)
        bodies = [
            {"keys": [keys[p]], "k": args.k}
            if i % 2 == 0
            else {"vectors": [np.asarray(index.vectors[p], np.float32).tolist()], "k": args.k}
            for i, p in enumerate(picks)
        ]
        server, thread, url = start_server(create_app(QueryService(index)))
        # The clients run in their own process: client threads in the server's process would compete
        # with its request threads for the GIL and measure that contention instead of the server.
        import multiprocessing

        try:
            with multiprocessing.get_context("spawn").Pool(1) as clients:
                clients.apply(run_load, (url, bodies[: max(1, args.concurrency * 2)], args.concurrency))  # warm-up
                concurrent = clients.apply(run_load, (url, bodies, args.concurrency))
                single = clients.apply(run_load, (url, bodies, 1))
        finally:
            server.should_exit = True
            thread.join(10)
    print(
        json.dumps(
            {
                "bench": "serve_load",
                "index": str(args.index or f"synthetic ivfpq n={args.n} d={args.d}"),
                "ntotal": index.ntotal,
                "build_s": round(build_s, 2),
                "cpus": os.cpu_count(),
                "queries": "half key, half vector",
                "concurrent": concurrent,
                "single": single,
                "throughput_ratio": round(concurrent["requests_per_s"] / single["requests_per_s"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
