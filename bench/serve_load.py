"""Load on the ``needle serve`` app: uvicorn on 127.0.0.1, N concurrent clients against 1.

Builds a small synthetic IVF-PQ index in a temporary directory (or takes ``--index DIR``), starts
the app (webapi.webapp) with uvicorn on an ephemeral port of 127.0.0.1 in this process, and sends
a fixed number of ``POST /search`` requests, half by stored key and half by vector, first from
``--concurrency`` client threads (one keep-alive httpx client each, in a separate process), then
from one. Prints one JSON
line last: requests/s, p50/p99 latency (ms) and errors of each run, and their throughput ratio.

    python bench/serve_load.py [--index DIR] [--requests 400] [--concurrency 8] [--k 10]
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


def build_index(work: Path, n: int, d: int, parts: int = 4) -> Path:
    import importlib.util

    from index.build import IndexConfig, main

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


def start_server(app):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


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

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", help="index directory (default: a synthetic one in a temporary directory)")
    parser.add_argument("--n", type=int, default=20000, help="synthetic index: vectors")
    parser.add_argument("--d", type=int, default=128, help="synthetic index: dimension")
    parser.add_argument("--requests", type=int, default=400, help="requests per run")
    parser.add_argument("--concurrency", type=int, default=8, help="client threads of the concurrent run")
    parser.add_argument("--k", type=int, default=10)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

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
