"""A database kept in device memory for exact k-NN (``ResidentDatabase``), the rule for when one
fits (``fits_on_device``), and the choice a flat shard makes between keeping its vectors on the
GPU and streaming them at every search (``keep_resident``).

``ResidentDatabase(xb, "cuda")`` copies the rows once (float16 on CUDA, float32 on the CPU, where
results equal FAISS's flat search) through pinned buffers; ``search(xq, k)`` then scores them
where they are, in device chunks whose score matrix fits a budget, merges the top k's on the device
and copies (D, I) back once (index/gpu/topk.py: the engine, ties to the smaller id, precision).

It fits where its bytes leave ``headroom`` (a fraction of the device's total memory, 10 % unless
told) free: ``torch.cuda.mem_get_info``'s free memory on CUDA, the available physical memory on
the CPU. The headroom is for the searches' score matrices (``gpu_topk.score_budget``, at most
4 GiB or a quarter of what is free) and whatever else shares the GPU. A database that does not
fit is streamed by ``gpu_stream.search_streamed``, its copy overlapped with the compute.

torch is imported only when a database is built or measured.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from core.errors import NeedleInputError
from index.gpu.stream import STREAM_CHUNK_BYTES, Stager, array_chunks
from index.gpu.topk import METRICS, TopK, check_chunk, check_queries, row_norms, score_budget, torch_device
from index.memory import cpu_available_bytes

log = logging.getLogger(__name__)

HEADROOM = 0.10  # of the device's total memory left free beside a resident database
DTYPES = ("float16", "float32")


def device_memory(device: Any) -> tuple[int, int]:
    """(free, total) bytes of ``device``: ``torch.cuda.mem_get_info`` on CUDA, the available and
    total physical memory on the CPU."""
    dev = torch_device(device)
    if dev.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(dev)
        return int(free), int(total)
    page = os.sysconf("SC_PAGE_SIZE")
    return cpu_available_bytes(os.sysconf("SC_AVPHYS_PAGES") * page), os.sysconf("SC_PHYS_PAGES") * page


def resident_nbytes(n: int, d: int, device: Any = "cuda", metric: str = "ip", dtype: str | None = None) -> int:
    """Bytes that ``ResidentDatabase`` holds for n x d rows: float16 on CUDA, float32 on the CPU
    (unless ``dtype``), with float32 squared norms for L2."""
    dtype = dtype or ("float16" if torch_device(device).type == "cuda" else "float32")
    return n * d * (2 if dtype == "float16" else 4) + (4 * n if metric == "l2" else 0)


def fits_on_device(nbytes: int, device: Any = "cuda", headroom: float = HEADROOM) -> bool:
    """Whether ``nbytes`` more fit on ``device`` leaving ``headroom`` (a fraction of its total
    memory) free: ``nbytes <= free - headroom * total`` (``device_memory``)."""
    if not 0 <= headroom < 1:
        raise NeedleInputError(f"headroom must be a fraction in [0, 1), got {headroom!r}")
    free, total = device_memory(device)
    return nbytes <= free - headroom * total


class ResidentDatabase:
    """(n, d) rows held on a torch device for exact k-NN, searched with ``search(xq, k)``.

    ``xb``: an (n, d) float16/float32 array, or consecutive chunks of rows (each becomes a block
    of its own on the device, or, with ``rows`` = their total, all one block). ``dtype``: how the
    rows are held, "float16" on CUDA and "float32" on the CPU unless told. ``score_bytes``: the
    budget of one device chunk's score matrix (``gpu_topk.score_budget``).
    """

    def __init__(
        self,
        xb: np.ndarray | Iterable[np.ndarray],
        device: Any = "cuda",
        metric: str = "ip",
        *,
        dtype: str | None = None,
        rows: int | None = None,
        score_bytes: int | None = None,
    ):
        if metric not in METRICS:
            raise NeedleInputError(f"unknown metric {metric!r}; choose from {', '.join(METRICS)}")
        self.device, self.metric = torch_device(device), metric
        dtype = dtype or ("float16" if self.device.type == "cuda" else "float32")
        if dtype not in DTYPES:
            raise NeedleInputError(f"unknown dtype {dtype!r} for resident rows; choose from {', '.join(DTYPES)}")
        if rows is not None and (not isinstance(rows, (int, np.integer)) or isinstance(rows, bool) or rows < 0):
            raise NeedleInputError(f"rows must be an integer >= 0, got {rows!r}")
        self.score_bytes = None if score_bytes is None else score_budget(self.device, score_bytes)
        self.d: int | None = None
        chunks = xb
        if isinstance(xb, np.ndarray):
            self.d = check_chunk(xb, 0, xb.shape[1] if xb.ndim == 2 else -1).shape[1]
            chunks, rows = array_chunks(xb), len(xb)
        self.parts: list[tuple[Any, Any, int]] = []  # (rows on the device, their squared norms (L2), first id)
        self.upload(chunks, dtype, rows)

    def upload(self, chunks: Iterable[np.ndarray], dtype: str, rows: int | None) -> None:
        """Copy the chunks to the device (pinned buffers, a copy stream), into one block of
        ``rows`` rows, or a block per chunk."""
        import torch

        stager, block, filled, n = Stager(self.device), None, 0, 0
        for i, chunk in enumerate(chunks):
            self.d = self.d or (chunk.shape[1] if getattr(chunk, "ndim", 0) == 2 else -1)
            check_chunk(chunk, i, self.d)
            if block is None or filled == len(block):
                size = len(chunk) if rows is None else rows - n
                block, filled = torch.empty((size, self.d), dtype=getattr(torch, dtype), device=self.device), 0
                self.parts.append((block, None, n))
            if filled + len(chunk) > len(block):
                raise NeedleInputError(f"the chunks hold more rows than rows={rows}")
            step = max(1, STREAM_CHUNK_BYTES // max(1, self.d * chunk.itemsize))
            for start in range(0, len(chunk), step):
                piece = chunk[start : start + step]
                stager.upload(piece, dest=block[filled : filled + len(piece)])
                filled += len(piece)
            n += len(chunk)
        if rows is not None and n != rows:
            raise NeedleInputError(f"the chunks hold {n} rows, not rows={rows}")
        stager.finish()
        if self.metric == "l2":
            self.parts = [(xb, row_norms(xb), offset) for xb, _, offset in self.parts]
        self.parts = [part for part in self.parts if len(part[0])]
        self.ntotal = n

    @property
    def nbytes(self) -> int:
        """Bytes held on the device (rows, and squared norms for L2)."""
        return sum(
            xb.numel() * xb.element_size() + (0 if norms is None else norms.numel() * 4) for xb, norms, _ in self.parts
        )

    def __len__(self) -> int:
        return self.ntotal

    def search(self, xq: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact k-NN of (nq, d) queries: (nq, k) float32 scores best first (FAISS's convention,
        as ``index.gpu.engine.exact_search``) and int64 ids, ties to the smaller id, id -1 and the worst
        score past the end. Scored on the device, merged there, one copy back."""
        xq = check_queries(xq, k, self.metric)
        if self.d is not None and xq.shape[1] != self.d:
            raise NeedleInputError(f"queries have d={xq.shape[1]}; this database has d={self.d}")
        top = TopK(xq, k, self.metric, self.device, score_budget(self.device, self.score_bytes), "half")
        if len(xq):
            waiting = None
            for xb, norms, offset in self.parts:
                part = top.add(xb, norms, offset)  # queued: the part before settles while it runs
                if waiting is not None:
                    top.settle(waiting)
                waiting = part
            if waiting is not None:
                top.settle(waiting)
        return top.result()


def keep_resident(
    chunks: Callable[[], Iterable[np.ndarray]],
    n: int,
    d: int,
    device: Any = "cuda",
    metric: str = "ip",
    label: str = "database",
    headroom: float = HEADROOM,
) -> ResidentDatabase | None:
    """A ``ResidentDatabase`` of the n x d rows that ``chunks()`` yields where it fits on
    ``device`` (``fits_on_device``), else None with a warning saying why (the caller streams)."""
    import torch

    dev = torch_device(device)
    nbytes = resident_nbytes(n, d, dev, metric)
    free, total = device_memory(dev)
    if not fits_on_device(nbytes, dev, headroom):
        log.warning(
            "%s: %d x %d vectors (%.2f GB) do not fit on %s (%.2f GB free of %.2f GB, %.0f%% kept as headroom): "
            "each search streams them, the copy overlapped with the compute",
            label, n, d, nbytes / 1e9, dev, free / 1e9, total / 1e9, 100 * headroom,
        )  # fmt: skip
        return None
    try:
        database = ResidentDatabase(chunks(), dev, metric, rows=n)
    except torch.OutOfMemoryError as error:
        torch.cuda.empty_cache()
        log.warning("%s: out of memory keeping %.2f GB on %s (%s): each search streams them", label, nbytes / 1e9, dev,
                    str(error).splitlines()[0])  # fmt: skip
        return None
    log.info("%s: %d x %d vectors (%.2f GB) kept on %s for exact search", label, n, d, database.nbytes / 1e9, dev)
    return database
