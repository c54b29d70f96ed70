"""Keys of an index's rows, looked up in both directions at a cost that does not grow with N.

At 100M rows the key column is ~3 GB. Answering a request must touch only the pages it needs:
``keys_at`` (positions -> keys, every answer) reads two offsets and one key per position, and
``position_of`` (key -> position: key queries, thumbnails) binary-searches a sorted permutation,
touching O(log n) pages. Three files beside the index, all memory-mapped:

- ``keys.bin``: the UTF-8 bytes of every key, concatenated in row (file) order;
- ``key_offsets.npy``: (n + 1,) int64, key i is ``keys.bin[offsets[i]:offsets[i + 1]]``;
- ``key_order.npy``: (n,) int64 positions sorted by key bytes (ties by position).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core.atomic import atomic_path, write_atomic
from core.errors import NeedleInputError
from core.joined_keys import JoinedKeys

KEYS_FILE = "keys.bin"
KEY_OFFSETS_FILE = "key_offsets.npy"
KEY_ORDER_FILE = "key_order.npy"
KEY_FILES = (KEYS_FILE, KEY_OFFSETS_FILE, KEY_ORDER_FILE)
# ``joined_keys_at``: up to this many keys are sliced from the map one by one and joined (fewer
# numpy calls: cheaper for the few hundred keys a shard answers a lookup with, most of all on a
# loaded box where each numpy call runs cold); more go through the one numpy gather
SLICED_MAX = 512
BATCH_LOOKUP_RATIO = 64  # ``positions_of``: binary searches while keys x this < rows, else one pass


class KeyFileError(NeedleInputError):
    """Key files that are missing, truncated, or disagree with each other."""


def _save_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:  # np.save given a name would append ".npy" to the temporary path
        np.save(f, array)


def write_key_files(chunks: Iterable[pa.Array], directory: Path, sort_keys: pa.ChunkedArray | None = None) -> int:
    """Write the three key files for the string arrays ``chunks`` (row order), streaming: memory
    holds one chunk, the (n + 1,) offsets and, for the sort, the (n,) order. ``sort_keys``: the
    same keys as one (memory-mapped) column to sort, where the caller has it; else the chunks are
    gathered for the sort. Returns n."""
    directory = Path(directory)
    offsets = [np.zeros(1, np.int64)]
    gathered: list[pa.Array] = []
    end = 0
    with atomic_path(directory / KEYS_FILE) as tmp, open(tmp, "wb") as data:
        for chunk in chunks:
            chunk = chunk.cast(pa.large_string())
            if chunk.null_count:
                raise KeyFileError(f"{chunk.null_count} null keys: every row needs a key")
            value_offsets = np.frombuffer(chunk.buffers()[1], np.int64)[chunk.offset : chunk.offset + len(chunk) + 1]
            start, stop = int(value_offsets[0]), int(value_offsets[-1])
            data.write(memoryview(chunk.buffers()[2])[start:stop] if stop > start else b"")
            offsets.append(value_offsets[1:] - start + end)
            end += stop - start
            if sort_keys is None:
                gathered.append(chunk)
    offsets_array = np.concatenate(offsets)
    column = sort_keys if sort_keys is not None else pa.chunked_array(gathered, pa.large_string())
    if len(column) != len(offsets_array) - 1:
        raise KeyFileError(f"{len(column)} keys to sort, {len(offsets_array) - 1} written")
    # Stable sort by key, so equal keys (there should be none) keep row order.
    order = pc.sort_indices(column).to_numpy().astype(np.int64)
    write_atomic(directory / KEY_OFFSETS_FILE, lambda tmp: _save_npy(tmp, offsets_array))
    write_atomic(directory / KEY_ORDER_FILE, lambda tmp: _save_npy(tmp, order))
    return len(order)


class _SortedKeys:
    """The keys in sorted order as a read-only sequence, for ``bisect`` (reads only what it compares)."""

    def __init__(self, store: KeyStore):
        self.store = store

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, i: int) -> bytes:
        return self.store.key_bytes(int(self.store.order[i]))


class KeyStore:
    """Memory-mapped key files: ``keys_at(positions)`` and ``position_of(key)``."""

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        try:
            self.offsets = np.load(self.directory / KEY_OFFSETS_FILE, mmap_mode="r")
            self.order = np.load(self.directory / KEY_ORDER_FILE, mmap_mode="r")
            size = (self.directory / KEYS_FILE).stat().st_size
            self.data = np.memmap(self.directory / KEYS_FILE, np.uint8, "r") if size else np.zeros(0, np.uint8)
            # Keys are sliced from a plain memoryview of the map: slicing the np.memmap itself makes
            # a memmap object per key (~4 us; 1,000 keys took 4.5 ms, through the view 0.6 ms).
            self.view = self.data.data  # the map's buffer as a memoryview
        except (OSError, ValueError) as exc:
            raise KeyFileError(f"cannot read the key files in {self.directory}: {exc}") from exc
        n = len(self.order)
        if self.offsets.shape != (n + 1,) or int(self.offsets[-1]) != size:
            raise KeyFileError(
                f"key files in {self.directory} disagree: {len(self.offsets)} offsets for {n} keys, "
                f"last offset {int(self.offsets[-1]) if len(self.offsets) else None} for {size} bytes in {KEYS_FILE}"
            )

    def __len__(self) -> int:
        return len(self.order)

    def key_bytes(self, position: int) -> bytes:
        start, stop = self.offsets[position : position + 2]
        return self.view[int(start) : int(stop)].tobytes()

    def keys_at(self, positions: np.ndarray) -> list[str | None]:
        """Positions (any shape, flattened) -> keys; None for a negative position (FAISS's -1 padding).

        The keys' bytes are gathered in one numpy pass, NUL-separated, and split into strings in
        one decode (a key per Python slice and decode cost ~0.3 us each: 40 % of a shard's answer
        to a key lookup, whose keys every search also returns)."""
        flat = np.asarray(positions, dtype=np.int64).reshape(-1)
        joined = self.joined_keys_at(flat)
        if joined is not None:
            return joined.split()
        if not len(flat):
            return []
        # a key holding a NUL itself: one at a time
        starts, lengths, valid = self.spans(flat)
        keys: list[str | None] = [str(self.view[a : a + n], "utf-8") for a, n in zip(starts.tolist(), lengths.tolist())]
        for i in np.flatnonzero(~valid).tolist():
            keys[i] = None
        return keys

    def joined_keys_at(self, positions: np.ndarray) -> JoinedKeys | None:
        """The keys at ``positions`` (any shape, flattened; negative: padding) as one NUL-joined
        buffer, no string made (what a shard sends: core/joined_keys.py); None where there are no
        positions or a key holds a NUL itself (``keys_at`` makes those one by one)."""
        flat = np.asarray(positions, dtype=np.int64).reshape(-1)
        if not len(flat):
            return None
        if len(flat) <= SLICED_MAX and int(flat.min()) >= 0:  # no padding (a key lookup's rows): sliced
            if int(flat.max()) >= len(self):
                raise KeyFileError(f"position {int(flat.max())} is past the {len(self)} keys in {self.directory}")
            offsets, view = self.offsets.view(np.ndarray), self.view
            keys = [view[a:b] for a, b in zip(offsets[flat].tolist(), offsets[flat + 1].tolist())]
            return JoinedKeys.of(b"\0".join(keys), len(flat))
        starts, lengths, valid = self.spans(flat)
        padding = () if valid.all() else tuple(np.flatnonzero(~valid).tolist())
        return JoinedKeys.of(self.joined(starts, lengths), len(flat), padding)

    def spans(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start, length, valid) of each position's key bytes in ``keys.bin`` (0, 0 for padding);
        KeyFileError past the last key."""
        if int(flat.max()) >= len(self):
            raise KeyFileError(f"position {int(flat.max())} is past the {len(self)} keys in {self.directory}")
        valid = flat >= 0
        at = np.where(valid, flat, 0)
        offsets = self.offsets.view(np.ndarray)  # indexing the np.memmap itself makes a memmap per call
        starts = np.where(valid, offsets[at], 0)
        lengths = np.where(valid, offsets[np.minimum(at + 1, len(offsets) - 1)] - starts, 0)  # (no keys: 1 offset)
        return starts, lengths, valid

    def joined(self, starts: np.ndarray, lengths: np.ndarray) -> bytes:
        """The keys' bytes at ``starts`` (``lengths`` each), separated by NULs."""
        spans = lengths + 1  # each key and its separator
        ends = np.cumsum(spans)
        total = int(ends[-1])
        if not total or not len(self.data):
            return b"\0" * (len(starts) - 1)
        # the byte at output i is data[start of its key + (i - its first output byte)]
        index = np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - spans), spans)
        out = self.data.view(np.ndarray)[np.minimum(index, len(self.data) - 1)]
        out[ends - 1] = 0  # the separators (past each key: another key's byte, or past the end)
        return out[:-1].tobytes()

    def positions_of(self, keys: list[str]) -> dict[str, list[int]]:
        """Every position of each of ``keys`` that is there (absent keys are left out). Few keys: a
        binary search each (O(log n) pages); many (a writer's batch): one pass of Arrow's hash
        lookup over the key files, zero copy (a Python binary search per key cost ~0.15 ms per
        segment, 12 s for 20k keys in 4 segments; the pass reads the key bytes once, in C)."""
        if len(keys) * BATCH_LOOKUP_RATIO < len(self):
            found = {key: self.position_of(key) for key in keys}
            return {key: [position] for key, position in found.items() if position >= 0}
        column = pa.LargeStringArray.from_buffers(
            len(self), pa.py_buffer(np.ascontiguousarray(self.offsets)), pa.py_buffer(self.data)
        )
        hits = np.flatnonzero(
            pc.is_in(column, value_set=pa.array(keys, pa.large_string())).to_numpy(zero_copy_only=False)
        )
        out: dict[str, list[int]] = {}
        for position, key in zip(hits.tolist(), self.keys_at(hits)):
            out.setdefault(str(key), []).append(position)
        return out

    def position_of(self, key: str) -> int:
        """The position of ``key``, or -1 where it is not there."""
        target = key.encode()
        sorted_keys = _SortedKeys(self)
        i = bisect.bisect_left(sorted_keys, target)
        if i < len(self) and sorted_keys[i] == target:
            return int(self.order[i])
        return -1
