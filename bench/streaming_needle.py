"""needle replaying a runbook's phases for bench/streaming.py, through its CLI and HTTP API only.

    python bench/streaming_needle.py WORKDIR [SYSTEM]   # writes WORKDIR/SYSTEM/found_J.npy, fresh_J.npy, result.json

SYSTEM is ``needle`` (``needle index build`` with its defaults) or ``needle-ivfpq`` (build flags
from the plan, ``--kind ivfpq``: the plan chosen for the first insert's rows, trained on them only).

Its own process, so that the peak memory it reports is that of needle's processes alone (each
command's, from ``wait4``, and the server's high-water mark). The first insert phase is
``needle index build`` over the phase's descriptor files; then ``needle serve --reload-interval``
answers every search (``POST /search`` with the query vectors packed as float32, at most
``--max-queries`` a body);
each later insert phase is one ``needle index add`` of its files (one Parquet file per insert step:
a shard of the collection), each delete phase one ``needle index delete --keys -``, a replace phase
``needle index add --replace``, all with ``--wait-for`` (a change is served when its command
returns), and ``needle index compact --keep 2`` after every ``compact_every`` changes, as a
scheduled job would. A key is the track's tag (``tag/000012345``), so deletes and replaces name tags.
Compaction's ``--retrain`` is passed only where the plan asks and the CLI has it (recorded).

For each search, a fresh ``needle index build`` over that step's live rows answers the same
queries (``needle query --vectors``): how far the living index is from a rebuild.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from streaming_runbook import LiveState  # noqa: E402

from ingest.descriptors import descriptor_schema, fixed_size_list, make_row_id, write_parquet_atomic  # noqa: E402
from webapi.packed_vectors import pack_vectors  # noqa: E402

log = logging.getLogger("streaming.needle")
NEEDLE = [sys.executable, "-m", "cli.main"]


def env() -> dict[str, str]:
    """One thread for every pool of every needle process; bytecode cached as when installed."""
    inherited = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    one = dict.fromkeys(("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"), "1")
    return {**inherited, **one, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def run(args: list[str], stdin: str | None = None) -> tuple[str, float, float]:
    """``needle ARGS``: (stdout, wall seconds, the process's peak RSS in MB, from wait4)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            NEEDLE + args, cwd=ROOT, env=env(), stdin=subprocess.PIPE if stdin is not None else None,
            stdout=out, stderr=err, text=True,
        )  # fmt: skip
        if stdin is not None:
            proc.stdin.write(stdin)  # type: ignore[union-attr]
            proc.stdin.close()  # type: ignore[union-attr]
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        text, errors = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"needle {' '.join(args[:2])} failed ({proc.returncode}): {errors[-3000:]}")
    return text, time.perf_counter() - start, usage.ru_maxrss / 1024


def last_json(text: str) -> dict[str, Any]:
    """A command's JSON report: its whole stdout (indented), else its last line that is an object."""
    try:
        whole = json.loads(text)
        return whole if isinstance(whole, dict) else {}
    except ValueError:
        pass
    for line in reversed(text.strip().splitlines()):
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict):
            return found
    return {}


def write_shard(directory: Path, shard_id: int, tags: np.ndarray, vectors: np.ndarray) -> Path:
    """One descriptor Parquet file in the ingest schema: keys ``tag/<tag>``, rows of shard ``shard_id``."""
    shard = f"{shard_id:06d}"
    n = len(tags)
    table = pa.table(
        {
            "key": [f"tag/{t:09d}" for t in tags],
            "shard": [shard] * n,
            "row": pa.array([make_row_id(shard_id, i) for i in range(n)], pa.int64()),
            "global": fixed_size_list(np.asarray(vectors, np.float16), pa.float16()),
            "width": pa.array([0] * n, pa.int32()),
            "height": pa.array([0] * n, pa.int32()),
            "status": ["ok"] * n,
            "error": [""] * n,
        },
        schema=descriptor_schema(vectors.shape[1]),
    )
    return write_parquet_atomic(table, directory / f"{shard}.parquet")


def tags_of(answers: list[dict[str, Any]], k: int) -> np.ndarray:
    found = np.full((len(answers), k), -1, np.int64)
    for i, answer in enumerate(answers):
        tags = [int(r["key"].rsplit("/", 1)[-1]) for r in answer["results"][:k]]
        found[i, : len(tags)] = tags
    return found


class Server:
    """``needle serve`` on a free local port; its peak RSS read from /proc before it is stopped."""

    def __init__(self, index: Path, reload_interval: float, max_queries: int) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["serve", "--index", str(index), "--port", str(self.port), "--reload-interval", str(reload_interval),
                "--max-queries", str(max_queries)]  # fmt: skip
        self.log = open(index.parent / "serve.log", "w")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(NEEDLE + args, cwd=ROOT, env=env(), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                self.get("/health")
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"needle serve exited {self.proc.returncode}") from None
                time.sleep(0.2)
        raise TimeoutError("needle serve did not answer /health")

    def get(self, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as answer:
            return json.loads(answer.read())

    def peak_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class NeedleRun:
    """The replay: state, timings and memory of one run (see the module's docstring)."""

    def __init__(self, work: Path, system: str) -> None:
        self.system = system
        self.plan = json.loads((work / "plan.json").read_text())
        self.conf = self.plan["settings"][system]
        self.data = np.load(work / "data.npy", mmap_mode="r")
        self.queries_path = work / "queries.npy"
        self.queries = np.load(self.queries_path).astype(np.float32)
        self.out = work / system
        shutil.rmtree(self.out, ignore_errors=True)
        (self.out / "desc").mkdir(parents=True)
        self.index = self.out / "index"
        self.state = LiveState(len(self.data))
        self.server: Server | None = None
        self.next_shard, self.changes = 0, 0
        self.seconds = dict.fromkeys(("insert", "delete", "replace", "compact", "search"), 0.0)
        self.per_search: list[float] = []
        self.fresh_s: list[float] = []
        self.rss_commands = 0.0
        self.drift: list[dict[str, Any]] = []
        help_text, _, _ = run(["index", "compact", "--help"])
        self.retrain_flag = "--retrain" in help_text

    def needle(self, args: list[str], stdin: str | None = None) -> tuple[dict[str, Any], float]:
        text, seconds, rss = run(args, stdin)
        self.rss_commands = max(self.rss_commands, rss)
        return last_json(text), seconds

    def shard_files(self, steps: list[dict[str, Any]], ids_key: str) -> list[str]:
        files = []
        for step in steps:
            tags = np.arange(step["start"], step["end"])
            ids = np.arange(step[ids_key], step[ids_key] + len(tags))
            files.append(str(write_shard(self.out / "desc", self.next_shard, tags, self.data[ids])))
            self.next_shard += 1
        return files

    def change(self, phase: dict[str, Any]) -> None:
        op, steps = phase["op"], phase["steps"]
        if op == "insert" and self.server is None:
            files = self.shard_files(steps, "start")
            _, seconds = self.needle(["index", "build", "--descriptors", *files, "--out", str(self.index),
                                      *self.conf["build_args"]])  # fmt: skip
            start = time.perf_counter()
            self.server = Server(self.index, self.conf["reload_interval"], self.conf["max_queries"])
            seconds += time.perf_counter() - start
        elif op in ("insert", "replace"):
            files = self.shard_files(steps, "start" if op == "insert" else "ids_start")
            extra = ["--replace"] if op == "replace" else []
            report, seconds = self.needle(["index", "add", "--index", str(self.index), "--descriptors", *files,
                                           *extra, "--wait-for", self.server.url])  # fmt: skip
            self.drift.append({"generation": report.get("generation"), **(report.get("drift") or {})})
        else:
            keys = "".join(f"tag/{t:09d}\n" for s in steps for t in range(s["start"], s["end"]))
            _, seconds = self.needle(["index", "delete", "--index", str(self.index), "--keys", "-", "--wait-for",
                                      self.server.url], stdin=keys)  # fmt: skip
        self.seconds[op] += seconds
        for step in steps:
            self.state.apply({**step, "op": op})
        self.changes += 1
        if self.changes % self.conf["compact_every"] == 0:
            retrain = ["--retrain", self.conf["retrain"]] if self.conf["retrain"] and self.retrain_flag else []
            _, seconds = self.needle(["index", "compact", "--index", str(self.index), "--keep", "2", *retrain,
                                      "--wait-for", self.server.url])  # fmt: skip
            self.seconds["compact"] += seconds

    def search(self) -> None:
        assert self.server is not None
        k, batch, answers = self.plan["k"], self.conf["max_queries"], []
        start = time.perf_counter()
        for lo in range(0, len(self.queries), batch):
            body = {"k": k, "vectors": pack_vectors(self.queries[lo : lo + batch])}  # as a client at scale sends
            answers += self.server.get("/search", body)
        spent = time.perf_counter() - start
        np.save(self.out / f"found_{len(self.per_search)}.npy", tags_of(answers, k))
        self.seconds["search"] += spent
        self.per_search.append(spent)
        if self.conf["fresh"]:
            self.fresh(len(self.per_search) - 1)

    def fresh(self, j: int) -> None:
        """A build over this step's live rows answering the same queries (not in the run's times)."""
        start = time.perf_counter()
        folder = self.out / "fresh"
        shutil.rmtree(folder, ignore_errors=True)
        (folder / "desc").mkdir(parents=True)
        tags = self.state.live_tags()
        for part, lo in enumerate(range(0, len(tags), 100_000)):
            chunk = tags[lo : lo + 100_000]
            write_shard(folder / "desc", part, chunk, self.data[self.state.vec[chunk]])
        found = np.full((len(self.queries), self.plan["k"]), -1, np.int64)
        if len(tags):
            run(["index", "build", "--descriptors", str(folder / "desc"), "--out", str(folder / "index"),
                 *self.conf["build_args"]])  # fmt: skip
            run(["query", "--index", str(folder / "index"), "--vectors", str(self.queries_path), "--k",
                 str(self.plan["k"]), "--out", str(folder / "answers.json")])  # fmt: skip
            answers = json.loads((folder / "answers.json").read_text())
            found = tags_of(answers if isinstance(answers, list) else answers["queries"], self.plan["k"])
        np.save(self.out / f"fresh_{j}.npy", found)
        shutil.rmtree(folder, ignore_errors=True)
        self.fresh_s.append(time.perf_counter() - start)

    def replay(self) -> dict[str, Any]:
        try:
            for phase in self.plan["phases"]:
                self.search() if phase["op"] == "search" else self.change(phase)
            try:
                info, _ = self.needle(["index", "info", "--index", str(self.index)])
            except RuntimeError as error:  # recorded, not raised: the replay's figures stand without it
                info = {"error": str(error)[-300:]}
            rss_server = self.server.peak_mb() if self.server else 0.0
        finally:
            if self.server is not None:
                self.server.stop()
        keep = ("kind", "factory", "nlist", "nprobe", "refine_factor", "live_rows", "segments_per_shard", "error")
        return {
            "system": self.system, "seconds": self.seconds, "search_s_per_step": self.per_search,
            "fresh_s_per_step": self.fresh_s, "rss_peak_mb": max(rss_server, self.rss_commands),
            "rss_server_mb": rss_server, "rss_commands_mb": self.rss_commands, "changes": self.changes,
            "compact_retrain_flag": self.retrain_flag, "final_index": {k: info[k] for k in keep if k in info},
            "rebuild_recommended": sum(bool(d.get("rebuild_recommended")) for d in self.drift),
            "drift": self.drift[-3:],
            "settings": f"build {' '.join(self.conf['build_args']) or '(defaults)'}, compact every "
            f"{self.conf['compact_every']} changes, reload {self.conf['reload_interval']} s",
        }  # fmt: skip


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    work, system = Path(sys.argv[1]), (sys.argv[2:] or ["needle"])[0]
    result = NeedleRun(work, system).replay()
    (work / system / "result.json").write_text(json.dumps(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
