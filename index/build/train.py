"""The train step of ``needle index build``: the empty index trained on a sample (k-means of the
coarse quantizer, PQ codebooks), saved as ``trained.faiss`` for every part to add to; on an S3
output also committed, so that a resumed build adds to the same quantizer as the shards it keeps.

Where its trained quantizer runs is decided here too (``add_quantizer``: the GPU assigns added
vectors to lists where FAISS has GPUs): one module asks ``faiss_gpus`` for both k-means and the
add, so the GPU placement of a build is one switch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from core.atomic import write_atomic
from core.errors import NeedleInputError
from core.location import S3Location
from core.storage import MARKER_SUFFIX
from index.build.config import DEFAULT_QUANTIZER_EF
from index.build.factory import IndexPlan
from index.build.plan import FileInfo, read_valid
from index.gpu.engine import assignment_quantizer, faiss_gpus
from index.layout import TRAINED_FILE

log = logging.getLogger(__name__)


def training_sample(files: list[FileInfo], dim: int, n_train: int, seed: int, adapter: Any = None) -> np.ndarray:
    """About ``n_train`` valid (adapted) vectors drawn uniformly, reading one file at a time."""
    total = sum(f.rows for f in files)
    rng = np.random.default_rng(seed)
    take = min(1.0, 1.1 * n_train / total)
    blocks = []
    for f in files:
        _rows, xb, _ = read_valid(f.path, dim, adapter)
        if len(xb):
            blocks.append(xb[rng.random(len(xb)) < take])
    xt = np.concatenate(blocks)  # float16: half the memory while the sample is drawn
    del blocks
    return xt[rng.permutation(len(xt))[:n_train]].astype(np.float32)


def sample_for(
    plan: IndexPlan, files: list[FileInfo], dim: int, index_dim: int, seed: int, adapter: Any = None
) -> np.ndarray:
    """What ``plan`` trains on: a sample for IVF-PQ; one zero vector for a flat index (nothing to
    train, the vector only gives the index its dimension)."""
    if plan.kind == "ivfpq":
        return training_sample(files, dim, plan.n_train, seed, adapter)
    return np.zeros((1, index_dim), np.float32)


def hnsw_quantizer(index: Any) -> Any | None:
    """The HNSW graph over an IVF index's centroids, or None (flat quantizer, flat index)."""
    import faiss

    try:
        quantizer = faiss.downcast_index(faiss.extract_index_ivf(index).quantizer)
    except RuntimeError:
        return None
    return quantizer if hasattr(quantizer, "hnsw") else None


def train(plan: IndexPlan, xt: np.ndarray, quantizer_ef: int = DEFAULT_QUANTIZER_EF) -> Any:
    import faiss

    index = faiss.index_factory(xt.shape[1], plan.factory, faiss.METRIC_INNER_PRODUCT)
    if plan.kind == "ivfpq":
        if faiss_gpus() > 0:  # k-means of the coarse quantizer on the GPUs
            ivf = faiss.extract_index_ivf(index)
            ivf.clustering_index = faiss.index_cpu_to_all_gpus(faiss.IndexFlatL2(ivf.d))
        log.info("training %s on %d vectors", plan.factory, len(xt))
        index.train(xt)
        graph = hnsw_quantizer(index)
        if graph is not None:  # saved with the index: every part assigns its vectors with this depth
            graph.hnsw.efSearch = quantizer_ef
    return index


def train_and_save(
    plan: IndexPlan, xt: np.ndarray, quantizer_ef: int, trained_path: Path, storage: S3Location | None
) -> int:
    """Train on ``xt`` and write the trained index to ``trained_path``; with ``storage`` (an S3
    output) also upload it, then its marker: a later run resumes with this quantizer, so its
    shards agree with the kept ones. Returns the vectors it was trained on (0: a flat index)."""
    import faiss

    trained = train(plan, xt, quantizer_ef)
    write_atomic(trained_path, lambda tmp: faiss.write_index(trained, str(tmp)))
    n_train = len(xt) if plan.kind == "ivfpq" else 0
    if storage is not None:
        storage.upload(TRAINED_FILE, trained_path)
        storage.write_json(TRAINED_FILE + MARKER_SUFFIX, {"factory": plan.factory, "n_train": n_train})
    return n_train


def reuse_trained(storage: S3Location, factory: str, trained_path: Path) -> dict[str, Any] | None:
    """A previous run's committed trained index for the same plan, downloaded to ``trained_path``
    (its marker), or None: shards kept from that run were added to this quantizer."""
    marker = storage.read_json(TRAINED_FILE + MARKER_SUFFIX)
    if marker is None or marker.get("factory") != factory:
        return None
    storage.download(TRAINED_FILE, trained_path)
    return dict(marker)


def add_quantizer(index: Any) -> Any | None:
    """Where FAISS has GPUs, a stand-in for an IVF index's coarse quantizer that assigns added
    vectors to lists on the GPU (exact, where an HNSW quantizer's graph search is approximate;
    index/gpu/engine.py ``assignment_quantizer``); None for a flat index or without GPUs (the CPU
    quantizer adds, as before)."""
    import faiss

    if faiss_gpus() == 0:
        return None
    try:
        ivf = faiss.extract_index_ivf(index)
    except RuntimeError:  # a flat index: nothing to assign
        return None
    return assignment_quantizer(ivf.quantizer, gpu=True)


@contextmanager
def assigning_with(index: Any, quantizer: Any | None) -> Iterator[Any]:
    """Within the block, ``index``'s IVF assigns added vectors to lists (and takes their
    residuals) with ``quantizer``, which holds the same centroids in the same order (e.g.
    ``add_quantizer``'s); the index's own quantizer is back in place when the block ends, before
    anything saves the index. ``quantizer`` None: the index is left as it is."""
    import faiss

    if quantizer is None:
        yield index
        return
    ivf = faiss.extract_index_ivf(index)
    if quantizer.ntotal != ivf.quantizer.ntotal or quantizer.d != ivf.quantizer.d:
        raise NeedleInputError(
            f"replacement quantizer holds {quantizer.ntotal} x {quantizer.d} centroids, "
            f"the index {ivf.quantizer.ntotal} x {ivf.quantizer.d}"
        )
    own = ivf.quantizer
    ivf.quantizer = quantizer
    try:
        yield index
    finally:
        ivf.quantizer = own
