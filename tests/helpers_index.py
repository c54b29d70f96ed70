"""Writing schema-v1 Parquet files of synthetic descriptors for index tests; an index in the layout
built before shard directories."""

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc

from index.build import INFOS_FILE, SHARD_INFOS_FILE
from index.keys import write_key_files
from index.search import read_ids
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


def to_old_layout(out: Path, target: Path, key_files: bool = True) -> Path:
    """An index directory as built before shard directories: ids, vectors, key files, local
    segments and ``index.faiss`` / ``shard_*.faiss`` at the top, global positions (``key_files``
    False: also before the key files)."""
    infos = json.loads((out / INFOS_FILE).read_text())
    target.mkdir()
    shards = [json.loads((out / e["name"] / SHARD_INFOS_FILE).read_text()) for e in infos["shards"]]
    tables = [read_ids(out / e["name"] / "ids.arrow") for e in infos["shards"]]
    ids = pa.concat_tables(tables)
    with pa.OSFile(str(target / "ids.arrow"), "wb") as sink, pa.ipc.new_file(sink, ids.schema) as writer:
        writer.write_table(ids)
    if key_files:
        write_key_files(ids["key"].chunks, target)
    np.save(
        target / "vectors.f16.npy",
        np.concatenate([np.load(out / e["name"] / "vectors.f16.npy") for e in infos["shards"]]),
    )
    names = ["index.faiss"] if len(shards) == 1 else [f"shard_{i:03d}.faiss" for i in range(len(shards))]
    offsets, segments, base = {}, [], 0
    for entry, shard, name in zip(infos["shards"], shards, names):
        shutil.copy(out / entry["name"] / "index.faiss", target / name)
        offsets.update({k: base + v for k, v in shard["shard_offsets"].items()})
        for segment in (shard["locals"] or {}).get("segments", []):
            for file in (segment["tokens"], segment["offsets"]):
                shutil.copy(out / entry["name"] / file, target / file)
            segments.append({**segment, "start": base + segment["start"]})
        base += shard["rows"]
    old = {k: v for k, v in infos.items() if k not in ("layout", "shards")}
    old.update(index_files=names, shard_offsets=offsets)
    if infos["locals"]:
        old["locals"] = {**infos["locals"], "segments": segments}
    (target / INFOS_FILE).write_text(json.dumps(old))
    return target
