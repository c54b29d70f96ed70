"""Runbooks of the Big-ANN streaming track for bench/streaming.py: reading the track's YAML, scaling
it, generating one by the track's recipe, coalescing it into the phases a scheduled job would run,
and the clustered synthetic data the steps refer to.

A step inserts the ids ``[start, end)`` (their tags are their ids), deletes the tags ``[start, end)``,
replaces the tags ``[tags_start, tags_end)`` by the vectors of ids ``[ids_start, ids_end)``, or
searches. Everything downstream works on *phases*: the change steps between two kept searches,
merged per kind in order (an insert phase, then a delete phase, ...), so that the state at every
kept search is the runbook's.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

# The datasets the track's runbooks name, by their row counts (the ids a runbook's ranges index).
DATASET_ROWS = {"random-xs": 10_000, "random-xs-clustered": 10_000}
DIRICHLET_SHARES = (100.0, 15.0, 10.0, 5.0, 3.0)  # the scored runbook's per-cluster share weights


@dataclass(frozen=True)
class Step:
    op: str  # insert | delete | replace | search
    start: int = 0
    end: int = 0
    ids_start: int = 0  # replace: the ids whose vectors the tags [start, end) take
    ids_end: int = 0


def dataset_rows(name: str, steps: list[Step]) -> int:
    """Rows of the dataset a runbook was written for: known names, else the ``10M``/``30M`` in
    the name (msturing-30M-clustered), else the largest id the steps touch."""
    if name in DATASET_ROWS:
        return DATASET_ROWS[name]
    found = re.search(r"(\d+)([MK])\b", name)
    if found:
        return int(found.group(1)) * (1_000_000 if found.group(2) == "M" else 1_000)
    return max(max(s.end, s.ids_end) for s in steps)


def read_track_runbook(path: Path, dataset: str | None = None) -> tuple[str, list[Step]]:
    """One dataset's steps of a track runbook file (the first dataset unless named), by step number."""
    import yaml

    books = yaml.safe_load(Path(path).read_text())
    name = dataset or next(iter(books))
    book = books[name]
    steps = []
    for number in sorted(key for key in book if isinstance(key, int)):
        entry = book[number]
        op = entry["operation"]
        if op == "replace":
            steps.append(Step(op, entry["tags_start"], entry["tags_end"], entry["ids_start"], entry["ids_end"]))
        elif op in ("insert", "delete"):
            steps.append(Step(op, entry["start"], entry["end"]))
        else:
            steps.append(Step("search"))
    return name, steps


def scale_steps(steps: list[Step], rows: int, n: int) -> list[Step]:
    """Every id range scaled by ``n / rows`` and rounded, the order of steps kept."""

    def scale(value: int) -> int:
        return min(n, round(value * n / rows))

    return [Step(s.op, scale(s.start), scale(s.end), scale(s.ids_start), scale(s.ids_end)) for s in steps]


def clusters_of(steps: list[Step], n: int) -> list[int]:
    """Cluster boundaries implied by a clustered runbook: an insert that starts where an earlier
    insert ended continues that one's cluster (the next share of it), any other starts a cluster.
    Returns sorted starts (the first is 0); the data generator gives each range its own cluster."""
    ends: set[int] = set()
    starts = {0}
    for step in steps:
        if step.op == "insert" and step.end > step.start:
            if step.start not in ends:
                starts.add(step.start)
            ends.add(step.end)
    return sorted(s for s in starts if s < n)


def generated_runbook(n: int, clusters: int, rounds: int, rng: np.random.Generator) -> tuple[list[Step], list[int]]:
    """The scored runbook's recipe on ``n`` rows: cluster sizes drawn unequal, each cluster's rows
    split into ``rounds`` shares from Dirichlet(100, 15, 10, 5, 3) shuffled per cluster; per round,
    for each cluster insert its next share then search, then for each cluster delete a fraction
    uniform(0.5, 0.9) of its inserted, not yet deleted rows from the oldest end, then search."""
    weights = rng.dirichlet(np.full(clusters, 5.0))
    sizes = np.maximum(1, np.floor(weights * n).astype(np.int64))
    sizes[-1] = n - sizes[:-1].sum()
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    alpha = np.array(DIRICHLET_SHARES[:rounds])
    shares = []
    for size in sizes:
        split = rng.dirichlet(rng.permutation(alpha)) * size
        cuts = np.round(np.cumsum(split)).astype(np.int64)
        cuts[-1] = size
        shares.append(np.diff(np.concatenate([[0], cuts])))
    inserted = starts.copy()  # next id to insert, per cluster
    deleted = starts.copy()  # first id not deleted, per cluster
    steps: list[Step] = []
    for round_ in range(rounds):
        for c in range(clusters):
            end = inserted[c] + shares[c][round_]
            steps += [Step("insert", int(inserted[c]), int(end)), Step("search")]
            inserted[c] = end
        for c in range(clusters):
            count = round(rng.uniform(0.5, 0.9) * (inserted[c] - deleted[c]))
            steps += [Step("delete", int(deleted[c]), int(deleted[c] + count)), Step("search")]
            deleted[c] += count
    return steps, [int(s) for s in starts]


def keep_searches(steps: list[Step], max_searches: int) -> list[Step]:
    """The steps with at most ``max_searches`` search steps, evenly spaced and the last one kept
    (0: all). Dropping a search changes no state, so the kept ones see the runbook's states."""
    where = [i for i, s in enumerate(steps) if s.op == "search"]
    if max_searches <= 0 or len(where) <= max_searches:
        return list(steps)
    if max_searches == 1:
        picks = {where[-1]}
    else:
        picks = {where[round(j * (len(where) - 1) / (max_searches - 1))] for j in range(max_searches)}
    return [s for i, s in enumerate(steps) if s.op != "search" or i in picks]


def phases(steps: list[Step]) -> list[dict[str, Any]]:
    """Consecutive change steps of one kind merged: ``{"op", "steps": [...]}`` and ``{"op": "search"}``.
    Steps of different kinds keep their order (a delete then an insert of the same id stays so)."""
    out: list[dict[str, Any]] = []
    for step in steps:
        if step.op != "search" and step.end <= step.start:
            continue  # a range scaled to nothing
        if step.op != "search" and out and out[-1]["op"] == step.op:
            out[-1]["steps"].append(asdict(step))
        else:
            out.append({"op": step.op, "steps": [] if step.op == "search" else [asdict(step)]})
    return out


class LiveState:
    """The track's tag -> id map: ``vec[tag]`` is the vector id a live tag has, -1 where not live."""

    def __init__(self, n: int) -> None:
        self.vec = np.full(n, -1, np.int64)

    def apply(self, step: dict[str, Any]) -> None:
        tags = np.arange(step["start"], step["end"])
        if step["op"] == "insert":
            self.vec[tags] = tags
        elif step["op"] == "delete":
            self.vec[tags] = -1
        else:
            self.vec[tags] = np.arange(step["ids_start"], step["ids_end"])[: len(tags)]

    def live_tags(self) -> np.ndarray:
        return np.flatnonzero(self.vec >= 0)


def clustered_data(
    n: int, dim: int, boundaries: list[int], queries: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Embedding-like rows: one cluster per id range, each a centre plus anisotropic noise (a
    random orthogonal basis, variances decaying along it), L2-normalised and rounded to float16 (what
    descriptor Parquet holds). Queries are drawn from the same mixture, every cluster alike, so that
    early searches ask about clusters not inserted yet, as the track's fixed query set does."""
    edges = [*list(boundaries), n]
    centres = rng.standard_normal((len(boundaries), dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    spread = (0.6 / np.sqrt(dim)) * np.linspace(2.0, 0.3, dim).astype(np.float32)  # anisotropy
    data = np.empty((n, dim), np.float16)
    qs = np.empty((queries, dim), np.float16)
    q_cluster = rng.integers(0, len(boundaries), queries)
    for c in range(len(boundaries)):
        basis, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
        basis = basis.astype(np.float32)

        def draw(count: int, c: int = c, basis: np.ndarray = basis) -> np.ndarray:
            rows = centres[c] + (rng.standard_normal((count, dim)).astype(np.float32) * spread) @ basis.T
            return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float16)

        data[edges[c] : edges[c + 1]] = draw(edges[c + 1] - edges[c])
        picked = np.flatnonzero(q_cluster == c)
        qs[picked] = draw(len(picked))
    return data, qs
