"""Writing schema-v1 Parquet files of synthetic descriptors for index tests; an index in the layout
built before shard directories (which every reader refuses: the tests of that refusal)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc

from index.build.stage import INFOS_FILE, SHARD_INFOS_FILE
from index.keys import write_key_files
from index.shard_files import read_ids
from ingest.descriptors import descriptor_schema, fixed_size_list, make_row_id, write_parquet_atomic


def clustered_unit_vectors(n: int, d: int, seed: int = 0, clusters: int = 20) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(clusters, d))
    x = centers[rng.integers(0, clusters, n)] + 0.5 * rng.normal(size=(n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)


def write_descriptor_file(
    directory: Path, shard: str, shard_id: int, xb: np.ndarray, keys: list[str] | None = None
) -> Path:
    """Descriptor Parquet ``<shard>.parquet`` of Parquet shard ``shard_id`` (keys ``<shard>/i`` unless given)."""
    n, d = xb.shape
    table = pa.table(
        {
            "key": keys or [f"{shard}/{i:05d}" for i in range(n)],
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


def to_old_layout(out: Path, target: Path) -> Path:
    """The index ``out`` copied to ``target`` as built before shard directories (no reader opens
    it: index.errors.OldIndexLayoutError): ids, vectors, key files, local segments and
    ``index.faiss`` / ``shard_*.faiss`` at the top, global positions, and its infos without
    ``layout`` (its ``descriptors`` kept, as that build recorded them)."""
    infos = json.loads((out / INFOS_FILE).read_text())
    target.mkdir()
    shards = [json.loads((out / e["name"] / SHARD_INFOS_FILE).read_text()) for e in infos["shards"]]
    tables = [read_ids(out / e["name"] / "ids.arrow") for e in infos["shards"]]
    ids = pa.concat_tables(tables)
    with pa.OSFile(str(target / "ids.arrow"), "wb") as sink, pa.ipc.new_file(sink, ids.schema) as writer:
        writer.write_table(ids)
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


def token_table(shard: int, vectors: np.ndarray, codes: list[np.ndarray], rng: np.random.Generator) -> pa.Table:
    """A schema-v2 descriptor table of Parquet shard ``shard``: row i has ``vectors[i]`` and the
    tokens ``codes[i]``, each at a random position, scale and weight drawn from ``rng``."""
    from core.tokens import CODE_BYTES
    from ingest.descriptors import list_column, local_fields

    n = len(vectors)
    counts = [len(c) for c in codes]
    return pa.table(
        {
            "key": [f"{shard:06d}/{i:05d}" for i in range(n)],
            "shard": [f"{shard:06d}"] * n,
            "row": pa.array([make_row_id(shard, i) for i in range(n)], pa.int64()),
            "global": fixed_size_list(vectors, pa.float16()),
            "width": pa.array([100] * n, pa.int32()),
            "height": pa.array([80] * n, pa.int32()),
            "status": ["ok"] * n,
            "error": [""] * n,
            "local_codes": list_column(codes, pa.list_(pa.binary(CODE_BYTES))),
            "local_x": list_column([rng.integers(0, 99, t) for t in counts], pa.list_(pa.int16())),
            "local_y": list_column([rng.integers(0, 79, t) for t in counts], pa.list_(pa.int16())),
            "local_scale": list_column([rng.integers(0, 2, t) for t in counts], pa.list_(pa.uint8())),
            "local_weight": list_column([rng.random(t) for t in counts], pa.list_(pa.float16())),
        },
        schema=descriptor_schema(vectors.shape[1], local_fields(True, None)),
    )


def write_descriptors_with_tokens(
    directory: Path, sizes: dict[int, int], d: int, seed: int = 0, aliked: bool = False
) -> np.ndarray:
    """Parquet files (Parquet shard id -> rows) with global vectors and 0-12 random local tokens
    per row (codes from a pool of 256, so that rows share some); the first vectors of the first
    shard repeated in the second (exact ties across index shards). With ``aliked`` the tokens are
    recorded as ALIKED's, made with the packaged ITQ projection (what the second verification
    rebuilds descriptors with). Returns the vectors in row order (float32)."""
    from core.tokens import CODE_BYTES

    rng = np.random.default_rng(seed)
    ids = sorted(sizes)
    vectors = {s: clustered_unit_vectors(sizes[s], d, seed=seed + s) for s in ids}
    if len(ids) > 1:
        n = min(10, sizes[ids[0]], sizes[ids[1]])
        vectors[ids[1]][:n] = vectors[ids[0]][:n]
    for s in ids:
        n = sizes[s]
        tokens = [int(t) for t in rng.integers(0, 13, n)]
        codes = rng.integers(0, 256, (256, CODE_BYTES), dtype=np.uint8)
        table = token_table(s, vectors[s], [codes[rng.choice(256, t, replace=False)] for t in tokens], rng)
        write_parquet_atomic(table, Path(directory) / f"{s:06d}.parquet")
    local: dict = {"extractor": "local", "scales": [1.0, 0.5]}
    if aliked:
        from core.hashing import file_sha256
        from embed.locals.extract import resolve_itq
        from embed.locals.presets import ALIKED_ITQ

        _, itq_path = resolve_itq(ALIKED_ITQ)
        local.update(
            config={"kind": "aliked", "itq": ALIKED_ITQ, "scales": [1.0, 0.5]},
            itq=str(itq_path),
            itq_sha256=file_sha256(itq_path),
        )
    (Path(directory) / "ingest_info.json").write_text(json.dumps({"extractors": [local]}))
    return np.concatenate([vectors[s] for s in ids]).astype(np.float32)


def write_source_tars(
    desc: Path, directory: Path, sizes: dict[int, int], images: int = 20, url_of=None
) -> dict[str, Path]:
    """A tar per Parquet shard of ``desc`` with the images of its first ``images`` keys (random
    JPEGs), recorded in the descriptors' ingest_info.json as ingestion does (``url_of(path)``:
    the URL recorded for a tar, default its path). Returns shard name -> tar path."""
    from tests.support.tars import jpeg_bytes, write_tar

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    info = json.loads((desc / "ingest_info.json").read_text())
    info["results"] = []
    tars = {}
    for s in sorted(sizes):
        members = [
            (f"{i:05d}.jpg", jpeg_bytes(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8))) for i in range(images)
        ]
        tars[f"{s:06d}"] = write_tar(directory / f"{s:06d}.tar", members)
        url = url_of(tars[f"{s:06d}"]) if url_of else str(tars[f"{s:06d}"])
        info["results"].append({"shard": f"{s:06d}", "url": url, "status": "ok"})
    (desc / "ingest_info.json").write_text(json.dumps(info))
    return tars
