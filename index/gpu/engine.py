"""GPU paths for FAISS work, with the CPU as the fallback: which GPU backends exist, and exact
k-NN over a database read in memory-mapped chunks (the ILIAS baseline: ``knn_gpu`` over chunks
of the float16 vectors).

``exact_search(xq, xb_chunks, k)`` runs each chunk on one backend and merges the chunks' top k:

- ``faiss-gpu``: ``faiss.knn_gpu`` (faiss-gpu, the ``gpu`` extra). It takes the chunk as it is
  (float16 or float32 numpy, copied to the GPU by FAISS); its queries are cast to the chunk's
  dtype (knn_gpu wants both alike), so float16 chunks score float16-rounded queries (~1e-4 off).
- ``torch``: a matmul and ``topk`` on a torch device (CUDA, or the CPU in tests and benchmarks),
  ``index.gpu.stream.search_streamed``: the chunk is copied as stored (float16 halves the copy)
  through pinned buffers on a copy stream while the chunk before is scored, the top k's are merged
  on the device. Scores are float32, to about float32's rounding (float16 chunks on CUDA: each
  query split in two float16 parts, two tensor-core products). A database kept on the GPU between
  searches: ``index.gpu.resident.ResidentDatabase``.
- ``faiss-cpu``: ``faiss.knn`` per chunk (converted to float32 in memory).

``device="auto"`` takes the first available of these; results are the same up to float rounding:
every row's k best by score, ties to the smaller id (deterministic on every backend: where a tie
group reaches the end of what a backend returned, that chunk is searched again deeper for those
queries), padded like FAISS with id -1 and the worst float32 score (-FLT_MAX for inner products,
+FLT_MAX for L2) where the database has fewer than k vectors.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Iterable, Iterator
from functools import cache
from typing import Any

import numpy as np

from core.errors import NeedleInputError
from index.gpu.stream import search_streamed  # the torch backend
from index.gpu.topk import (  # the engine; its checks and constants are this module's too
    METRICS,  # noqa: F401 (index.gpu.engine.METRICS, as before)
    TIE_MARGIN,
    WORST,
    check_chunk,
    check_queries,
)

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("faiss-gpu", "torch", "faiss-cpu")
CHUNK_BYTES = 256 << 20  # default chunk of chunks_of: ~256 MB of stored vectors (167k rows of 768-d float16)
FAISS_GPU_MAX_K = 2048  # the largest k faiss-gpu's k-selection supports


def faiss_gpus() -> int:
    """GPUs that FAISS can use: 0 with faiss-cpu, without a CUDA device, or on any error."""
    try:
        import faiss

        if not hasattr(faiss, "StandardGpuResources"):  # a CPU-only build
            return 0
        return int(faiss.get_num_gpus())
    except Exception:  # a broken CUDA runtime must not break CPU use
        return 0


def torch_cuda_available() -> bool:
    """Whether torch sees a CUDA device (torch is imported only when asked)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


@cache
def gpu_resources() -> Any:
    """One ``faiss.StandardGpuResources`` per process for ``knn_gpu`` (scratch memory and
    streams, reused). Not thread-safe: calls that use it hold ``GPU_LOCK``."""
    import faiss

    return faiss.StandardGpuResources()


GPU_LOCK = threading.Lock()  # serialises knn_gpu calls on the shared resources (a server searches from many threads)


def default_chunk_rows(array: np.ndarray) -> int:
    """Rows in ~``CHUNK_BYTES`` of ``array``."""
    return max(1, CHUNK_BYTES // max(1, array.shape[1] * array.itemsize))


def advise_willneed(view: np.ndarray) -> None:
    """Ask the kernel to start reading a memory-mapped slice now (best effort, never raises).

    index/shard_files.py maps the vectors for random access (no readahead, right for re-scoring);
    a full scan needs the readahead back, and asking for the next chunk while the current one is
    scored overlaps the disk with the compute.
    """
    mm = getattr(view, "_mmap", None)
    if mm is None or not view.size or not view.flags.c_contiguous or not hasattr(mmap, "MADV_WILLNEED"):
        return
    try:
        start = view.ctypes.data - np.frombuffer(mm, np.uint8).ctypes.data
        aligned = start - start % mmap.PAGESIZE
        mm.madvise(mmap.MADV_WILLNEED, aligned, start + view.nbytes - aligned)
    except (ValueError, OSError, TypeError, BufferError):
        pass


def check_chunking(array: Any, rows: Any, caller: str) -> int:
    """``rows`` per chunk of a 2-D ``array`` (None: ~``CHUNK_BYTES``), or NeedleInputError."""
    if getattr(array, "ndim", None) != 2:
        raise NeedleInputError(f"{caller} needs a 2-D array, got shape {getattr(array, 'shape', None)}")
    rows = default_chunk_rows(array) if rows is None else rows
    if not isinstance(rows, (int, np.integer)) or isinstance(rows, bool) or rows < 1:
        raise NeedleInputError(f"chunk rows must be an integer >= 1, got {rows!r}")
    return int(rows)


def chunks_of(array: np.ndarray, rows: int | None = None, prefetch: bool = True) -> Iterator[np.ndarray]:
    """Consecutive row slices (views, no copy) of a 2-D array, e.g. a ``np.load(mmap_mode="r")``
    map; ``rows`` per slice (None: ~256 MB each). With ``prefetch``, each slice of a memory map
    is read ahead one slice before it is yielded."""
    rows = check_chunking(array, rows, "chunks_of")
    if prefetch:
        advise_willneed(array[:rows])
    for start in range(0, len(array), rows):
        if prefetch:
            advise_willneed(array[start + rows : start + 2 * rows])
        yield array[start : start + rows]


def chunks_at(
    array: np.ndarray, positions: np.ndarray, rows: int | None = None, prefetch: bool = True
) -> Iterator[np.ndarray]:
    """The rows of ``array`` at ascending ``positions``, ``rows`` at a time (None: ~256 MB): a
    view where a chunk's positions are consecutive, a gathered copy where they skip rows (e.g.
    rows whose image failed, which an index leaves out)."""
    rows = check_chunking(array, rows, "chunks_at")
    positions = np.asarray(positions, dtype=np.int64)
    if len(positions) and (positions[0] < 0 or positions[-1] >= len(array) or (np.diff(positions) <= 0).any()):
        raise NeedleInputError(
            f"positions must ascend strictly within [0, {len(array)}), got {positions[0]}..{positions[-1]}"
        )
    starts = range(0, len(positions), rows)
    spans = [(int(positions[s]), int(positions[min(s + rows, len(positions)) - 1]) + 1) for s in starts]
    if prefetch and spans:
        advise_willneed(array[slice(*spans[0])])
    for i, start in enumerate(starts):
        if prefetch and i + 1 < len(spans):
            advise_willneed(array[slice(*spans[i + 1])])
        (first, stop), count = spans[i], min(rows, len(positions) - start)
        yield array[first:stop] if stop - first == count else array[positions[start : start + count]]


def assignment_quantizer(quantizer: Any, gpu: bool = True) -> Any:
    """A stand-in for an IVF's coarse quantizer (flat or HNSW) while vectors are added: the same
    centroids and metric, nearest centroid found by brute force on GPU 0 (``gpu``; the CPU
    otherwise), centroids read back from a CPU copy. Exact assignment (an HNSW graph's is
    approximate), and the residuals that PQ encodes (``x - centroid``, one vector at a time in
    FAISS) stay on the CPU: a GPU index would answer each with a copy from the device.

    An ``IndexRefineFlat`` over the flat (GPU) index: ``assign`` searches the GPU, ``reconstruct``
    reads the CPU copy."""
    import faiss

    centroids = np.ascontiguousarray(quantizer.reconstruct_n(0, quantizer.ntotal), dtype=np.float32)
    flat = faiss.IndexFlat(quantizer.d, quantizer.metric_type)
    flat.add(centroids)
    keep: list[Any] = [flat]
    searched: Any = flat  # the CPU index, or its GPU copy
    if gpu:
        resources = faiss.StandardGpuResources()  # its own: the shared one is for knn_gpu under GPU_LOCK
        searched = faiss.index_cpu_to_gpu(resources, 0, flat)
        keep += [resources, searched]
    # Any: FAISS's bundled (SWIG) stubs lack the attributes its Python layer sets, referenced_objects
    stand_in: Any = faiss.IndexRefineFlat(searched, faiss.swig_ptr(centroids))
    stand_in.referenced_objects = keep  # FAISS's way of keeping the base index (and GPU resources) alive
    return stand_in


# --- backends: prepare(chunk) once per chunk, then search(xq, prepared, kk) -> (D, I) local ids --
# (faiss ones; the torch backend runs index.gpu.stream.search_streamed)


class FaissCpu:
    name = "faiss-cpu"

    def __init__(self, metric: str):
        import faiss

        self.metric = faiss.METRIC_INNER_PRODUCT if metric == "ip" else faiss.METRIC_L2

    def prepare(self, chunk: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(chunk, dtype=np.float32)

    def search(self, xq: np.ndarray, xb: np.ndarray, kk: int) -> tuple[np.ndarray, np.ndarray]:
        import faiss

        return faiss.knn(xq, xb, kk, self.metric)


class FaissGpu:
    name = "faiss-gpu"

    def __init__(self, metric: str):
        import faiss

        self.metric = faiss.METRIC_INNER_PRODUCT if metric == "ip" else faiss.METRIC_L2
        self.cpu = FaissCpu(metric)

    def prepare(self, chunk: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(chunk)  # float16 or float32 as stored: FAISS copies it to the GPU

    def search(self, xq: np.ndarray, xb: np.ndarray, kk: int) -> tuple[np.ndarray, np.ndarray]:
        import faiss

        if kk > FAISS_GPU_MAX_K:  # only a tie group deeper than the GPU's k-selection gets here
            return self.cpu.search(xq, self.cpu.prepare(xb), kk)
        with GPU_LOCK:
            return faiss.knn_gpu(gpu_resources(), np.ascontiguousarray(xq, dtype=xb.dtype), xb, kk, metric=self.metric)


class TorchBackend:
    """A matmul and ``topk`` on a torch device (CUDA, or the CPU): ``exact_search`` runs it as
    ``index.gpu.stream.search_streamed`` (chunks copied as stored, the copy overlapped with the
    compute on CUDA, the top k merged on the device)."""

    name = "torch"

    def __init__(self, metric: str, device: Any):
        import torch

        self.metric = metric
        self.device = torch.device(device)


def check_device(device: str) -> str:
    """A valid ``device``; "cuda" only where a GPU backend exists (NeedleInputError otherwise)."""
    if device not in DEVICES:
        raise NeedleInputError(f"unknown device {device!r}; choose from {', '.join(DEVICES)}")
    if device == "cuda" and not gpu_backend_available():
        raise NeedleInputError("device 'cuda': neither faiss-gpu nor torch sees a CUDA GPU")
    return device


def auto_backend(device: str, k: int) -> str:
    """The first available of faiss-gpu (while k fits its k-selection, or torch has no CUDA),
    torch on CUDA, faiss-cpu (``device`` checked by ``check_device``: "cuda" has a GPU one)."""
    if device == "cpu":
        return "faiss-cpu"
    gpus, cuda = faiss_gpus(), torch_cuda_available()
    if gpus > 0 and (k + TIE_MARGIN <= FAISS_GPU_MAX_K or not cuda):
        return "faiss-gpu"
    if cuda:
        return "torch"
    return "faiss-cpu"


def choose_backend(device: str = "auto", k: int = 1, backend: str | None = None, metric: str = "ip") -> Any:
    """The backend that ``exact_search`` uses on ``device`` (``backend`` forces one; ``torch``
    then runs on the CPU for "cpu", on CUDA for "cuda", on CUDA where available for "auto")."""
    check_device(device)
    if backend is not None and backend not in BACKENDS:
        raise NeedleInputError(f"unknown exact-search backend {backend!r}; choose from {', '.join(BACKENDS)}")
    backend = backend or auto_backend(device, k)
    if backend == "faiss-gpu":
        if device == "cpu" or faiss_gpus() == 0:
            raise NeedleInputError(
                f"backend 'faiss-gpu' on device {device!r}: faiss sees {faiss_gpus()} GPUs (install the gpu extra)"
            )
        return FaissGpu(metric)
    if backend == "torch":
        cuda = torch_cuda_available()
        if device == "cuda" and not cuda:
            raise NeedleInputError("device 'cuda' for the torch backend, but torch sees no CUDA GPU")
        return TorchBackend(metric, "cuda" if device != "cpu" and cuda else "cpu")
    if device == "cuda":
        raise NeedleInputError("backend 'faiss-cpu' cannot run on device 'cuda'")
    return FaissCpu(metric)


def gpu_backend_available() -> bool:
    """Whether ``exact_search(device="auto")`` would run on a GPU."""
    return faiss_gpus() > 0 or torch_cuda_available()


# --- merging -------------------------------------------------------------------------------------


def sort_candidates(D: np.ndarray, I: np.ndarray, metric: str, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each row's candidates best first (ties to the smaller id, id -1 last), cut or padded to
    ``k`` columns (padding: id -1, score ``WORST[metric]``)."""
    k = D.shape[1] if k is None else k
    if D.shape[1] < k:
        pad = ((0, 0), (0, k - D.shape[1]))
        D, I = np.pad(D, pad, constant_values=WORST[metric]), np.pad(I, pad, constant_values=-1)
    key = -D if metric == "ip" else D
    order = np.lexsort((I, key, I < 0), axis=-1)[:, :k]
    return np.take_along_axis(D, order, 1), np.take_along_axis(I, order, 1)


def order_ties(D: np.ndarray, I: np.ndarray, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """A backend's (D, I), best first, with equal scores put in id order: only the rows whose
    scores are not strictly ordered (ties, rare in real data) are sorted again."""
    key = -D if metric == "ip" else D
    unsure = ~(np.diff(key, axis=1) > 0).all(1)
    if unsure.any():
        D, I = D.copy(), I.copy()
        D[unsure], I[unsure] = sort_candidates(D[unsure], I[unsure], metric)
    return D, I


def merge_sorted(
    D: np.ndarray, I: np.ndarray, D_new: np.ndarray, I_new: np.ndarray, metric: str, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The k best of two candidate lists, each best first with ties in id order, and every id of
    the second larger than the first's: a stable sort by score alone keeps ties in id order (and
    merges the two sorted runs in linear time, ~10x faster than ``sort_candidates``)."""
    D, I = np.concatenate([D, D_new], 1), np.concatenate([I, I_new], 1)
    key = np.minimum(-D if metric == "ip" else D, np.finfo(np.float32).max)
    order = np.argsort(np.where(I < 0, np.inf, key), axis=1, kind="stable")[:, :k]  # padding last
    return np.take_along_axis(D, order, 1), np.take_along_axis(I, order, 1)


def chunk_topk(
    backend: Any, xq: np.ndarray, prepared: Any, n: int, k: int, metric: str
) -> tuple[np.ndarray, np.ndarray]:
    """One chunk's (nq, min(k, n)) best (local ids), ties to the smaller id whatever the backend
    keeps among equal scores: queries whose k-th score equals the last one returned are searched
    again with 4x the depth until their tie group fits or the whole chunk is returned."""
    kk = min(n, k + TIE_MARGIN)
    D, I = backend.search(xq, prepared, kk)
    D, I = order_ties(D, I, metric)
    width = min(k, n)
    D_out, I_out = D[:, :width].copy(), I[:, :width].copy()
    rows = np.arange(len(xq))
    while kk < n:
        tied = D[:, k - 1] == D[:, kk - 1]
        if not tied.any():
            break
        rows, kk = rows[tied], min(n, 4 * kk)
        D, I = backend.search(xq[rows], prepared, kk)
        D, I = order_ties(D, I, metric)
        D_out[rows], I_out[rows] = D[:, :k], I[:, :k]
    return D_out, I_out


def exact_search(
    xq: np.ndarray,
    xb_chunks: Iterable[np.ndarray] | np.ndarray,
    k: int,
    metric: str = "ip",
    device: str = "auto",
    backend: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact k-NN of (nq, d) queries over a database given as consecutive chunks of rows (e.g.
    ``chunks_of(np.load(path, mmap_mode="r"))``; one 2-D array is chunked with ``chunks_of``).

    Returns (D, I): (nq, k) float32 scores and int64 ids (a row's position in the concatenated
    chunks), best first, ties to the smaller id, id -1 and the worst score past the database's
    end. ``device``: "auto" (a GPU backend when there is one) | "cpu" | "cuda" (a GPU or
    NeedleInputError); ``backend`` forces one of ``BACKENDS``.
    """
    xq = check_queries(xq, k, metric)
    chosen = choose_backend(device, k, backend, metric)
    if isinstance(xb_chunks, np.ndarray):
        xb_chunks = chunks_of(xb_chunks)
    if isinstance(chosen, TorchBackend):
        start = time.perf_counter()
        D, I = search_streamed(xq, xb_chunks, k, metric, chosen.device)
        log.debug("exact search on torch (%s): %d queries, k=%d: %.3f s", chosen.device, len(xq), k,
                  time.perf_counter() - start)  # fmt: skip
        return D, I
    nq, d = xq.shape
    D = np.full((nq, k), WORST[metric], dtype=np.float32)
    I = np.full((nq, k), -1, dtype=np.int64)
    start, offset, chunks = time.perf_counter(), 0, 0
    for i, chunk in enumerate(xb_chunks):
        n = len(check_chunk(chunk, i, d))
        if n == 0:
            continue
        if nq:
            D_c, I_c = chunk_topk(chosen, xq, chosen.prepare(chunk), n, k, metric)
            D, I = merge_sorted(D, I, D_c, I_c + offset, metric, k)
        offset += n
        chunks += 1
    log.debug(
        "exact search on %s: %d queries, %d vectors in %d chunks, k=%d: %.3f s",
        chosen.name,
        nq,
        offset,
        chunks,
        k,
        time.perf_counter() - start,
    )
    return D, I
