"""Phase B of a retrain (index/live/retrain.py): under the writer lock, the changes published while
phase A ran carried onto its result, its files put in place under their final names, one generation
published.

Phase A re-encoded the live rows of generation P; the newest generation is now N (P where nothing
was published meanwhile). Row ids identify rows across generations (a row id is never reused:
``add`` refuses a Parquet file whose shard id the index holds). So, comparing N's segments that
are not P's unchanged ones with the rows phase A wrote:

- a row phase A wrote that no segment of N holds live was deleted meanwhile: it joins the delete
  set of the re-encoded segment holding it;
- a row live in N that phase A did not write was added meanwhile (an ``add``, or ``add --replace``'s
  new row): it is encoded with the new quantizer into one more segment of the shard N holds it in.

A compaction published meanwhile moved rows without changing which are live: nothing to carry.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from core.atomic import write_json_atomic
from core.kill_points import kill_point
from index.generation import DeleteFile, Segment, ShardSegments, Training
from index.layout import SHARD_INFOS_FILE, listed_files
from index.live.compact import remove_unreferenced, rewrite_rows
from index.live.config import CompactConfig
from index.live.generations import GENERATIONS_DIR
from index.live.retrain import Prepared, plan_record, segment_rows
from index.live.writer import Writer, writing

log = logging.getLogger(__name__)
CARRIED_SUFFIX = "c"  # a carried segment's token: the writer's + this (hex, so still a segment name)


def publish_retrained(conf: CompactConfig, index: Path | str, prepared: Prepared, reason: str) -> dict[str, Any]:
    """Take the lock, carry what was published since phase A's generation, publish; then remove
    what ``conf.keep`` leaves behind. Returns the change (the manifest's)."""
    with writing(index, conf.s3_endpoint_url) as writer:
        base = prepared.writer.parent
        entries = {s: put_in_place(writer, prepared, s) for s in sorted(prepared.shards)}
        deleted, added = changes_since(writer, prepared)
        carried = {}
        for shard, rows in sorted(added.items()):
            sources = list(writer.parent.shards[shard].segments)
            name = f"{writer.segment_name(shard)}{CARRIED_SUFFIX}"
            done = rewrite_rows(writer, sources, name, shard, prepared.trained, prepared.fields, keep=rows)
            writer.commit_segment(name)
            carried[shard] = done.entry
        shards = []
        for shard, entry in entries.items():
            gone = np.intersect1d(deleted, prepared.shards[shard].rows)
            if len(gone):
                indexed = len(np.intersect1d(gone, prepared.shards[shard].indexed))
                entry = replace_deleted(entry, writer.write_deletes(entry.name, gone, indexed))
            shards.append(ShardSegments(shard, (entry, *([carried[shard]] if shard in carried else []))))
        training = Training(
            writer.number,
            write_trained(writer, prepared.trained.read_bytes(), "faiss"),
            write_trained(writer, json.dumps(prepared.drift).encode(), "drift.json") if prepared.drift else None,
            sum(len(r.rows) for r in prepared.shards.values()),
            sum(e.rows for e in carried.values()),
            False,
            plan_record(prepared.plan, prepared.fields),
            prepared.search,
        )
        change: dict[str, Any] = {
            "command": "compact",
            "generation": None,
            "retrained": True,
            "retrain_reason": reason,
            "started_from": base.number,
            "plan": training.plan,
            "search": training.search,
            "carried": {
                "from_generations": writer.parent.number - base.number,
                "deleted_rows": len(deleted),
                "added_rows": training.added_rows,
            },
            "rewritten": [{"shard": s, "to": e.name} for s, e in entries.items()],
            "removed_rows": base.totals.deleted_rows,
            "timings": prepared.timings,
        }
        change["generation"] = writer.publish(shards, change, training).number
        change["removed"] = remove_unreferenced(writer, conf.keep)
        return change


def put_in_place(writer: Writer, prepared: Prepared, shard: int) -> Segment:
    """Phase A's segment of ``shard`` under its final name (this writer's generation and token):
    its ``shard_infos.json`` renamed, every file it lists uploaded (locally: moved, on the same
    filesystem), that file last; its manifest entry."""
    done = prepared.shards[shard]
    source = prepared.writer.root / done.entry.name
    name = writer.segment_name(shard)
    infos = json.loads((source / SHARD_INFOS_FILE).read_text())
    infos["name"] = name
    write_json_atomic(infos, source / SHARD_INFOS_FILE)
    writer.created.append(name)  # removed again if this writer fails before it publishes
    for file in listed_files(infos, str(source / SHARD_INFOS_FILE)):
        writer.location.upload(f"{name}/{file}", source / file)
    writer.location.upload(f"{name}/{SHARD_INFOS_FILE}", source / SHARD_INFOS_FILE)
    kill_point("segment_written")
    return Segment(name, done.entry.rows, done.entry.ntotal, done.entry.parquet_shard_ids, done.entry.bytes)


def changes_since(writer: Writer, prepared: Prepared) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """(rows deleted since phase A's generation, shard -> rows added since): module doc."""
    base = prepared.writer.parent
    if writer.parent.number == base.number:
        return np.zeros(0, np.int64), {}
    unchanged = {(s.name, s.deleted) for s in base.segments}
    written: dict[str, np.ndarray] = {}
    for done in prepared.shards.values():
        written.update(done.sources)
    covered = np.unique(np.concatenate([r.rows for r in prepared.shards.values()] or [np.zeros(0, np.int64)]))
    live_now, added = [], {}
    for shard in writer.parent.shards:
        for segment in shard.segments:
            if (segment.name, segment.deleted) in unchanged:
                continue  # as in phase A's generation: its live rows were written, none deleted since
            rows = segment_rows(writer, segment)
            rows = rows[~np.isin(rows, writer.deleted_rows(segment))]
            live_now.append(rows)
            new = rows[~np.isin(rows, covered)]
            if len(new):
                added[shard.shard] = np.union1d(added.get(shard.shard, np.zeros(0, np.int64)), new)
    # the rows phase A wrote from segments that changed since: those no segment of N holds live are deleted
    unchanged_names = {s.name for s in writer.parent.segments if (s.name, s.deleted) in unchanged}
    moved = [rows for name, rows in written.items() if name not in unchanged_names]
    candidates = np.concatenate(moved) if moved else np.zeros(0, np.int64)
    alive = np.concatenate(live_now) if live_now else np.zeros(0, np.int64)
    deleted = np.setdiff1d(candidates, alive)
    if len(deleted) or added:
        log.info("carrying %d rows deleted and %d added since generation %d", len(deleted),
                 sum(len(r) for r in added.values()), base.number)  # fmt: skip
    return deleted, added


def replace_deleted(entry: Segment, deleted: DeleteFile) -> Segment:
    return Segment(entry.name, entry.rows, entry.ntotal, entry.parquet_shard_ids, entry.bytes, deleted)


def write_trained(writer: Writer, data: bytes, suffix: str) -> str:
    """A training's file beside the manifests, under a name no one else uses (this writer's
    generation and token): written once, never rewritten."""
    name = f"{GENERATIONS_DIR}/trained_{writer.number:06d}_{writer.token}.{suffix}"
    writer.created.append(name)
    writer.location.create_exclusive(name, data)
    return name
