"""The ingestion job: a pool of Ray actor workers, each loading the model once, pulling shards from
a dynamic queue and committing one Parquet file per shard.

    needle ingest --shards 'data/{000000..000999}.tar' --out descriptors/

Inside ``ray job submit`` it joins that cluster; run directly it starts a local Ray instance.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ingest.descriptors import write_json_atomic
from ingest.errors import NeedleInputError
from ingest.shards import expand_shards, shard_ids, shard_name

log = logging.getLogger(__name__)

INFO_FILE = "ingest_info.json"


@dataclass(frozen=True)
class IngestConfig:
    model: str = "tf_efficientnet_lite0.gem"  # registry name (see `needle models`)
    weights: str | None = None  # local weights file; None: the preset's packaged weights, if any
    resolution: int | None = None  # longer side of the resized images; None: the model's test resolution
    batch_size: int = 32  # images per forward pass (same-size images are batched together)
    precision: str = "auto"  # auto | fp32 | bf16 | fp16 (auto: fp16 on GPU, the preset's choice on CPU)
    num_workers: int | None = None  # actors; None: one per GPU, else cluster CPUs // cpus_per_worker
    cpus_per_worker: int = 2  # CPUs reserved by each CPU actor (its torch threads)
    decode_threads: int = 2  # background decoding threads per worker
    overwrite: bool = False  # redo shards whose Parquet file is already committed
    address: str | None = None  # Ray cluster; None: $RAY_ADDRESS (set by `ray job submit`), else a new local instance


class IngestWorker:
    """One model instance; processes whole shards. Wrapped with ``ray.remote`` by the job."""

    def __init__(self, conf: IngestConfig, device: str, torch_threads: int):
        import torch

        from embed.extract import GlobalExtractor

        torch.set_num_threads(max(1, torch_threads))
        self.conf = conf
        self.extractors = [
            GlobalExtractor(conf.model, conf.weights, device, conf.precision, conf.batch_size, conf.resolution)
        ]

    def info(self) -> dict[str, Any]:
        return {"extractors": [e.info() for e in self.extractors]}

    def process(self, url: str, shard_id: int, out_dir: str) -> dict[str, Any]:
        from ingest.pipeline import process_shard

        return process_shard(url, shard_id, Path(out_dir), self.extractors, self.conf.decode_threads).to_dict()


def connect_ray(address: str | None) -> None:
    """Join ``address`` or $RAY_ADDRESS; otherwise start a local instance bound to 127.0.0.1.

    Never Ray's implicit auto-detection: a stale record of a dead cluster would make it hang.
    """
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False)


def _worker_layout(conf: IngestConfig, resources: dict[str, float], n_shards: int) -> tuple[int, dict[str, Any], str, int]:
    """(count, actor options, device, torch threads) from the cluster's resources."""
    gpus = int(resources.get("GPU", 0))
    if gpus:
        count = min(conf.num_workers or gpus, n_shards)
        return count, {"num_gpus": 1, "num_cpus": 1}, "cuda", conf.cpus_per_worker
    cpus = int(resources.get("CPU", 1))
    per = max(1, min(conf.cpus_per_worker, cpus))
    count = min(conf.num_workers or max(1, cpus // per), n_shards)
    return count, {"num_cpus": per}, "cpu", per


def main(conf: IngestConfig, shards: str | list[str], output: Path) -> Path:
    """Ingest ``shards`` into ``output`` (one ``<shard>.parquet`` each); returns ``output``.

    Raises IngestFailed after writing the report when any shard failed.
    """
    import ray
    from ray.util import ActorPool
    from tqdm import tqdm

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    previous = _previous_info(output, conf)
    urls = expand_shards(shards)
    ids = shard_ids(urls)
    todo = [u for u in urls if conf.overwrite or not (output / f"{shard_name(u)}.parquet").exists()]
    log.info("%d shards, %d already committed, %d to do", len(urls), len(urls) - len(todo), len(todo))

    if not ray.is_initialized():
        connect_ray(conf.address)
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    worker_info: dict[str, Any] = {"extractors": previous.get("extractors", [])}
    if todo:
        count, options, device, threads = _worker_layout(conf, ray.cluster_resources(), len(todo))
        log.info("starting %d %s workers (%s)", count, device, options)
        actor_cls = ray.remote(**options)(IngestWorker)
        workers = [actor_cls.remote(conf, device, threads) for _ in range(count)]
        worker_info = ray.get(workers[0].info.remote())
        pool = ActorPool(workers)
        tasks = pool.map_unordered(lambda w, url: w.process.remote(url, ids[url], str(output)), todo)
        with tqdm(total=len(todo), unit="shard", desc="ingest") as bar:
            for result in tasks:
                results.append(result)
                bar.update(1)
                bar.set_postfix(images=sum(r["rows"] for r in results))
        for worker in workers:
            ray.kill(worker)
    seconds = time.perf_counter() - start
    report = _report(conf, urls, results, seconds, worker_info)
    write_json_atomic(report, output / INFO_FILE)
    log.info("ingest summary: %s", {k: report[k] for k in ("shards_ok", "shards_failed", "images", "error_rows", "images_per_s")})
    if report["failed"]:
        raise IngestFailed(report["failed"])
    return output


# Settings that change the descriptors: a resumed job must use the same ones.
_DESCRIPTOR_SETTINGS = ("model", "weights", "resolution")


def _previous_info(output: Path, conf: IngestConfig) -> dict[str, Any]:
    """The info of an earlier run into ``output``; refuses to mix descriptors of other settings."""
    path = output / INFO_FILE
    if not path.is_file():
        return {}
    previous = json.loads(path.read_text())
    before = {k: previous.get("config", {}).get(k) for k in _DESCRIPTOR_SETTINGS}
    now = {k: getattr(conf, k) for k in _DESCRIPTOR_SETTINGS}
    if before != now and not conf.overwrite:
        raise NeedleInputError(
            f"{output} holds descriptors made with {before}, this job asks for {now}: "
            "use --overwrite to redo every shard, or another --out"
        )
    return previous


class IngestFailed(RuntimeError):
    """Some shards could not be read; the others are committed."""

    def __init__(self, failed: dict[str, str]):
        super().__init__("shards failed: " + "; ".join(f"{url}: {why}" for url, why in sorted(failed.items())))
        self.failed = failed


def _report(conf: IngestConfig, urls: list[str], results: list[dict[str, Any]], seconds: float, worker_info: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in results if r["status"] == "ok"]
    images = sum(r["rows"] for r in ok)
    return {
        "schema_version": 1,
        "config": asdict(conf),
        "shards": len(urls),
        "shards_processed": len(results),
        "shards_ok": len(ok),
        "shards_failed": len(results) - len(ok),
        "failed": {r["url"]: r["reason"] for r in results if r["status"] != "ok"},
        "images": images,
        "error_rows": sum(r["error_rows"] for r in ok),
        "seconds": round(seconds, 3),
        "images_per_s": round(images / seconds, 2) if seconds > 0 else None,
        "results": sorted(results, key=lambda r: r["shard"]),
        **worker_info,
    }
