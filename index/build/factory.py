"""Choosing a FAISS index for N vectors of dimension d under a memory budget (the autofaiss way),
and recording why.

- Below ``flat_threshold`` vectors (and when they fit) an exact flat index: no training, no loss.
- Otherwise IVF-PQ: IVF lists ~ 4 * sqrt(N) (a power of two, >= 39 training points per list),
  PQ code bytes as large as the budget allows up to d/8 (more bytes, less quantisation loss),
  stored as 4-bit fast-scan codes (``PQ{2m}x4fsr``: the same bytes, SIMD distance tables, faster
  scans), an HNSW coarse quantizer from 8192 lists on, with an OPQ rotation from 1M vectors on
  when sub-quantizers span >= 8 dimensions (it spreads variance across sub-spaces; worth its
  training time only at scale). Whatever PQ loses is restored by the exact re-scoring of a
  shortlist against the stored float16 vectors (``refine``), which are memory-mapped, not counted
  in RAM.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from core.errors import NeedleInputError

ID_BYTES = 8  # int64 id per vector in the inverted lists
OVERHEAD = 1.15  # inverted-list growth slack and allocator overhead
PQ_BYTES_CANDIDATES = (128, 96, 64, 48, 32, 24, 16, 8, 4)
HNSW_QUANTIZER_FROM = 8192  # lists from which the coarse quantizer is an HNSW graph
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str | int) -> int:
    """``"8GB"`` -> 8e9, ``"512MiB"`` -> 512 * 2**20; plain numbers are bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise NeedleInputError(f"cannot read memory size {text!r} (examples: 8GB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class IndexPlan:
    factory: str  # FAISS index_factory string (metric: inner product)
    kind: str  # "flat" or "ivfpq"
    nlist: int = 0  # IVF lists
    code_bytes: int = 0  # PQ bytes per vector
    n_train: int = 0  # training sample size
    estimated_bytes: int = 0  # RAM of the built index
    reasons: list[str] = field(default_factory=list)  # why each choice was made


def default_nlist(n: int) -> int:
    nlist = 2 ** round(math.log2(max(1.0, 4 * math.sqrt(n))))
    return int(max(1, min(nlist, 2**18, 2 ** int(math.log2(max(1, n // 39))))))


def plan_index(
    n: int,
    d: int,
    budget: int,
    kind: str = "auto",
    factory: str | None = None,
    flat_threshold: int = 100_000,
    points_per_list: int = 64,
    nlist: int | None = None,
    code_bytes: int | None = None,
) -> IndexPlan:
    """The index to build for ``n`` vectors of dimension ``d`` within ``budget`` bytes of RAM."""
    if n < 1:
        raise NeedleInputError("no vectors to index")
    flat_bytes = int(n * (d * 4 + ID_BYTES) * OVERHEAD)
    if factory:
        kind = "flat" if factory.replace("IDMap2,", "").strip() == "Flat" else "ivfpq"
        lists = re.search(r"IVF(\d+)", factory)
        n_list = int(lists.group(1)) if lists else 0
        return IndexPlan(factory, kind, n_list, 0, min(n, n_list * points_per_list), 0, [f"factory {factory!r} given"])
    if kind == "flat" or (kind == "auto" and n < flat_threshold and flat_bytes <= budget):
        why = (
            "asked for an exact index"
            if kind == "flat"
            else f"{n} < {flat_threshold} vectors and {flat_bytes} B fit the budget"
        )
        return IndexPlan("IDMap2,Flat", "flat", estimated_bytes=flat_bytes, reasons=[f"flat: {why}"])
    if kind not in ("auto", "ivfpq"):
        raise NeedleInputError(f"unknown index kind {kind!r}; choose from auto, flat, ivfpq")

    reasons = []
    n_list = nlist or default_nlist(n)
    reasons.append(f"IVF{n_list}: ~4*sqrt(N) lists for N={n}, at least 39 training points each")
    # Beyond a few thousand lists, assigning every vector to its list by brute force dominates the
    # add time: an HNSW graph over the centroids makes that step logarithmic (autofaiss does the same).
    hnsw = n_list >= HNSW_QUANTIZER_FROM
    if hnsw:
        reasons.append(
            f"HNSW32 coarse quantizer: {n_list} lists >= {HNSW_QUANTIZER_FROM}, brute-force assignment would dominate"
        )
    centroid_bytes = n_list * d * 4
    # At most d/8 bytes (d/4 four-bit sub-quantizers): larger codes slow every scan, and the
    # exact re-scoring already restores what coarser codes lose.
    fitting = [
        m
        for m in PQ_BYTES_CANDIDATES
        if d % (2 * m) == 0 and 8 * m <= d and n * (m + ID_BYTES) * OVERHEAD + centroid_bytes <= budget
    ]
    if code_bytes:
        m = code_bytes
    elif fitting:
        m = fitting[0]
        reasons.append(f"PQ {m} bytes/vector: the largest code that divides d={d} and fits {budget} B")
    else:
        raise NeedleInputError(
            f"{n} vectors of d={d} do not fit {budget} B even at 4 bytes/vector "
            f"(needs ~{int(n * (4 + ID_BYTES) * OVERHEAD + centroid_bytes)} B): raise --memory-budget or use --shards"
        )
    sub = 2 * m  # 4-bit fast-scan: two sub-quantizers per byte
    fast = d % sub == 0
    pq = f"PQ{sub}x4fsr" if fast else f"PQ{m}"
    reasons.append(
        "4-bit fast-scan codes: same bytes, SIMD scans" if fast else f"8-bit PQ: d={d} not divisible by {sub}"
    )
    subspaces = sub if fast else m
    opq = n >= 1_000_000 and d // subspaces >= 8
    prefix = f"OPQ{subspaces}_{d}," if opq else ""
    reasons.append(
        "OPQ rotation: N >= 1M and >= 8 dims per sub-quantizer, where balancing variance pays"
        if opq
        else "no OPQ: below 1M vectors or fine sub-quantizers already"
    )
    train_cap = max(n_list * 39, budget // 4 // (d * 4))
    n_train = int(min(n, n_list * points_per_list, train_cap))
    estimated = int(n * (m + ID_BYTES) * OVERHEAD + centroid_bytes)
    ivf = f"IVF{n_list}_HNSW32" if hnsw else f"IVF{n_list}"
    estimated += n_list * 32 * 2 * 4 if hnsw else 0  # graph links
    return IndexPlan(f"{prefix}{ivf},{pq}", "ivfpq", n_list, m, n_train, estimated, reasons)
