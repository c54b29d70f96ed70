"""What a living-index test expects: the live rows (key -> row id and vector) and their brute-force
answers, held against an index after every change."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from index.search import load_index
from ingest.descriptors import make_row_id

D = 16


class Live:
    """The live rows a test expects: key -> (row id, float16 vector)."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[int, np.ndarray]] = {}

    @staticmethod
    def of_files(files: Iterable[tuple[str, int, np.ndarray]]) -> Live:
        """The rows of descriptor files (name, Parquet shard id, vectors): a built index's, from
        ``SyntheticIndex.parts``."""
        live = Live()
        for name, shard_id, xb in files:
            live.add_file(name, shard_id, xb)
        return live

    def add_file(self, name: str, shard_id: int, xb: np.ndarray, keys: list[str] | None = None) -> None:
        for i, key in enumerate(keys or [f"{name}/{i:05d}" for i in range(len(xb))]):
            self.rows[key] = (make_row_id(shard_id, i), xb[i])

    def brute_force(self, xq: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        rows = np.array([r for r, _ in self.rows.values()], np.int64)
        xb = np.stack([v for _, v in self.rows.values()]).astype(np.float32)
        scores = xq @ xb.T
        order = np.stack([np.lexsort((rows, -s))[:k] for s in scores])
        return np.take_along_axis(scores, order, 1), rows[order]


def assert_exact(index_dir: Path, live: Live, xq: np.ndarray, k: int = 10) -> None:
    index = load_index(index_dir)
    assert index.ntotal == len(live.rows)
    D_, I = index.search(xq, k)
    D_ref, I_ref = live.brute_force(xq, k)
    np.testing.assert_array_equal(I, I_ref)
    np.testing.assert_allclose(D_, D_ref, rtol=1e-3, atol=1e-3)
