"""An index's files on disk, opened and checked: never a wrong answer from files that disagree.

An index is one self-contained directory per shard (``shard_000/`` ...: its FAISS index, ids,
float16 vectors, key files and local tokens, at shard-local positions, and ``shard_infos.json``),
listed by the top-level ``index_infos.json`` (index.layout.check_layout refuses any other layout).
``open_shard_files`` opens one shard directory by itself (a
shard actor reads nothing outside it); ``ShardLayout``, ``ShardedVectors`` and ``ShardedKeys``
are the views of an index over all its shard directories in one process: a position (or a row id)
is routed to the shard that owns it, and nothing concatenates the shards' keys, vectors or tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc

from index.errors import IndexFileError
from index.generation import Segment
from index.keys import KeyFileError, KeyStore
from index.layout import IDS_FILE, INDEX_FILE, INFOS_FILE, SHARD_INFOS_FILE, VECTORS_FILE, listed_files
from index.live.row_map import RoutedRows, RowMap
from index.locals import LocalStore, LocalStoreError


def read_faiss(path: Path, mmap: bool = True) -> Any:
    import faiss

    if not path.is_file():
        raise IndexFileError(f"index file {path} does not exist")
    try:
        # Memory-mapped inverted lists where FAISS supports it: shards load instantly and share pages.
        return faiss.read_index(str(path), faiss.IO_FLAG_MMAP if mmap else 0)
    except RuntimeError:
        try:
            return faiss.read_index(str(path))
        except RuntimeError as exc:
            raise IndexFileError(f"cannot read {path}: {str(exc).splitlines()[0]}") from exc


def map_vectors(path: Path) -> np.ndarray:
    """The float16 refine vectors, memory-mapped for random access: without readahead a cold
    2000-row shortlist read 4-5x faster here (0.13-0.2 s instead of 0.64-0.87 s from this disk)."""
    import mmap

    vectors = np.load(path, mmap_mode="r")
    if hasattr(mmap, "MADV_RANDOM") and getattr(vectors, "_mmap", None) is not None:
        vectors._mmap.madvise(mmap.MADV_RANDOM)
    return vectors


def read_ids(path: Path) -> Any:
    """The id table, memory-mapped (zero copy)."""
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all()


@dataclass
class ShardFiles:
    """A shard directory's own files, opened (memory-mapped) and checked against its ``shard_infos.json``."""

    directory: Path
    infos: dict[str, Any]  # shard_infos.json
    ids: Any  # pyarrow Table (row, key, status) of its rows, memory-mapped
    vectors: np.ndarray  # (rows, d) float16 memory map, shard-local positions
    keys: KeyStore
    index: Any | None  # FAISS index (None: not loaded)

    @property
    def rows(self) -> int:
        return int(self.infos["rows"])


def shard_error(directory: Path, message: str) -> IndexFileError:
    return IndexFileError(f"index shard {directory.name} ({directory}): {message}")


def open_shard_files(
    directory: Path | str, entry: Segment | None = None, with_index: bool = True, mmap: bool = True
) -> ShardFiles:
    """Open a shard directory's files, checking that each file its ``shard_infos.json`` lists is
    there with its recorded size and that they agree (rows, vectors, keys, index size);
    ``entry``: the top-level infos' record of this shard, which must agree too. Any failure is an
    IndexFileError naming the shard and the file. (The SHA-256 of each file is checked by
    ``verify_shard``, which reads every byte.)"""
    directory = Path(directory)
    infos_path = directory / SHARD_INFOS_FILE
    if not infos_path.is_file():
        raise shard_error(directory, f"no {SHARD_INFOS_FILE}")
    try:
        infos = json.loads(infos_path.read_text())
    except Exception as exc:
        raise shard_error(directory, f"cannot read {SHARD_INFOS_FILE}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(infos, dict):
        raise shard_error(directory, f"{SHARD_INFOS_FILE} is not a JSON object")
    checksums = listed_files(infos, str(infos_path))
    for name, recorded in checksums.items():
        file = directory / name
        if not file.is_file():
            raise shard_error(directory, f"{name} is missing")
        size = file.stat().st_size
        if size != recorded.get("bytes"):
            raise shard_error(directory, f"{name} has {size} bytes, {SHARD_INFOS_FILE} says {recorded.get('bytes')}")
    if entry is not None and (entry.rows != infos.get("rows") or entry.ntotal != infos.get("ntotal")):
        raise shard_error(
            directory,
            f"{SHARD_INFOS_FILE} says {infos.get('rows')} rows, {infos.get('ntotal')} vectors; the index's "
            f"{INFOS_FILE} says {entry.rows}, {entry.ntotal}",
        )
    reading = VECTORS_FILE
    try:
        vectors = map_vectors(directory / VECTORS_FILE)
        reading = IDS_FILE
        ids = read_ids(directory / IDS_FILE)
        reading = "its key files"
        keys = KeyStore(directory)
    except (KeyFileError, Exception) as exc:  # numpy, pyarrow and the key files each raise their own types
        raise shard_error(directory, f"cannot read {reading}: {type(exc).__name__}: {exc}") from exc
    index = None
    if with_index:
        try:
            index = read_faiss(directory / INDEX_FILE, mmap)
        except IndexFileError as exc:
            raise shard_error(directory, str(exc)) from exc
    rows = infos.get("rows")
    if not (ids.num_rows == len(vectors) == len(keys) == rows):
        raise shard_error(
            directory,
            f"inconsistent: {ids.num_rows} ids in {IDS_FILE}, {len(vectors)} rows in {VECTORS_FILE}, "
            f"{len(keys)} keys in its key files, {rows} rows in {SHARD_INFOS_FILE}",
        )
    if vectors.ndim != 2 or vectors.shape[1] != infos.get("dim") or (index is not None and index.d != infos.get("dim")):
        raise shard_error(
            directory, f"{VECTORS_FILE} has shape {vectors.shape}, {SHARD_INFOS_FILE} says d={infos.get('dim')}"
        )
    if index is not None and index.ntotal != infos.get("ntotal"):
        raise shard_error(
            directory,
            f"inconsistent: {index.ntotal} vectors in {INDEX_FILE}, {infos.get('ntotal')} in {SHARD_INFOS_FILE}",
        )
    return ShardFiles(directory, infos, ids, vectors, keys, index)


def verify_shard(directory: Path | str) -> dict[str, Any]:
    """Open a shard directory (``open_shard_files``) and check every file's SHA-256 against its
    ``shard_infos.json``; returns those infos, or IndexFileError naming the shard and the file."""
    from core.hashing import file_sha256

    files = open_shard_files(directory, with_index=False)
    for name, recorded in files.infos["checksums"].items():
        if file_sha256(files.directory / name) != recorded.get("sha256"):
            raise shard_error(files.directory, f"{name} does not match its SHA-256 in {SHARD_INFOS_FILE}")
    return files.infos


class ShardedVectors:
    """The float16 vectors of every position, read from the shard that holds it: indexing with a
    position, an array of positions or a slice gathers only those rows (never a concatenation)."""

    def __init__(self, arrays: list[np.ndarray], bases: np.ndarray):
        self.arrays = arrays
        self.bases = bases  # first position of each shard
        self.dtype = np.dtype(np.float16)
        self.shape = (int(sum(len(a) for a in arrays)), int(arrays[0].shape[1]) if arrays else 0)
        self.ndim = 2

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> np.ndarray:
        n, d = self.shape
        if isinstance(key, (int, np.integer)):
            position = int(key) + (n if key < 0 else 0)
            if not 0 <= position < n:
                raise IndexError(f"position {int(key)} is outside the {n} rows")
            shard = int(np.searchsorted(self.bases, position, side="right")) - 1
            return self.arrays[shard][position - self.bases[shard]]
        positions = np.arange(n)[key] if isinstance(key, slice) else np.asarray(key)
        if positions.dtype == bool:
            positions = np.flatnonzero(positions)
        flat = positions.reshape(-1).astype(np.int64)
        flat = np.where(flat < 0, flat + n, flat)
        if len(flat) and (flat.min() < 0 or flat.max() >= n):
            raise IndexError(f"positions outside the {n} rows")
        out = np.empty((len(flat), d), self.dtype)
        shard_of = np.searchsorted(self.bases, flat, side="right") - 1
        for shard in np.unique(shard_of):
            take = np.flatnonzero(shard_of == shard)
            local = flat[take] - self.bases[shard]
            order = np.argsort(local, kind="stable")  # ascending: sequential reads of the map
            out[take[order]] = self.arrays[shard][local[order]]
        return out.reshape((*positions.shape, d))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)


class ShardedKeys:
    """``keys_at(positions)`` and ``position_of(key)`` over the shards' own key files (index/keys.py);
    ``deleted(shard, position)``: whether that row is deleted in the generation read (never found)."""

    def __init__(self, stores: list[KeyStore], bases: np.ndarray, deleted: Callable[[int, int], bool] | None = None):
        self.stores = stores
        self.bases = bases
        self.deleted = deleted

    def __len__(self) -> int:
        return int(sum(len(s) for s in self.stores))

    def keys_at(self, positions: np.ndarray) -> list[str | None]:
        flat = np.asarray(positions, dtype=np.int64).reshape(-1)
        keys: list[str | None] = [None] * len(flat)
        valid = np.flatnonzero(flat >= 0)
        shard_of = np.searchsorted(self.bases, flat[valid], side="right") - 1
        for shard in np.unique(shard_of):
            take = valid[shard_of == shard]
            for i, key in zip(take, self.stores[shard].keys_at(flat[take] - self.bases[shard])):
                keys[i] = key
        return keys

    def position_of(self, key: str) -> int:
        """The position of ``key`` (a binary search in each shard's key files), or -1; a row deleted
        in the generation read is passed over (a key re-added with ``--replace`` lives in a later
        segment)."""
        for shard, (base, store) in enumerate(zip(self.bases, self.stores)):
            position = store.position_of(key)
            if position >= 0 and not (self.deleted is not None and self.deleted(shard, position)):
                return int(base) + position
        return -1


@dataclass
class ShardLayout:
    """The shard directories of an index: names, first positions, their shard_infos.json."""

    names: list[str]
    bases: np.ndarray  # (shards,) first position of each shard
    shard_infos: list[dict[str, Any]]

    maps: list[RowMap]  # each shard's (segment's) row ids -> its own positions

    @cached_property
    def row_map(self) -> RoutedRows:
        """Row ids -> positions over every shard: a row id's Parquet shard id routes it to the shard
        (segment) that holds its file, whose own map places it."""
        parquet_ids = [[int(i) for i in infos["shard_offsets"]] for infos in self.shard_infos]
        return RoutedRows(self.maps, self.bases, parquet_ids)

    def local_store(self, path: Path, infos: dict[str, Any]) -> LocalStore | None:
        if not infos.get("locals"):
            return None
        segments = []
        for name, base, shard in zip(self.names, self.bases, self.shard_infos):
            if not shard.get("locals"):
                raise LocalStoreError(f"index shard {name} of {path} lists no local segments")
            for segment in shard["locals"]["segments"]:
                segments.append(
                    {
                        **segment,
                        "tokens": f"{name}/{segment['tokens']}",
                        "offsets": f"{name}/{segment['offsets']}",
                        "start": int(base) + int(segment["start"]),
                    }
                )
        return LocalStore(path, {**infos["locals"], "segments": segments})


def shard_names(infos: dict[str, Any]) -> list[str]:
    """The shard directories (segments) an index's infos list, in order: what ``open_shard`` takes."""
    return [entry["name"] for entry in infos["shards"]]


def index_file_paths(path: Path | str, infos: dict[str, Any]) -> list[Path]:
    """The FAISS index files of an index directory, in shard order."""
    return [Path(path) / name / INDEX_FILE for name in shard_names(infos)]
