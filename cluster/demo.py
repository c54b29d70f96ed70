"""``needle demo``: the whole pipeline on the built-in demo collection, on a local Ray head.

1. build the demo tars from scikit-image photos (ingest.demo_data)
2. start a local Ray head on 127.0.0.1 only, every port free (or use the running cluster at ``--address``)
3. submit ``needle ingest --shards ... --out ...`` as a Ray job (cluster.local_ray.submit_job)
   (globals and the default local tokens, ``--locals aliked-n16``: embed.locals.presets.DEFAULT_LOCALS)
4. stop the head it started; build the index and its local store; evaluate mAP@1k global-only and
   re-ranked with spatial verification; write ``report.json``
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from core.atomic import write_json_atomic
from core.settings import setting
from embed.locals.presets import DEFAULT_LOCALS
from ingest.config import DemoConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoRunConfig:
    data: DemoConfig = field(default_factory=DemoConfig)  # what the demo collection holds
    num_cpus: int | None = setting(None, "CPUs of the local head; None: all")
    k: int = setting(1000, "mAP@k cut-off")
    address: str | None = setting(None, "dashboard URL of a running Ray cluster; None: start a local head")
    locals: str = setting(DEFAULT_LOCALS, "local-token preset ingested beside the globals (re-ranking)")
    rerank: str = setting("sp", "re-ranking method reported next to global-only")


class DemoJobFailed(RuntimeError):
    """The submitted ingestion job did not succeed."""


def main(conf: DemoRunConfig, workdir: Path) -> Path:
    """Run the demo in ``workdir``; returns the path of its JSON report."""
    from cluster.local_ray import start_head, submit_job
    from eval.evaluate import EvalConfig, evaluate, load_ground_truth
    from index.build.stage import IndexConfig
    from index.build.stage import main as build_index
    from ingest.demo_data import build_demo  # numpy and PIL: when the demo runs, not for --help
    from rerank.rerank import RerankConfig

    workdir = Path(workdir)
    shards_dir, descriptors, index_dir = workdir / "shards", workdir / "descriptors", workdir / "index"
    truth = build_demo(shards_dir, conf.data)
    pattern = str(shards_dir.resolve() / f"{{{0:06d}..{truth['num_shards'] - 1:06d}}}.tar")

    entrypoint = [
        "needle",
        "ingest",
        "--shards",
        pattern,
        "--out",
        str(descriptors.resolve()),
        "--overwrite",
        "--locals",
        conf.locals,
    ]
    if conf.address:
        outcome = submit_job(conf.address, entrypoint)
    else:
        head = start_head(conf.num_cpus, log_file=workdir / "ray_head.log")
        try:
            outcome = submit_job(head.dashboard_url, entrypoint, head.env, head_log=workdir / "ray_head.log", head=head)
        finally:
            head.stop()
    if not outcome.ok:
        raise DemoJobFailed(f"the ingestion job {outcome.submission_id} ended {outcome.status}: {outcome.message}")

    build_index(IndexConfig(), descriptors, index_dir)
    truth = load_ground_truth(shards_dir / "ground_truth.json")
    result = evaluate(index_dir, truth, EvalConfig(k=conf.k))
    # Re-ranked: the queries' stored tokens against their global shortlists.
    reranked = evaluate(index_dir, truth, EvalConfig(k=conf.k, rerank=RerankConfig(method=conf.rerank)))
    ingest_info = json.loads((descriptors / "ingest_info.json").read_text())
    report: dict[str, Any] = {
        f"map_at_{conf.k}": result[f"map_at_{conf.k}"],
        f"map_at_{conf.k}_rerank_{conf.rerank}": reranked[f"map_at_{conf.k}"],
        "n_queries": result["n_queries"],
        "database_size": result["database_size"],
        "images": ingest_info["images"],
        "error_rows": ingest_info["error_rows"],
        "ingest_images_per_s": ingest_info["images_per_s"],
        "shards": str(shards_dir),
        "descriptors": str(descriptors),
        "index": str(index_dir),
        "config": asdict(conf),
        "per_query": result["per_query"],
    }
    path = write_json_atomic(report, workdir / "report.json")
    print(
        f"needle demo: mAP@{conf.k} = {report[f'map_at_{conf.k}']:.2f} global-only, "
        f"{report[f'map_at_{conf.k}_rerank_{conf.rerank}']:.2f} re-ranked ({conf.rerank}) "
        f"over {report['n_queries']} queries "
        f"({report['database_size']} images); report: {path}"
    )
    return path
