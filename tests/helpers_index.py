"""Writing schema-v1 Parquet files of synthetic descriptors for index tests."""

from pathlib import Path

import numpy as np
import pyarrow as pa

from ingest.descriptors import descriptor_schema, fixed_size_list, make_row_id, write_parquet_atomic


def clustered_unit_vectors(n: int, d: int, seed: int = 0, clusters: int = 20) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(clusters, d))
    x = centers[rng.integers(0, clusters, n)] + 0.5 * rng.normal(size=(n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)


def write_descriptor_file(directory: Path, shard: str, shard_id: int, xb: np.ndarray) -> Path:
    n, d = xb.shape
    table = pa.table(
        {
            "key": [f"{shard}/{i:05d}" for i in range(n)],
            "shard": [shard] * n,
            "row": pa.array([make_row_id(shard_id, i) for i in range(n)], pa.int64()),
            "global": fixed_size_list(xb, pa.float16()),
            "width": pa.array([100] * n, pa.int32()),
            "height": pa.array([80] * n, pa.int32()),
            "status": ["ok"] * n,
            "error": [""] * n,
        },
        schema=descriptor_schema(d),
    )
    return write_parquet_atomic(table, Path(directory) / f"{shard}.parquet")
