"""Exact k-NN over a database streamed to a torch device chunk by chunk, the copy overlapped with
the compute: ``index.gpu.engine.exact_search``'s torch backend (the engine: index/gpu/topk.py).

On CUDA (``Stager.prefetch``) a thread copies chunk i+1 into one of ``SLOTS`` pinned buffers and
queues its copy to the device on a copy stream while the GPU scores chunk i; events order each
device buffer's copy after the last compute that read it, and each compute after its chunk's copy,
so a search takes about the longer of the copy and the compute rather than their sum. Three slots,
not two: chunk i-1's slot is released (its ties settled, ``TopK.settle``) after chunk i's compute
is queued, so its event fires only when chunk i is scored; chunk i+1 goes to the third slot, free
since chunk i-1 was scored. On the CPU it is a plain loop.
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from core.errors import NeedleInputError
from index.gpu.topk import Part, TopK, check_chunk, check_queries, row_norms, score_budget, torch_device

STREAM_CHUNK_BYTES = 256 << 20  # search_streamed's chunks of one array (as index.gpu.engine.chunks_of)
SLOTS = 3  # staging buffers (pinned and on the device): chunk i+1 copies while chunk i is scored


def host_tensor(chunk: np.ndarray) -> Any:
    """A torch view of a numpy chunk (read-only memory maps too: torch only reads them)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(chunk))


class Stager:
    """Host-to-device copies that overlap the compute (CUDA): the host copies a chunk into one of
    ``SLOTS`` pinned buffers (once its last device copy ended), then a copy stream to the device
    (once the compute last reading that device buffer, ``release``d, ended); the compute stream
    waits for that copy. ``prefetch`` copies on a thread, chunks ahead of the compute."""

    def __init__(self, device: Any):
        import torch

        self.device, self.cuda, self.turn = device, device.type == "cuda", 0
        self.free: queue.Queue[int | None] | None = None  # slots the copying thread may fill (prefetch)
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.stream = torch.cuda.Stream(device)
            self.stream.wait_stream(self.compute)  # device memory freed by queued work is reused only after it
            self.pinned: list[Any] = [None] * SLOTS
            self.buffers: list[Any] = [None] * SLOTS
            self.copied = [torch.cuda.Event() for _ in range(SLOTS)]
            self.consumed = [torch.cuda.Event() for _ in range(SLOTS)]

    def copy(self, chunk: np.ndarray, slot: int, dest: Any = None) -> Any:
        """Queue ``chunk``'s copy through slot ``slot`` into ``dest`` (its shape, any dtype) or the
        slot's device buffer; returns the device tensor (CUDA only; the compute has not waited)."""
        import torch

        dtype = dest.dtype if dest is not None else torch.float16 if chunk.dtype == np.float16 else torch.float32
        self.copied[slot].synchronize()  # this pinned buffer's last copy to the device ended
        pinned = self.slot_buffer(self.pinned, slot, chunk.shape, dtype, pin_memory=True)
        pinned.copy_(host_tensor(chunk))  # the host's copy (and cast to dest's dtype), in parallel
        if dest is None:
            dest = self.slot_buffer(self.buffers, slot, chunk.shape, dtype, device=self.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.consumed[slot])  # the compute no longer reads this device buffer
            dest.copy_(pinned, non_blocking=True)
            self.copied[slot].record(self.stream)
        return dest

    def upload(self, chunk: np.ndarray, dest: Any) -> None:
        """Copy ``chunk`` into ``dest`` on the device (a float32 copy on the CPU); the compute waits."""
        if not self.cuda:
            dest.copy_(host_tensor(chunk))
            return
        slot, self.turn = self.turn, (self.turn + 1) % SLOTS
        self.stream.wait_stream(self.compute)  # dest may reuse memory that queued compute frees
        self.copy(chunk, slot, dest)
        self.compute.wait_event(self.copied[slot])

    def prefetch(self, chunks: Iterable[Any], d: int) -> Iterator[tuple[int, Any, int | None]]:
        """(rows, the chunk on the device or None where empty, slot) of each chunk, checked; on CUDA
        copied by a thread, ``SLOTS`` - 1 chunks ahead at most: ``release`` a slot to reuse it."""
        if not self.cuda:
            for i, chunk in enumerate(chunks):
                n = len(check_chunk(chunk, i, d))
                yield n, (host_tensor(chunk).float() if n else None), None
            return
        self.free = queue.Queue()
        ready: queue.Queue[Any] = queue.Queue()
        for slot in range(SLOTS):
            self.free.put(slot)
        worker = threading.Thread(target=self.copy_all, args=(chunks, d, ready), daemon=True)
        worker.start()
        try:
            while (item := ready.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                n, xb, slot = item
                if slot is not None:
                    self.compute.wait_event(self.copied[slot])
                yield n, xb, slot
        finally:
            self.free.put(None)  # stops the thread where the search stopped early
            worker.join()

    def copy_all(self, chunks: Iterable[Any], d: int, ready: queue.Queue[Any]) -> None:
        import torch

        try:
            with torch.cuda.device(self.device):
                for i, chunk in enumerate(chunks):
                    if not len(check_chunk(chunk, i, d)):
                        ready.put((0, None, None))
                        continue
                    slot = self.free.get()  # type: ignore[union-attr]
                    if slot is None:
                        return
                    ready.put((len(chunk), self.copy(chunk, slot), slot))
            ready.put(None)
        except BaseException as error:  # raised in the search's thread
            ready.put(error)

    def slot_buffer(self, buffers: list[Any], slot: int, shape: tuple[int, int], dtype: Any, **where: Any) -> Any:
        """Slot ``slot`` of ``buffers`` as a (rows, d) tensor, grown (never shrunk) as chunks need."""
        import torch

        size = shape[0] * shape[1]
        held = buffers[slot]
        if held is None or held.numel() < size or held.dtype != dtype:
            buffers[slot] = held = torch.empty(max(size, 1), dtype=dtype, **where)
            if "device" in where:
                self.stream.wait_stream(self.compute)  # it may reuse memory that queued compute frees
        return held[:size].view(shape)

    def release(self, slot: int | None) -> None:
        """The compute queued so far is the last to read slot ``slot``'s device buffer."""
        if self.cuda and slot is not None:
            self.consumed[slot].record(self.compute)
            if self.free is not None:
                self.free.put(slot)

    def finish(self) -> None:
        if self.cuda:
            self.compute.wait_stream(self.stream)


def array_chunks(xb: np.ndarray) -> Iterator[np.ndarray]:
    """Row slices of ~``STREAM_CHUNK_BYTES`` of a 2-D array."""
    if xb.ndim != 2:
        raise NeedleInputError(f"the database must be a 2-D array, got shape {xb.shape}")
    rows = max(1, STREAM_CHUNK_BYTES // max(1, xb.shape[1] * xb.itemsize))
    for start in range(0, len(xb), rows):
        yield xb[start : start + rows]


def search_streamed(
    xq: np.ndarray,
    xb_chunks: Iterable[np.ndarray] | np.ndarray,
    k: int,
    metric: str = "ip",
    device: Any = "cuda",
    score_bytes: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact k-NN of (nq, d) queries over a database given as consecutive (n_i, d) float16/float32
    chunks, each copied to ``device`` while the one before is scored (on CUDA; a plain loop on the
    CPU), the top k merged there and copied back once. (D, I) as ``index.gpu.engine.exact_search``:
    (nq, k) float32 scores best first, int64 ids, ties to the smaller id, id -1 and the worst score
    past the end. ``score_bytes``: the score matrix budget (``score_budget``)."""
    xq = check_queries(xq, k, metric)
    dev = torch_device(device)
    chunks = array_chunks(xb_chunks) if isinstance(xb_chunks, np.ndarray) else xb_chunks
    top, stager = TopK(xq, k, metric, dev, score_budget(dev, score_bytes), "split"), Stager(dev)
    waiting: tuple[Part, int | None] | None = None
    offset = 0
    for n, xb, slot in stager.prefetch(chunks, xq.shape[1]):
        if xb is None or not len(xq):
            stager.release(slot)
        else:
            part = top.add(xb, row_norms(xb) if metric == "l2" else None, offset)
            if waiting is not None:  # the chunk before: its ties settled while this one is scored
                top.settle(waiting[0])
                stager.release(waiting[1])
            waiting = (part, slot)
        offset += n
    if waiting is not None:
        top.settle(waiting[0])
    stager.finish()
    return top.result()
