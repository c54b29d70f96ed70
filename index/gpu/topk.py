"""Exact k-NN on a torch device with the top k kept there, over a database searched a part at a
time: the engine of ``index.gpu.stream.search_streamed`` (``index.gpu.engine.exact_search``'s torch
backend) and of ``index.gpu.resident.ResidentDatabase``.

Each part (a chunk copied to the device, or a resident block of rows) is scored in device chunks
whose float32 score matrix (queries x rows) fits a budget (``score_budget``, ``plan_blocks``: the
queries are split where it would not over ``4 * (k + TIE_MARGIN)`` rows). A device chunk's best
``k + TIE_MARGIN`` (``grouped_topk``) are put in (score, id) order and merged into the part's top k
on the device, the part's into the search's; (D, I) come back to the host once. Ties go to the
smaller id: a query whose k-th score equals the last one a chunk returned (a tie group cut by
topk) has that part searched again exactly (``exact_candidates``).

Precision: float32 scores. On the CPU all in float32. On CUDA, streamed float16 chunks are scored
with each query split in two float16 parts (q = hi + rest: two tensor-core products summed in
float32, about float32's error), a resident database's float16 rows with the queries rounded to
float16 (~1e-4 off for unit vectors, as faiss-gpu); float32 rows in float32 (TF32 off, torch's
default). torch is imported only when a search runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.errors import NeedleInputError

log = logging.getLogger(__name__)

METRICS = ("ip", "l2")  # inner product (larger is better) | squared L2 distance (smaller is better)
TIE_MARGIN = 16  # extra candidates asked of each chunk, so that ties at the k-th score rarely need a second search
WORST = {"ip": -np.finfo(np.float32).max, "l2": np.finfo(np.float32).max}  # FAISS's padding scores
FLT_MAX = float(np.finfo(np.float32).max)
SCORE_BYTES_CUDA = 4 << 30  # the score matrix of one device chunk on a GPU (at most a quarter of free memory)
SCORE_BYTES_CPU = 1 << 28  # ... on the CPU (as the old torch backend's query blocks)
ROW_ALIGN = 256  # device chunks of a multiple of this many rows (cuBLAS is several times slower on odd strides)
GROUP = 16  # topk over the best rows of each group of this many (see grouped_topk)
PRECISIONS = ("float32", "half", "split")  # how float16 rows are scored on CUDA (TopK)
HALF_MAX = 60_000.0  # queries with a larger component are scored in float32 (float16 ends at 65504)
REST_SHIFT = 11  # "split": what float16 leaves of a query, times 2^11 (float16 keeps 11 bits)


# --- input checks (index.gpu.engine re-exports them) ----------------------------------------------------


def check_queries(xq: np.ndarray, k: int, metric: str) -> np.ndarray:
    xq = np.asarray(xq)
    if xq.ndim != 2 or xq.dtype.kind not in "fiu":
        raise NeedleInputError(f"queries must be a 2-D (nq, d) float array, got shape {xq.shape} dtype {xq.dtype}")
    xq = np.ascontiguousarray(xq, dtype=np.float32)
    if not np.isfinite(xq).all():
        raise NeedleInputError("queries contain NaN or inf")
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
        raise NeedleInputError(f"k must be an integer >= 1, got {k!r}")
    if metric not in METRICS:
        raise NeedleInputError(f"unknown metric {metric!r}; choose from {', '.join(METRICS)}")
    return xq


def check_chunk(chunk: Any, i: int, d: int) -> np.ndarray:
    if (
        not isinstance(chunk, np.ndarray)
        or chunk.ndim != 2
        or chunk.shape[1] != d
        or chunk.dtype not in (np.float16, np.float32)
    ):
        raise NeedleInputError(
            f"database chunk {i} has shape {getattr(chunk, 'shape', None)} "
            f"and dtype {getattr(chunk, 'dtype', type(chunk).__name__)}; "
            f"expected an (n, {d}) float16 or float32 numpy array"
        )
    return chunk


def torch_device(device: Any) -> Any:
    """``device`` ("cpu", "cuda", "cuda:1", a torch.device) as a torch.device with its index, or
    NeedleInputError (an unknown device, or CUDA that torch does not see)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise NeedleInputError(f"unknown device {device!r}; use 'cpu' or 'cuda'") from error
    if dev.type not in ("cpu", "cuda"):
        raise NeedleInputError(f"unknown device {device!r}; use 'cpu' or 'cuda'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise NeedleInputError(f"device {device!r}: torch sees no CUDA GPU")
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    return dev


def score_budget(device: Any, score_bytes: int | None = None) -> int:
    """Bytes for one device chunk's score matrix: ``score_bytes``, or ``SCORE_BYTES_CPU`` on the
    CPU, ``SCORE_BYTES_CUDA`` on a GPU but at most a quarter of its free memory (>= 64 MB)."""
    if score_bytes is not None:
        if not isinstance(score_bytes, (int, np.integer)) or isinstance(score_bytes, bool) or score_bytes < 1:
            raise NeedleInputError(f"score_bytes must be an integer >= 1, got {score_bytes!r}")
        return int(score_bytes)
    if device.type != "cuda":
        return SCORE_BYTES_CPU
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    return max(64 << 20, min(SCORE_BYTES_CUDA, free // 4))


def plan_blocks(nq: int, n: int, k: int, metric: str, budget: int) -> tuple[int, int]:
    """(queries per block, rows per device chunk) for nq queries over n rows: a chunk's scores
    (4 bytes a pair, 8 for L2's second matrix) within ``budget``, chunks of at least
    ``4 * (k + TIE_MARGIN)`` rows (fewer queries per block rather than thinner chunks), a multiple
    of ``ROW_ALIGN`` rows where more."""
    per_pair = 4 if metric == "ip" else 8
    floor = max(1, min(n, 4 * (k + TIE_MARGIN)))
    queries = max(1, min(nq, budget // (per_pair * floor)))
    rows = max(floor, min(n, budget // (per_pair * queries)))
    return queries, rows if rows == n or rows < 2 * ROW_ALIGN else rows // ROW_ALIGN * ROW_ALIGN


# --- on the device: scores, a chunk's candidates, merging ----------------------------------------


_OUT_DTYPE_MM = [True]  # torch.mm(..., out_dtype=) works here (checked at the first float16 product)


def half_product(q: Any, xb: Any) -> Any:
    """float16 (m, d) x (n, d)^T accumulated and returned in float32 (cuBLAS), or, where this torch
    lacks ``mm(out_dtype=)``, the product of the two converted to float32."""
    import torch

    if _OUT_DTYPE_MM[0]:
        try:
            return torch.mm(q, xb.T, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError) as error:
            _OUT_DTYPE_MM[0] = False
            log.warning("torch.mm(out_dtype=float32) failed (%s): float16 rows are converted to float32", error)
    return q.float() @ xb.float().T


@dataclass
class Queries:
    """One block of queries on the device: float32; for float16 rows on CUDA, float16 and (split)
    the float16 rounding of what float16 left out; squared norms (L2)."""

    f32: Any
    f16: Any
    f16_rest: Any
    norms: Any

    @classmethod
    def of(cls, xq: Any, metric: str, precision: str) -> Queries:
        """``precision`` "float32" (or queries beyond float16's range), "half", "split": the rest
        scaled by 2^REST_SHIFT, out of float16's subnormals (exact: a power of two)."""
        f16 = rest = None
        if xq.is_cuda and precision != "float32" and len(xq) and float(xq.abs().max()) < HALF_MAX:
            f16 = xq.half()
            if precision == "split":
                rest = (xq - f16.float()).mul_(2.0**REST_SHIFT).half()
        return cls(xq, f16, rest, (xq * xq).sum(1, keepdim=True) if metric == "l2" else None)

    def take(self, rows: Any) -> Queries:
        return Queries(*(None if t is None else t[rows] for t in (self.f32, self.f16, self.f16_rest, self.norms)))


def row_norms(xb: Any) -> Any:
    """Squared norms (float32) of a device chunk's rows, 64k rows at a time (float16 converted)."""
    import torch

    return torch.cat([(x.float() ** 2).sum(1) for x in xb.split(65_536)]) if len(xb) else xb.new_zeros(0).float()


def scores(q: Queries, xb: Any, norms: Any, metric: str) -> Any:
    """(queries, rows) float32 scores: inner products, or |q|^2 + |x|^2 - 2 q.x clamped at 0 (as
    FAISS). float16 rows with float16 queries (``q.f16``, plus the rest's product: error ~2^-22
    of |q||x|, float32's), else in float32 (rows converted)."""
    import torch

    if xb.dtype == torch.float16 and q.f16 is not None:
        s = half_product(q.f16, xb)
        if q.f16_rest is not None:
            s.add_(half_product(q.f16_rest, xb), alpha=2.0**-REST_SHIFT)
    else:
        s = q.f32 @ xb.float().T
    if metric == "l2":
        s = torch.add(q.norms, norms).sub_(s, alpha=2).clamp_min_(0)
    return s


def order_ties(D: Any, I: Any, largest: bool) -> tuple[Any, Any]:
    """Candidates by score, equal scores by id (sort by id, then a stable sort by score)."""
    I, perm = I.sort(dim=1)
    D, perm = D.gather(1, perm).sort(dim=1, descending=largest, stable=True)
    return D, I.gather(1, perm)


def grouped_topk(s: Any, kk: int, largest: bool) -> tuple[Any, Any]:
    """``torch.topk(s, kk, sorted=False)`` of (nq, n) scores, reading most of them once: the kk groups
    of ``GROUP`` columns with the best maxima hold the kk best scores (a group left out has kk
    better maxima before it, ties aside: ``chunk_candidates`` flags those), so topk runs over the
    groups' maxima and then over the kk * GROUP scores of the chosen groups (and the last columns
    that fill no group)."""
    import torch

    nq, n = s.shape
    whole = n // GROUP * GROUP
    if whole // GROUP < 4 * kk:  # few groups: the plain topk costs as little
        return torch.topk(s, kk, dim=1, largest=largest, sorted=False)
    body = s[:, :whole].view(nq, whole // GROUP, GROUP)
    best = body.amax(2) if largest else body.amin(2)
    groups = torch.topk(best, kk, dim=1, largest=largest, sorted=False).indices
    cols = (groups.unsqueeze(2) * GROUP + torch.arange(GROUP, device=s.device)).flatten(1)
    if whole < n:
        cols = torch.cat([cols, torch.arange(whole, n, device=s.device).expand(nq, -1)], 1)
    D, at = torch.topk(s.gather(1, cols), kk, dim=1, largest=largest, sorted=False)
    return D, cols.gather(1, at)


def chunk_candidates(s: Any, k: int, largest: bool) -> tuple[Any, Any, Any]:
    """A device chunk's best ``min(k, n)`` (local ids, ties to the smaller id unless flagged) and
    the flag per query: its k-th score equals the last of the ``k + TIE_MARGIN`` that topk gave,
    so a tie group may be cut (``exact_candidates`` then answers)."""
    import torch

    n = s.shape[1]
    kk, width = min(n, k + TIE_MARGIN), min(k, n)
    D, I = order_ties(*grouped_topk(s, kk, largest), largest)
    tied = D[:, k - 1] == D[:, kk - 1] if kk < n else torch.zeros(len(s), dtype=torch.bool, device=s.device)
    return D[:, :width], I[:, :width], tied


def exact_candidates(s: Any, k: int, largest: bool) -> tuple[Any, Any]:
    """A device chunk's best ``min(k, n)`` with ties to the smaller id however large the tie group:
    every row better than the k-th score, then the smallest ids of those equal to it."""
    import torch

    n = s.shape[1]
    width = min(k, n)
    kth = torch.topk(s, width, dim=1, largest=largest).values[:, -1:]
    ids = torch.arange(n, device=s.device)
    key = torch.where(s == kth, -ids, -n - 1)
    key = torch.where(s > kth if largest else s < kth, 1, key)
    I = torch.topk(key, width, dim=1).indices
    return order_ties(s.gather(1, I), I, largest)


def merge(D: Any, I: Any, D_new: Any, I_new: Any, k: int, largest: bool) -> tuple[Any, Any]:
    """The k best of two lists in (score, id) order whose second's ids are all larger: a stable
    sort by score (padding, id -1, last) keeps ties in id order."""
    D, I = torch_cat(D, D_new), torch_cat(I, I_new)
    key = D.clamp(-FLT_MAX, FLT_MAX).masked_fill(I < 0, -np.inf if largest else np.inf)
    order = key.sort(dim=1, descending=largest, stable=True).indices[:, :k]
    return D.gather(1, order), I.gather(1, order)


def torch_cat(a: Any, b: Any) -> Any:
    import torch

    return torch.cat([a, b], 1)


# --- the search: parts added, ties settled, one copy back ----------------------------------------


@dataclass
class Part:
    """One part's running top k (local ids) and tie flags, waiting for ``TopK.settle``."""

    xb: Any
    norms: Any
    offset: int
    D: Any
    I: Any
    tied: Any


class TopK:
    """The running top k of (nq, d) queries on a device over parts added in id order; with
    ``precision`` (CUDA), float16 rows are scored in float32 (converted), with float16 queries
    ("half"), or with the queries split in two float16 parts ("split": two tensor-core products,
    float32's precision; the budget halved for the second product)."""

    def __init__(self, xq: np.ndarray, k: int, metric: str, device: Any, budget: int, precision: str = "float32"):
        import torch

        if precision not in PRECISIONS:
            raise NeedleInputError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
        self.k, self.metric, self.device = k, metric, device
        self.budget = budget // 2 if precision == "split" else budget
        self.largest = metric == "ip"
        self.queries = Queries.of(torch.from_numpy(xq).to(device), metric, precision)
        self.D = torch.full((len(xq), k), float(WORST[metric]), dtype=torch.float32, device=device)
        self.I = torch.full((len(xq), k), -1, dtype=torch.int64, device=device)

    def add(self, xb: Any, norms: Any, offset: int) -> Part:
        """Queue the scoring of a part (rows ``offset``...) chunk by chunk; nothing waits for the device."""
        import torch

        nq = len(self.D)
        worst = float(WORST[self.metric])
        part = Part(xb, norms, offset, self.D.new_full(self.D.shape, worst), torch.full_like(self.I, -1),
                    torch.zeros(nq, dtype=torch.bool, device=self.device))  # fmt: skip
        block, rows = plan_blocks(nq, len(xb), self.k, self.metric, self.budget)
        for q0 in range(0, nq, block):
            q = self.queries.take(slice(q0, q0 + block))
            D, I = part.D[q0 : q0 + block], part.I[q0 : q0 + block]
            for r0 in range(0, len(xb), rows):
                s = scores(q, xb[r0 : r0 + rows], None if norms is None else norms[r0 : r0 + rows], self.metric)
                D_c, I_c, tied = chunk_candidates(s, self.k, self.largest)
                D, I = merge(D, I, D_c, I_c + r0, self.k, self.largest)
                part.tied[q0 : q0 + block] |= tied
            part.D[q0 : q0 + block], part.I[q0 : q0 + block] = D, I
        return part

    def settle(self, part: Part) -> None:
        """Search the part again exactly for its flagged queries (waits for the device), then merge
        it into the top k."""
        rows = part.tied.nonzero().flatten()
        if len(rows):
            self.search_exactly(part, rows)
        I = part.I.masked_fill(part.I < 0, -1 - part.offset) + part.offset
        self.D, self.I = merge(self.D, self.I, part.D, I, self.k, self.largest)

    def search_exactly(self, part: Part, rows: Any) -> None:
        log.debug("%d queries tie at their k-th score in a chunk: searched again exactly", len(rows))
        block, step = plan_blocks(len(rows), len(part.xb), self.k, self.metric, self.budget)
        for b0 in range(0, len(rows), block):
            sel = rows[b0 : b0 + block]
            q = self.queries.take(sel)
            D, I = (
                part.D.new_full((len(sel), self.k), float(WORST[self.metric])),
                part.I.new_full((len(sel), self.k), -1),
            )
            for r0 in range(0, len(part.xb), step):
                norms = None if part.norms is None else part.norms[r0 : r0 + step]
                s = scores(q, part.xb[r0 : r0 + step], norms, self.metric)
                D_c, I_c = exact_candidates(s, self.k, self.largest)
                D, I = merge(D, I, D_c, I_c + r0, self.k, self.largest)
            part.D[sel], part.I[sel] = D, I

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(D, I) on the host: one copy back."""
        return self.D.cpu().numpy(), self.I.cpu().numpy()
