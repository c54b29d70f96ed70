"""``needle index build`` on Ray: the add step's parts run as parallel Ray tasks.

index/build.py does the work (scan, train, parts, merge); this module only supplies the runner
that executes the parts as tasks, each reading its range of Parquet files and writing its part
file and its rows of the shared memory-mapped vectors.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from index.build import IndexConfig, PartTask, build_part
from index.build import main as build_index

log = logging.getLogger(__name__)


def ray_part_runner(cpus_per_part: int = 1):
    """A runner for index.build.main that executes the parts as Ray tasks, with a progress bar."""

    def run(tasks: list[PartTask]) -> list[dict[str, Any]]:
        import ray
        from tqdm import tqdm

        remote = ray.remote(num_cpus=cpus_per_part)(build_part)
        refs = [remote.remote(*task) for task in tasks]
        results = {}
        with tqdm(total=len(refs), desc="index parts", unit="part") as bar:
            pending = list(refs)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                results[done[0]] = ray.get(done[0])
                bar.update(1)
        return [results[r] for r in refs]

    return run


def main(conf: IndexConfig, descriptors: Any, output: Path, address: str | None = None) -> Path:
    """Build the index with parallel parts on Ray (a local instance unless ``address`` or $RAY_ADDRESS)."""
    import ray

    from cluster.ingest_job import connect_ray

    if not ray.is_initialized():
        connect_ray(address)
    parts = conf.parts or max(conf.shards, int(ray.cluster_resources().get("CPU", 1)))
    from dataclasses import replace

    return build_index(replace(conf, parts=parts), descriptors, output, run_parts=ray_part_runner())
