"""``needle index build``: a FAISS index over the ``global`` descriptors of Parquet files, built
streaming (never all descriptors in memory) within a memory budget, in parallel parts.

Output directory (see docs/schema.md): one self-contained directory per index shard,
``shard_000/`` ... (one unless ``--shards N``), each holding everything needed to answer for its
rows, at shard-local positions (its rows in file order):

- ``index.faiss``: its FAISS index, ids = the Parquet ``row`` ids (shards share one trained
  quantizer and hold disjoint rows)
- ``ids.arrow``: ``row``, ``key``, ``status`` of its Parquet rows, in file order (an uncompressed
  Arrow IPC file, memory-mapped at query time)
- ``vectors.f16.npy``: the float16 descriptors of its rows in the same order (zeros for rows not
  indexed), memory-mapped at query time for exact re-scoring ("refine") and queries by key
- ``keys.bin``, ``key_offsets.npy``, ``key_order.npy``: its key lookup files (index/keys.py)
- ``locals_<part>.tokens.bin`` / ``.offsets.npy``: its local-token segments (index/locals.py)
- ``shard_infos.json``: its Parquet files and their offsets, counts, every file's size and SHA-256

and ``index_infos.json`` at the top: the plan and why, sizes, the list of shards, the ingestion's
extractor info. Indexes built before shard directories (files at the top) still load
(index/search.py).

Steps: scan the files' footers and row ids; train on a sample read file by file; add each range
of files to a copy of the trained index (a "part", written inside its shard's directory: in
parallel on Ray with cluster/index_job.py, sequentially here); each shard merges its parts into
its own files.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc
import pyarrow.parquet as pq

from core.atomic import atomic_path, write_atomic, write_json_atomic
from core.errors import NeedleInputError
from core.hashing import file_sha256
from index.factory import IndexPlan, parse_bytes, plan_index
from index.gpu import assignment_quantizer, faiss_gpus
from index.keys import KEY_FILES, write_key_files
from index.locals import SegmentInfo, locals_infos, write_segment
from index.memory import peak_rss_bytes, process_memory
from ingest.descriptors import (
    ROW_SHARD_SHIFT,
    STATUS_OK,
    DescriptorFileError,
    global_dim,
    has_locals,
    list_descriptor_files,
    read_global,
)
from ingest.storage import MARKER_SUFFIX as MARKER
from ingest.storage import s3_client, split_s3

log = logging.getLogger(__name__)

INDEX_FILE = "index.faiss"
IDS_FILE = "ids.arrow"
VECTORS_FILE = "vectors.f16.npy"
INFOS_FILE = "index_infos.json"
SHARD_INFOS_FILE = "shard_infos.json"
TRAINED_FILE = "trained.faiss"
LAYOUT_SHARDS = "shard-directories"  # index_infos.json "layout" of indexes built as shard directories
DEFAULT_QUANTIZER_EF = 128


@dataclass(frozen=True)
class IndexConfig:
    kind: str = "auto"  # auto | flat | ivfpq (auto: flat below flat_threshold vectors when it fits)
    memory_budget: str = "8GB"  # RAM the built index may use (codes, ids, centroids); refine vectors are memory-mapped
    factory: str | None = None  # a FAISS factory string to use as is (e.g. "IVF4096,PQ64"); None: choose
    flat_threshold: int = 100_000  # under "auto", collections smaller than this get an exact index
    nlist: int | None = None  # IVF lists; None: ~4*sqrt(N)
    pq_bytes: int | None = None  # PQ code bytes per vector; None: the largest that fits the budget
    points_per_list: int = 64  # training sample = nlist * this, capped by the budget
    s3_endpoint_url: str | None = None  # S3-compatible endpoint for s3:// descriptor sources
    shards: int = 1  # keep this many index shards (served by one Ray actor each) instead of one index
    parts: int | None = None  # parallel add tasks; None: shards (at least 1)
    nprobe: int = 64  # default IVF lists visited per query (recorded; queries may override)
    adapt: str | None = (
        None  # adapter file (needle adapt train, or ILIAS's): index adapted descriptors; None: as ingested
    )
    refine_factor: int = 2  # IVF-PQ shortlist = refine_factor * k, re-scored exactly from float16
    quantizer_ef: int = DEFAULT_QUANTIZER_EF  # HNSW coarse quantizer: graph candidates explored per assignment (FAISS's
    # default 16 puts some vectors in a list far from them, where no query probes: recall@1000 capped at 0.986 on 1M)
    seed: int = 0  # training sample and k-means seed
    locals: bool = True  # build the local store when the descriptors carry local tokens (schema v2)


@dataclass(frozen=True)
class FileInfo:
    path: str
    rows: int
    shard_id: int
    offset: int  # position of the file's first row in its shard's ids.arrow / vectors.f16.npy
    source: str | None = None  # the s3:// object it was staged from (a task on another node fetches it)
    tar: str | None = None  # the tar ingestion read its rows from (thumbnails); None: not recorded


def shard_name(number: int) -> str:
    return f"shard_{number:03d}"


# "s3://b/x" as a Path is "s3:/b/x": both spellings of a URL name no local directory.
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/")


def output_location(output: Path | str) -> tuple[Path | None, str | None]:
    """(local directory, None) or (None, ``s3://bucket/prefix``); any other URL is refused rather
    than written to a local directory named ``gs:`` (or ``s3:``, for a mangled ``s3:/b/x``)."""
    text = str(output)
    if text.startswith("s3://"):
        return None, text.rstrip("/")
    if _URL.match(text):
        raise NeedleInputError(
            f"index output {output} is a URL needle index build cannot write: give a local directory or an "
            "s3://bucket/prefix"
        )
    return Path(output), None


def descriptor_files(
    descriptors: Path | str | Sequence[Path | str],
    staging: Path | None = None,
    s3_endpoint_url: str | None = None,
    origins: dict[str, str] | None = None,
) -> list[Path]:
    """Parquet files of one or several sources: descriptor directories, single files, or
    ``s3://`` prefixes, whose committed parts (those with their marker) are staged one by one
    into ``staging`` on local disk, with their ``ingest_info.json``; ``origins`` (if given)
    receives each staged file's ``s3://`` object."""
    sources = [descriptors] if isinstance(descriptors, (str, Path)) else list(descriptors)
    files: list[Path] = []
    for i, source in enumerate(sources):
        if str(source).startswith("s3://"):
            if staging is None:
                raise DescriptorFileError(f"{source}: s3:// sources need a staging directory")
            staged = stage_s3_parts(str(source), staging / f"source_{i:03d}", s3_endpoint_url)
            if origins is not None:
                origins.update({str(path): f"{str(source).rstrip('/')}/{path.name}" for path in staged})
            files.extend(staged)
        else:
            source = Path(source)
            files.extend([source] if source.is_file() else list_descriptor_files(source))
    return files


def stage_s3_parts(url: str, directory: Path, endpoint_url: str | None) -> list[Path]:
    """Download the committed Parquet parts under an ``s3://`` prefix (never the unmarked ones)."""
    from ingest.storage import S3Storage

    storage = S3Storage(url, endpoint_url)
    committed = storage.committed()
    if not committed:
        raise DescriptorFileError(f"{url} holds no committed .parquet part")
    directory.mkdir(parents=True, exist_ok=True)
    info = storage.read_json("ingest_info.json")
    if info is not None:
        write_json_atomic(info, directory / "ingest_info.json")
    files = []
    for name in sorted(committed):
        target = directory / name
        write_atomic(
            target, lambda tmp, name=name: storage.client.download_file(storage.bucket, storage._key(name), str(tmp))
        )
        files.append(target)
    log.info("staged %d parts of %s in %s", len(files), url, directory)
    return files


IDS_SCHEMA = pa.schema([("row", pa.int64()), ("key", pa.string()), ("status", pa.string())])


def scan(files: list[Path]) -> tuple[list[FileInfo], int, int]:
    """Check every file (dimension, row ids); returns (files with their positions in file order,
    d, ok rows)."""
    dim = None
    infos, offset, n_ok = [], 0, 0
    seen_shards: dict[int, Path] = {}
    for path in files:
        file_dim = global_dim(path)
        if dim is None:
            dim = file_dim
        elif file_dim != dim:
            raise DescriptorFileError(f"{path}: descriptor dimension {file_dim} differs from {dim} of {files[0]}")
        table = pq.read_table(path, columns=["row", "status"])
        rows = table["row"].to_numpy()
        shard_id = int(rows[0] >> ROW_SHARD_SHIFT) if len(rows) else -1
        expected = (np.int64(shard_id) << ROW_SHARD_SHIFT) + np.arange(len(rows), dtype=np.int64)
        if len(rows) and not np.array_equal(rows, expected):
            raise DescriptorFileError(f"{path}: row ids are not one shard's consecutive ids (schema v1)")
        if shard_id in seen_shards:
            raise DescriptorFileError(f"{path} and {seen_shards[shard_id]} hold the same shard id {shard_id}")
        seen_shards[shard_id] = path
        n_ok += int(pc.sum(pc.equal(table["status"], STATUS_OK)).as_py() or 0)
        infos.append(FileInfo(str(path), len(rows), shard_id, offset))
        offset += len(rows)
    if offset == 0:
        raise DescriptorFileError(f"no rows in {files[0].parent}")
    return infos, int(dim), n_ok


def write_ids(files: list[FileInfo], ids_path: Path) -> int:
    """The id table (row, key, status) of ``files``, in order, streamed file by file; returns rows."""
    rows = 0
    with atomic_path(ids_path) as tmp, pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, IDS_SCHEMA) as writer:
        for f in files:
            table = pq.read_table(f.path, columns=["row", "key", "status"])
            if table.num_rows != f.rows:
                raise DescriptorFileError(f"{f.path}: {table.num_rows} rows, {f.rows} when scanned (file changed?)")
            writer.write_table(table.cast(IDS_SCHEMA))
            rows += table.num_rows
    return rows


def write_keys_of_ids(ids_path: Path, directory: Path) -> int:
    """The key lookup files (index/keys.py) for the key column of the id table, streamed from its map."""
    with pa.memory_map(str(ids_path)) as source:
        keys = pa.ipc.open_file(source).read_all()["key"]
        return write_key_files(keys.chunks, directory, sort_keys=keys)


def read_valid(path: str, dim: int, adapter: Any = None) -> tuple[np.ndarray, np.ndarray, int]:
    """(row ids, float16 (n, d) descriptors) of a file's ok, finite rows, and how many were
    rejected; with ``adapter`` (embed.adapt.LinearAdapter) the adapted descriptors."""
    table, xb = read_global(Path(path), ("row", "status"))
    if xb.shape[1] != dim:
        raise DescriptorFileError(
            f"{path}: descriptor dimension {xb.shape[1]} differs from {dim} (file changed during the build?)"
        )
    ok = pc.equal(table["status"], STATUS_OK).to_numpy(zero_copy_only=False)
    finite = np.isfinite(xb).all(axis=1)
    rejected = int((ok & ~finite).sum())
    if rejected:
        log.warning("%s: %d descriptors with NaN/inf rejected", path, rejected)
    keep = ok & finite
    xb = xb[keep] if adapter is None else adapter.apply(xb[keep]).astype(np.float16)
    return table["row"].to_numpy()[keep], xb, rejected


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


def add_quantizer(index: Any) -> Any | None:
    """Where FAISS has GPUs, a stand-in for an IVF index's coarse quantizer that assigns added
    vectors to lists on the GPU (exact, where an HNSW quantizer's graph search is approximate;
    index/gpu.py ``assignment_quantizer``); None for a flat index or without GPUs (the CPU
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


def build_part(
    trained_path: str,
    files: list[FileInfo],
    dim: int,
    vectors_path: str,
    part_path: str,
    locals_name: str | None = None,
    adapt: str | None = None,
) -> dict[str, Any]:
    """Add ``files`` (contiguous, positions shard-local) to a copy of the trained index (saved at
    ``part_path``) and write their vectors, in order, into the part's own float16 ``.npy`` file
    ``vectors_path``; with ``locals_name``, also write their local tokens as that segment of the
    local store beside ``part_path``; with ``adapt``, add the descriptors through that adapter.
    Writes only beside ``part_path`` (its shard's directory). Plain function: the Ray job runs one
    per task."""
    import faiss

    adapter = _load_adapter(adapt)
    index_dim = adapter.out_dim if adapter is not None else dim
    index = faiss.read_index(trained_path)
    added = rejected = 0
    gpu_quantizer = add_quantizer(index)  # None without GPUs: the CPU add is unchanged
    if gpu_quantizer is not None:
        log.info("%s: assigning vectors to lists on the GPU", part_path)
    n_rows = sum(f.rows for f in files)
    # Written block by block after the .npy header, not through a writable memory map: mapped
    # dirty pages would count as this process's memory and inflate its RSS by the size of the vectors.
    with atomic_path(Path(vectors_path)) as tmp, open(tmp, "wb") as out, assigning_with(index, gpu_quantizer):
        write_float16_npy_header(out, n_rows, index_dim)
        for f in files:
            rows, xb, bad = read_valid(f.path, dim, adapter)
            index.add_with_ids(np.ascontiguousarray(xb, dtype=np.float32), rows)
            block = np.zeros((f.rows, index_dim), dtype=np.float16)
            block[(rows - (np.int64(f.shard_id) << ROW_SHARD_SHIFT)).astype(np.int64)] = xb
            out.write(block.tobytes())
            added += len(rows)
            rejected += bad
    rss = process_memory().get("rss", 0)  # the part's codes are in memory now: the add phase's high point
    write_atomic(Path(part_path), lambda tmp: faiss.write_index(index, str(tmp)))
    stats: dict[str, Any] = {"added": added, "rejected_non_finite": rejected, "rss_bytes": rss}
    if locals_name is not None:
        segment = write_segment(Path(part_path).parent, locals_name, [(f.path, f.rows, f.offset) for f in files])
        stats["locals"] = segment.to_dict()
    return stats


def write_float16_npy_header(out: Any, n_rows: int, dim: int) -> None:
    """The ``.npy`` header of an (n_rows, dim) float16 array, for rows written after it block by block."""
    np.lib.format.write_array_header_1_0(
        out,
        {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float16)), "fortran_order": False, "shape": (n_rows, dim)},
    )


def concatenate_vectors(part_paths: list[Path], out_path: Path, dim: int, chunk_rows: int = 1 << 16) -> int:
    """The parts' float16 vectors, in order, as one ``.npy`` file (streamed in chunks); returns rows."""
    parts = [np.load(path, mmap_mode="r") for path in part_paths]
    n_rows = sum(len(v) for v in parts)
    with atomic_path(out_path) as tmp, open(tmp, "wb") as out:
        write_float16_npy_header(out, n_rows, dim)
        for vectors in parts:
            if vectors.ndim != 2 or vectors.shape[1] != dim or vectors.dtype != np.float16:
                raise DescriptorFileError(
                    f"part vectors of shape {vectors.shape} {vectors.dtype}, expected (n, {dim}) float16"
                )
            for start in range(0, len(vectors), chunk_rows):
                out.write(np.ascontiguousarray(vectors[start : start + chunk_rows]).tobytes())
    del parts
    return n_rows


def _load_adapter(path: str | None) -> Any:
    if path is None:
        return None
    from embed.adapt import load_adapter

    return load_adapter(path)


def _adapt_infos(path: str | None, adapter: Any) -> dict[str, Any] | None:
    """How the indexed descriptors were adapted (None: they were not)."""
    if adapter is None:
        return None
    return {
        "file": str(Path(path).resolve()),
        "sha256": file_sha256(Path(path)),
        "in_dim": adapter.in_dim,
        "out_dim": adapter.out_dim,
    }


def _local_extractor(ingest: dict[str, Any]) -> dict[str, Any] | None:
    """The local extractor's info recorded by the ingestion, if any."""
    return next((e for e in ingest.get("extractors", []) if e.get("extractor") == "local"), None)


def split_ranges(files: list[FileInfo], parts: int) -> list[list[FileInfo]]:
    """Contiguous ranges of files with about equal row counts (each file goes to the part its
    middle row falls in); never fewer ranges than ``min(parts, len(files))``."""
    parts = max(1, min(parts, len(files)))
    total = sum(f.rows for f in files)
    ranges: list[list[FileInfo]] = [[] for _ in range(parts)]
    done = 0
    for f in files:
        ranges[min(parts - 1, int((done + f.rows / 2) * parts // max(1, total)))].append(f)
        done += f.rows
    ranges = [r for r in ranges if r]
    if len(ranges) < parts:  # very uneven files: split by file count instead
        ranges = [list(r) for r in np.array_split(np.array(files, dtype=object), parts)]
    return ranges


def merge_parts(part_paths: list[str], out_path: Path) -> int:
    """Merge parts built from one trained index into one index file; returns its size."""
    import faiss

    index = faiss.read_index(part_paths[0])
    try:
        ivf = faiss.extract_index_ivf(index)
    except RuntimeError:  # a flat index
        ivf = None
    for path in part_paths[1:]:
        other = faiss.read_index(path)
        if ivf is not None:
            ivf.merge_from(faiss.extract_index_ivf(other), 0)
        else:
            index.merge_from(other, 0)
    if ivf is not None:
        index.ntotal = ivf.ntotal  # a pre-transform wrapper does not see its inner index grow
    write_atomic(out_path, lambda tmp: faiss.write_index(index, str(tmp)))
    return int(index.ntotal)


def finish_shard(
    directory: Path,
    number: int,
    files: list[FileInfo],
    tasks: list[PartTask],
    stats: list[dict[str, Any]],
    common: dict[str, Any],
    extractor: dict[str, Any] | None,
) -> dict[str, Any]:
    """Turn a shard directory's built parts into its own files (index, vectors, ids, keys; the
    local segments stay as the parts wrote them), then write its ``shard_infos.json`` last, with
    every file's size and SHA-256; returns the shard's entry of the top-level infos."""
    dim = int(common["dim"])
    ntotal = merge_parts([task[4] for task in tasks], directory / INDEX_FILE)
    rows = concatenate_vectors([Path(task[3]) for task in tasks], directory / VECTORS_FILE, dim)
    if write_ids(files, directory / IDS_FILE) != rows:
        raise DescriptorFileError(f"{directory}: {rows} vectors for other than its {sum(f.rows for f in files)} rows")
    write_keys_of_ids(directory / IDS_FILE, directory)
    for task in tasks:
        Path(task[3]).unlink(missing_ok=True)
        Path(task[4]).unlink(missing_ok=True)
    segments = [SegmentInfo(**s["locals"]) for s in stats if "locals" in s]
    names = [INDEX_FILE, VECTORS_FILE, IDS_FILE, *KEY_FILES]
    names += [name for seg in segments for name in (seg.tokens, seg.offsets)]
    checksums = {
        name: {"bytes": (directory / name).stat().st_size, "sha256": file_sha256(directory / name)} for name in names
    }
    infos = {
        **common,
        "shard": number,
        "name": directory.name,
        "rows": rows,
        "ntotal": ntotal,
        "files": [
            {
                "path": f.source or f.path,
                "shard_id": f.shard_id,
                "rows": f.rows,
                "offset": f.offset,
                "tar": f.tar,
                **_file_stat(f.path),
            }
            for f in files
        ],
        "shard_offsets": {str(f.shard_id): f.offset for f in files},  # Parquet shard id -> first position here
        "rejected_non_finite": sum(s["rejected_non_finite"] for s in stats),
        "locals": locals_infos(segments, extractor, rows) if segments else None,
        "checksums": checksums,
    }
    write_json_atomic(infos, directory / SHARD_INFOS_FILE)
    return {
        "name": directory.name,
        "rows": rows,
        "ntotal": ntotal,
        "parquet_shard_ids": [f.shard_id for f in files],
        "bytes": sum(c["bytes"] for c in checksums.values()),
    }


def tars_of_files(paths: list[str]) -> dict[str, str]:
    """Parquet file -> the tar ingestion read it from, as recorded beside it (``ingest_info.json``,
    copied with staged S3 parts), for the files whose tar is recorded."""
    from ingest.source_images import tar_urls_of_files

    urls = tar_urls_of_files([{"path": str(Path(path).absolute())} for path in paths])  # shard name -> tar
    names = {path: Path(path).name.removesuffix(".parquet") for path in paths}
    return {path: urls[name] for path, name in names.items() if name in urls}


def _file_stat(path: str) -> dict[str, Any]:
    """Size of a Parquet file the shard was made from."""
    return {"bytes": Path(path).stat().st_size}


# (trained index, files, descriptor d, vectors file, part file, local segment name or None, adapter file or None)
PartTask = tuple[str, list[FileInfo], int, str, str, str | None, str | None]
PartRunner = Callable[[list[PartTask]], list[dict[str, Any]]]


def run_parts_sequentially(tasks: list[PartTask]) -> list[dict[str, Any]]:
    return [build_part(*task) for task in tasks]


# --- s3:// output: one task per shard builds it in a local temporary directory and uploads it -----
# (shard spec: number, parts (lists of FileInfo, shard-local offsets), part_ids, dim, locals, adapt,
# common, extractor, url, endpoint_url) -> its commit marker {"summary": ..., "stats": [...]}
ShardRunner = Callable[[bytes, list[dict[str, Any]]], list[dict[str, Any]]]


def upload_file(storage: Any, name: str, path: Path, sha256: str | None = None) -> None:
    """Upload ``path`` as ``name`` under the storage's prefix, with its SHA-256 as object metadata."""
    extra = {"Metadata": {"sha256": sha256}} if sha256 else None
    storage.client.upload_file(str(path), storage.bucket, storage._key(name), ExtraArgs=extra)


def reuse_trained(storage: Any, factory: str, trained_path: Path) -> dict[str, Any] | None:
    """A previous run's committed trained index for the same plan, downloaded to ``trained_path``
    (its marker), or None: shards kept from that run were added to this quantizer."""
    marker = storage.read_json(TRAINED_FILE + MARKER)
    if marker is None or marker.get("factory") != factory:
        return None
    storage.client.download_file(storage.bucket, storage._key(TRAINED_FILE), str(trained_path))
    return marker


def committed_shard(storage: Any, name: str, files: list[FileInfo], common: dict[str, Any]) -> dict[str, Any] | None:
    """The commit marker of shard ``name`` when a previous run committed it from the same files,
    plan and trained index and every file its shard_infos.json lists is there with the recorded
    size and SHA-256 (object metadata); else None (the shard is built again)."""
    from botocore.exceptions import ClientError

    marker = storage.read_json(name + MARKER)
    infos = storage.read_json(f"{name}/{SHARD_INFOS_FILE}") if marker is not None else None
    if infos is None:
        return None
    recorded = [(f["shard_id"], f["rows"], f["offset"]) for f in infos.get("files", [])]
    if recorded != [(f.shard_id, f.rows, f.offset) for f in files] or any(
        infos.get(key) != common.get(key) for key in ("factory", "dim", "trained_sha256", "adapt")
    ):
        log.info("%s/%s was made from other files or another plan: building it again", storage.url, name)
        return None
    for file, checksum in infos.get("checksums", {}).items():
        try:
            head = storage.client.head_object(Bucket=storage.bucket, Key=storage._key(f"{name}/{file}"))
        except ClientError:
            return None
        if (
            head.get("ContentLength") != checksum["bytes"]
            or head.get("Metadata", {}).get("sha256") != checksum["sha256"]
        ):
            log.info("%s/%s/%s does not match its checksum: building the shard again", storage.url, name, file)
            return None
    return marker


def fetch_source(f: FileInfo, directory: Path, endpoint_url: str | None) -> FileInfo:
    """``f`` where this node can read it: as it is, or downloaded from its ``s3://`` source."""
    if Path(f.path).is_file():
        return f
    if f.source is None:
        raise DescriptorFileError(
            f"{f.path} is not on this node and has no s3:// source: local descriptors need a filesystem "
            "every node sees (or give an s3:// prefix written by needle ingest)"
        )
    bucket, key = split_s3(f.source)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / Path(key).name
    s3_client(endpoint_url).download_file(bucket, key, str(target))
    return replace(f, path=str(target))


def build_shard_task(trained: bytes, spec: dict[str, Any]) -> dict[str, Any]:
    """Build one shard in a local temporary directory (its parts one after another, then its
    files), upload every file, its ``shard_infos.json``, then its commit marker last; returns the
    marker. Plain function: the Ray job runs one per task (retried where a task dies)."""
    from ingest.storage import S3Storage

    storage = S3Storage(spec["url"], spec["endpoint_url"])
    name = shard_name(spec["number"])
    with tempfile.TemporaryDirectory(prefix=f"needle-{name}-") as scratch:
        scratch = Path(scratch)
        trained_path = scratch / TRAINED_FILE
        trained_path.write_bytes(trained)
        parts = [[fetch_source(f, scratch / "parquet", spec["endpoint_url"]) for f in part] for part in spec["parts"]]
        directory = scratch / name
        directory.mkdir()
        tasks: list[PartTask] = [
            (
                str(trained_path),
                part,
                spec["dim"],
                str(directory / f"part_{i:03d}.vectors.f16.npy"),
                str(directory / f"part_{i:03d}.faiss"),
                f"locals_{i:03d}" if spec["locals"] else None,
                spec["adapt"],
            )
            for i, part in zip(spec["part_ids"], parts)
        ]
        stats = [build_part(*task) for task in tasks]
        files = [f for part in parts for f in part]
        summary = finish_shard(directory, spec["number"], files, tasks, stats, spec["common"], spec["extractor"])
        infos = json.loads((directory / SHARD_INFOS_FILE).read_text())
        for file, checksum in infos["checksums"].items():
            upload_file(storage, f"{name}/{file}", directory / file, checksum["sha256"])
        upload_file(storage, f"{name}/{SHARD_INFOS_FILE}", directory / SHARD_INFOS_FILE)
    marker = {"summary": summary, "stats": stats}
    storage.write_json(name + MARKER, marker)
    return marker


def run_shards_sequentially(trained: bytes, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [build_shard_task(trained, spec) for spec in specs]


def build_on_s3(
    storage: Any,
    trained_path: Path,
    ranges: list[list[FileInfo]],
    groups: list[list[int]],
    dim: int,
    with_locals: bool,
    adapt: str | None,
    common: dict[str, Any],
    extractor: dict[str, Any] | None,
    run_shards: ShardRunner,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run the shard tasks an S3 build still needs (a shard committed by an earlier run from the
    same files, plan and trained index is kept); returns the shards' summaries and their parts' stats."""
    kept: dict[int, dict[str, Any]] = {}
    specs = []
    for number, group in enumerate(groups):
        base = ranges[group[0]][0].offset
        parts = [[replace(f, offset=f.offset - base) for f in ranges[i]] for i in group]
        marker = committed_shard(storage, shard_name(number), [f for part in parts for f in part], common)
        if marker is not None:
            log.info("%s/%s is committed: kept", storage.url, shard_name(number))
            kept[number] = marker
            continue
        specs.append(
            {
                "number": number,
                "parts": parts,
                "part_ids": [int(i) for i in group],
                "dim": dim,
                "locals": with_locals,
                "adapt": adapt,
                "common": common,
                "extractor": extractor,
                "url": storage.url,
                "endpoint_url": storage.endpoint_url,
            }
        )
    markers = {**kept, **{spec["number"]: m for spec, m in zip(specs, run_shards(trained_path.read_bytes(), specs))}}
    summaries = [markers[n]["summary"] for n in range(len(groups))]
    return summaries, [stat for n in range(len(groups)) for stat in markers[n]["stats"]]


def main(
    conf: IndexConfig,
    descriptors: Path | str | Sequence[Path | str],
    output: Path | str,
    run_parts: PartRunner = run_parts_sequentially,
    run_shards: ShardRunner = run_shards_sequentially,
) -> Path | str:
    """Build the index of ``descriptors`` into ``output`` (a local directory, or an
    ``s3://bucket/prefix``); returns ``output``.

    ``run_parts`` executes the add tasks of a local build, ``run_shards`` the shard tasks of an
    S3 build (sequentially by default; cluster/index_job.py passes Ray runners).
    """
    import faiss

    start = time.perf_counter()
    local, url = output_location(output)
    storage = None
    if url is not None:
        from ingest.storage import S3Storage

        storage = S3Storage(url, conf.s3_endpoint_url)
        output = Path(tempfile.mkdtemp(prefix="needle-index-"))  # the driver's scratch: staging, training
    else:
        output = local
    output.mkdir(parents=True, exist_ok=True)
    origins: dict[str, str] = {}
    files = descriptor_files(descriptors, output / "staging", conf.s3_endpoint_url, origins)
    info_path = files[0].parent / "ingest_info.json"  # how the descriptors were made
    ingest = json.loads(info_path.read_text()) if info_path.is_file() else {}
    infos, dim, n_ok = scan(files)
    tars = tars_of_files([f.path for f in infos])
    infos = [replace(f, source=origins.get(f.path), tar=tars.get(f.path)) for f in infos]
    adapter = _load_adapter(conf.adapt)
    if adapter is not None and adapter.in_dim != dim:
        raise DescriptorFileError(f"adapter {conf.adapt} takes d={adapter.in_dim}, the descriptors have d={dim}")
    index_dim = adapter.out_dim if adapter is not None else dim  # what the index and the refine vectors hold
    timings = {"scan_s": time.perf_counter() - start}
    n_rows = sum(f.rows for f in infos)
    budget = parse_bytes(conf.memory_budget)
    plan = plan_index(
        max(1, n_ok),
        index_dim,
        budget,
        conf.kind,
        conf.factory,
        conf.flat_threshold,
        conf.points_per_list,
        conf.nlist,
        conf.pq_bytes,
    )
    log.info("index plan: %s (%s)", plan.factory, "; ".join(plan.reasons))

    trained_path = output / TRAINED_FILE
    reused = reuse_trained(storage, plan.factory, trained_path) if storage is not None else None
    if reused is None:
        xt = (
            training_sample(infos, dim, plan.n_train, conf.seed, adapter)
            if plan.kind == "ivfpq"
            else np.zeros((1, index_dim), np.float32)
        )
        timings["sample_s"] = time.perf_counter() - start - sum(timings.values())
        trained = train(plan, xt, conf.quantizer_ef)
        write_atomic(trained_path, lambda tmp: faiss.write_index(trained, str(tmp)))
        n_train = len(xt) if plan.kind == "ivfpq" else 0
        del xt
        if storage is not None:  # a later run resumes with this quantizer, so its shards agree with the kept ones
            upload_file(storage, TRAINED_FILE, trained_path)
            storage.write_json(TRAINED_FILE + MARKER, {"factory": plan.factory, "n_train": n_train})
    else:
        n_train = reused["n_train"]
        log.info("resuming with the trained index already at %s", url)
    timings["train_s"] = time.perf_counter() - start - sum(timings.values())
    training_peak = peak_rss_bytes()
    shards = max(1, conf.shards)
    ranges = split_ranges(infos, max(shards, conf.parts or shards))
    if shards > 1 and len(ranges) < shards:
        raise DescriptorFileError(f"--shards {shards} needs at least {shards} descriptor files, found {len(infos)}")
    with_locals = conf.locals and all(has_locals(Path(f.path)) for f in infos)
    if conf.locals and not with_locals and any(has_locals(Path(f.path)) for f in infos):
        raise DescriptorFileError(
            "some descriptor files carry local tokens and others do not: ingest them alike, or build with locals off"
        )
    common = {
        "kind": plan.kind,
        "factory": plan.factory,
        "metric": "inner_product",
        "dim": index_dim,
        "nprobe": conf.nprobe,
        "refine_factor": conf.refine_factor,
        "quantizer_ef": conf.quantizer_ef if "HNSW" in plan.factory else None,
        "adapt": _adapt_infos(conf.adapt, adapter),
        "faiss_version": faiss.__version__,
        "trained_sha256": file_sha256(trained_path),
    }
    extractor = _local_extractor(ingest)
    # Contiguous parts grouped into `shards` shards; positions inside a shard count from its first row.
    groups = [list(g) for g in np.array_split(np.arange(len(ranges)), shards)]
    if storage is not None:  # one task per shard: built on its node, uploaded, committed
        summaries, stats = build_on_s3(
            storage, trained_path, ranges, groups, dim, with_locals, conf.adapt, common, extractor, run_shards
        )
        timings["add_s"] = time.perf_counter() - start - sum(timings.values())
    else:
        tasks: list[PartTask] = []
        shard_parts: list[list[int]] = []
        shard_files: list[list[FileInfo]] = []
        for number, group in enumerate(groups):
            directory = output / shard_name(number)
            directory.mkdir(parents=True, exist_ok=True)
            base = ranges[group[0]][0].offset
            shard_files.append([])
            shard_parts.append([])
            for i in group:
                local = [replace(f, offset=f.offset - base) for f in ranges[i]]
                shard_files[-1].extend(local)
                shard_parts[-1].append(len(tasks))
                tasks.append(
                    (
                        str(trained_path),
                        local,
                        dim,
                        str(directory / f"part_{i:03d}.vectors.f16.npy"),
                        str(directory / f"part_{i:03d}.faiss"),
                        f"locals_{i:03d}" if with_locals else None,
                        conf.adapt,
                    )
                )
        stats = run_parts(tasks)
        timings["add_s"] = time.perf_counter() - start - sum(timings.values())

        summaries = [
            finish_shard(
                output / shard_name(number),
                number,
                files_of_shard,
                [tasks[t] for t in parts],
                [stats[t] for t in parts],
                common,
                extractor,
            )
            for number, (files_of_shard, parts) in enumerate(zip(shard_files, shard_parts))
        ]
    ntotal = sum(s["ntotal"] for s in summaries)
    trained_path.unlink(missing_ok=True)
    shutil.rmtree(output / "staging", ignore_errors=True)
    if storage is not None:
        shutil.rmtree(output, ignore_errors=True)
    timings["merge_s"] = time.perf_counter() - start - sum(timings.values())
    segments = [SegmentInfo(**s["locals"]) for s in stats] if with_locals else []
    locals_summary = locals_infos(segments, extractor, n_rows) if with_locals else None
    if locals_summary is not None:
        del locals_summary["segments"]  # each shard lists its own (shard_infos.json)

    index_infos = {
        "config": asdict(conf),
        "factory": plan.factory,
        "kind": plan.kind,
        "nlist": plan.nlist,
        "code_bytes": plan.code_bytes,
        "n_train": n_train,
        "estimated_bytes": plan.estimated_bytes,
        "memory_budget_bytes": budget,
        "reasons": plan.reasons,
        "metric": "inner_product",
        "ntotal": ntotal,
        "rows": n_rows,
        "dim": index_dim,
        "adapt": _adapt_infos(conf.adapt, adapter),
        "layout": LAYOUT_SHARDS,
        "shards": summaries,  # name, rows, ntotal, parquet shard ids, bytes of each shard directory
        "key_files": list(KEY_FILES),
        "nprobe": conf.nprobe,
        "refine_factor": conf.refine_factor,
        "quantizer_ef": conf.quantizer_ef if "HNSW" in plan.factory else None,
        "rejected_non_finite": sum(s["rejected_non_finite"] for s in stats),
        "descriptors": [str(d) for d in ([descriptors] if isinstance(descriptors, (str, Path)) else descriptors)],
        "parquet_files": len(infos),
        "extractors": ingest.get("extractors", []),
        "locals": locals_summary,
        "build_s": round(time.perf_counter() - start, 3),
        "timings": {name: round(seconds, 3) for name, seconds in timings.items()},  # scan, sample, train, add, merge
        "memory": {  # this process's high-water RSS after training and at the end; the parts' RSS when full
            "peak_rss_after_training_bytes": training_peak,
            "peak_rss_bytes": peak_rss_bytes(),
            "part_rss_bytes": max((s.get("rss_bytes", 0) for s in stats), default=0),
        },
        "faiss_version": faiss.__version__,
    }
    if storage is not None:  # last: the index is complete once its infos are there
        storage.write_json(INFOS_FILE, index_infos)
        output = url
    else:
        write_json_atomic(index_infos, output / INFOS_FILE)
    log.info("index %s: %d vectors, d=%d, %s in %d shards", output, ntotal, dim, plan.factory, len(summaries))
    return output
