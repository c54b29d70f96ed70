"""Processing one shard: stream samples, decode in background threads, extract, write one Parquet.

Plain library code: ``cluster/`` runs :func:`process_shard` inside Ray actors, tests call it
directly. Decoding (PIL releases the GIL) runs in a thread pool and stays a couple of batches ahead
of the model, so decoding overlaps model compute.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.errors import ImageDecodeError, ShardReadError
from core.location import Location, output_location
from core.storage import open_url
from ingest.descriptors import (
    STATUS_ERROR,
    STATUS_OK,
    descriptor_schema,
    fixed_size_list,
    list_column,
    make_row_id,
)
from ingest.images import decode_resized_many
from ingest.reader import image_bytes, iter_samples
from ingest.shards import shard_name

log = logging.getLogger(__name__)

T = TypeVar("T")


FAILED_SHOWN = 20  # error rows a shard's result names (its error_rows counts them all)
# Images handed to the extractors at once on CPU (they batch equal input shapes within a chunk).
CHUNK_SIZE = 64
# On GPU: only equal input shapes share a batch, and real photos come in hundreds of shapes, so a
# larger window keeps batches full (realbench at 384 px: 248 shapes among 1,650 photos).
GPU_CHUNK_SIZE = 512


@dataclass(frozen=True)
class ShardResult:
    url: str  # the shard read
    shard: str  # its name
    status: str  # "ok" (Parquet committed) or "failed" (nothing written)
    output: str | None  # the committed Parquet file
    rows: int  # samples written (ok + error rows)
    error_rows: int  # samples that could not be decoded
    seconds: float  # wall time of the shard
    reason: str = ""  # why the shard failed
    failed_images: tuple[dict[str, str], ...] = ()  # the first FAILED_SHOWN error rows: {key, reason}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Decoded:
    key: str
    images: dict[int, np.ndarray] | None  # longer side -> RGB array, one per extractor resolution
    width: int
    height: int
    error: str


class Extractor(Protocol):
    """What an ingestion worker needs from an extractor."""

    resolution: int  # longer side the images must be resized to

    def extra_fields(self) -> list[pa.Field]: ...  # columns beyond the schema's base ones

    def __call__(self, images: list[np.ndarray]) -> dict[str, np.ndarray]: ...

    def info(self) -> dict[str, Any]: ...  # how the columns were made, for the JSON beside the output


class BatchDecoder(Protocol):
    """Decodes batches of samples elsewhere than on the decode threads (the GPU, processes)."""

    batch: int  # samples per call
    concurrency: int  # calls the pipeline may have in flight at once

    def __call__(self, items: list[tuple[str, bytes]], longer_sides: tuple[int, ...]) -> list[Any]: ...


def _decode_sample(sample: dict[str, Any], longer_sides: tuple[int, ...]) -> _Decoded:
    key = sample["__key__"]
    data = image_bytes(sample)
    if data is None:
        members = sorted(k for k in sample if not k.startswith("__"))
        return _Decoded(key, None, 0, 0, f"sample has no image member (members: {members})")
    try:
        images, width, height = decode_resized_many(data, longer_sides, key)
    except ImageDecodeError as exc:
        return _Decoded(key, None, 0, 0, exc.reason)
    return _Decoded(key, images, width, height, "")


def _decoded_stream(
    samples: Iterator[dict[str, Any]], longer_sides: tuple[int, ...], pool: ThreadPoolExecutor, ahead: int
) -> Iterator[_Decoded]:
    """Decode samples in ``pool``, keeping up to ``ahead`` decodes in flight, in input order."""
    pending: deque[Future[_Decoded]] = deque()
    for sample in samples:
        pending.append(pool.submit(_decode_sample, sample, longer_sides))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _decode_batch(
    samples: list[dict[str, Any]], longer_sides: tuple[int, ...], decoder: BatchDecoder
) -> list[_Decoded]:
    """A batch of samples through a batched decoder (GpuJpegDecoder, ProcessDecoder)."""
    out: list[_Decoded | None] = [None] * len(samples)
    items = []
    for i, sample in enumerate(samples):
        data = image_bytes(sample)
        if data is None:
            out[i] = _decode_sample(sample, longer_sides)  # the no-image-member error row
        else:
            items.append((i, sample["__key__"], data))
    results = decoder([(key, data) for _, key, data in items], longer_sides)
    for (i, key, _), result in zip(items, results):
        if isinstance(result, ImageDecodeError):
            out[i] = _Decoded(key, None, 0, 0, result.reason)
        else:
            images, width, height = result
            out[i] = _Decoded(key, images, width, height, "")
    return out


def _batch_decoded_stream(
    samples: Iterator[dict[str, Any]],
    longer_sides: tuple[int, ...],
    decoder: BatchDecoder,
    pool: ThreadPoolExecutor,
    batch: int,
    ahead: int,
) -> Iterator[_Decoded]:
    """Like :func:`_decoded_stream`, decoding ``batch`` samples per call of ``decoder`` in ``pool``."""
    pending: deque[Future[list[_Decoded]]] = deque()
    for group in _chunks(samples, batch):
        pending.append(pool.submit(_decode_batch, group, longer_sides, decoder))
        if len(pending) * batch >= ahead:
            yield from pending.popleft().result()
    while pending:
        yield from pending.popleft().result()


def _phased_chunks(
    samples: Iterator[dict[str, Any]], longer_sides: tuple[int, ...], pool: ThreadPoolExecutor, size: int
) -> Iterator[list[_Decoded]]:
    """Chunks of ``size`` samples, each decoded on all of ``pool``'s threads before it is handed
    on, and nothing decoded while the caller works on it: where decoding and the model share the
    same cores, taking turns avoids the stalls of oversubscription (a decoding thread preempting
    one of the model's threads holds up all of them at the next barrier)."""
    for group in _chunks(samples, size):
        yield list(pool.map(_decode_sample, group, [longer_sides] * len(group)))


def _chunks(stream: Iterator[T], size: int) -> Iterator[list[T]]:
    """Consecutive lists of ``size`` items of ``stream`` (the last one shorter)."""
    chunk: list[T] = []
    for item in stream:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _mark_duplicate_keys(items: list[_Decoded], seen: set[str]) -> None:
    for item in items:
        if item.key in seen:
            item.images, item.error = None, f"duplicate sample key {item.key!r} in shard"
        seen.add(item.key)


def process_shard(
    url: str,
    shard_id: int,
    out: Path | str | Location,
    extractors: Sequence[Extractor],
    decode_threads: int = 2,
    chunk_size: int = CHUNK_SIZE,
    s3_endpoint_url: str | None = None,
    read_retries: int = 3,
    backoff_s: float = 1.0,
    batch_decoder: BatchDecoder | None = None,
    overlap: bool = True,
) -> ShardResult:
    """Read shard ``url`` (local or ``s3://``), describe every image, commit ``<shard>.parquet``
    into ``out`` (a directory, an ``s3://`` prefix or a Location) atomically.

    Each sample becomes exactly one row; an undecodable sample becomes an ``error`` row. A shard
    that cannot be read to the end (missing, truncated) is returned as failed and writes nothing.
    A transient read failure (an S3 stream cut mid-way) reads the shard again, up to
    ``read_retries`` times with exponential backoff from ``backoff_s``.
    ``batch_decoder``: decode in batches with it (a GpuJpegDecoder, a ProcessDecoder), up to its
    ``concurrency`` calls at once, instead of with PIL on ``decode_threads`` threads. ``overlap``: decode the next chunk
    while the extractors work on this one (a GPU model); False: decode each chunk on all the
    threads, then run the extractors (a CPU model on the same cores: taking turns is faster).
    """
    storage = out if hasattr(out, "commit_file") else output_location(out, s3_endpoint_url)
    opener = functools.partial(open_url, endpoint_url=s3_endpoint_url)
    start = time.perf_counter()
    name = shard_name(url)
    for attempt in range(read_retries + 1):
        try:
            described = _describe(url, opener, extractors, decode_threads, chunk_size, batch_decoder, overlap)
            break
        except ShardReadError as exc:
            if exc.transient and attempt < read_retries:
                delay = backoff_s * 2**attempt
                log.warning("shard %s: %s; reading again in %.1fs", url, exc.reason, delay)
                time.sleep(delay)
                continue
            log.error("shard %s failed: %s", url, exc.reason)
            return ShardResult(url, name, "failed", None, 0, 0, time.perf_counter() - start, exc.reason)
    keys, widths, heights, errors, ok_rows, columns = described
    positions = np.concatenate(ok_rows) if ok_rows else np.zeros(0, np.int64)
    table = _build_table(name, shard_id, keys, widths, heights, errors, positions, columns, extractors)
    n_errors = sum(1 for e in errors if e)
    tmp = storage.local_scratch() / f"{name}.parquet.tmp"
    try:
        pq.write_table(table, tmp)
        path = storage.commit_file(f"{name}.parquet", tmp, {"rows": len(keys), "error_rows": n_errors, "url": url})
    finally:
        tmp.unlink(missing_ok=True)
    seconds = time.perf_counter() - start
    log.info("shard %s: %d rows (%d errors) in %.1fs", name, len(keys), n_errors, seconds)
    failed = tuple({"key": k, "reason": e} for k, e in zip(keys, errors) if e)[:FAILED_SHOWN]
    return ShardResult(url, name, "ok", path, len(keys), n_errors, seconds, failed_images=failed)


def _describe(
    url: str,
    opener: Any,
    extractors: Sequence[Extractor],
    decode_threads: int,
    chunk_size: int,
    batch_decoder: BatchDecoder | None = None,
    overlap: bool = True,
) -> tuple:
    """Every sample of the shard through decoding and the extractors, in archive order."""
    name = shard_name(url)
    keys, widths, heights, errors = [], [], [], []
    # Extractor outputs for the decodable rows only, with those rows' positions in the shard.
    ok_rows: list[np.ndarray] = []
    columns: dict[str, list[Any]] = {}
    seen: set[str] = set()
    # One decode per image, resized to every extractor's resolution (globals and locals differ).
    longer_sides = tuple(sorted({e.resolution for e in extractors}))
    threads = batch_decoder.concurrency if batch_decoder is not None else decode_threads
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"decode-{name}") as pool:
        # Enough decodes in flight to fill the next chunk while the extractors work on this one.
        ahead = chunk_size + 4 * decode_threads
        samples = iter_samples(url, opener)
        if batch_decoder is not None:
            chunks = _chunks(
                _batch_decoded_stream(samples, longer_sides, batch_decoder, pool, batch_decoder.batch, ahead),
                chunk_size,
            )
        elif overlap:
            chunks = _chunks(_decoded_stream(samples, longer_sides, pool, ahead), chunk_size)
        else:
            chunks = _phased_chunks(samples, longer_sides, pool, chunk_size)
        for chunk in chunks:
            _mark_duplicate_keys(chunk, seen)
            ok = [i for i, item in enumerate(chunk) if item.images is not None]
            if ok:
                ok_rows.append(np.asarray(ok, dtype=np.int64) + len(keys))
                for extractor in extractors:
                    images = [chunk[i].images[extractor.resolution] for i in ok]
                    for column, values in extractor(images).items():
                        columns.setdefault(column, []).append(values)
            keys += [item.key for item in chunk]
            widths += [item.width for item in chunk]
            heights += [item.height for item in chunk]
            errors += [item.error for item in chunk]
    return keys, widths, heights, errors, ok_rows, columns


def _build_table(
    name: str,
    shard_id: int,
    keys: list[str],
    widths: list[int],
    heights: list[int],
    errors: list[str],
    positions: np.ndarray,
    columns: dict[str, list[np.ndarray]],
    extractors: Sequence[Extractor],
) -> pa.Table:
    """Assemble the Parquet table (schema v1, v2 with local tokens); rows without descriptors
    (error rows) hold zeros, or empty lists for list columns."""
    dim = extractors[0].dim
    extra = [f for e in extractors for f in e.extra_fields()]
    schema = descriptor_schema(dim, extra)
    n = len(keys)
    arrays: dict[str, Any] = {
        "key": pa.array([f"{name}/{k}" for k in keys], pa.string()),
        "shard": pa.array([name] * n, pa.string()),
        "row": pa.array([make_row_id(shard_id, i) for i in range(n)], pa.int64()),
        "width": pa.array(widths, pa.int32()),
        "height": pa.array(heights, pa.int32()),
        "status": pa.array([STATUS_ERROR if e else STATUS_OK for e in errors], pa.string()),
        "error": pa.array(errors, pa.string()),
    }
    for field in schema:
        if field.name in arrays:
            continue
        if pa.types.is_list(field.type):  # variable-length per row (local tokens)
            per_row: list[np.ndarray | None] = [None] * n
            for position, values in zip(positions, (v for block in columns.get(field.name, []) for v in block)):
                per_row[position] = values
            arrays[field.name] = list_column(per_row, field.type)
            continue
        if not pa.types.is_fixed_size_list(field.type):
            raise TypeError(f"extractor column {field.name!r}: only fixed-size or variable list columns are supported")
        full = np.zeros((n, field.type.list_size), dtype=field.type.value_type.to_pandas_dtype())
        if field.name in columns:
            full[positions] = np.concatenate(columns[field.name])
        arrays[field.name] = fixed_size_list(full, field.type.value_type)
    return pa.table([arrays[f.name] for f in schema], schema=schema)
