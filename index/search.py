"""Loading a built index directory and searching it.

``search(xq, k) -> (D, I)``: scores (inner product = cosine) and Parquet ``row`` ids, best first,
-1 where fewer than k results exist. IVF-PQ results are re-scored exactly: the shortlist of
``refine_factor * k`` candidates is scored against the memory-mapped float16 vectors, so the
returned scores are exact and the ranking matches exact search within the shortlist.

A sharded directory (``shard_*.faiss``) is searched shard by shard and the candidates merged by
score; cluster/serve.py does the same with one Ray actor per shard.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from index.build import IDS_FILE, INFOS_FILE, VECTORS_FILE
from ingest.descriptors import ROW_SHARD_SHIFT, STATUS_OK
from ingest.errors import NeedleInputError


class IndexFileError(NeedleInputError):
    """An index directory that is missing a file, or whose files disagree with each other."""


class UnknownKeyError(NeedleInputError):
    """A key that is not in the index."""


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


def merge_topk(D_parts: list[np.ndarray], I_parts: list[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Merge per-shard (D, I) results into the global top-k: descending score, ties to the lower
    row id, so that any split of the data into shards gives the same answer."""
    D = np.concatenate(D_parts, axis=1)
    I = np.concatenate(I_parts, axis=1)
    D = np.where(I < 0, -np.inf, D)
    order = np.stack([np.lexsort((I[q], -D[q]))[:k] for q in range(len(D))]) if len(D) else np.zeros((0, k), np.int64)
    return np.take_along_axis(D, order, 1), np.take_along_axis(I, order, 1)


def tie_margin(kk: int) -> int:
    """Extra candidates asked of every shard: PQ scores tie often (fast-scan quantises its lookup
    tables), and which of a tied group FAISS keeps at its cut-off depends on the data's split;
    cutting later with the deterministic merge makes shards and a single index agree."""
    return max(16, kk // 2)


def set_nprobe(index: Any, nprobe: int) -> None:
    import faiss

    try:
        faiss.extract_index_ivf(index).nprobe = nprobe
    except RuntimeError:
        pass  # flat: nothing to probe


@dataclass
class SearchIndex:
    shards: list[Any]  # faiss indexes (ids = row ids); one unless the directory is sharded
    rows: np.ndarray  # (N,) int64 row ids of every Parquet row, in file order
    status: np.ndarray  # (N,) bool: the row was described (status ok)
    vectors: np.ndarray  # (N, d) float16, memory-mapped
    infos: dict[str, Any]  # index_infos.json
    path: Path
    _keys: Any = field(default=None, repr=False)  # pyarrow array of keys (loaded lazily)
    _positions: dict[str, int] | None = field(default=None, repr=False)

    @property
    def d(self) -> int:
        return int(self.vectors.shape[1])

    @property
    def ntotal(self) -> int:
        if not self.shards:  # shards served elsewhere (Ray actors): trust the checked infos
            return int(self.infos["ntotal"])
        return int(sum(s.ntotal for s in self.shards))

    @property
    def is_exact(self) -> bool:
        return self.infos.get("kind") == "flat"

    def check_queries(self, xq: np.ndarray, k: int) -> np.ndarray:
        xq = np.ascontiguousarray(np.atleast_2d(xq), dtype=np.float32)
        if xq.ndim != 2 or xq.shape[1] != self.d:
            raise NeedleInputError(f"query vectors have shape {xq.shape}, the index expects (nq, {self.d})")
        if k < 1:
            raise NeedleInputError(f"k must be >= 1, got {k}")
        if not np.isfinite(xq).all():
            raise NeedleInputError("query vectors contain NaN or inf")
        return xq

    def shortlist_size(self, k: int, refine: bool = True) -> int:
        factor = 1 if self.is_exact or not refine else max(1, int(self.infos.get("refine_factor", 2)))
        return min(k * factor, self.ntotal)

    def search_candidates(self, xq: np.ndarray, kk: int, nprobe: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Index-level top-kk over all shards (PQ scores for IVF-PQ)."""
        D_parts, I_parts = [], []
        for shard in self.shards:
            set_nprobe(shard, nprobe or int(self.infos.get("nprobe", 64)))
            D, I = shard.search(xq, min(kk + tie_margin(kk), max(1, shard.ntotal)))
            D_parts.append(D)
            I_parts.append(I)
        return merge_topk(D_parts, I_parts, kk)

    def search(self, xq: np.ndarray, k: int, nprobe: int | None = None, refine: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(nq, d) queries -> (D, I): (nq, k) scores and row ids, best first."""
        xq = self.check_queries(xq, k)
        k = min(k, self.ntotal)
        D, I = self.search_candidates(xq, self.shortlist_size(k, refine), nprobe)
        if refine and not self.is_exact:
            D, I = self.rescore(xq, I)
        return D[:, :k], I[:, :k]

    def positions_of_rows(self, I: np.ndarray) -> np.ndarray:
        """Row ids -> positions in ids/vectors (from each shard's offset; -1 stays -1)."""
        offsets = self._offset_table()
        shard_ids = I >> ROW_SHARD_SHIFT
        local = I & ((1 << ROW_SHARD_SHIFT) - 1)
        positions = np.where(I >= 0, offsets[0][np.searchsorted(offsets[1], shard_ids).clip(0, len(offsets[1]) - 1)] + local, -1)
        return positions

    def _offset_table(self) -> tuple[np.ndarray, np.ndarray]:
        if not hasattr(self, "_offsets_cache"):
            items = sorted((int(s), int(o)) for s, o in self.infos["shard_offsets"].items())
            self._offsets_cache = (np.array([o for _, o in items], np.int64), np.array([s for s, _ in items], np.int64))
        return self._offsets_cache

    def rescore(self, xq: np.ndarray, I: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Exact scores of the candidates against the float16 vectors, re-sorted."""
        positions = self.positions_of_rows(I)
        safe = np.where(positions >= 0, positions, 0)
        flat = np.sort(np.unique(safe))  # sorted reads of the memory map
        block = np.asarray(self.vectors[flat], dtype=np.float32)
        lookup = np.searchsorted(flat, safe)
        scores = np.einsum("qd,qkd->qk", xq, block[lookup])
        scores = np.where(positions >= 0, scores, -np.inf)
        order = np.argsort(-scores, axis=1, kind="stable")
        return np.take_along_axis(scores, order, 1).astype(np.float32), np.take_along_axis(I, order, 1)

    # --- keys -------------------------------------------------------------------------------
    def _key_array(self) -> Any:
        if self._keys is None:
            self._keys = pq.read_table(self.path / IDS_FILE, columns=["key"])["key"].combine_chunks()
        return self._keys

    def position_of(self, key: str) -> int:
        if self._positions is None:
            self._positions = {k: i for i, k in enumerate(self._key_array().to_pylist())}
        try:
            return self._positions[key]
        except KeyError:
            raise UnknownKeyError(f"key {key!r} is not in the index at {self.path}") from None

    def vector_of(self, key: str) -> np.ndarray:
        position = self.position_of(key)
        vector = np.asarray(self.vectors[position], dtype=np.float32)
        if not self.status[position] or not np.isfinite(vector).all() or not vector.any():
            raise UnknownKeyError(f"key {key!r} has no valid descriptor in {self.path} (its image failed or was rejected)")
        return vector

    def keys_of(self, I: np.ndarray) -> list[list[str | None]]:
        """Row ids (nq, k) -> keys, None for the -1 padding."""
        I = np.atleast_2d(I)
        positions = self.positions_of_rows(I)
        keys = self._key_array().take(positions.clip(0).reshape(-1)).to_pylist()
        flat_valid = (positions >= 0).reshape(-1)
        out = [k if v else None for k, v in zip(keys, flat_valid)]
        return [out[i * I.shape[1] : (i + 1) * I.shape[1]] for i in range(I.shape[0])]


def load_index(path: str | Path, mmap: bool = True, with_shards: bool = True) -> SearchIndex:
    """Open an index directory, checking that its files exist and agree (never a wrong answer).

    ``with_shards=False`` skips the FAISS files (a coordinator whose shards live in Ray actors).
    """
    path = Path(path)
    for name in (IDS_FILE, VECTORS_FILE, INFOS_FILE):
        if not (path / name).is_file():
            raise IndexFileError(f"index directory {path} has no {name}")
    try:
        infos = json.loads((path / INFOS_FILE).read_text())
        ids = pq.read_table(path / IDS_FILE, columns=["row", "status"])
        vectors = np.load(path / VECTORS_FILE, mmap_mode="r")
    except Exception as exc:  # pyarrow, numpy and json each raise their own types for corrupt files
        raise IndexFileError(f"cannot read index files in {path}: {type(exc).__name__}: {exc}") from exc
    names = infos.get("index_files", ["index.faiss"])
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise IndexFileError(f"index directory {path} has no {', '.join(missing)}")
    shards = [read_faiss(path / name, mmap) for name in names] if with_shards else []
    rows = ids["row"].to_numpy()
    status = pc.equal(ids["status"], STATUS_OK).to_numpy(zero_copy_only=False)
    ntotal = sum(s.ntotal for s in shards) if with_shards else infos.get("ntotal")
    if len(rows) != len(vectors) or len(rows) != infos.get("rows") or ntotal != infos.get("ntotal"):
        raise IndexFileError(
            f"index {path} is inconsistent: {ntotal} vectors in the index files (infos: {infos.get('ntotal')}), "
            f"{len(rows)} ids in {IDS_FILE}, {len(vectors)} rows in {VECTORS_FILE} (infos: {infos.get('rows')})"
        )
    if vectors.ndim != 2 or vectors.shape[1] != infos.get("dim") or any(s.d != vectors.shape[1] for s in shards):
        raise IndexFileError(f"index {path}: {VECTORS_FILE} has shape {vectors.shape}, the index d={infos.get('dim')}")
    return SearchIndex(shards, rows, status, vectors, infos, path)
