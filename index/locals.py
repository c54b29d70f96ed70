"""The local store: every row's binary local tokens beside the index, memory-mapped, O(1) by row.

Built by ``needle index build`` when the descriptor files carry local tokens (schema v2). Each
build part writes one *segment* for its contiguous range of positions (the positions of
``ids.arrow`` / ``vectors.f16.npy``), so the parts are written in parallel and each index shard's
rows live in its own segment files:

- ``locals_<part>.tokens.bin``: raw little-endian records (``TOKEN_DTYPE``), 23 bytes per token:
  ``code`` (16 x uint8: 128 ITQ bits), ``x``, ``y`` (int16 base pixels), ``scale`` (uint8 index
  into the recorded scales), ``weight`` (float16); a row's tokens are consecutive, best first.
- ``locals_<part>.offsets.npy``: int64 (rows + 1,): the tokens of the segment's i-th row are
  records ``offsets[i]:offsets[i + 1]``.

``index_infos.json`` lists the segments (``locals.segments``: file names, first position, rows,
tokens), the scales, and bytes per image. Nothing is read until a row is asked for: at 100M images
with 100 tokens each the store is ~230 GB on disk and costs RAM only for the pages a query touches.
"""

from __future__ import annotations

import functools
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.atomic import write_atomic
from core.errors import NeedleInputError
from core.tokens import CODE_BYTES, LocalTokens, TokenBatch
from ingest.descriptors import DescriptorFileError, list_values

TOKEN_DTYPE = np.dtype(
    [("code", np.uint8, (CODE_BYTES,)), ("x", "<i2"), ("y", "<i2"), ("scale", "u1"), ("weight", "<f2")]
)
LOCAL_COLUMNS = ["local_codes", "local_x", "local_y", "local_scale", "local_weight"]


class LocalStoreError(NeedleInputError):
    """A local store whose files are missing or disagree with the index."""


def _save_npy(path: Path, array: np.ndarray) -> None:
    """``np.save`` to exactly ``path`` (given a name, np.save would append ``.npy`` to a ``.tmp`` path)."""
    with open(path, "wb") as f:
        np.save(f, array)


def read_token_records(path: Path | str) -> tuple[np.ndarray, np.ndarray]:
    """(offsets (rows + 1,), TOKEN_DTYPE records) of one schema-v2 Parquet file's local tokens."""
    try:
        table = pq.read_table(path, columns=LOCAL_COLUMNS)
    except (OSError, KeyError, pa.ArrowInvalid) as exc:  # a missing file or column, a corrupt file
        raise DescriptorFileError(f"{path}: cannot read local token columns {LOCAL_COLUMNS}: {exc}") from exc
    offsets, codes = list_values(table["local_codes"])
    records = np.zeros(len(codes), TOKEN_DTYPE)
    records["code"] = codes
    for column, name in (("local_x", "x"), ("local_y", "y"), ("local_scale", "scale"), ("local_weight", "weight")):
        other, values = list_values(table[column])
        if not np.array_equal(other, offsets):
            raise DescriptorFileError(f"{path}: column {column} has other token counts than local_codes")
        records[name] = values
    return offsets, records


def tokens_from_records(records: np.ndarray, scales: np.ndarray) -> LocalTokens:
    """One image's TOKEN_DTYPE records -> LocalTokens (scale indices looked up in ``scales``)."""
    return LocalTokens(
        np.ascontiguousarray(records["code"]),
        np.stack([records["x"], records["y"]], 1).astype(np.float32),
        np.asarray(scales, np.float32)[records["scale"]],
        records["weight"].astype(np.float32),
    )


@dataclass(frozen=True)
class SegmentInfo:
    tokens: str  # file name of the records
    offsets: str  # file name of the offsets
    start: int  # first position it covers
    rows: int  # positions covered
    count: int  # tokens
    max_tokens: int | None = None  # the longest row's tokens (None: built before it was recorded)

    def to_dict(self) -> dict[str, str | int | None]:
        return {
            "tokens": self.tokens,
            "offsets": self.offsets,
            "start": self.start,
            "rows": self.rows,
            "count": self.count,
            "max_tokens": self.max_tokens,
        }


def write_segment(directory: Path, name: str, files: list[tuple[str, int, int]]) -> SegmentInfo:
    """Write the tokens of ``files`` ((parquet path, rows, first position), contiguous, in order)
    as segment ``name``; returns its info. Records are appended file by file (one in memory)."""
    start = files[0][2] if files else 0
    offsets_parts = [np.zeros(1, np.int64)]
    total, expected = 0, start

    def write_tokens(tmp: Path) -> None:
        nonlocal total, expected
        with open(tmp, "wb") as out:
            for path, rows, first in files:
                if first != expected:
                    raise DescriptorFileError(
                        f"{path}: segment {name} is not contiguous (position {first}, expected {expected})"
                    )
                offsets, records = read_token_records(path)
                if len(offsets) != rows + 1:
                    raise DescriptorFileError(f"{path}: {len(offsets) - 1} token lists for {rows} rows")
                out.write(records.tobytes())
                offsets_parts.append(offsets[1:] + total)
                total += len(records)
                expected += rows

    tokens_path = write_atomic(directory / f"{name}.tokens.bin", write_tokens)
    offsets = np.concatenate(offsets_parts)
    offsets_path = write_atomic(directory / f"{name}.offsets.npy", lambda tmp: _save_npy(tmp, offsets))
    longest = int(np.diff(offsets).max(initial=0))
    return SegmentInfo(tokens_path.name, offsets_path.name, start, expected - start, total, longest)


class LocalStore:
    """Memory-mapped segments; ``batch(positions)`` gathers the tokens of any rows."""

    def __init__(self, directory: Path | str, locals_infos: dict[str, Any]):
        self.directory = Path(directory)
        self.scales = np.asarray(locals_infos.get("scales", [1.0]), dtype=np.float32)
        segments = [SegmentInfo(**s) for s in locals_infos.get("segments", [])]
        if not segments:
            raise LocalStoreError(f"index {self.directory} lists no local segments")
        self.segments = sorted(segments, key=lambda s: s.start)
        self.starts = np.array([s.start for s in self.segments], np.int64)
        self.ends = self.starts + np.array([s.rows for s in self.segments], np.int64)
        self._records = [self._map(s.tokens, TOKEN_DTYPE, s.count) for s in self.segments]
        # the same records as (count, 23) bytes, for gathering (``batch``)
        self._bytes = [r.view(np.uint8).reshape(len(r), TOKEN_DTYPE.itemsize) for r in self._records]
        self._offsets = [np.asarray(self._map(s.offsets, np.dtype(np.int64), s.rows + 1)) for s in self.segments]

    def _map(self, name: str, dtype: np.dtype, length: int) -> np.ndarray:
        path = self.directory / name
        try:
            if path.suffix == ".npy":
                array = np.load(path, mmap_mode="r")
            else:  # raw records: their count is in the infos
                size = path.stat().st_size
                if size != length * dtype.itemsize:
                    raise LocalStoreError(
                        f"local store file {path} has {size} bytes, the infos say {length} records of {dtype.itemsize}"
                    )
                array = np.memmap(path, dtype=dtype, mode="r", shape=(length,)) if length else np.zeros(0, dtype)
        except (OSError, ValueError) as exc:
            raise LocalStoreError(f"cannot read local store file {path}: {exc}") from exc
        if array.dtype != dtype or array.shape != (length,):
            raise LocalStoreError(
                f"local store file {path} holds {array.shape} {array.dtype}, the infos say ({length},) {dtype}"
            )
        if hasattr(mmap, "MADV_RANDOM") and getattr(array, "_mmap", None) is not None:
            array._mmap.madvise(mmap.MADV_RANDOM)  # rows are read at random: no readahead
        return array

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._records) + sum(o.nbytes for o in self._offsets)

    @functools.cached_property
    def max_tokens(self) -> int:
        """The most tokens any row has (recorded per segment; read from the offsets of segments
        built before it was recorded)."""
        return max(
            (s.max_tokens if s.max_tokens is not None else int(np.diff(o).max(initial=0)))
            for s, o in zip(self.segments, self._offsets)
        )

    def _locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        segment = np.searchsorted(self.starts, positions, side="right") - 1
        if len(positions) and ((segment < 0).any() or (positions >= self.ends[segment.clip(0)]).any()):
            bad = positions[(segment < 0) | (positions >= self.ends[segment.clip(0)])][:5]
            raise LocalStoreError(f"positions {bad.tolist()} are outside the local store of {self.directory}")
        return segment, positions - self.starts[segment]

    def records(self, position: int) -> np.ndarray:
        """One row's token records (TOKEN_DTYPE), best first."""
        (segment,), (local,) = self._locate(np.array([position], np.int64))
        offsets = self._offsets[segment]
        return np.asarray(self._records[segment][offsets[local] : offsets[local + 1]])

    def tokens(self, position: int) -> LocalTokens:
        return self.to_tokens(self.records(position))

    def to_tokens(self, records: np.ndarray) -> LocalTokens:
        return tokens_from_records(records, self.scales)

    def batch(self, positions: np.ndarray, length: int | None = None) -> TokenBatch:
        """The tokens of rows at ``positions`` (-1: no row, an empty entry), padded to ``length``
        tokens (default: the longest), each row's first (best) tokens kept."""
        positions = np.asarray(positions, np.int64)
        valid = positions >= 0
        segment, local = self._locate(positions[valid])
        starts = np.zeros(len(positions), np.int64)
        counts = np.zeros(len(positions), np.int64)
        for s in np.unique(segment):
            rows = np.flatnonzero(valid)[segment == s]
            offsets = self._offsets[s]
            starts[rows] = offsets[local[segment == s]]
            counts[rows] = offsets[local[segment == s] + 1] - starts[rows]
        T = int(counts.max(initial=0)) if length is None else length
        counts = np.minimum(counts, T)
        mask = np.arange(T)[None, :] < counts[:, None]
        # Records as raw bytes (R, 23): every wanted record of a segment in one fancy index, read
        # in ascending order, put at its (row, slot) in a flat buffer; fields are column slices.
        width = TOKEN_DTYPE.itemsize
        raw = np.zeros((len(positions) * T, width), np.uint8)
        for s in np.unique(segment):
            rows = np.flatnonzero(valid)[segment == s]
            row_of, slot = np.nonzero(mask[rows])
            source = starts[rows][row_of] + slot
            order = np.argsort(source, kind="stable")
            raw[(rows[row_of] * T + slot)[order]] = self._bytes[s][source[order]]
        records = raw.reshape(len(positions), T, width)
        codes = np.ascontiguousarray(records[..., :CODE_BYTES])
        fields: dict[str, Any] = dict(TOKEN_DTYPE.fields or {})  # a structured dtype: never empty

        def field(name: str) -> np.ndarray:
            dtype, offset = fields[name][:2]
            return records[..., offset : offset + dtype.itemsize].copy().view(dtype)[..., 0]

        xy = np.stack([field("x"), field("y")], -1).astype(np.float32)
        scale = np.where(mask, self.scales[field("scale").clip(0, len(self.scales) - 1)], 1.0).astype(np.float32)
        weight = field("weight").astype(np.float32)  # 0 where padded (zero bytes)
        return TokenBatch(codes, xy, scale, weight, mask)


def locals_infos(segments: list[SegmentInfo], extractor: dict[str, Any] | None, rows: int) -> dict[str, Any]:
    """The ``locals`` entry of index_infos.json."""
    tokens = sum(s.count for s in segments)
    nbytes = tokens * TOKEN_DTYPE.itemsize + (rows + len(segments)) * 8
    return {
        "segments": [s.to_dict() for s in segments],
        "scales": (extractor or {}).get("scales", [1.0]),
        "extractor": extractor,
        "tokens": tokens,
        "max_tokens": max_tokens_of(segments),
        "record_bytes": TOKEN_DTYPE.itemsize,
        "bytes": nbytes,
        "bytes_per_image": round(nbytes / max(1, rows), 1),
    }


def max_tokens_of(segments: list[SegmentInfo]) -> int | None:
    """The longest row's tokens over ``segments`` (None when a segment did not record it)."""
    if any(s.max_tokens is None for s in segments):
        return None
    return max((int(s.max_tokens or 0) for s in segments), default=0)


def open_local_store(path: Path | str, infos: dict[str, Any]) -> LocalStore | None:
    """The store of an index directory, or None when it was built without local tokens."""
    return LocalStore(path, infos["locals"]) if infos.get("locals") else None
