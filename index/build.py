"""``needle index build``: a FAISS index over the ``global`` descriptors of a Parquet directory.

Output directory layout (see docs/schema.md):

- ``index.faiss``: the FAISS index; its ids are the Parquet ``row`` ids
- ``ids.parquet``: ``row`` (int64) and ``key`` (string) of every indexed vector, in index order
- ``vectors.f16.npy``: the float16 descriptors in the same order (memory-mapped for exact re-scoring
  and key queries)
- ``index_infos.json``: how it was made (parameters, sizes, the ingestion's extractor info)

Small collections get an exact flat index (inner product = cosine on L2-normalised vectors);
above ``ivf_threshold`` vectors, IVF-PQ trained on a sample.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ingest.descriptors import (
    DescriptorFileError,
    iter_global_descriptors,
    list_descriptor_files,
    write_atomic,
    write_json_atomic,
    write_parquet_atomic,
)

log = logging.getLogger(__name__)

INDEX_FILE = "index.faiss"
IDS_FILE = "ids.parquet"
VECTORS_FILE = "vectors.f16.npy"
INFOS_FILE = "index_infos.json"
KINDS = ("auto", "flat", "ivfpq")


@dataclass(frozen=True)
class IndexConfig:
    kind: str = "auto"  # auto | flat | ivfpq (auto: flat below ivf_threshold vectors)
    ivf_threshold: int = 100_000  # collections at least this large get IVF-PQ under "auto"
    nlist: int | None = None  # IVF lists; None: about 4 * sqrt(N), a power of two
    pq_bytes: int | None = None  # PQ code size in bytes; None: d / 8 rounded to a divisor of d
    train_points_per_list: int = 64  # training sample = nlist * this (FAISS warns below 39)
    seed: int = 0  # training sample and k-means seed


def _default_nlist(n: int) -> int:
    return max(1, 2 ** round(math.log2(max(1.0, 4 * math.sqrt(n)))))


def _default_pq_bytes(d: int) -> int:
    target = max(1, d // 8)
    return max(m for m in range(1, target + 1) if d % m == 0)


def _collect(files: list[Path]) -> tuple[np.ndarray, np.ndarray, list[str], dict[str, int]]:
    """Read every ok descriptor; NaN/inf rows are rejected and counted."""
    rows, keys, blocks = [], [], []
    rejected = 0
    for path, table, xb in iter_global_descriptors(files):
        finite = np.isfinite(xb).all(axis=1)
        if not finite.all():
            rejected += int((~finite).sum())
            log.warning("%s: %d descriptors with NaN/inf rejected", path, int((~finite).sum()))
        mask = pa.array(finite)
        rows.append(table["row"].filter(mask).to_numpy())
        keys += table["key"].filter(mask).to_pylist()
        blocks.append(xb[finite])
    if not blocks or sum(len(b) for b in blocks) == 0:
        raise DescriptorFileError(f"no valid descriptor in {files[0].parent}")
    row_ids = np.concatenate(rows).astype(np.int64)
    if len(np.unique(row_ids)) != len(row_ids):
        raise DescriptorFileError(f"duplicate row ids in {files[0].parent}: ingest outputs overlap")
    return np.concatenate(blocks), row_ids, keys, {"rejected_non_finite": rejected}


def _make_index(conf: IndexConfig, xb: np.ndarray) -> tuple[Any, dict[str, Any]]:
    import faiss

    n, d = xb.shape
    kind = conf.kind
    if kind not in KINDS:
        raise ValueError(f"unknown index kind {kind!r}; choose from {KINDS}")
    if kind == "auto":
        kind = "ivfpq" if n >= conf.ivf_threshold else "flat"
    if kind == "flat":
        return faiss.IndexIDMap2(faiss.IndexFlatIP(d)), {"kind": "flat", "factory": "IDMap2,Flat"}
    nlist = conf.nlist or _default_nlist(n)
    m = conf.pq_bytes or _default_pq_bytes(d)
    if d % m:
        raise ValueError(f"pq_bytes={m} must divide the dimension {d}")
    factory = f"IVF{nlist},PQ{m}"
    index = faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
    n_train = min(n, nlist * conf.train_points_per_list)
    sample = np.random.default_rng(conf.seed).choice(n, n_train, replace=False) if n_train < n else np.arange(n)
    xt = np.ascontiguousarray(xb[np.sort(sample)], dtype=np.float32)
    log.info("training %s on %d vectors", factory, len(xt))
    index.train(xt)
    return index, {"kind": "ivfpq", "factory": factory, "nlist": nlist, "pq_bytes": m, "n_train": int(len(xt))}


def _save_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object: np.save would append ".npy" to a ".tmp" path
        np.save(f, array)


def _ingest_info(descriptors: Path) -> dict[str, Any]:
    path = descriptors / "ingest_info.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def descriptor_files(descriptors: Path | Sequence[Path]) -> list[Path]:
    """Parquet files of one or several sources, each a descriptor directory or a single file."""
    sources = [Path(descriptors)] if isinstance(descriptors, (str, Path)) else [Path(d) for d in descriptors]
    files: list[Path] = []
    for source in sources:
        if source.is_file():
            files.append(source)
        else:
            files.extend(list_descriptor_files(source))
    return files


def main(conf: IndexConfig, descriptors: Path | Sequence[Path], output: Path) -> Path:
    """Build the index of ``descriptors`` (Parquet directories or files) into ``output``; returns ``output``."""
    import faiss

    start = time.perf_counter()
    output = Path(output)
    files = descriptor_files(descriptors)
    xb, row_ids, keys, counts = _collect(files)
    index, params = _make_index(conf, xb)
    index.add_with_ids(np.ascontiguousarray(xb, dtype=np.float32), row_ids)

    output.mkdir(parents=True, exist_ok=True)
    write_atomic(output / INDEX_FILE, lambda tmp: faiss.write_index(index, str(tmp)))
    write_parquet_atomic(pa.table({"row": pa.array(row_ids, pa.int64()), "key": pa.array(keys, pa.string())}), output / IDS_FILE)
    write_atomic(output / VECTORS_FILE, lambda tmp: _save_npy(tmp, xb.astype(np.float16)))
    ingest = _ingest_info(files[0].parent)
    infos = {
        "config": asdict(conf),
        **params,
        "metric": "inner_product",
        "ntotal": int(index.ntotal),
        "dim": int(xb.shape[1]),
        "descriptors": sorted({str(f.parent.resolve()) for f in files}),
        "parquet_files": len(files),
        **counts,
        "extractors": ingest.get("extractors", []),
        "build_s": round(time.perf_counter() - start, 3),
        "faiss_version": faiss.__version__,
    }
    write_json_atomic(infos, output / INFOS_FILE)
    log.info("index %s: %d vectors, d=%d, %s", output, index.ntotal, xb.shape[1], params["factory"])
    return output
