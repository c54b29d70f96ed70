"""Parquet descriptor files: schema v1 (see docs/schema.md), atomic writes, and reading.

One Parquet file per shard, ``<out>/<shard>.parquet``. Columns:

- ``key``: string, ``"<shard>/<__key__>"``, unique across the collection
- ``shard``: string, the shard's name
- ``row``: int64, stable id: ``(shard_id << 32) | position in the shard``; the index's ids
- ``global``: fixed-size list of float16, the L2-normalised global descriptor (zeros on error rows)
- ``width``, ``height``: int32, the original image size (0 on error rows)
- ``status``: string, ``ok`` or ``error``
- ``error``: string, why the sample failed (empty when ok)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ingest.errors import NeedleInputError

SCHEMA_VERSION = 1
ROW_SHARD_SHIFT = 32  # row = (shard_id << 32) | position: up to 4G samples per shard
STATUS_OK = "ok"
STATUS_ERROR = "error"


class DescriptorFileError(NeedleInputError):
    """A descriptor Parquet file that is missing, unreadable or does not follow the schema."""


def make_row_id(shard_id: int, position: int) -> int:
    return (shard_id << ROW_SHARD_SHIFT) | position


def descriptor_schema(dim: int, extra: list[pa.Field] | None = None) -> pa.Schema:
    """Schema v1 for descriptors of dimension ``dim``; extractors may add ``extra`` columns."""
    fields = [
        pa.field("key", pa.string(), nullable=False),
        pa.field("shard", pa.string(), nullable=False),
        pa.field("row", pa.int64(), nullable=False),
        pa.field("global", pa.list_(pa.float16(), dim)),
        pa.field("width", pa.int32()),
        pa.field("height", pa.int32()),
        pa.field("status", pa.string(), nullable=False),
        pa.field("error", pa.string()),
    ]
    return pa.schema(fields + list(extra or []), metadata={b"needle_schema_version": str(SCHEMA_VERSION).encode()})


def fixed_size_list(array: np.ndarray, value_type: pa.DataType) -> pa.FixedSizeListArray:
    """(n, d) numpy array -> Arrow fixed-size-list column without a Python loop."""
    n, d = array.shape
    flat = pa.array(np.ascontiguousarray(array).reshape(-1), type=value_type)
    return pa.FixedSizeListArray.from_arrays(flat, d)


def write_atomic(path: Path, write: Any) -> Path:
    """Call ``write(tmp_path)`` then rename onto ``path``: readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def write_parquet_atomic(table: pa.Table, path: Path) -> Path:
    return write_atomic(path, lambda tmp: pq.write_table(table, tmp))


def write_json_atomic(obj: Any, path: Path) -> Path:
    return write_atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n"))


def list_descriptor_files(directory: Path) -> list[Path]:
    """The committed Parquet parts of a descriptor directory, sorted (``.tmp`` files are ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DescriptorFileError(f"descriptor directory {directory} does not exist")
    files = sorted(directory.glob("*.parquet"))
    if not files:
        raise DescriptorFileError(f"descriptor directory {directory} holds no .parquet file")
    return files


def global_dim(path: Path) -> int:
    """Dimension of the ``global`` column of one Parquet file."""
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise DescriptorFileError(f"cannot read Parquet file {path}: {exc}") from exc
    if "global" not in schema.names:
        raise DescriptorFileError(f"Parquet file {path} has no 'global' column (columns: {schema.names})")
    field_type = schema.field("global").type
    if not pa.types.is_fixed_size_list(field_type):
        raise DescriptorFileError(f"column 'global' of {path} is {field_type}, expected a fixed-size list")
    return field_type.list_size


def read_global(path: Path, columns: tuple[str, ...] = ("row", "key", "status")) -> tuple[pa.Table, np.ndarray]:
    """One file's ``columns`` and its (n, d) float16 ``global`` descriptors, all rows."""
    dim = global_dim(path)
    table = pq.read_table(path, columns=[*columns, "global"])
    values = table["global"].combine_chunks().flatten().to_numpy(zero_copy_only=False)
    xb = np.asarray(values, dtype=np.float16).reshape(len(table), dim)
    return table.drop_columns(["global"]), xb
