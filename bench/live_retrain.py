"""The retrain round of bench/live_index.py (issue 56): ``needle index compact --retrain always``
under the query load, while an add and a delete are published (the retrain's long work holds no
lock: what they publish meanwhile is carried onto its generation).

Measures the retrain's wall time, the answers' p99 while it ran against the idle phase's, the
server's peak RSS from the retrain's start through its switch against its steady RSS before
(``/proc/<pid>/status`` VmHWM after resetting it through ``clear_refs``; sampled VmRSS where that is
refused), and checks that every key added during the retrain is in the index after it and no key
deleted during it is (all of them, from ``needle index keys``; a sample also asked of the server).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class RetrainContext:
    """What the round takes from bench/live_index.py."""

    args: Any  # the bench's flags (round_rows, dim, clusters)
    work: Path  # its work directory (the index is work/index)
    url: str  # the server
    live: dict[str, np.ndarray]  # key -> vector of every live row (updated by the round)
    next_id: int  # a Parquet shard id no file of the index has used
    delete_visible: list[tuple[float, set[str]]]  # each delete's (returned at, keys): the round's appended
    env: dict[str, str]  # the commands' environment
    run_needle: Callable[..., tuple[dict | None, float, float]]  # needle(args, stdin=...)
    make_vectors: Callable[..., np.ndarray]
    write_files: Callable[[Path, int, np.ndarray], list[str]]
    get_json: Callable[..., Any]


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """A field of ``/proc/<pid>/status`` in KiB (0 where the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class PeakRss:
    """The peak RSS of a process from ``start()`` to ``stop()``: the kernel's high-water mark, reset
    at the start (``clear_refs`` 5), with a 20 Hz sample as the floor where the reset is refused."""

    def __init__(self, pid: int):
        self.pid, self.sampled, self.reset = pid, 0, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> None:
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            self.reset = True
        except OSError:
            self.reset = False
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.sampled = max(self.sampled, rss_kib(self.pid))
            time.sleep(0.05)

    def stop(self) -> int:
        """Peak RSS in KiB."""
        self._stop.set()
        self._thread.join()
        return max(self.sampled, rss_kib(self.pid, "VmHWM") if self.reset else 0)


def while_unlocked(command: list[str], run_needle: Any, attempts: int = 600) -> tuple[dict, float, float]:
    """``run_needle(command)`` again while the index's writer lock is held (the retrain's short
    publishing phase): a local writer refuses at once rather than waiting."""
    for _ in range(attempts):
        try:
            return run_needle(command)
        except RuntimeError as exc:
            if "another writer" not in str(exc):
                raise
            time.sleep(0.2)
    raise TimeoutError(f"{command[:2]}: the writer lock stayed held")


def served_keys(url: str, keys: list[str], get_json: Any) -> int:
    """How many of ``keys`` the server knows (a key query answers 400 for an unknown key)."""
    import urllib.error

    known = 0
    for key in keys:
        try:
            get_json(f"{url}/search", {"keys": [key], "k": 1}, timeout=60)
            known += 1
        except urllib.error.HTTPError as exc:
            if exc.code != 400:
                raise
    return known


def retrain_round(context: RetrainContext, server_pid: int) -> tuple[dict, tuple[float, float]]:
    """The round: its figures, and its window on the load's clock (for the latency figures, which
    the load process hands over when it finishes)."""
    args, work, url, live = context.args, context.work, context.url, context.live
    index = str(work / "index")
    steady_kib = rss_kib(server_pid)
    peak = PeakRss(server_pid)
    peak.start()
    started = time.monotonic()
    retrain = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "index", "compact", "--index", index, "--retrain", "always", "--keep", "2",
         "--wait-for", url], cwd=ROOT, env=context.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    new = context.make_vectors(args.round_rows, args.dim, 900, args.clusters)
    shutil.rmtree(work / "during", ignore_errors=True)
    new_keys = context.write_files(work / "during", context.next_id, new)
    while_unlocked(["index", "add", "--index", index, "--descriptors", str(work / "during")], context.run_needle)
    doomed = [str(k) for k in np.random.default_rng(9).choice(sorted(live), args.round_rows, replace=False)]
    while_unlocked(["index", "delete", "--index", index, "--keys", "-", "--wait-for", url],
                   lambda command: context.run_needle(command, stdin="\n".join(doomed) + "\n"))  # fmt: skip
    context.delete_visible.append((time.monotonic(), set(doomed)))
    out, err = retrain.communicate(timeout=7200)
    if retrain.returncode != 0:
        raise RuntimeError(f"compact --retrain always failed ({retrain.returncode}): {err[-2000:]}")
    ended = time.monotonic()
    peak_kib = peak.stop()
    live.update(zip(new_keys, new))
    for key in doomed:
        del live[key]
    change = json.loads(out.strip() or "{}")
    sample_added = new_keys[:: max(1, len(new_keys) // 50)]
    record = {
        "retrain_s": round(ended - started, 1),
        "retrained": change.get("retrained"),
        "retrain_reason": change.get("retrain_reason"),
        "retrain_carried": change.get("carried"),
        "server_rss_steady_mb": round(steady_kib / 1024, 1),
        "server_rss_peak_during_retrain_mb": round(peak_kib / 1024, 1),
        "server_rss_peak_vs_steady": round(peak_kib / max(1, steady_kib), 3),
        "server_peak_from_high_water_mark": peak.reset,
        "added_during_retrain": len(new_keys),
        "added_during_retrain_served": served_keys(url, sample_added, context.get_json) == len(sample_added),
        "deleted_during_retrain": len(doomed),
        "deleted_during_retrain_served": served_keys(url, doomed[:20], context.get_json),
        **keys_after(index, set(new_keys), set(doomed), context.env),
        "retrain_timings": change.get("timings"),  # phase A: sample, train, encode, tune (s)
        "retrain_plan": change.get("plan"),
        "retrain_search": change.get("search"),  # the served defaults it chose for the recall target
    }
    return record, (started, ended)


def keys_after(index: str, added: set[str], deleted: set[str], env: dict[str, str]) -> dict[str, int]:
    """Every change made during the retrain, checked in the index it published (``needle index keys``:
    all its live keys): the added keys missing, the deleted keys still there (both 0: none lost)."""
    done = subprocess.run([sys.executable, "-m", "cli.main", "index", "keys", "--index", index], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    keys = set(done.stdout.split("\n"))
    return {"added_during_retrain_missing": len(added - keys), "deleted_during_retrain_present": len(deleted & keys)}


def retrain_latency(load: Any, window: tuple[float, float], idle: tuple[float, float]) -> dict:
    """p99 of the answers started while the retrain ran, and against the idle phase's."""
    during, quiet = load.latencies(*window), load.latencies(*idle)
    if not len(during) or not len(quiet):
        return {"p99_during_retrain_ms": None, "p99_ratio_during_retrain": None}
    return {
        "p99_during_retrain_ms": round(float(np.percentile(during, 99)) * 1000, 2),
        "p99_ratio_during_retrain": round(float(np.percentile(during, 99) / np.percentile(quiet, 99)), 3),
    }
