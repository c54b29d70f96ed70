"""The served side of bench/live_index.py: a steady query load from a client process, its
answers' latencies by what ran when each started, one more busy core as a control, and waiting
for the server to serve a generation (``/health``)."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np


def get_json(url: str, body: dict | None = None, timeout: float = 60) -> dict | list:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


def send_queries(url: str, queries: str, k: int, stop: Any, out: str) -> None:
    """The client process: one query at a time until ``stop`` is set, then every answer's
    (start, seconds, keys) and the error count to ``out`` (JSON)."""
    xq = np.load(queries)
    records: list[tuple[float, float, list[str]]] = []
    errors, i = 0, 0
    while not stop.is_set():
        body = {"vectors": [xq[i % len(xq)].tolist()], "k": k}
        start = time.monotonic()
        try:
            answer = get_json(f"{url}/search", body)
            records.append((start, time.monotonic() - start, [r["key"] for r in answer[0]["results"]]))
        except (OSError, urllib.error.HTTPError, ValueError):
            errors += 1
        i += 1
    Path(out).write_text(json.dumps({"records": records, "errors": errors}))


class Load:
    """A steady query load from a client in its own process (``send_queries``).

    Not a thread of this driver: the driver's own work between commands (writing the round's files,
    choosing the keys to delete among a million) holds its GIL for up to a second at a time, and a
    client thread waiting for it would count that wait as the server's latency."""

    def __init__(self, url: str, queries: Path, k: int, out: Path):
        context = multiprocessing.get_context("spawn")
        self.out = out
        self.stop = context.Event()
        self.process = context.Process(
            target=send_queries, args=(url, str(queries), k, self.stop, str(out)), daemon=True
        )
        self.records: list[tuple[float, float, list[str]]] = []  # (start, seconds, keys), after finish()
        self.errors = 0

    def start(self) -> None:
        self.process.start()

    def finish(self, timeout: float = 120) -> None:
        self.stop.set()
        self.process.join(timeout)
        if self.process.exitcode != 0:
            raise RuntimeError(f"the query load process ended with {self.process.exitcode}")
        done = json.loads(self.out.read_text())
        self.records, self.errors = [tuple(r) for r in done["records"]], done["errors"]

    def latencies(self, since: float, until: float) -> np.ndarray:
        """Seconds of the answers started in [since, until) (time.monotonic: one clock for every process)."""
        return np.array([s for t, s, _ in self.records if since <= t < until])


def latency_by_span(load: Load, spans: list[tuple[str, float, float]], since: float, until: float) -> dict:
    """p50/p99 (ms) of the answers started in [since, until), by what ran when each started: a
    writer command (``add``; ``delete_until_visible``, which waits for the server's switch), the
    wait from an add's return to its generation served, or nothing but the driver (``no_writer``)."""
    kinds: dict[str, list[float]] = {}
    for start, seconds, _ in load.records:
        if since <= start < until:
            kind = next((name for name, a, b in spans if a <= start < b), "no_writer")
            kinds.setdefault(kind, []).append(seconds)
    return {
        kind: {"queries": len(v), "p50_ms": round(float(np.percentile(v, 50)) * 1000, 2),
               "p99_ms": round(float(np.percentile(v, 99)) * 1000, 2)}
        for kind, v in sorted(kinds.items())
    }  # fmt: skip


def busy_core(seconds: float, nice: int) -> tuple[float, float]:
    """Keep one more core busy (a Python loop at ``nice``) for ``seconds``, no change made; the
    window's (start, end) on the load's clock."""
    loop = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    burner = subprocess.Popen(["nice", "-n", str(nice), sys.executable, "-c", loop])
    time.sleep(0.5)  # started
    start = time.monotonic()
    burner.wait()
    return start, time.monotonic()


def wait_generation(url: str, generation: int, timeout: float = 600) -> float:
    """Monotonic time at which the server first reports ``generation`` (polled every 20 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if get_json(f"{url}/health", timeout=5)["generation"] >= generation:
                return time.monotonic()
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise TimeoutError(f"{url} did not serve generation {generation} in {timeout} s")
