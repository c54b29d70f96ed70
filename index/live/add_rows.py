"""``needle index add``: the rows of Parquet files an index does not hold yet, as a new generation.

Rows are encoded with the build's trained quantizer and PQ (no retraining: ``trained_empty``) by
the build's own add and shard steps (index/build/add.py, index/build/shard.py), one new segment
per shard that receives files; files go to the shards with the fewest live rows, so the shards
stay balanced. Local tokens, refine vectors and keys are written into the segment beside its
index. Re-running adds nothing twice: a Parquet file the index already holds (its Parquet shard
id, with the same name and rows) is skipped; a key the index already holds is an error naming it,
unless ``replace``: then its old row goes into the new generation's delete set. The report says
how far the new rows drift from what the quantizer was trained on (index/live/drift.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core.errors import NeedleInputError
from core.kill_points import kill_point
from core.quoting import short_repr
from index.build.add import PartRunner, run_parts_sequentially
from index.build.plan import FileInfo, load_adapter, local_extractor, part_task, read_sources
from index.build.records import BuildFields
from index.build.shard import finish_shard
from index.layout import VECTORS_FILE
from index.live.config import AddConfig
from index.live.drift import CoarseStats, coarse_stats, drift_report, sample_positions
from index.live.generations import GENERATIONS_DIR
from index.live.keys import ParentKeys
from index.live.writer import Writer, next_shards, parent_files, writing
from ingest.descriptors import STATUS_OK, DescriptorFileError, has_locals

log = logging.getLogger(__name__)
TRAINED_STATS_FILE = f"{GENERATIONS_DIR}/trained_drift.json"  # the drift report's baseline
TRAINED_SAMPLE_ROWS = 2000
SAMPLE_RUN = 100  # consecutive rows read at a time for the sample (one ranged read on S3)


class DuplicateKeyError(NeedleInputError):
    """A key being added that the index (or another added file) already holds."""


def main(
    conf: AddConfig,
    descriptors: Path | str | Sequence[Path | str],
    index: Path | str,
    run_parts: PartRunner = run_parts_sequentially,
) -> dict[str, Any]:
    """Add the new rows of ``descriptors`` to ``index`` as its next generation; returns what changed
    (the manifest's ``change``: ``"generation"`` None where nothing was new)."""
    with writing(index, conf.s3_endpoint_url) as writer:
        sources = read_sources(descriptors, writer.scratch / "staging", conf.s3_endpoint_url)
        adapt = (writer.infos.fields.get("config") or {}).get("adapt")
        adapter = load_adapter(adapt, sources.dim)
        index_dim = int(adapter.out_dim) if adapter is not None else sources.dim
        if index_dim != writer.infos.dim:
            raise NeedleInputError(
                f"--descriptors have d={sources.dim} (indexed as d={index_dim}); "
                f"index {index} holds d={writer.infos.dim}"
            )
        new, skipped = new_files(writer, sources.files)
        change: dict[str, Any] = {"command": "add", "skipped_files": skipped, "generation": None}
        if not new:
            log.info("every file is already in %s: nothing to add", index)
            return change
        with_locals = bool(writer.infos.fields.get("locals"))
        missing = [f.path for f in new if with_locals != has_locals(Path(f.path))]
        if missing:
            what = "has local tokens" if with_locals else "has no local tokens"
            raise DescriptorFileError(f"index {index} {what}, and {missing[0]} does not match it")
        replaced = replaced_rows(writer, new, conf.replace)
        assignment = balance(writer, new)
        trained = writer.trained_empty()
        names, tasks = {}, []
        for shard, files in assignment.items():
            names[shard] = writer.segment_name(shard)
            directory = writer.new_segment_dir(names[shard])
            tasks.append(part_task(trained, directory, 0, files, sources.dim, with_locals, adapt))
        started, started_cpu = time.perf_counter(), time.process_time()
        stats = run_parts(tasks)
        # the build's add phase, timed alike (index/build/stage.py ``add_s``); CPU: this process's (--ray: its own only)
        timings = {
            "add_s": round(time.perf_counter() - started, 3),
            "add_cpu_s": round(time.process_time() - started_cpu, 3),
        }
        kill_point("parts_added")
        common = BuildFields.of(writer.segment_infos(writer.parent.segments[0].name))
        extractor = local_extractor(sources.ingest)
        entries = {}
        for (shard, files), task, stat in zip(assignment.items(), tasks, stats):
            directory = writer.root / names[shard]
            entries[shard] = finish_shard(directory, shard, files, [task], [stat], common, extractor)
            writer.commit_segment(names[shard])
        drift = added_drift(writer, conf, trained, [writer.root / names[s] for s in assignment])
        shards = next_shards(writer, entries, replaced)
        change.update(
            files=[Path(f.source or f.path).name for f in new],
            rows=sum(f.rows for f in new),
            vectors=sum(s.added for s in stats),
            replaced=sum(len(rows) for rows, _ in replaced.values()),
            segments=sorted(names.values()),
            drift=drift,
            timings=timings,
        )
        if drift and drift["rebuild_recommended"]:
            log.warning(
                "the added rows drift from what the quantizer was trained on (mean quantisation error x%.2f, "
                "fullest 1%% of lists x%.2f their trained share): retrain it (needle index compact --retrain auto)",
                drift["error_ratio"],
                drift["top_share_ratio"],
            )
        carried = writer.training()  # the retrain rule counts the rows added since training (index/live/retrain.py)
        training = replace(
            carried,
            added_rows=carried.added_rows + change["rows"],
            drift_recommended=carried.drift_recommended or bool(drift and drift["rebuild_recommended"]),
        )
        change["generation"] = writer.publish(shards, change, training).number
        return change


def new_files(writer: Writer, files: list[FileInfo]) -> tuple[list[FileInfo], list[str]]:
    """The files the parent does not hold, and the names of those it holds (skipped). A Parquet
    shard id the index holds from another file is an error: their row ids would collide."""
    held = parent_files(writer)
    new, skipped = [], []
    for f in files:
        name = Path(f.source or f.path).name
        if f.shard_id in held:
            have = held[f.shard_id]
            if Path(have.path).name == name and have.rows == f.rows:
                skipped.append(name)
                continue
            raise DescriptorFileError(
                f"{f.source or f.path} holds Parquet shard id {f.shard_id}, which the index already holds from "
                f"{have.path} ({have.rows} rows): their row ids would collide"
            )
        new.append(f)
    return new, skipped


def replaced_rows(writer: Writer, files: list[FileInfo], replace_keys: bool) -> dict[int, tuple[np.ndarray, int]]:
    """Parent segment number -> (rows to delete, how many had vectors) for keys the new files
    re-add (``replace_keys``); a duplicate key without it is a DuplicateKeyError naming it."""
    keys: list[str] = []
    ok_keys: list[str] = []
    for f in files:
        table = pq.read_table(f.path, columns=["key", "status"])
        keys.extend(table["key"].to_pylist())
        ok_keys.extend(table.filter(pc.equal(table["status"], STATUS_OK))["key"].to_pylist())
    # Two indexable rows under one key are refused. A repeated key's other rows are error rows
    # (ingest writes a tar's repeated sample key so): kept, as the build keeps them, never indexed.
    twice = [key for key, count in Counter(ok_keys).items() if count > 1]
    if twice:
        raise DuplicateKeyError(f"key {short_repr(twice[0])} is in more than one added row ({len(twice)} such keys)")
    keys = list(dict.fromkeys(keys))
    parent = ParentKeys(writer)
    found = parent.find_many(keys)
    if len(found) and not replace_keys:
        raise DuplicateKeyError(
            f"key {short_repr(keys[int(found.key[0])])} is already in the index ({len(found)} of the added keys "
            "are): delete them first, or add with --replace"
        )
    return parent.deletes_of(writer, found)


def balance(writer: Writer, files: list[FileInfo]) -> dict[int, list[FileInfo]]:
    """Shard -> the files it receives (largest first to the shard with the fewest live rows),
    each shard's files in Parquet shard id order with positions counted from its segment's start."""
    live = [shard.live_rows for shard in writer.parent.shards]
    chosen: dict[int, list[FileInfo]] = {}
    for f in sorted(files, key=lambda f: (-f.rows, f.shard_id)):
        shard = int(np.argmin(live))
        live[shard] += f.rows
        chosen.setdefault(shard, []).append(f)
    out = {}
    for shard in sorted(chosen):
        offset, placed = 0, []
        for f in sorted(chosen[shard], key=lambda f: f.shard_id):
            placed.append(replace(f, offset=offset))
            offset += f.rows
        out[shard] = placed
    return out


def added_drift(writer: Writer, conf: AddConfig, trained: Path, segments: list[Path]) -> dict[str, Any] | None:
    """The drift report of the rows just added (index/live/drift.py), against the build's rows."""
    import faiss

    index = faiss.read_index(str(trained))
    try:
        faiss.extract_index_ivf(index)
    except RuntimeError:
        return None  # a flat index: no quantizer to drift from
    baseline = trained_stats(writer, index)
    # as many new rows as the baseline counted: the fullest lists' share depends on the rows counted
    size = baseline.rows if baseline else 0
    xb = sample_indexed_rows([np.load(d / VECTORS_FILE, mmap_mode="r") for d in segments], size, writer.infos.dim)
    return drift_report(coarse_stats(index, xb), baseline, conf.drift_error_ratio, conf.drift_top_share_ratio)


def sample_indexed_rows(parts: Sequence[np.ndarray], size: int, dim: int) -> np.ndarray:
    """Up to ``size`` rows (float32) drawn from the indexed rows of ``parts`` (float16, memory-mapped),
    in order: rows whose image failed hold zeros and are not indexed. Only the drawn rows are read
    whole and widened: widening a 20k-row batch took ~0.15 s, a tenth of a small add's CPU time."""
    starts = np.cumsum([0, *[len(p) for p in parts]])
    indexed = np.concatenate(
        [start + np.flatnonzero(indexed_rows(p)) for start, p in zip(starts, parts)] or [np.zeros(0, np.int64)]
    )
    chosen = indexed[sample_positions(len(indexed), size, seed=1)]
    blocks = [
        np.asarray(p[chosen[(chosen >= a) & (chosen < b)] - a], np.float32)
        for p, a, b in zip(parts, starts, starts[1:])
    ]
    return np.concatenate(blocks) if blocks else np.zeros((0, dim), np.float32)


def indexed_rows(x: np.ndarray) -> np.ndarray:
    """Which rows of stored vectors ``x`` are indexed: a row whose image failed (or whose descriptor
    was rejected) is stored as zeros, -0.0 included."""
    return np.asarray((x != 0).any(axis=1))


def trained_stats(writer: Writer, index: Any) -> CoarseStats | None:
    """The drift report's baseline: ``coarse_stats`` of a sample of the index's rows taken at its
    first add (the build's rows), kept beside the generations and reused by later adds."""
    training = writer.parent.training
    if training is not None and training.drift is not None:  # a retrain's baseline (index/live/retrain.py)
        return CoarseStats.from_json(json.loads(writer.location.read_required(training.drift)))
    data = writer.location.read_bytes(TRAINED_STATS_FILE)
    if data is not None:
        return CoarseStats.from_json(json.loads(data))
    blocks = []
    segments = writer.parent.segments
    per_segment = TRAINED_SAMPLE_ROWS // len(segments)
    for segment in segments:  # runs of SAMPLE_RUN consecutive rows at random places: a few reads each
        starts = sample_positions(max(1, segment.rows // SAMPLE_RUN), max(1, per_segment // SAMPLE_RUN))
        for start in starts:
            rows = writer.row_vectors(segment.name, int(start) * SAMPLE_RUN, SAMPLE_RUN)
            blocks.append(np.asarray(rows, np.float32))
    sample = np.concatenate(blocks) if blocks else np.zeros((0, writer.infos.dim), np.float32)
    stats = coarse_stats(index, sample[indexed_rows(sample)])
    if stats is not None:
        with contextlib.suppress(FileExistsError):
            writer.location.create_exclusive(TRAINED_STATS_FILE, json.dumps(stats.to_json()).encode())
    return stats
