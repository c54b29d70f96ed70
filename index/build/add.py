"""The add step of ``needle index build``: each part (a contiguous range of files) added to its own
copy of the trained index, its vectors and local tokens written beside it inside its shard's
directory. Parts are independent: cluster/index_job.py runs them as parallel Ray tasks, here they
run one after another. For a local output the shards are then finished where the parts lie.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.atomic import atomic_path, write_atomic
from index.build import train as build_train
from index.build.plan import FileInfo, PartTask, ShardPlan, load_adapter, part_task, read_valid
from index.build.records import BuildFields, PartStats
from index.build.shard import finish_shard, write_float16_npy_header
from index.generation import Segment
from index.layout import shard_name
from index.locals import write_segment
from index.memory import process_memory
from ingest.descriptors import ROW_SHARD_SHIFT

log = logging.getLogger(__name__)

PartRunner = Callable[[list[PartTask]], list[PartStats]]


def build_part(
    trained_path: str,
    files: list[FileInfo],
    dim: int,
    vectors_path: str,
    part_path: str,
    locals_name: str | None = None,
    adapt: str | None = None,
) -> PartStats:
    """Add ``files`` (contiguous, positions shard-local) to a copy of the trained index (saved at
    ``part_path``) and write their vectors, in order, into the part's own float16 ``.npy`` file
    ``vectors_path``; with ``locals_name``, also write their local tokens as that segment of the
    local store beside ``part_path``; with ``adapt``, add the descriptors through that adapter.
    Writes only beside ``part_path`` (its shard's directory). Plain function: the Ray job runs one
    per task."""
    import faiss

    adapter = load_adapter(adapt)
    index_dim = adapter.out_dim if adapter is not None else dim
    index = faiss.read_index(trained_path)
    # looked up on its module at each call: build_train decides the GPU placement (and tests stand it in there)
    gpu_quantizer = build_train.add_quantizer(index)  # None without GPUs: the CPU add is unchanged
    if gpu_quantizer is not None:
        log.info("%s: assigning vectors to lists on the GPU", part_path)
    # Written block by block after the .npy header, not through a writable memory map: mapped
    # dirty pages would count as this process's memory and inflate its RSS by the size of the vectors.
    with (
        atomic_path(Path(vectors_path)) as tmp,
        open(tmp, "wb") as out,
        build_train.assigning_with(index, gpu_quantizer),
    ):
        write_float16_npy_header(out, sum(f.rows for f in files), index_dim)
        added, rejected = _add_files(index, files, dim, index_dim, adapter, out)
    rss = process_memory().get("rss", 0)  # the part's codes are in memory now: the add phase's high point
    write_atomic(Path(part_path), lambda tmp: faiss.write_index(index, str(tmp)))
    segment = None
    if locals_name is not None:
        segment = write_segment(Path(part_path).parent, locals_name, [(f.path, f.rows, f.offset) for f in files])
    return PartStats(added, rejected, rss, segment)


def _add_files(index: Any, files: list[FileInfo], dim: int, index_dim: int, adapter: Any, out: Any) -> tuple[int, int]:
    """Add each file's valid rows to ``index`` and write all its rows' vectors to ``out`` (zeros
    for rows not indexed); returns (vectors added, rejected as not finite)."""
    added = rejected = 0
    for f in files:
        rows, xb, bad = read_valid(f.path, dim, adapter)
        index.add_with_ids(np.ascontiguousarray(xb, dtype=np.float32), rows)
        block = np.zeros((f.rows, index_dim), dtype=np.float16)
        block[(rows - (np.int64(f.shard_id) << ROW_SHARD_SHIFT)).astype(np.int64)] = xb
        out.write(block.tobytes())
        added += len(rows)
        rejected += bad
    return added, rejected


def run_parts_sequentially(tasks: list[PartTask]) -> list[PartStats]:
    return [build_part(*task) for task in tasks]


@dataclass(frozen=True)
class LocalParts:
    tasks: list[PartTask]  # every shard's parts, in order
    shard_files: list[list[FileInfo]]  # each shard's files, positions counted from its first row
    shard_tasks: list[list[int]]  # each shard's tasks (indices into ``tasks``)


def local_parts(
    output: Path, trained_path: Path, shards: ShardPlan, dim: int, with_locals: bool, adapt: str | None
) -> LocalParts:
    """The add tasks of a local build, each writing inside its shard's directory under ``output``
    (created here)."""
    tasks: list[PartTask] = []
    shard_files: list[list[FileInfo]] = []
    shard_tasks: list[list[int]] = []
    for number in range(len(shards.groups)):
        directory = output / shard_name(number)
        directory.mkdir(parents=True, exist_ok=True)
        shard_files.append([])
        shard_tasks.append([])
        for part_id, files in shards.parts_of(number):
            shard_files[-1].extend(files)
            shard_tasks[-1].append(len(tasks))
            tasks.append(part_task(trained_path, directory, part_id, files, dim, with_locals, adapt))
    return LocalParts(tasks, shard_files, shard_tasks)


def finish_local_shards(
    output: Path,
    parts: LocalParts,
    stats: list[PartStats],
    common: BuildFields,
    extractor: dict[str, Any] | None,
) -> list[Segment]:
    """Every shard directory of a local build finished from its added parts; returns their entries."""
    return [
        finish_shard(
            output / shard_name(number),
            number,
            files,
            [parts.tasks[t] for t in task_ids],
            [stats[t] for t in task_ids],
            common,
            extractor,
        )
        for number, (files, task_ids) in enumerate(zip(parts.shard_files, parts.shard_tasks))
    ]
