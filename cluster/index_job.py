"""``needle index build`` on Ray: the add step's parts run as parallel Ray tasks.

index/build/stage.py chains the steps that do the work (index/build/*.py: plan, train, add, shard);
this module only supplies the runners: for a local output, the parts (index/build/add.py
``build_part``) as tasks on the driver's node (the output is on its disk), each reading its range
of Parquet files and writing its part files inside its shard's directory; for an ``s3://`` output,
one task per shard (index/build/s3.py ``build_shard_task``) that builds the shard on its node's
local disk and uploads it with a commit marker (no shared filesystem), retried where a task dies
(``max_retries``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from index.build.add import build_part
from index.build.plan import PartTask
from index.build.records import PartStats
from index.build.s3 import build_shard_task
from index.build.stage import IndexConfig
from index.build.stage import main as build_index

log = logging.getLogger(__name__)


def gather_with_progress(refs: list[Any], desc: str, unit: str) -> list[Any]:
    """The results of Ray tasks ``refs``, in their order, with a progress bar as each finishes
    (the first failure raises)."""
    import ray
    from tqdm import tqdm

    results = {}
    with tqdm(total=len(refs), desc=desc, unit=unit) as bar:
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            results[done[0]] = ray.get(done[0])
            bar.update(1)
    return [results[r] for r in refs]


def ray_part_runner(cpus_per_part: float = 1, task: Any = build_part):
    """A runner for index.build.stage.main that executes the parts of a local build as Ray tasks, with a
    progress bar. The tasks read and write paths on the driver's disk, so they run on the driver's
    node (pinned: no filesystem shared between nodes is assumed); a build across nodes writes to
    ``s3://`` (``ray_shard_runner``)."""

    def run(tasks: list[PartTask]) -> list[PartStats]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        # ray's stubs list only placement-group strategies for a task; node affinity works all the same
        remote = ray.remote(num_cpus=cpus_per_part, scheduling_strategy=here)(task)  # type: ignore[call-overload]
        return gather_with_progress([remote.remote(*task) for task in tasks], "index parts", "part")

    return run


def ray_shard_reencoder(cpus_per_shard: float = 1) -> Any:
    """A runner for a retrain's phase A (index/live/retrain.py ``ShardRunner``): each shard's live
    rows re-encoded as a Ray task. The tasks build their segments in the retrain's scratch, on the
    driver's disk, so they run on the driver's node (pinned, as ``ray_part_runner``'s): the retrain
    uses that node's CPUs, and assumes no filesystem shared between nodes."""
    from index.live.retrain import reencode_shard

    def run(tasks: list[Any]) -> list[Any]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        remote = ray.remote(num_cpus=cpus_per_shard, scheduling_strategy=here)(reencode_shard)  # type: ignore[call-overload]
        return gather_with_progress([remote.remote(task) for task in tasks], "re-encoding shards", "shard")

    return run


def ray_shard_runner(cpus_per_shard: int = 1, max_retries: int = 3):
    """A runner for index.build.stage.main's S3 shard tasks: one Ray task per shard, retried up to
    ``max_retries`` times where it dies or fails (a retried task rebuilds its shard and uploads
    it again; the commit marker goes last)."""

    def run(trained: bytes, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        import ray

        remote = ray.remote(num_cpus=cpus_per_shard, max_retries=max_retries, retry_exceptions=True)(build_shard_task)
        trained_ref = ray.put(trained)
        return gather_with_progress([remote.remote(trained_ref, spec) for spec in specs], "index shards", "shard")

    return run


def node_cpus(output: Path | str) -> int:
    """The CPUs that run the parts: the driver's node's for a local output (its tasks are pinned
    there), the cluster's for an ``s3://`` one."""
    import ray

    from core.location import location_of

    if location_of(output).local_root is None:
        return int(ray.cluster_resources().get("CPU", 1))
    here = ray.get_runtime_context().get_node_id()
    node = next((n for n in ray.nodes() if n["NodeID"] == here), None)
    return int((node or {}).get("Resources", {}).get("CPU", 0))  # a head started with --num-cpus=0 has none


def main(conf: IndexConfig, descriptors: Any, output: Path | str, address: str | None = None) -> Path | str:
    """Build the index with parallel parts on Ray (a local instance unless ``address`` or $RAY_ADDRESS)."""
    import ray

    from cluster.connect import connect_ray

    if not ray.is_initialized():
        connect_ray(address)
    cpus = node_cpus(output)
    if cpus < 1:
        from core.errors import NeedleInputError

        raise NeedleInputError(
            f"the Ray node of this driver has no CPUs, and a local --out ({output}) is built on it: build without "
            "--ray here, or on a node with CPUs, or to --out s3://…"
        )
    parts = conf.parts or max(conf.shards, cpus)
    from dataclasses import replace

    return build_index(
        replace(conf, parts=parts), descriptors, output, run_parts=ray_part_runner(), run_shards=ray_shard_runner()
    )
