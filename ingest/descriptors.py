"""Parquet descriptor files: schema v1/v2 (see docs/schema.md), atomic writes, and reading.

One Parquet file per shard, ``<out>/<shard>.parquet``. Columns:

- ``key``: string, ``"<shard>/<__key__>"``, unique across the collection
- ``shard``: string, the shard's name
- ``row``: int64, stable id: ``(shard_id << 32) | position in the shard``; the index's ids
- ``global``: fixed-size list of float16, the L2-normalised global descriptor (zeros on error rows)
- ``width``, ``height``: int32, the original image size (0 on error rows)
- ``status``: string, ``ok`` or ``error``
- ``error``: string, why the sample failed (empty when ok)

Schema v2 adds the local tokens of each row as list columns (``local_codes``, ``local_x``,
``local_y``, ``local_scale``, ``local_weight``, optionally ``local_desc``); v1 files stay readable.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.atomic import write_atomic
from core.errors import NeedleInputError
from core.tokens import CODE_BYTES

SCHEMA_VERSION = 1  # globals only
SCHEMA_VERSION_LOCALS = 2  # globals and local tokens
ROW_SHARD_SHIFT = 32  # row = (shard_id << 32) | position: up to 4G samples per shard
STATUS_OK = "ok"
STATUS_ERROR = "error"


class DescriptorFileError(NeedleInputError):
    """A descriptor Parquet file that is missing, unreadable or does not follow the schema."""


def make_row_id(shard_id: int, position: int) -> int:
    return (shard_id << ROW_SHARD_SHIFT) | position


def local_fields(with_codes: bool, desc_dim: int | None) -> list[pa.Field]:
    """The schema-v2 list columns of local tokens (``local_codes`` with codes, ``local_desc`` with a
    float descriptor dimension)."""
    fields = [
        pa.field("local_x", pa.list_(pa.int16())),
        pa.field("local_y", pa.list_(pa.int16())),
        pa.field("local_scale", pa.list_(pa.uint8())),
        pa.field("local_weight", pa.list_(pa.float16())),
    ]
    if with_codes:
        fields.insert(0, pa.field("local_codes", pa.list_(pa.binary(CODE_BYTES))))
    if desc_dim is not None:
        fields.append(pa.field("local_desc", pa.list_(pa.list_(pa.float16(), desc_dim))))
    return fields


def descriptor_schema(dim: int, extra: list[pa.Field] | None = None) -> pa.Schema:
    """Schema for descriptors of dimension ``dim``; extractors may add ``extra`` columns (local
    token columns make it schema v2)."""
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
    extra = list(extra or [])
    version = SCHEMA_VERSION_LOCALS if any(f.name.startswith("local_") for f in extra) else SCHEMA_VERSION
    return pa.schema(fields + extra, metadata={b"needle_schema_version": str(version).encode()})


def fixed_size_list(array: np.ndarray, value_type: pa.DataType) -> pa.FixedSizeListArray:
    """(n, d) numpy array -> Arrow fixed-size-list column without a Python loop."""
    _n, d = array.shape
    flat = pa.array(np.ascontiguousarray(array).reshape(-1), type=value_type)
    return pa.FixedSizeListArray.from_arrays(flat, d)


def list_column(per_row: list[np.ndarray | None], list_type: pa.ListType) -> pa.ListArray:
    """Per-row numpy arrays (None: an empty list) -> an Arrow list column of ``list_type``, whose
    values are scalars, fixed-size binary (rows of an (n, bytes) uint8 array) or fixed-size lists
    (rows of an (n, d) array)."""
    value_type = list_type.value_type
    lengths = np.array([0 if v is None else len(v) for v in per_row], dtype=np.int32)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    present = [v for v in per_row if v is not None and len(v)]
    if pa.types.is_fixed_size_binary(value_type):
        width = value_type.byte_width
        flat = np.concatenate(present).astype(np.uint8) if present else np.zeros((0, width), np.uint8)
        if flat.ndim != 2 or flat.shape[1] != width:
            raise TypeError(f"fixed-size binary column needs (n, {width}) uint8 rows, got {flat.shape}")
        values = pa.FixedSizeBinaryArray.from_buffers(
            value_type, len(flat), [None, pa.py_buffer(np.ascontiguousarray(flat).tobytes())]
        )
    elif pa.types.is_fixed_size_list(value_type):
        d = value_type.list_size
        dtype = value_type.value_type.to_pandas_dtype()
        flat = np.concatenate(present).astype(dtype) if present else np.zeros((0, d), dtype)
        values = fixed_size_list(flat.reshape(-1, d), value_type.value_type)
    else:
        dtype = value_type.to_pandas_dtype()
        values = pa.array(np.concatenate(present).astype(dtype) if present else np.zeros(0, dtype), type=value_type)
    return pa.ListArray.from_arrays(offsets, values, type=list_type)


def list_values(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """An Arrow list column -> (offsets (n+1,) int64, flat numpy values). Fixed-size binary values
    come back as (total, bytes) uint8, fixed-size lists as (total, d)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    # Offsets relative to the array's own slice: flatten() drops what lies outside it.
    offsets = array.offsets.to_numpy().astype(np.int64)
    offsets = offsets - offsets[0]
    flat = array.flatten()
    value_type = flat.type
    if pa.types.is_fixed_size_binary(value_type):
        buffer = flat.buffers()[1]
        width = value_type.byte_width
        raw = np.frombuffer(buffer, dtype=np.uint8)[flat.offset * width : (flat.offset + len(flat)) * width]
        return offsets, raw.reshape(len(flat), width)
    if pa.types.is_fixed_size_list(value_type):
        inner = flat.flatten().to_numpy(zero_copy_only=False)
        return offsets, np.asarray(inner).reshape(len(flat), value_type.list_size)
    return offsets, flat.to_numpy(zero_copy_only=False)


def has_locals(path: Path) -> bool:
    """Whether a descriptor file carries binary local tokens (schema v2 with codes)."""
    try:
        return "local_codes" in pq.read_schema(path).names
    except (OSError, pa.ArrowInvalid) as exc:
        raise DescriptorFileError(f"cannot read Parquet file {path}: {exc}") from exc


def write_parquet_atomic(table: pa.Table, path: Path) -> Path:
    return write_atomic(path, lambda tmp: pq.write_table(table, tmp))


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


def valid_descriptors(vectors: np.ndarray, statuses: np.ndarray) -> np.ndarray:
    """Which rows of ``vectors`` (n, d) with ``statuses`` (n,) are valid descriptors: status ok,
    finite, not all zeros (-0.0 counts as zero). The one definition of a row a FAISS index holds
    (index.shard.is_valid_descriptor is it for one row): the build and add index these rows only,
    delete and compact count them (``ntotal``)."""
    x = np.asarray(vectors)
    ok = np.asarray(statuses, object) == STATUS_OK
    return ok & np.isfinite(x).all(axis=1) & (x != 0).any(axis=1)
