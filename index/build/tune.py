"""Search defaults that reach a recall target: the served ``nprobe`` and shortlist (``refine_factor``)
of an IVF-PQ index, chosen on its own rows.

A sample of the index's indexed rows is searched as queries (each less its own row, which a
query from outside the index would not find), and their exact answers are found by
brute force over the stored float16 vectors (the vectors the index re-scores with, so an exact
answer is what a search that visits every list and re-scores every row returns). For each shortlist
factor in ``REFINE_FACTORS`` the smallest power-of-two ``nprobe`` (a binary search, after one
search over every list tells whether any nprobe reaches it) whose recall@k reaches the target
at every k asked is found (recall grows with both); of those pairs the one with the least work per
query wins: the codes scanned (``nprobe / nlist`` of the rows, ``code_bytes`` each) plus the rows
re-scored (``refine_factor * k``, ``2 d`` bytes each, counted ``RANDOM_READ_WEIGHT`` times: a
re-scored row is a random read of the memory-mapped vectors, a scanned code a sequential one).
Where no pair reaches the target, the cheapest pair within ``UNREACHED_SLACK`` of the best
recall any pair reached is chosen (the same search, for that lower target) and ``"reached": false``
says so: serving every list for the last hundredth of recall had made a retrained 1M-row index
answer five times slower. The build (index/build/stage.py) records
the choice in ``index_infos.json``, a retrain (index/live/retrain.py) in its manifest; the loader
serves it, and a request's own ``nprobe`` / ``refine_factor`` still override it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ingest.descriptors import valid_descriptors

log = logging.getLogger(__name__)
REFINE_FACTORS = (1, 2, 4, 8, 16)  # shortlist sizes tried, as multiples of k
RANDOM_READ_WEIGHT = 8  # a re-scored row's bytes cost this many scanned code bytes (random vs sequential reads)
# a target no setting reaches: the cheapest setting within this much recall of the best any reached
UNREACHED_SLACK = 0.01
CONFIDENCE_Z = 2.0  # standard errors of the sample's mean recall the target is held to (~97.5 % one-sided)
EXACT_BLOCK = 1 << 16  # rows scored at a time by the brute force


@dataclass(frozen=True)
class SearchChoice:
    """The served search defaults and how they were chosen (recorded as ``search_tuning``)."""

    nprobe: int  # lists visited per query
    refine_factor: int  # shortlist = refine_factor * k, re-scored exactly
    target: float  # the recall@k asked for
    ks: tuple[int, ...]  # the k it must hold at
    recall: dict[str, float]  # recall@k reached on the sample, per k
    reached: bool  # every k reached the target
    queries: int  # rows of the index searched as queries
    seconds: float  # the tuning's wall time

    def to_json(self) -> dict[str, object]:
        return {
            "nprobe": self.nprobe,
            "refine_factor": self.refine_factor,
            "recall_target": self.target,
            "recall_ks": list(self.ks),
            "recall": self.recall,
            "reached": self.reached,
            "queries": self.queries,
            "tuning_s": round(self.seconds, 3),
        }


def sample_queries(index: Any, size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Up to ``size`` of ``index``'s indexed rows drawn uniformly, as (float32 vectors, row ids): the
    tuning's queries."""
    status = index.ids["status"].to_numpy(zero_copy_only=False)
    rng = np.random.default_rng(seed)
    picked = np.sort(rng.choice(len(status), size=min(len(status), size * 2), replace=False))
    x = np.asarray(index.vectors[picked], np.float32)
    ok = valid_descriptors(x, status[picked])
    return x[ok][:size], index.rows[picked][ok][:size]


def without_self(found: np.ndarray, own: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` of each row of ``found`` less the query's own row id: a row searched for
    finds itself first, which a query from outside the index does not (its recall would be inflated)."""
    out = np.full((len(found), k), -1, np.int64)
    for i, (row, self_id) in enumerate(zip(found, own)):
        kept = row[row != self_id][:k]
        out[i, : len(kept)] = kept
    return out


def exact_answers(index: Any, xq: np.ndarray, k: int) -> np.ndarray:
    """(nq, k) row ids of each query's exact top k among the indexed rows (inner product over the
    stored float16 vectors), by brute force in blocks of EXACT_BLOCK rows."""
    n = len(index.vectors)
    rows = index.rows
    status = index.ids["status"].to_numpy(zero_copy_only=False)
    best_s = np.full((len(xq), 0), -np.inf, np.float32)
    best_i = np.zeros((len(xq), 0), np.int64)
    for start in range(0, n, EXACT_BLOCK):
        block = np.asarray(index.vectors[start : start + EXACT_BLOCK])
        ok = valid_descriptors(block, status[start : start + len(block)])
        scores = xq @ block.astype(np.float32).T
        scores[:, ~ok] = -np.inf
        s = np.concatenate([best_s, scores], 1)
        i = np.concatenate([best_i, np.broadcast_to(rows[start : start + len(block)], scores.shape)], 1)
        top = np.argpartition(-s, min(k, s.shape[1] - 1), axis=1)[:, :k] if s.shape[1] > k else np.argsort(-s, 1)
        best_s, best_i = np.take_along_axis(s, top, 1), np.take_along_axis(i, top, 1)
    return np.where(np.isfinite(best_s), best_i, -1)


def recall_at(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean over queries of |found ∩ truth| / |truth| (padding -1 ignored)."""
    return float(np.mean(per_query_recall(found, truth))) if len(truth) else 1.0


def per_query_recall(found: np.ndarray, truth: np.ndarray) -> np.ndarray:
    return np.array(
        [len(np.intersect1d(f[f >= 0], t[t >= 0])) / max(1, int((t >= 0).sum())) for f, t in zip(found, truth)]
    )


def lower_bound(recalls: np.ndarray) -> float:
    """The sample's mean recall less CONFIDENCE_Z standard errors: what the target is held to, so
    that the choice holds for queries the sample did not draw (a bare mean is over half the time
    above what other queries get, by the sample's noise)."""
    if not len(recalls):
        return 1.0
    return (
        float(recalls.mean() - CONFIDENCE_Z * recalls.std(ddof=1) / np.sqrt(len(recalls)))
        if len(recalls) > 1
        else float(recalls.mean())
    )


def choose_search(
    index: Any, target: float, ks: Sequence[int], queries: int = 200, seed: int = 0
) -> SearchChoice | None:
    """The cheapest ``(nprobe, refine_factor)`` whose recall@k on ``queries`` of ``index``'s own rows
    reaches ``target`` at every k of ``ks`` (capped at the index's rows); None for an exact index."""
    if index.is_exact:
        return None
    started = time.perf_counter()
    nlist = max(1, int(index.infos.get("nlist") or 1))
    xq, own = sample_queries(index, queries, seed)
    ks = tuple(sorted({max(1, min(int(k), index.ntotal - 1)) for k in ks}))
    truth = {k: without_self(exact_answers(index, xq, k + 1), own, k) for k in ks}

    def recalls(nprobe: int, factor: int) -> tuple[float, dict[str, float]]:
        """(the lowest bound over ks, each k's mean recall)."""
        found = {
            k: per_query_recall(without_self(index.search(xq, k + 1, nprobe, True, factor)[1], own, k), truth[k])
            for k in ks
        }
        return min(lower_bound(r) for r in found.values()), {str(k): float(r.mean()) for k, r in found.items()}

    probes = sorted({min(nlist, 1 << i) for i in range(nlist.bit_length() + 1)})
    measured: dict[tuple[int, int], tuple[float, dict[str, float]]] = {}

    def measure(nprobe: int, factor: int) -> tuple[float, dict[str, float]]:
        if (nprobe, factor) not in measured:
            measured[nprobe, factor] = recalls(nprobe, factor)
        return measured[nprobe, factor]

    found = cheapest_pairs(index, probes, ks, nlist, target, measure)
    reached = bool(found)
    if not reached:  # the cheapest pair within UNREACHED_SLACK of the best any pair reached
        best = max(low for low, _ in measured.values())
        found = cheapest_pairs(index, probes, ks, nlist, best - UNREACHED_SLACK, measure)
    _, nprobe, factor, got = min(found)
    choice = SearchChoice(
        nprobe, factor, target, ks, {k: round(v, 4) for k, v in got.items()}, reached, len(xq),
        time.perf_counter() - started,
    )  # fmt: skip
    if reached:
        log.info("search defaults for recall@%s >= %g: nprobe %d, refine factor %d (recall %s)", list(ks), target,
                 nprobe, factor, choice.recall)  # fmt: skip
    else:  # served, but said loudly: no setting reaches it; visiting more lists would buy almost nothing
        log.warning("no nprobe and refine factor reach recall@%s >= %g on this index; serving the cheapest within "
                    "%g of the best any reached: recall %s at nprobe %d of %d lists, refine factor %d. Ask a lower "
                    "--recall-target, or 0 to serve --nprobe and --refine-factor as given", list(ks), target,
                    UNREACHED_SLACK, choice.recall, nprobe, nlist, factor)  # fmt: skip
    return choice


def cheapest_pairs(
    index: Any,
    probes: list[int],
    ks: Sequence[int],
    nlist: int,
    target: float,
    measure: Callable[[int, int], tuple[float, dict[str, float]]],
) -> list[tuple[float, int, int, dict[str, float]]]:
    """For each shortlist factor that reaches ``target`` (its recall's lower bound at every k) with
    every list visited, the fewest lists that do: (cost, nprobe, factor, recall per k). ``measure``:
    (nprobe, factor) -> (lower bound over ks, mean recall per k), cached by the caller."""
    found: list[tuple[float, int, int, dict[str, float]]] = []
    for factor in REFINE_FACTORS:
        if found and cost(index, probes[0], factor, ks, nlist) >= min(f[0] for f in found):
            break  # even one list costs more than a pair that reached it: larger shortlists too
        low, got = measure(probes[-1], factor)  # every list first: where that fails, no nprobe reaches it
        if low < target:
            continue
        lo, hi, reached = 0, len(probes) - 1, (probes[-1], got)
        while lo < hi:  # the fewest lists reaching it (recall grows with nprobe): a binary search
            middle = (lo + hi) // 2
            low, got = measure(probes[middle], factor)
            if low >= target:
                hi, reached = middle, (probes[middle], got)
            else:
                lo = middle + 1
        found.append((cost(index, reached[0], factor, ks, nlist), reached[0], factor, reached[1]))
    return found


def cost(index: Any, nprobe: int, factor: int, ks: Sequence[int], nlist: int) -> float:
    """Bytes a query reads, as the module's doc counts them (the largest k asked)."""
    code_bytes = int(index.infos.get("code_bytes") or 8)
    scanned = nprobe / nlist * index.ntotal * code_bytes
    return scanned + RANDOM_READ_WEIGHT * factor * max(ks) * 2 * index.d
