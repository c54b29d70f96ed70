"""One peer of bench/streaming.py replaying a runbook's phases in its own process, one thread.

    python bench/streaming_peers.py WORKDIR SYSTEM      # writes WORKDIR/SYSTEM/found_J.npy, result.json

Reads ``WORKDIR/plan.json`` (phases, k, the systems' settings), ``data.npy`` (float16 rows) and
``queries.npy``. Every inserted or replacing row takes a new slot (the library's label); a slot
maps back to its tag, and a slot no longer live (deleted, or the old vector of a replaced tag)
is answered as tag ``n`` (counted as a deleted row returned), as is an id the library invents.

- ``faiss-ivfpq`` / ``faiss-ivfflat``: a flat index until 39 x nlist rows have arrived, then
  trained once on the live rows so far (nlist lowered to rows/39 where fewer), rows added as they come,
  deleted rows skipped at search time by an ``IDSelectorBitmap`` (FAISS 1.15's fast-scan IVF
  scores rows added after ``remove_ids`` wrongly), re-scored exactly over ``refine`` x k.
- ``hnswlib``: ``add_items`` / ``mark_deleted``; M, ef_construction, ef from the plan.
- ``diskannpy``: the track's FreshDiskANN baseline: ``DynamicMemoryIndex`` R 50, L 50, search L 70,
  ``mark_deleted`` per delete, ``consolidate_delete`` before the next insert (lazily, as the
  track's wrapper does).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("streaming.peers")


class Slots:
    """Slot (library label) <-> tag bookkeeping shared by the peers."""

    def __init__(self, n: int, capacity: int) -> None:
        self.n = n
        self.slot_of_tag = np.full(n, -1, np.int64)
        self.tag_of_slot = np.full(capacity, -1, np.int64)
        self.live = np.zeros(capacity, bool)
        self.used = 0

    def take(self, tags: np.ndarray) -> np.ndarray:
        slots = np.arange(self.used, self.used + len(tags))
        self.used += len(tags)
        self.slot_of_tag[tags], self.tag_of_slot[slots], self.live[slots] = slots, tags, True
        return slots

    def drop(self, tags: np.ndarray) -> np.ndarray:
        slots = self.slot_of_tag[tags]
        slots = slots[slots >= 0]
        self.live[slots] = False
        self.slot_of_tag[tags] = -1
        return slots

    def tags(self, slots: np.ndarray) -> np.ndarray:
        slots = np.asarray(slots, np.int64)
        ok = (slots >= 0) & (slots < self.used)
        safe = np.where(ok, slots, 0)
        return np.where(ok & self.live[safe], self.tag_of_slot[safe], np.where(slots < 0, -1, self.n))


class FaissPeer:
    """Exact (a flat index) until ``train_at`` rows have arrived, then trained once on the live rows
    so far (as the track's winner waited for 4M): an IVF index trained on a first insert of a few
    hundred rows would not be a peer worth the name."""

    def __init__(self, dim: int, settings: dict[str, Any], capacity: int) -> None:
        import faiss

        self.dim, self.s = dim, settings
        self.train_at = min(capacity, 39 * settings["nlist"])
        self.index, self.trained = faiss.IndexFlatL2(dim), False
        self.note = f"flat until {self.train_at} rows, then trained once"

    def train(self, live: np.ndarray) -> None:
        import faiss

        flat = self.index
        everything = flat.reconstruct_n(0, flat.ntotal)
        sample = everything[live[: flat.ntotal]]
        nlist = max(1, min(self.s["nlist"], len(sample) // 39))
        self.index = faiss.index_factory(self.dim, self.s["factory"].format(nlist=nlist), faiss.METRIC_L2)
        self.index.train(sample)
        self.index.add(everything)  # the deleted ones too: labels stay slots; the selector skips them
        self.trained = True
        self.note = f"flat until {flat.ntotal} rows, then trained once on {len(sample)} live rows, nlist {nlist}"

    def insert(self, x: np.ndarray, slots: np.ndarray, live: np.ndarray) -> None:
        assert self.index.ntotal == slots[0]  # labels are slots: added in order
        self.index.add(x)
        if not self.trained and self.index.ntotal >= self.train_at:
            self.train(live)

    def delete(self, slots: np.ndarray) -> None:
        pass  # skipped at search time (the selector)

    def search(self, q: np.ndarray, k: int, live: np.ndarray) -> np.ndarray:
        import faiss

        bitmap = np.packbits(live[: self.index.ntotal], bitorder="little")
        sel = faiss.IDSelectorBitmap(self.index.ntotal, faiss.swig_ptr(bitmap))
        if not self.trained:
            _, found = self.index.search(q, k, params=faiss.SearchParameters(sel=sel))
            return found
        params = faiss.SearchParametersIVF(nprobe=self.s["nprobe"], sel=sel)
        if self.s["refine"]:
            params = faiss.IndexRefineSearchParameters(k_factor=self.s["refine"], base_index_params=params)
        _, found = self.index.search(q, k, params=params)
        return found


class HnswPeer:
    def __init__(self, dim: int, settings: dict[str, Any], capacity: int) -> None:
        import hnswlib

        self.index = hnswlib.Index(space="l2", dim=dim)
        self.index.init_index(max_elements=capacity, M=settings["M"], ef_construction=settings["ef_construction"])
        self.index.set_ef(settings["ef"])
        self.index.set_num_threads(1)
        self.note = f"M {settings['M']}, ef_construction {settings['ef_construction']}, ef {settings['ef']}"

    def insert(self, x: np.ndarray, slots: np.ndarray, live: np.ndarray) -> None:
        self.index.add_items(x, slots, num_threads=1)

    def delete(self, slots: np.ndarray) -> None:
        for slot in slots:
            self.index.mark_deleted(int(slot))

    def search(self, q: np.ndarray, k: int, live: np.ndarray) -> np.ndarray:
        alive = int(live.sum())
        found = np.full((len(q), k), -1, np.int64)
        if alive:
            labels, _ = self.index.knn_query(q, k=min(k, alive), num_threads=1)
            found[:, : labels.shape[1]] = labels.astype(np.int64)
        return found


class DiskannPeer:
    def __init__(self, dim: int, settings: dict[str, Any], capacity: int) -> None:
        import diskannpy

        self.s, self.pending = settings, 0
        self.index = diskannpy.DynamicMemoryIndex(
            distance_metric="l2", vector_dtype=np.float32, dimensions=dim, max_vectors=capacity + 1,
            complexity=settings["L"], graph_degree=settings["R"], num_threads=1,
            initial_search_complexity=settings["search_L"],
        )  # fmt: skip
        self.note = f"R {settings['R']}, L {settings['L']}, search L {settings['search_L']}, lazy consolidation"

    def insert(self, x: np.ndarray, slots: np.ndarray, live: np.ndarray) -> None:
        if self.pending:
            self.index.consolidate_delete()
            self.pending = 0
        self.index.batch_insert(x, (slots + 1).astype(np.uint32), num_threads=1)  # tag 0 is invalid

    def delete(self, slots: np.ndarray) -> None:
        for slot in slots:
            self.index.mark_deleted(np.uint32(slot + 1))
        self.pending += len(slots)

    def search(self, q: np.ndarray, k: int, live: np.ndarray) -> np.ndarray:
        tags, _ = self.index.batch_search(q, k, self.s["search_L"], 1)
        return np.asarray(tags, np.int64) - 1  # 0 (no answer) becomes -1


PEERS = {"faiss-ivfpq": FaissPeer, "faiss-ivfflat": FaissPeer, "hnswlib": HnswPeer, "diskannpy": DiskannPeer}


def ranges(steps: list[dict[str, Any]], lo: str, hi: str) -> np.ndarray:
    return np.concatenate([np.arange(s[lo], s[hi]) for s in steps])


def replay(system: str, work: Path) -> dict[str, Any]:
    """Run every phase; write each search's tags (found_J.npy) and return the timings."""
    plan = json.loads((work / "plan.json").read_text())
    data = np.load(work / "data.npy", mmap_mode="r")
    queries = np.load(work / "queries.npy").astype(np.float32)
    out = work / system
    out.mkdir(exist_ok=True)
    slots = Slots(len(data), plan["capacity"])
    peer = PEERS[system](data.shape[1], plan["settings"][system], plan["capacity"])
    rss_base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    seconds = {"insert": 0.0, "delete": 0.0, "replace": 0.0, "search": 0.0}
    per_search: list[float] = []
    for phase in plan["phases"]:
        op, start = phase["op"], time.perf_counter()
        if op == "search":
            found = peer.search(queries, plan["k"], slots.live)
            spent = time.perf_counter() - start
            np.save(out / f"found_{len(per_search)}.npy", slots.tags(found))
            per_search.append(spent)
        else:
            if op in ("delete", "replace"):
                peer.delete(slots.drop(ranges(phase["steps"], "start", "end")))
            if op in ("insert", "replace"):
                tags = ranges(phase["steps"], "start", "end")
                ids = tags if op == "insert" else ranges(phase["steps"], "ids_start", "ids_end")
                peer.insert(np.ascontiguousarray(data[ids], dtype=np.float32), slots.take(tags), slots.live)
            spent = time.perf_counter() - start
        seconds[op] += spent
    return {
        "system": system, "seconds": seconds, "search_s_per_step": per_search, "settings": peer.note,
        "rss_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_base_mb": rss_base,
    }  # fmt: skip


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    work, system = Path(sys.argv[1]), sys.argv[2]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = replay(system, work)
    (work / system / "result.json").write_text(json.dumps(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
