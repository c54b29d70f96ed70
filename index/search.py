"""Loading a built index directory and searching it: ``search(xq, k) -> (D, I)`` with ``I`` the
Parquet ``row`` ids (-1 where fewer than k results exist), plus id -> key lookups."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from index.build import IDS_FILE, INDEX_FILE, INFOS_FILE, VECTORS_FILE
from ingest.errors import NeedleInputError


class IndexFileError(NeedleInputError):
    """An index directory that is missing a file, or whose files disagree with each other."""


class UnknownKeyError(NeedleInputError):
    """A key that is not in the index."""


@dataclass
class SearchIndex:
    index: Any  # the faiss index (ids = row ids)
    rows: np.ndarray  # (N,) int64 row ids, in the order of `keys` and `vectors`
    keys: list[str]  # (N,) keys
    vectors: np.ndarray  # (N, d) float16, memory-mapped
    infos: dict[str, Any]  # index_infos.json
    path: Path

    @property
    def d(self) -> int:
        return int(self.vectors.shape[1])

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    def search(self, xq: np.ndarray, k: int, nprobe: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(nq, d) queries -> (D, I): (nq, k) scores and row ids, best first."""
        xq = np.ascontiguousarray(np.atleast_2d(xq), dtype=np.float32)
        if xq.ndim != 2 or xq.shape[1] != self.d:
            raise NeedleInputError(f"query vectors have shape {xq.shape}, the index expects (nq, {self.d})")
        if k < 1:
            raise NeedleInputError(f"k must be >= 1, got {k}")
        if nprobe is not None:
            import faiss

            faiss.extract_index_ivf(self.index).nprobe = nprobe
        return self.index.search(xq, min(k, self.ntotal))

    def position_of(self, key: str) -> int:
        try:
            return self._positions[key]
        except KeyError:
            raise UnknownKeyError(f"key {key!r} is not in the index at {self.path}") from None

    def vector_of(self, key: str) -> np.ndarray:
        return np.asarray(self.vectors[self.position_of(key)], dtype=np.float32)

    def keys_of(self, ids: np.ndarray) -> list[list[str | None]]:
        """Row ids (any shape ending in k) -> keys, None for the -1 padding."""
        return [[self.keys[self._row_positions[i]] if i >= 0 else None for i in row] for row in np.atleast_2d(ids)]

    def __post_init__(self) -> None:
        self._positions = {k: i for i, k in enumerate(self.keys)}
        self._row_positions = {int(r): i for i, r in enumerate(self.rows)}


def load_index(path: str | Path) -> SearchIndex:
    """Open an index directory, checking that its files exist and agree (never a wrong answer)."""
    import faiss

    path = Path(path)
    for name in (INDEX_FILE, IDS_FILE, VECTORS_FILE, INFOS_FILE):
        if not (path / name).is_file():
            raise IndexFileError(f"index directory {path} has no {name}")
    try:
        index = faiss.read_index(str(path / INDEX_FILE))
    except RuntimeError as exc:
        raise IndexFileError(f"cannot read {path / INDEX_FILE}: {exc}") from exc
    try:
        ids = pq.read_table(path / IDS_FILE, columns=["row", "key"])
        vectors = np.load(path / VECTORS_FILE, mmap_mode="r")
        infos = json.loads((path / INFOS_FILE).read_text())
    except Exception as exc:  # pyarrow, numpy and json each raise their own types for corrupt files
        raise IndexFileError(f"cannot read index files in {path}: {type(exc).__name__}: {exc}") from exc
    rows = ids["row"].to_numpy()
    if not (len(rows) == index.ntotal == len(vectors)):
        raise IndexFileError(
            f"index {path} is inconsistent: {index.ntotal} vectors in {INDEX_FILE}, "
            f"{len(rows)} ids in {IDS_FILE}, {len(vectors)} rows in {VECTORS_FILE}"
        )
    if vectors.ndim != 2 or vectors.shape[1] != index.d:
        raise IndexFileError(f"index {path}: {VECTORS_FILE} has shape {vectors.shape}, the index d={index.d}")
    return SearchIndex(index, rows, ids["key"].to_pylist(), vectors, infos, path)
