"""``needle index compact --retrain``: the index made what a fresh build of its live rows would be.

A build trains its coarse quantizer and PQ once; every ``add`` encodes its rows with them. When the
collection drifts (docs/live_index.md: when a retrain pays) recall falls and stays down. A retrain
plans the index for its live rows again (the build's planner, index/build/plan.py and factory.py:
a flat index past the flat threshold becomes IVF-PQ, nlist and PQ size follow the rows within the
memory budget), trains on a sample of the live rows read from the stored float16 vectors (no
re-ingestion), re-encodes every live row into one new segment per shard, chooses the served search
defaults for a recall target (index/build/tune.py) and publishes it all as one generation, whose
manifest records the new training (``training``: its trained index and drift baseline, each
written once under a name of its own, ``generations/trained_<generation>_<token>.*``).

The long work is done without the writer lock (phase A, ``prepare``): from the generation it
starts on, into a private scratch directory (``.retrain-<pid>-<token>/`` inside a local index,
which no writer or compaction touches; a temporary directory for an S3 one). Only then does it
take the lock (phase B, ``publish_retrained``): adds and deletes published meanwhile are
carried onto its result (deleted rows into its segments' delete sets, added rows encoded with the
new quantizer into one more segment of their shard), its files are moved under their final names,
and it publishes. So writers wait for a retrain only while it carries changes over and publishes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from core.atomic import write_json_atomic
from core.errors import NeedleInputError
from core.kill_points import kill_point
from core.location import Location, location_of
from index.build.factory import IndexPlan, parse_bytes, plan_index
from index.build.records import BuildFields
from index.generation import DeleteFile, Generation, GenerationView, IndexInfos, Segment, ShardSegments, Training
from index.layout import SHARD_INFOS_FILE, listed_files
from index.live.config import CompactConfig
from index.live.drift import coarse_stats
from index.live.generations import GENERATIONS_DIR, read_infos_at, read_manifest
from index.live.rewrite import Rewritten, remove_unreferenced, rewrite_rows
from index.live.writer import Writer, process_alive, writing

log = logging.getLogger(__name__)
RETRAIN_MODES = ("auto", "always", "never")
SCRATCH_PREFIX = ".retrain-"  # a local index's retrain scratch: + "<pid>-<token>" (no writer touches it)
DRIFT_SAMPLE = 2000  # rows of the training sample kept as the new drift baseline (as an add's first baseline)


def retrain_reason(conf: CompactConfig, index: Path | str) -> str | None:
    """Why ``compact`` retrains now (None: it does not): asked to; an add's drift report
    recommended it; the rows added since training pass ``retrain_share`` of the live rows; or the
    plan for the live rows differs from the one the index was trained with."""
    if conf.retrain not in RETRAIN_MODES:
        raise NeedleInputError(f"--retrain must be one of {', '.join(RETRAIN_MODES)}, got {conf.retrain!r}")
    if conf.retrain == "never":
        return None
    if conf.retrain == "always":
        return "asked (--retrain always)"
    location = location_of(index, conf.s3_endpoint_url)
    infos = read_infos_at(location)
    parent = read_manifest(location, infos=infos)
    current = GenerationView(infos, parent).as_infos()
    try:
        plan = plan_for(conf, infos, parent.totals.live_ntotal)
    except NeedleInputError as exc:  # no plan fits (the budget, a dimension no PQ divides): compact as it is
        log.warning("not retraining %s: %s", index, exc)
        return None
    if plan.factory != current.get("factory"):
        return f"the live rows' plan is {plan.factory}, the index's {current.get('factory')} ({plan.reasons[0]})"
    if current.get("kind") != "ivfpq":
        return None  # a flat index has nothing trained to drift from
    training = Writer(location, infos, parent, Path(tempfile.gettempdir())).training()
    if training.drift_recommended:
        return "an add since training reported drift past its limits"
    live = max(1, parent.totals.live_rows)
    if training.added_rows > conf.retrain_share * live:
        return f"{training.added_rows} rows added since training, over {conf.retrain_share:g} of {live} live rows"
    return None


def plan_for(conf: CompactConfig, infos: IndexInfos, rows: int) -> IndexPlan:
    """The build's plan (its own settings: kind, factory, nlist, PQ bytes, budget) for ``rows`` vectors."""
    built = dict(infos.fields.get("config") or {})
    budget = conf.memory_budget or built.get("memory_budget") or "8GB"
    return plan_index(
        max(1, rows),
        infos.dim,
        parse_bytes(budget),
        built.get("kind") or "auto",
        built.get("factory"),
        int(built.get("flat_threshold") or 100_000),
        int(built.get("points_per_list") or 64),
        built.get("nlist"),
        built.get("pq_bytes"),
    )


class DetachedWriter(Writer):
    """A writer's reading helpers over a generation, without the lock: what phase A reads with.
    Its segments are built in its private scratch, never under the index."""

    @property
    def root(self) -> Path:
        return self.scratch / "segments"


@dataclass
class Prepared:
    """Phase A's result: the parent's live rows re-encoded with a new training, in scratch."""

    writer: DetachedWriter  # the parent generation and the scratch
    plan: IndexPlan  # what was trained
    fields: BuildFields  # what the new segments record of it
    trained: Path  # the trained index, no vectors (scratch)
    drift: dict[str, Any] | None  # the new drift baseline (None: flat)
    shards: dict[int, Rewritten] = field(default_factory=dict)  # shard -> its re-encoded segment
    search: dict[str, Any] = field(default_factory=dict)  # the search defaults chosen (index/build/tune.py)
    timings: dict[str, float] = field(default_factory=dict)  # phase A's steps, seconds


def retrain(
    conf: CompactConfig, index: Path | str, reason: str, run_shards: ShardRunner | None = None
) -> dict[str, Any]:
    """Retrain ``index`` as its next generation (phase A without the lock, phase B with it), its
    shards re-encoded by ``run_shards`` (default: one after another in this process); returns what
    changed, with ``"retrained": true`` and why."""
    log.info("retraining %s: %s", index, reason)
    with detached(index, conf.s3_endpoint_url) as writer:
        prepared = prepare(conf, writer, run_shards)
        return publish_retrained(conf, index, prepared, reason)


@contextlib.contextmanager
def detached(index: Path | str, endpoint_url: str | None) -> Iterator[DetachedWriter]:
    """A DetachedWriter on the newest generation, its scratch removed at the end (and those of
    retrains no longer running on this host before it starts)."""
    location: Location = location_of(index, endpoint_url)
    infos = read_infos_at(location)
    parent = read_manifest(location, infos=infos)
    token = secrets.token_hex(4)
    root = location.local_root
    if root is not None:
        for stale in root.glob(f"{SCRATCH_PREFIX}*"):
            pid = stale.name[len(SCRATCH_PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and not process_alive(int(pid)) and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
        scratch = root / f"{SCRATCH_PREFIX}{os.getpid()}-{token}"
        scratch.mkdir()
    else:
        scratch = Path(tempfile.mkdtemp(prefix=f"needle-retrain-{os.getpid()}-"))
    try:
        yield DetachedWriter(location, infos, parent, scratch, token)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        location.cleanup()


def prepare(conf: CompactConfig, writer: DetachedWriter, run_shards: ShardRunner | None = None) -> Prepared:
    """Phase A: plan, sample, train, re-encode every shard's live rows (``run_shards``: one after
    another here, or as Ray tasks), choose the search defaults."""
    import faiss

    from index.build.train import train

    clock = time.perf_counter()
    parent, infos = writer.parent, writer.infos
    plan = plan_for(conf, infos, parent.totals.live_ntotal)
    built = dict(infos.fields.get("config") or {})
    quantizer_ef = int(built.get("quantizer_ef") or infos.fields.get("quantizer_ef") or 128)
    sample = training_sample(writer, plan.n_train if plan.kind == "ivfpq" else 0, int(built.get("seed") or 0))
    timings = {"sample_s": time.perf_counter() - clock}
    index = train(plan, sample if plan.kind == "ivfpq" else np.zeros((1, infos.dim), np.float32), quantizer_ef)
    trained = writer.scratch / "trained.faiss"
    faiss.write_index(index, str(trained))
    drift = coarse_stats(index, sample[:DRIFT_SAMPLE]) if plan.kind == "ivfpq" else None
    timings["train_s"] = time.perf_counter() - clock - sum(timings.values())
    fields = new_fields(writer, plan, quantizer_ef, trained)
    prepared = Prepared(writer, plan, fields, trained, drift.to_json() if drift else None)
    tasks = [ShardTask.of(writer, conf.s3_endpoint_url, shard.shard, trained, fields) for shard in parent.shards]
    prepared.shards = dict(zip((t.shard for t in tasks), (run_shards or reencode_sequentially)(tasks)))
    timings["encode_s"] = time.perf_counter() - clock - sum(timings.values())
    prepared.search = choose_defaults(conf, prepared)
    timings["tune_s"] = time.perf_counter() - clock - sum(timings.values())
    prepared.timings = {k: round(v, 3) for k, v in timings.items()}
    return prepared


@dataclass(frozen=True)
class ShardTask:
    """One shard's re-encoding in phase A, as a task receives it: names and numbers only (it opens
    the index itself), so that a Ray task can run it. It writes into the retrain's scratch, a
    directory on the driver's disk: a runner runs it on the driver's node (no shared filesystem)."""

    index: str  # the index directory or s3:// prefix
    endpoint_url: str | None  # its S3 endpoint
    parent: int  # the generation phase A re-encodes
    scratch: str  # the retrain's scratch directory (its segments are built under ``scratch/segments``)
    token: str  # the retrain's token (in its provisional segment names)
    shard: int  # the shard whose live rows are re-encoded
    trained: str  # the new trained index (no vectors), in the scratch
    fields: BuildFields  # what the new segment records of the build and the new plan

    @classmethod
    def of(
        cls, writer: DetachedWriter, endpoint_url: str | None, shard: int, trained: Path, fields: BuildFields
    ) -> ShardTask:
        scratch, parent = str(writer.scratch), writer.parent.number
        return cls(writer.location.url, endpoint_url, parent, scratch, writer.token, shard, str(trained), fields)


ShardRunner = Callable[[list[ShardTask]], list[Rewritten]]  # the tasks' results, in their order


def reencode_shard(task: ShardTask) -> Rewritten:
    """A shard's live rows in generation ``task.parent`` encoded with ``task.trained`` as one
    segment in the scratch, under a provisional name (phase B names it for the generation it publishes)."""
    location = location_of(task.index, task.endpoint_url)
    try:
        infos = read_infos_at(location)
        parent = read_manifest(location, task.parent, infos)
        writer = DetachedWriter(location, infos, parent, Path(task.scratch), task.token)
        (shard,) = [s for s in parent.shards if s.shard == task.shard]
        name = writer.segment_name(task.shard)
        return rewrite_rows(writer, list(shard.segments), name, task.shard, Path(task.trained), task.fields)
    finally:
        location.cleanup()


def reencode_sequentially(tasks: list[ShardTask]) -> list[Rewritten]:
    return [reencode_shard(t) for t in tqdm(tasks, desc="re-encoding shards", unit="shard", disable=None)]


def training_sample(writer: Writer, size: int, seed: int) -> np.ndarray:
    """About ``size`` of the parent's live indexed rows (float32), drawn uniformly over all its
    segments from their stored float16 vectors, read in ascending order (ranged reads on S3)."""
    from index.live.add_rows import indexed_rows

    dim = writer.infos.dim
    if size <= 0:
        return np.zeros((0, dim), np.float32)
    rng = np.random.default_rng(seed)
    share = min(1.0, 1.1 * size / max(1, writer.parent.totals.live_ntotal))
    blocks = []
    for segment in writer.parent.segments:
        if not segment.ntotal:
            continue
        ids = segment_rows(writer, segment)
        live = np.flatnonzero(~np.isin(ids, writer.deleted_rows(segment)))
        chosen = live[rng.random(len(live)) < share]
        block = np.asarray(writer.vectors_at(segment.name, chosen), np.float32)
        blocks.append(block[indexed_rows(block) & np.isfinite(block).all(1)])
    sample = np.concatenate(blocks) if blocks else np.zeros((0, dim), np.float32)
    return sample[rng.permutation(len(sample))[:size]]


def segment_rows(writer: Writer, segment: Segment) -> np.ndarray:
    """The row ids of a published segment, by position."""
    from index.layout import IDS_FILE
    from index.shard_files import read_ids

    return read_ids(writer.segment_file(segment.name, IDS_FILE))["row"].to_numpy()


def new_fields(writer: Writer, plan: IndexPlan, quantizer_ef: int, trained: Path) -> BuildFields:
    """What the re-encoded segments record: the new plan and training, the rest as the build's."""
    from dataclasses import replace

    import faiss

    from core.hashing import file_sha256

    old = BuildFields.of(writer.segment_infos(writer.parent.segments[0].name))
    return replace(
        old,
        kind=plan.kind,
        factory=plan.factory,
        quantizer_ef=quantizer_ef if "HNSW" in plan.factory else None,
        faiss_version=faiss.__version__,
        trained_sha256=file_sha256(trained),
    )


def choose_defaults(conf: CompactConfig, prepared: Prepared) -> dict[str, Any]:
    """The served nprobe and refine factor for ``conf.recall_target`` on the re-encoded segments
    (index/build/tune.py), as the manifest records them; {} for a flat index or without a target."""
    if not conf.recall_target or prepared.plan.kind != "ivfpq":
        return {}
    from index.build.tune import choose_search
    from index.search import load_shard_directories

    writer = prepared.writer
    shards = tuple(ShardSegments(s, (r.entry,)) for s, r in sorted(prepared.shards.items()))
    training = Training(writer.number, None, None, 0, 0, False, plan_record(prepared.plan, prepared.fields))
    view = GenerationView(writer.infos, Generation(writer.number, writer.parent.number, shards, {}, training=training))
    index = load_shard_directories(writer.root, view)
    choice = choose_search(index, conf.recall_target, conf.recall_ks, conf.tune_queries)
    return choice.to_json() if choice is not None else {}


def plan_record(plan: IndexPlan, fields: BuildFields) -> dict[str, Any]:
    """The manifest's ``training.plan``: what replaces the build's plan in the infos readers see."""
    return {
        "kind": plan.kind,
        "factory": plan.factory,
        "nlist": plan.nlist,
        "code_bytes": plan.code_bytes,
        "quantizer_ef": fields.quantizer_ef,
    }


# --- phase B ---------------------------------------------------------------------------------
# Phase B: under the writer lock, the changes published while
# phase A ran carried onto its result, its files put in place under their final names, one generation
# published.
#
# Phase A re-encoded the live rows of generation P; the newest generation is now N (P where nothing
# was published meanwhile). Row ids identify rows across generations (a row id is never reused:
# ``add`` refuses a Parquet file whose shard id the index holds). So, comparing N's segments that
# are not P's unchanged ones with the rows phase A wrote:
#
# - a row phase A wrote that no segment of N holds live was deleted meanwhile: it joins the delete
#   set of the re-encoded segment holding it;
# - a row live in N that phase A did not write was added meanwhile (an ``add``, or ``add --replace``'s
#   new row): it is encoded with the new quantizer into one more segment of the shard N holds it in.
#
# A compaction published meanwhile moved rows without changing which are live: nothing to carry.

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
    live_now: list[np.ndarray] = []
    added: dict[int, np.ndarray] = {}
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
