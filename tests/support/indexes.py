"""The synthetic indexes of the tests: one spec per kind (``SyntheticIndex``: files and rows,
dimension, seed, IndexConfig, local tokens or not), one builder (``build_synthetic``), and a
session cache (``SyntheticIndexes``, the ``synthetic_indexes`` fixture) that builds each spec once
and hands out copies to the tests that change their index.

Layout under a spec's root: ``desc/`` (the descriptor Parquet files), ``tars/`` (source tars, when
the spec has them), ``index/`` (the index)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from index.build.stage import IndexConfig, main
from tests.support.index import (
    clustered_unit_vectors,
    write_descriptor_file,
    write_descriptors_with_tokens,
    write_source_tars,
)

FLAT = IndexConfig(kind="flat")
FLAT_2 = IndexConfig(kind="flat", shards=2)
SERVED_IVF = IndexConfig(
    recall_target=None, kind="ivfpq", nlist=8, pq_bytes=8, points_per_list=50, nprobe=4, refine_factor=3
)


@dataclass(frozen=True)
class SyntheticIndex:
    """Descriptor files of clustered unit vectors (file ``s``: ``clustered_unit_vectors(rows, d,
    seed + s)``, keys ``<name>/<row:05d>``) and the index ``config`` builds over them (None: the
    descriptors only). With ``tokens`` the files carry local tokens (``write_descriptors_with_tokens``:
    06d names, the second file's first 10 vectors repeat the first's, ``aliked`` records them as
    ALIKED's); ``tars``: a source tar per file with its first ``tars`` images."""

    files: tuple[tuple[int, int], ...]  # (Parquet shard id, rows), in order
    d: int
    seed: int = 0
    config: IndexConfig | None = FLAT
    name: str = "{:06d}"  # a file's name (and its keys' prefix) from its Parquet shard id
    nan: tuple[tuple[int, int, int], ...] = ()  # (Parquet shard id, row, column) set to NaN (a rejected row)
    tokens: bool = False
    aliked: bool = False
    tars: int = 0

    @property
    def sizes(self) -> dict[int, int]:
        return dict(self.files)

    def parts(self, xb: np.ndarray) -> Iterator[tuple[str, int, np.ndarray]]:
        """(file name, Parquet shard id, its vectors as written: float16) of each file of ``xb`` (the
        builder's vectors)."""
        start = 0
        for s, n in self.files:
            yield self.name.format(s), s, xb[start : start + n].astype(np.float16)
            start += n


def write_synthetic(
    spec: SyntheticIndex, root: Path, url_of: Callable[[Path], str] | None = None
) -> tuple[np.ndarray, dict[str, Path]]:
    """The descriptors of ``spec`` in ``root/desc`` (and its tars in ``root/tars``, recorded with
    ``url_of(path)``, default the path). Returns the vectors in row order (float32) and the tars."""
    desc = Path(root) / "desc"
    if spec.tokens:
        assert spec.name == "{:06d}" and not spec.nan, "token files are named by 06d Parquet shard ids"
        xb = write_descriptors_with_tokens(desc, spec.sizes, spec.d, seed=spec.seed, aliked=spec.aliked)
    else:
        parts = {s: clustered_unit_vectors(n, spec.d, seed=spec.seed + s) for s, n in spec.files}
        for s, row, column in spec.nan:
            parts[s][row, column] = np.nan
        for s, xb in parts.items():
            write_descriptor_file(desc, spec.name.format(s), s, xb)
        xb = np.concatenate(list(parts.values())).astype(np.float32)
    tars = write_source_tars(desc, Path(root) / "tars", spec.sizes, spec.tars, url_of) if spec.tars else {}
    return xb, tars


def build_synthetic(spec: SyntheticIndex, root: Path) -> tuple[Path, np.ndarray]:
    """(``root/index`` built by ``spec.config`` over ``spec``'s descriptors, or ``root/desc`` when it
    has none; the vectors in row order, float32)."""
    xb, _ = write_synthetic(spec, root)
    if spec.config is None:
        return Path(root) / "desc", xb
    return main(spec.config, Path(root) / "desc", Path(root) / "index"), xb


class SyntheticIndexes:
    """Each spec built once (under ``root``); ``copy`` for a test that changes its index."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.built: dict[SyntheticIndex, tuple[Path, np.ndarray]] = {}

    def get(self, spec: SyntheticIndex) -> tuple[Path, np.ndarray]:
        """(the index, or the descriptors when ``spec.config`` is None; a copy of its vectors). Read-only."""
        if spec not in self.built:
            self.built[spec] = build_synthetic(spec, self.root / f"{len(self.built):02d}")
        out, xb = self.built[spec]
        return out, xb.copy()

    def copy(self, spec: SyntheticIndex, root: Path) -> tuple[Path, np.ndarray]:
        """``get`` of a copy in ``root`` (``desc/``, ``index/``, ``tars/``) of the test's own, to change."""
        out, xb = self.get(spec)
        shutil.copytree(out.parent, root, dirs_exist_ok=True)
        return Path(root) / out.name, xb


# --- the kinds the tests use ------------------------------------------------------------------

LIVE_FLAT = SyntheticIndex(files=((0, 40), (1, 40), (2, 40)), d=16, config=FLAT_2, name="t{}")
"""A flat index of 2 shards over files t0-t2 of 40 rows (d 16): what the living-index tests change."""

LIVE_FLAT_4 = SyntheticIndex(files=((0, 40), (1, 40), (2, 40), (3, 40)), d=16, config=FLAT_2, name="t{}")
"""As LIVE_FLAT over four files (t0-t3)."""

LIVING = SyntheticIndex(files=((0, 30), (1, 30), (2, 30)), d=16, config=FLAT_2, name="t{}")
"""As LIVE_FLAT over files of 30 rows (the generation files' tests)."""

EXACT_FLAT = SyntheticIndex(
    files=((0, 150), (1, 150), (2, 150)), d=32, config=IndexConfig(kind="flat", shards=3), nan=((1, 40, 3),)
)
"""A flat index of 3 shards over 3 files of 150 rows (d 32), one descriptor rejected (NaN): exact search's."""

EXACT_DESCRIPTORS = SyntheticIndex(files=((0, 150), (1, 150), (2, 150)), d=32, config=None)
"""EXACT_FLAT's descriptors without the NaN (the index build tests build their own indexes)."""

S3_DESCRIPTORS = SyntheticIndex(files=((0, 80), (1, 80), (2, 80), (3, 80)), d=16, config=None)
"""Four files of 80 rows (d 16), for the builds to S3."""

QUERY_FLAT = SyntheticIndex(files=((0, 60), (1, 60)), d=16)
"""A flat index of one shard over two files of 60 rows (d 16): ``needle query``'s."""

CLIP_DESCRIPTORS = SyntheticIndex(files=((0, 40),), d=512, seed=3, config=None)
"""One file of 40 rows of 512-d vectors (open_clip ViT-B/16's width; the test records the extractor)."""

SERVED_IVFPQ = SyntheticIndex(files=((0, 150), (1, 150)), d=32, seed=20, config=SERVED_IVF)
"""A small IVF-PQ index (2 files of 150 rows, d 32) behind the HTTP service's tests."""

SERVED_480 = SyntheticIndex(files=tuple((s, 120) for s in range(4)), d=32, seed=10, config=SERVED_IVF)
"""Four files of 120 rows (d 32), the service's IVF-PQ: ``needle serve``'s single and sharded indexes."""

SHARDED_TOKENS = SyntheticIndex(
    files=((0, 300), (1, 250), (2, 400), (3, 120), (7, 330)),
    d=24,
    seed=3,
    config=IndexConfig(
        recall_target=None, kind="ivfpq", nlist=16, pq_bytes=8, points_per_list=20, nprobe=4, refine_factor=3, shards=4
    ),
    tokens=True,
    tars=20,
)
"""An IVF-PQ index of 4 shards over 5 files with local tokens and source tars (shards served in process)."""

ALIKED_FLAT = SyntheticIndex(files=((0, 40), (1, 30)), d=24, seed=5, config=FLAT_2, tokens=True, aliked=True)
"""A flat index of 2 shards whose tokens are recorded as ALIKED's (the packaged ITQ)."""

CLUSTER_TOKENS = SyntheticIndex(
    files=((0, 700), (1, 600), (2, 800), (3, 500), (4, 650), (5, 750)),
    d=32,
    seed=11,
    config=IndexConfig(
        recall_target=None, kind="ivfpq", nlist=32, pq_bytes=8, points_per_list=20, nprobe=8, refine_factor=2, shards=4
    ),
    tokens=True,
    tars=8,
)
"""An IVF-PQ index of 4 shards over 6 files with local tokens and source tars, served across Ray nodes."""


# --- fixtures (exposed by tests/conftest.py) --------------------------------------------------


@pytest.fixture(scope="session")
def synthetic_indexes(tmp_path_factory) -> SyntheticIndexes:
    return SyntheticIndexes(tmp_path_factory.mktemp("synthetic"))


@pytest.fixture
def live_flat_index(synthetic_indexes, tmp_path) -> Path:
    """LIVE_FLAT copied into the test's tmp_path (``desc/``, ``index/``): the index, to change."""
    return synthetic_indexes.copy(LIVE_FLAT, tmp_path)[0]


@pytest.fixture
def flat_index(synthetic_indexes) -> tuple[Path, np.ndarray]:
    """EXACT_FLAT: (the index, read-only; its vectors)."""
    return synthetic_indexes.get(EXACT_FLAT)
