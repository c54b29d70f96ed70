"""``needle index build``: a FAISS index over the ``global`` descriptors of Parquet files, built
streaming (never all descriptors in memory) within a memory budget, in parallel parts.

Output directory (see docs/schema.md): one self-contained directory per index shard,
``shard_000/`` ... (one unless ``--shards N``), each holding everything needed to answer for its
rows, at shard-local positions (its rows in file order):

- ``index.faiss``: its FAISS index, ids = the Parquet ``row`` ids (shards share one trained
  quantizer and hold disjoint rows)
- ``ids.arrow``: ``row``, ``key``, ``status`` of its Parquet rows, in file order (an uncompressed
  Arrow IPC file, memory-mapped at query time)
- ``vectors.f16.npy``: the float16 descriptors of its rows in the same order (zeros for rows not
  indexed), memory-mapped at query time for exact re-scoring ("refine") and queries by key
- ``keys.bin``, ``key_offsets.npy``, ``key_order.npy``: its key lookup files (index/keys.py)
- ``locals_<part>.tokens.bin`` / ``.offsets.npy``: its local-token segments (index/locals.py)
- ``shard_infos.json``: its Parquet files and their offsets, counts, every file's size and SHA-256

and ``index_infos.json`` at the top: the plan and why, sizes, the list of shards, the ingestion's
extractor info, and ``"layout": "shard-directories"``: readers refuse an index without it (built
before shard directories, files at the top: index.layout.check_layout names this command as the fix).

Steps, one module each, chained here: plan (index/build/plan.py: stage and scan the files' footers
and row ids, cut them into parts and shards), train (index/build/train.py: on a sample read file
by file), add (index/build/add.py: each range of files to a copy of the trained index, a "part"
written inside its shard's directory: in parallel on Ray with cluster/index_job.py, sequentially
here), shard (index/build/shard.py: each shard merges its parts into its own files). An ``s3://``
output builds each shard in one task on its node and uploads it (index/build/s3.py).
"""

from __future__ import annotations

import logging
import secrets
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from core.atomic import write_json_atomic
from core.errors import NeedleInputError
from core.hashing import file_sha256
from core.location import Location, S3Location, build_output
from index.build.add import PartRunner, finish_local_shards, local_parts, run_parts_sequentially
from index.build.config import DEFAULT_QUANTIZER_EF, IndexConfig
from index.build.factory import IndexPlan, parse_bytes, plan_index
from index.build.plan import (
    ShardPlan,
    Sources,
    adapt_infos,
    builds_locals,
    load_adapter,
    local_extractor,
    plan_shards,
    read_sources,
)
from index.build.records import BuildFields, PartStats
from index.build.s3 import ShardRunner, build_on_s3, run_shards_sequentially
from index.build.train import hnsw_quantizer, reuse_trained, sample_for, train_and_save
from index.generation import IndexInfos, Segment
from index.keys import KEY_FILES
from index.layout import (
    IDS_FILE,
    INDEX_FILE,
    INFOS_FILE,
    LAYOUT_SHARDS,
    LIVING_FILES,
    SHARD_INFOS_FILE,
    TRAINED_FILE,
    VECTORS_FILE,
    WRITER_LOCK,
)
from index.locals import locals_infos
from index.memory import peak_rss_bytes

log = logging.getLogger(__name__)

# Re-exported: the index's file names (index/layout.py), the HNSW helpers (index/build/train.py) and
# the config (index/build/config.py) stay importable from the stage that writes them, where benches
# and tests read them.
__all__ = [
    "DEFAULT_QUANTIZER_EF",
    "IDS_FILE",
    "INDEX_FILE",
    "INFOS_FILE",
    "LAYOUT_SHARDS",
    "SHARD_INFOS_FILE",
    "TRAINED_FILE",
    "VECTORS_FILE",
    "IndexConfig",
    "hnsw_quantizer",
    "main",
]


class Stopwatch:
    """The build's timings: each lap is the time since the previous one."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        self.laps[name] = time.perf_counter() - self.start - sum(self.laps.values())

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


@dataclass(frozen=True)
class Build:
    """What the steps of one build share: where it writes, what it reads."""

    conf: IndexConfig
    scratch: Path  # the output directory, or for an s3:// output the driver's scratch (staging, training)
    storage: S3Location | None  # the s3:// output, or None (a local one)
    sources: Sources
    adapter: Any  # embed.adapt.LinearAdapter, or None
    clock: Stopwatch

    @property
    def index_dim(self) -> int:
        """What the index and the refine vectors hold: the descriptors, adapted where asked."""
        return int(self.adapter.out_dim) if self.adapter is not None else self.sources.dim

    @property
    def trained_path(self) -> Path:
        return self.scratch / TRAINED_FILE

    @property
    def extractor(self) -> dict[str, Any] | None:
        return local_extractor(self.sources.ingest)


@dataclass(frozen=True)
class Trained:
    n_train: int  # vectors trained on (0: a flat index, or as recorded by the run that trained it)
    peak_rss_bytes: int  # this process's high-water RSS once trained


def main(
    conf: IndexConfig,
    descriptors: Path | str | Sequence[Path | str],
    output: Path | str,
    run_parts: PartRunner = run_parts_sequentially,
    run_shards: ShardRunner = run_shards_sequentially,
) -> Path | str:
    """Build the index of ``descriptors`` into ``output`` (a local directory, or an
    ``s3://bucket/prefix``); returns ``output``.

    ``run_parts`` executes the add tasks of a local build, ``run_shards`` the shard tasks of an
    S3 build (sequentially by default; cluster/index_job.py passes Ray runners).
    """
    build = open_build(conf, descriptors, output)
    plan = plan_of(conf, build.sources.n_ok, build.index_dim)
    trained = train_step(build, plan)
    shards = plan_shards(build.sources.files, conf.shards, conf.parts)
    with_locals = builds_locals(conf.locals, build.sources.files)
    common = common_infos(build, plan)
    if build.storage is not None:
        summaries, stats = add_on_s3(build, build.storage, shards, with_locals, common, run_shards)
    else:
        summaries, stats = add_locally(build, shards, with_locals, common, run_parts)
    clean_scratch(build)
    build.clock.lap("merge_s")
    given = [str(d) for d in ([descriptors] if isinstance(descriptors, (str, Path)) else descriptors)]
    infos = index_infos(build, plan, trained, summaries, stats, with_locals, given)
    return write_index_infos(build, tuned(build, infos))


def tuned(build: Build, infos: IndexInfos) -> IndexInfos:
    """``infos`` with the served ``nprobe`` and ``refine_factor`` chosen for the recall target
    (index/build/tune.py) on the built shards, and how (``search_tuning``); as given for a flat
    index, without a target, where either was set to other than its default, or for an S3 output
    (its shards are remote: tune it by a retrain)."""
    conf = build.conf
    if not conf.recall_target or infos.fields.get("kind") != "ivfpq" or build.storage is not None:
        return infos
    defaults = IndexConfig()
    if (conf.nprobe, conf.refine_factor) != (defaults.nprobe, defaults.refine_factor):
        # the user chose them: a target must not silently replace what was asked for
        log.info("--nprobe %d and --refine-factor %d served as given (no tuning for --recall-target)",
                 conf.nprobe, conf.refine_factor)  # fmt: skip
        return infos
    from index.build.tune import choose_search
    from index.generation import Generation, GenerationView
    from index.search import load_shard_directories

    index = load_shard_directories(build.scratch, GenerationView(infos, Generation.zero(infos)))
    choice = choose_search(index, conf.recall_target, conf.recall_ks, conf.tune_queries, conf.seed)
    if choice is None:
        return infos
    record = {**infos.to_json(), "nprobe": choice.nprobe, "refine_factor": choice.refine_factor}
    record["search_tuning"] = choice.to_json()
    return IndexInfos.from_json(record, f"the {INFOS_FILE} of {build.scratch}")


def open_build(conf: IndexConfig, descriptors: Path | str | Sequence[Path | str], output: Path | str) -> Build:
    """Where the build writes (its output directory, or a scratch directory and the S3 output),
    and its descriptor files, staged and scanned, with the adapter checked against them."""
    clock = Stopwatch()
    location = build_output(output, conf.s3_endpoint_url)
    refuse_living_index(location, output)
    local = location.local_root
    storage = location if isinstance(location, S3Location) else None
    scratch = local if local is not None else Path(tempfile.mkdtemp(prefix="needle-index-"))
    scratch.mkdir(parents=True, exist_ok=True)
    sources = read_sources(descriptors, scratch / "staging", conf.s3_endpoint_url)
    adapter = load_adapter(conf.adapt, sources.dim)
    clock.lap("scan_s")
    return Build(conf, scratch, storage, sources, adapter, clock)


class LivingIndexOutputError(NeedleInputError):
    """``--out`` holds a living index (generations published by add, delete or compact)."""


def refuse_living_index(location: Location, output: Path | str) -> None:
    """LivingIndexOutputError where ``output`` holds a living index, before anything is written: a
    build over it would replace the files generation 0 names while its generations still name
    segments encoded with the old quantizer (``generations/trained.faiss``, which later adds would
    go on encoding with), and rows it deleted would come back."""
    generations, current = LIVING_FILES
    written = [n for n in location.list(generations) if Path(n).name != WRITER_LOCK]
    if location.read_bytes(current) is None and not written:  # (a lock alone: a writer found nothing to do)
        return
    raise LivingIndexOutputError(
        f"--out {output} holds a living index (its {generations}/ has generations written by needle index "
        "add, delete or compact): build into a new --out folder, or delete this one first"
    )


def plan_of(conf: IndexConfig, n_ok: int, index_dim: int) -> IndexPlan:
    plan = plan_index(
        max(1, n_ok),
        index_dim,
        parse_bytes(conf.memory_budget),
        conf.kind,
        conf.factory,
        conf.flat_threshold,
        conf.points_per_list,
        conf.nlist,
        conf.pq_bytes,
    )
    log.info("index plan: %s (%s)", plan.factory, "; ".join(plan.reasons))
    return plan


def train_step(build: Build, plan: IndexPlan) -> Trained:
    """The trained index at ``build.trained_path``: for an S3 output a previous run's for the same
    plan where there is one (the shards it committed were added to it), else trained here."""
    reused = None
    if build.storage is not None:
        reused = reuse_trained(build.storage, plan.factory, build.trained_path)
        if reused is not None:
            log.info("resuming with the trained index already at %s", build.storage.url)
    if reused is not None:
        n_train = int(reused["n_train"])
    else:
        sources = build.sources
        xt = sample_for(plan, sources.files, sources.dim, build.index_dim, build.conf.seed, build.adapter)
        build.clock.lap("sample_s")
        n_train = train_and_save(plan, xt, build.conf.quantizer_ef, build.trained_path, build.storage)
        del xt
    build.clock.lap("train_s")
    return Trained(n_train, peak_rss_bytes())


def common_infos(build: Build, plan: IndexPlan) -> BuildFields:
    """What every shard's ``shard_infos.json`` records of the whole build."""
    import faiss

    conf = build.conf
    return BuildFields(
        kind=plan.kind,
        factory=plan.factory,
        metric="inner_product",
        dim=build.index_dim,
        nprobe=conf.nprobe,
        refine_factor=conf.refine_factor,
        quantizer_ef=conf.quantizer_ef if "HNSW" in plan.factory else None,
        adapt=adapt_infos(conf.adapt, build.adapter),
        faiss_version=faiss.__version__,
        trained_sha256=file_sha256(build.trained_path),
    )


def add_locally(
    build: Build, shards: ShardPlan, with_locals: bool, common: BuildFields, run_parts: PartRunner
) -> tuple[list[Segment], list[PartStats]]:
    """The parts added (by ``run_parts``), then each shard directory finished from its parts;
    returns the shards' summaries and the parts' stats."""
    dim, adapt = build.sources.dim, build.conf.adapt
    parts = local_parts(build.scratch, build.trained_path, shards, dim, with_locals, adapt)
    stats = run_parts(parts.tasks)
    build.clock.lap("add_s")
    return finish_local_shards(build.scratch, parts, stats, common, build.extractor), stats


def add_on_s3(
    build: Build,
    storage: S3Location,
    shards: ShardPlan,
    with_locals: bool,
    common: BuildFields,
    run_shards: ShardRunner,
) -> tuple[list[Segment], list[PartStats]]:
    """One task per shard (``run_shards``): built on its node, uploaded, committed; returns the
    shards' summaries and the parts' stats."""
    settings = {
        "dim": build.sources.dim,
        "locals": with_locals,
        "adapt": build.conf.adapt,
        "common": common,
        "extractor": build.extractor,
    }
    result = build_on_s3(storage, build.trained_path, shards, settings, run_shards)
    build.clock.lap("add_s")
    return result


def clean_scratch(build: Build) -> None:
    """Remove the trained index and the staged descriptors; for an S3 output the whole scratch."""
    build.trained_path.unlink(missing_ok=True)
    shutil.rmtree(build.scratch / "staging", ignore_errors=True)
    if build.storage is not None:
        shutil.rmtree(build.scratch, ignore_errors=True)


def index_infos(
    build: Build,
    plan: IndexPlan,
    trained: Trained,
    summaries: list[Segment],
    stats: list[PartStats],
    with_locals: bool,
    descriptors: list[str],
) -> IndexInfos:
    """The top-level ``index_infos.json`` (``descriptors``: the inputs as given), checked as a reader checks it."""
    import faiss

    conf, sources = build.conf, build.sources
    record = {
        # this build's identity: a server reports it in /health, and --wait-for checks that the server
        # it waits on serves this index (a rebuild into another folder, or another index, has another)
        "index_id": secrets.token_hex(8),
        "config": asdict(conf),
        **_plan_infos(plan, parse_bytes(conf.memory_budget)),
        "n_train": trained.n_train,
        "metric": "inner_product",
        "ntotal": sum(s.ntotal for s in summaries),
        "rows": sum(f.rows for f in sources.files),
        "dim": build.index_dim,
        "adapt": adapt_infos(conf.adapt, build.adapter),
        "layout": LAYOUT_SHARDS,
        "shards": [s.to_json(with_deleted=False) for s in summaries],  # name, rows, ntotal, parquet shard ids, bytes
        "key_files": list(KEY_FILES),
        "nprobe": conf.nprobe,
        "refine_factor": conf.refine_factor,
        "quantizer_ef": conf.quantizer_ef if "HNSW" in plan.factory else None,
        "rejected_non_finite": sum(s.rejected_non_finite for s in stats),
        "parquet_files": len(sources.files),
        "extractors": sources.ingest.get("extractors", []),
        "locals": _locals_summary(build, stats) if with_locals else None,
        "build_s": round(build.clock.elapsed(), 3),
        "timings": {name: round(seconds, 3) for name, seconds in build.clock.laps.items()},  # scan, sample, ...
        "memory": {  # this process's high-water RSS after training and at the end; the parts' RSS when full
            "peak_rss_after_training_bytes": trained.peak_rss_bytes,
            "peak_rss_bytes": peak_rss_bytes(),
            "part_rss_bytes": max((s.rss_bytes for s in stats), default=0),
        },
        "faiss_version": faiss.__version__,
        "descriptors": descriptors,
    }
    return IndexInfos.from_json(record, f"the {INFOS_FILE} of {build.storage.url if build.storage else build.scratch}")


def _plan_infos(plan: IndexPlan, budget: int) -> dict[str, Any]:
    return {
        "factory": plan.factory,
        "kind": plan.kind,
        "nlist": plan.nlist,
        "code_bytes": plan.code_bytes,
        "estimated_bytes": plan.estimated_bytes,
        "memory_budget_bytes": budget,
        "reasons": plan.reasons,
    }


def _locals_summary(build: Build, stats: list[PartStats]) -> dict[str, Any]:
    """The local store's top-level entry; each shard lists its own segments (shard_infos.json)."""
    segments = [s.locals for s in stats if s.locals is not None]
    summary = locals_infos(segments, build.extractor, sum(f.rows for f in build.sources.files))
    del summary["segments"]
    return summary


def write_index_infos(build: Build, infos: IndexInfos) -> Path | str:
    """Write ``index_infos.json`` last: the index is complete once it is there; returns the output."""
    output: Path | str = build.scratch
    if build.storage is not None:
        build.storage.write_json(INFOS_FILE, infos.to_json())
        output = build.storage.url
    else:
        write_json_atomic(infos.to_json(), build.scratch / INFOS_FILE)
    ntotal, dim, factory, n_shards = (
        infos.fields["ntotal"],
        build.sources.dim,
        infos.fields["factory"],
        len(infos.shards),
    )
    log.info("index %s: %d vectors, d=%d, %s in %d shards", output, ntotal, dim, factory, n_shards)
    return output
