"""The shard step of ``needle index build``: a shard directory's parts (one FAISS index and one
float16 vectors file each, written by the add step) merged into the shard's own files (index,
vectors, ids, keys; the local segments stay as the parts wrote them), then its
``shard_infos.json`` last, with every file's size and SHA-256 (docs/schema.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq

from core.atomic import atomic_path, write_atomic, write_json_atomic
from core.hashing import file_sha256
from index.build.plan import FileInfo, PartTask
from index.build.records import BuildFields, PartStats
from index.generation import Segment
from index.keys import KEY_FILES, write_key_files
from index.layout import IDS_FILE, INDEX_FILE, SHARD_INFOS_FILE, VECTORS_FILE
from index.locals import locals_infos
from ingest.descriptors import DescriptorFileError

IDS_SCHEMA = pa.schema([("row", pa.int64()), ("key", pa.string()), ("status", pa.string())])


def write_float16_npy_header(out: Any, n_rows: int, dim: int) -> None:
    """The ``.npy`` header of an (n_rows, dim) float16 array, for rows written after it block by block."""
    np.lib.format.write_array_header_1_0(
        out,
        {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float16)), "fortran_order": False, "shape": (n_rows, dim)},
    )


def check_part_vectors(vectors: np.ndarray, dim: int) -> None:
    """A part's vectors are (n, ``dim``) float16, else a DescriptorFileError naming their shape."""
    if vectors.ndim != 2 or vectors.shape[1] != dim or vectors.dtype != np.float16:
        raise DescriptorFileError(f"part vectors of shape {vectors.shape} {vectors.dtype}, expected (n, {dim}) float16")


def concatenate_vectors(part_paths: list[Path], out_path: Path, dim: int, chunk_rows: int = 1 << 16) -> int:
    """The parts' float16 vectors, in order, as one ``.npy`` file (streamed in chunks); returns rows."""
    parts = [np.load(path, mmap_mode="r") for path in part_paths]
    n_rows = sum(len(v) for v in parts)
    with atomic_path(out_path) as tmp, open(tmp, "wb") as out:
        write_float16_npy_header(out, n_rows, dim)
        for vectors in parts:
            check_part_vectors(vectors, dim)
            for start in range(0, len(vectors), chunk_rows):
                out.write(np.ascontiguousarray(vectors[start : start + chunk_rows]).tobytes())
    del parts
    return n_rows


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


def finish_shard(
    directory: Path,
    number: int,
    files: list[FileInfo],
    tasks: list[PartTask],
    stats: list[PartStats],
    common: BuildFields,
    extractor: dict[str, Any] | None,
) -> Segment:
    """Turn a shard directory's built parts into its own files (index, vectors, ids, keys; the
    local segments stay as the parts wrote them), then write its ``shard_infos.json`` last, with
    every file's size and SHA-256; returns the shard's entry of the top-level infos."""
    ntotal, rows = merge_shard_files(directory, files, tasks, common.dim)
    segments = [s.locals for s in stats if s.locals is not None]
    names = [INDEX_FILE, VECTORS_FILE, IDS_FILE, *KEY_FILES]
    names += [name for seg in segments for name in (seg.tokens, seg.offsets)]
    checksums = {name: _checksum(directory / name) for name in names}
    infos = {
        **common.to_json(),
        "shard": number,
        "name": directory.name,
        "rows": rows,
        "ntotal": ntotal,
        "files": [_file_entry(f) for f in files],
        "shard_offsets": {str(f.shard_id): f.offset for f in files},  # Parquet shard id -> first position here
        "rejected_non_finite": sum(s.rejected_non_finite for s in stats),
        "locals": locals_infos(segments, extractor, rows) if segments else None,
        "checksums": checksums,
    }
    write_json_atomic(infos, directory / SHARD_INFOS_FILE)
    return Segment(
        name=directory.name,
        rows=rows,
        ntotal=ntotal,
        parquet_shard_ids=tuple(f.shard_id for f in files),
        bytes=sum(c["bytes"] for c in checksums.values()),
    )


def merge_shard_files(directory: Path, files: list[FileInfo], tasks: list[PartTask], dim: int) -> tuple[int, int]:
    """The shard's index, vectors, ids and key files from its parts (whose files are removed
    then); returns (vectors indexed, rows)."""
    if len(tasks) == 1:  # one part (every ``needle index add`` segment): its files are the shard's, renamed
        ntotal, rows = adopt_part(Path(tasks[0][4]), Path(tasks[0][3]), directory, dim)
    else:
        ntotal = merge_parts([task[4] for task in tasks], directory / INDEX_FILE)
        rows = concatenate_vectors([Path(task[3]) for task in tasks], directory / VECTORS_FILE, dim)
    if write_ids(files, directory / IDS_FILE) != rows:
        raise DescriptorFileError(f"{directory}: {rows} vectors for other than its {sum(f.rows for f in files)} rows")
    write_keys_of_ids(directory / IDS_FILE, directory)
    for task in tasks:
        Path(task[3]).unlink(missing_ok=True)
        Path(task[4]).unlink(missing_ok=True)
    return ntotal, rows


def adopt_part(index_path: Path, vectors_path: Path, directory: Path, dim: int) -> tuple[int, int]:
    """A shard made of one part: the part's index and vectors renamed to the shard's (checked as
    a merge checks them: ``check_part_vectors``; a rename is atomic) instead of copied through a merge;
    returns (vectors indexed, rows)."""
    import faiss

    vectors = np.load(vectors_path, mmap_mode="r")
    check_part_vectors(vectors, dim)
    rows = len(vectors)
    del vectors
    ntotal = int(faiss.read_index(str(index_path)).ntotal)
    os.replace(index_path, directory / INDEX_FILE)
    os.replace(vectors_path, directory / VECTORS_FILE)
    return ntotal, rows


def _checksum(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def _file_entry(f: FileInfo) -> dict[str, Any]:
    """A Parquet file the shard was made from, as ``shard_infos.json`` lists it: where it came
    from (its ``s3://`` object where it was staged), its place in the shard, its tar and size."""
    return {
        "path": f.source or f.path,
        "shard_id": f.shard_id,
        "rows": f.rows,
        "offset": f.offset,
        "tar": f.tar,
        "bytes": Path(f.path).stat().st_size,
    }
