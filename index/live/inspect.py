"""``needle index info`` and ``needle index keys``: what an index holds now, read, never changed.

- ``index_info``: the newest generation's state as one JSON object: its number, the build's kind,
  dimension, nlist and nprobe, the rows (live, deleted), the vectors a search can return, each
  shard's segments, the bytes of the segment files and delete sets, the last change, and the drift
  report of the newest ``needle index add`` that made one (index/live/drift.py).
- ``live_keys``: the keys of that generation's live rows (not deleted, their image read), segment
  by segment in shard order, read one record batch of a segment's ``ids.arrow`` at a time.

Both read through core.location, so a local directory and an ``s3://`` prefix read alike; only
the newest generation is read (index.live.generations.read_view).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow as pa

from core.location import Location
from index.generation import Generation, GenerationView
from index.layout import IDS_FILE
from index.live.deletes import segment_deletes
from index.live.generations import GenerationRemoved, manifest_name, read_manifest, read_view
from ingest.descriptors import STATUS_OK


def index_info(location: Location) -> dict[str, Any]:
    """The newest generation of the index at ``location`` as ``needle index info`` prints it."""
    view = read_view(location)
    fields, generation, totals = (
        view.as_infos(),
        view.generation,
        view.generation.totals,
    )  # a retrain's plan over the build's
    shards = [
        {
            "shard": shard.shard,
            "segments": len(shard.segments),
            "live_rows": shard.live_rows,
            "deleted_rows": sum(s.deleted_rows for s in shard.segments),
            "bytes": sum(s.bytes for s in shard.segments),
        }
        for shard in generation.shards
    ]
    return {
        "index": location.url,
        "generation": generation.number,
        "kind": fields.get("kind"),
        "factory": fields.get("factory"),
        "dim": view.infos.dim,
        "metric": fields.get("metric"),
        "nlist": fields.get("nlist"),
        "nprobe": fields.get("nprobe"),  # the default a search visits (flat: unused)
        "refine_factor": fields.get("refine_factor"),
        "rows": totals.rows,
        "live_rows": totals.live_rows,
        "deleted_rows": totals.deleted_rows,
        "live_ntotal": totals.live_ntotal,  # vectors a search can return (rows whose image failed have none)
        "shards": len(generation.shards),
        "segments_per_shard": [s["segments"] for s in shards],
        "per_shard": shards,
        "bytes": sum(s.bytes for s in generation.segments),  # the segments' files, as their writers recorded
        "locals": bool(fields.get("locals")),
        "last_change": dict(generation.change),
        "created_unix": generation.created_unix,
        "drift": newest_drift(location, generation),
        "training": generation.training.to_json()
        if generation.training
        else None,  # a retrain's, or the build's (None)
        "search_tuning": fields.get("search_tuning"),  # how nprobe and refine_factor were chosen (None: as given)
    }


def newest_drift(location: Location, generation: Generation) -> dict[str, Any] | None:
    """The drift report of the newest generation up to ``generation`` whose change made one (an
    ``add``), walking the parents back; None where no add reported one (a flat index, no adds)."""
    seen = set()
    while generation.number and generation.number not in seen:
        seen.add(generation.number)
        drift = generation.change.get("drift")
        if drift is not None:
            return {**drift, "generation": generation.number}
        if not generation.parent or location.read_bytes(manifest_name(generation.parent)) is None:
            return None  # generation 0 (the build) reports none; a parent an older needle removed
        try:
            generation = read_manifest(location, generation.parent)
        except GenerationRemoved:
            return None  # retired by compact --keep (its tombstone)
    return None


def live_keys(location: Location) -> Iterator[str]:
    """The keys of the newest generation's live rows: not deleted, their image read (status ok)."""
    view = read_view(location)
    yield from keys_of_view(location, view)


def keys_of_view(location: Location, view: GenerationView) -> Iterator[str]:
    for segment in view.segments:
        deletes = segment_deletes(location, segment)
        with ids_reader(location, f"{segment.name}/{IDS_FILE}") as reader:
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                rows = batch.column("row").to_numpy(zero_copy_only=False)
                ok = np.asarray(batch.column("status").to_numpy(zero_copy_only=False) == STATUS_OK)
                live = ok & ~deletes.contains(rows)
                keys = batch.column("key").to_pylist()
                yield from (key for key, keep in zip(keys, live.tolist()) if keep)


@contextmanager
def ids_reader(location: Location, name: str) -> Iterator[pa.ipc.RecordBatchFileReader]:
    """A segment's ``ids.arrow`` opened as an IPC file: memory-mapped where the index is local, its
    bytes read where it is not (one segment's ids at a time)."""
    root = location.local_root
    source: Any = pa.memory_map(str(root / name)) if root is not None else pa.BufferReader(location.read_required(name))
    with source:
        yield pa.ipc.open_file(source)
