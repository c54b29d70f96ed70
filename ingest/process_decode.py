"""PIL decoding in worker processes instead of threads: ``needle ingest --decoder pil-processes``.

PIL releases the GIL while libjpeg decodes and while it resizes, but not while it parses a file's
headers, converts modes or copies pixels into a numpy array. On a 16-core GPU node sixteen decoding
threads and the thread that feeds the model share one GIL: on an H200, SigLIP-B16 made 1,252 img/s
alone, PIL 1,291 img/s alone on 16 threads, and the worker with both 503 (docs/gpu.md measures this
again, with the GIL handed over more often and with processes). Processes have a GIL each; the
price is one copy of each sample's bytes there and of its pixels back.

The same contract as :class:`ingest.gpu_decode.GpuJpegDecoder`: ``__call__(items, longer_sides)``
with [(key, bytes)] returns per item ({longer side: RGB uint8 array}, width, height) or its
ImageDecodeError; the pixels are exactly PIL's, as with threads.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from core.errors import ImageDecodeError
from ingest.images import decode_resized_many


def _decode_items(items: list[tuple[str, bytes]], longer_sides: tuple[int, ...]) -> list[Any]:
    """In a worker process: each item decoded, or ("error", reason) (exceptions with several
    constructor arguments do not survive pickling)."""
    out: list[Any] = []
    for key, data in items:
        try:
            out.append(decode_resized_many(data, longer_sides, key))
        except ImageDecodeError as exc:
            out.append(("error", exc.reason))
    return out


class ProcessDecoder:
    """Batches of samples decoded by PIL in ``processes`` worker processes."""

    batch = 16  # samples per call: enough to amortise the round trip, small enough to spread
    # The pipeline may have this many calls in flight at once (one per process).

    def __init__(self, processes: int):
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.concurrency = processes
        # spawn: a fork of a process holding CUDA or running threads is not safe.
        self.pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))

    def __call__(self, items: list[tuple[str, bytes]], longer_sides: tuple[int, ...]) -> list[Any]:
        results = self.pool.submit(_decode_items, items, longer_sides).result()
        return [
            ImageDecodeError(key, result[1]) if isinstance(result, tuple) and result[0] == "error" else result
            for (key, _), result in zip(items, results)
        ]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
