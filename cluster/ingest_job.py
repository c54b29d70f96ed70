"""The ingestion job: a pool of Ray actor workers, each loading the model once, pulling shards from
a dynamic queue and committing one Parquet file per shard, exactly once.

    needle ingest --shards 'data/{000000..000999}.tar' --out descriptors/

Inside ``ray job submit`` it joins that cluster; run directly it starts a local Ray instance.

Exactly once: a shard's rows exist only in its committed Parquet part (atomic rename locally,
upload + commit marker on S3). ``manifest.json`` beside the parts records each shard's state;
``--resume`` (the default) skips shards whose committed part has the row count the manifest
recorded, ``--overwrite`` redoes everything. A worker that dies (killed, OOM, node lost) is
replaced and its shards go back to the queue, up to ``max_retries`` times each.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from cluster.connect import connect_ray
from core.errors import NeedleInputError
from core.location import location_of, output_location
from core.storage import is_s3
from embed.registry import check_weights
from ingest.config import IngestConfig
from ingest.job_record import (
    check_unchanged,
    count_samples,
    failed_images,
    merge_report,
    settings_diff,
    tar_fingerprint,
)
from ingest.shards import expand_shards, shard_ids, shard_name

log = logging.getLogger(__name__)

INFO_FILE = "ingest_info.json"
MANIFEST_FILE = "manifest.json"


class IngestWorker:
    """One model instance; processes whole shards. Wrapped with ``ray.remote`` by the job."""

    def __init__(self, conf: IngestConfig, device: str, torch_threads: int):
        import torch

        from embed.extract import GlobalExtractor
        from ingest.pipeline import CHUNK_SIZE, GPU_CHUNK_SIZE

        self.conf = conf
        gpu = device == "cuda"
        # A GPU worker's CPUs all decode, while the GPU computes (its model runs on the GPU; torch's
        # host threads only stack batches). On CPU decoding and the model share the same cores, so
        # they take turns, each on all of them: a decoding thread running beside the model's threads
        # preempts one of them and stalls the rest at the next barrier (realbench, 2 cores, in one
        # process: turns 40.6-41.5 img/s, overlapping with one decoding thread 38.4-40.3, the bare
        # model 40.5-43; in Ray workers both ~35).
        torch.set_num_threads(1 if gpu else max(1, torch_threads))
        self.decode_threads = conf.decode_threads or max(1, torch_threads)
        self.overlap = gpu
        self.chunk_size = conf.chunk_size or (GPU_CHUNK_SIZE if gpu else CHUNK_SIZE)
        self.batch_decoder = make_batch_decoder(conf.decoder, gpu, device, self.decode_threads)
        self.extractors = [
            GlobalExtractor(
                conf.model,
                conf.weights,
                device,
                conf.precision,
                conf.batch_size,
                conf.resolution,
                scales=conf.query_scales or (1.0,),
                rotations=conf.query_rotations,
                shape_grid=conf.shape_grid,
            )
        ]
        # Every input shape of the grid at every fixed batch size, before the first shard: web
        # photos would otherwise bring new kernel set-ups for hours (embed/shape_plan.py).
        self.warmed = self.extractors[0].warm() if gpu else None
        if conf.locals:
            self.extractors.append(make_local_extractor(conf, device))
        self.extractors_info = [e.info() for e in self.extractors]  # hashes the weights once

    def process(self, url: str, shard_id: int, out: str) -> dict[str, Any]:
        """The shard's result, plus how its columns were made (for the job's info file)."""
        from ingest.pipeline import process_shard

        result = process_shard(
            url,
            shard_id,
            out,
            self.extractors,
            self.decode_threads,
            self.chunk_size,
            s3_endpoint_url=self.conf.s3_endpoint_url,
            batch_decoder=self.batch_decoder,
            overlap=self.overlap,
        )
        return {**result.to_dict(), "extractors": self.extractors_info}


def make_batch_decoder(decoder: str, gpu: bool, device: str, processes: int) -> Any:
    """The batched decoder ``decoder`` means on this worker, or None for PIL on threads."""
    if decoder in ("auto", "nvjpeg") and gpu:
        from ingest.gpu_decode import GpuJpegDecoder

        return GpuJpegDecoder(device)
    if decoder == "pil-processes":
        from ingest.process_decode import ProcessDecoder

        return ProcessDecoder(processes)
    return None


def make_local_extractor(conf: IngestConfig, device: str = "cpu"):
    """The local-token extractor a job's configuration asks for."""
    from embed.locals.extract import build_local_extractor
    from embed.registry import RANDOM

    # local_itq "none": descriptors only, no codes (e.g. to learn an ITQ projection)
    return build_local_extractor(
        conf.locals,
        RANDOM if conf.weights == RANDOM else None,
        device,
        top_k=conf.local_top_k,
        keep_desc=conf.keep_local_desc or None,
        itq=conf.local_itq,
    )


def cpus_per_gpu(nodes: list[dict[str, Any]]) -> int:
    """CPUs per GPU on the GPU nodes of ``ray.nodes()`` (the smallest share, so that every GPU
    node can place one actor per GPU); 1 when no live node has a GPU."""
    shares = [
        int(n["Resources"].get("CPU", 0) // n["Resources"]["GPU"])
        for n in nodes
        if n.get("Alive", True) and n.get("Resources", {}).get("GPU", 0) >= 1
    ]
    return max(1, min(shares)) if shares else 1


def _worker_layout(
    conf: IngestConfig, resources: dict[str, float], n_shards: int, gpu_share: int = 1
) -> tuple[int, dict[str, Any], str, int]:
    """(count, actor options, device, CPU threads) from the cluster's resources; ``gpu_share``: the
    CPUs per GPU of its GPU nodes (:func:`cpus_per_gpu`)."""
    gpus = int(resources.get("GPU", 0))
    if gpus:
        count = min(conf.num_workers or gpus, n_shards)
        share = conf.cpus_per_gpu_worker or gpu_share
        return count, {"num_gpus": 1, "num_cpus": share}, "cuda", share
    cpus = int(resources.get("CPU", 1))
    per = max(1, min(conf.cpus_per_worker, cpus))
    count = min(conf.num_workers or max(1, cpus // per), n_shards)
    return count, {"num_cpus": per}, "cpu", per


# Settings that change the descriptors: a resumed job must use the same ones.
_DESCRIPTOR_SETTINGS = (
    "model",
    "weights",
    "resolution",
    "locals",
    "local_itq",
    "local_top_k",
    "keep_local_desc",
    "query_scales",
    "query_rotations",
    "shape_grid",
)


def _comparable(key: str, value: Any) -> Any:
    # JSON turns the config's scales tuple into a list: compare them as tuples of floats.
    return tuple(float(v) for v in value) if key == "query_scales" and value is not None else value


# Settings added later, as older jobs made their descriptors (else: IngestConfig's default).
_BEFORE_THE_SETTING = {"shape_grid": 0}


def _check_same_settings(previous: dict[str, Any], conf: IngestConfig, where: str, committed: bool) -> None:
    """Refuse settings other than those of the descriptors committed at ``where`` (a record left
    by a run that committed nothing refuses nothing), naming each differing field."""
    defaults = IngestConfig()
    recorded = previous.get("config", {})
    before = {
        k: _comparable(k, recorded.get(k, _BEFORE_THE_SETTING.get(k, getattr(defaults, k))))
        for k in _DESCRIPTOR_SETTINGS
    }
    now = {k: _comparable(k, getattr(conf, k)) for k in _DESCRIPTOR_SETTINGS}
    if previous and committed and before != now and not conf.overwrite:
        raise NeedleInputError(
            f"{where} holds descriptors made with other settings ({settings_diff(before, now)}): "
            "use --overwrite to redo every shard, or another --out"
        )


def plan_shards(
    urls: list[str], committed: dict[str, dict[str, Any]], manifest: dict[str, Any], overwrite: bool
) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """(shards to process, manifest entries of the shards kept as they are)."""
    entries = manifest.get("shards", {})
    todo, kept = [], {}
    for url in urls:
        name = shard_name(url)
        part = committed.get(f"{name}.parquet")
        entry = entries.get(name)
        if overwrite or part is None:
            todo.append(url)
        elif entry is None or entry.get("state") != "committed":
            # Committed (atomic) but the driver died before recording it: adopt the part.
            kept[name] = {"url": url, "state": "committed", "rows": part["rows"], "attempts": 0, "adopted": True}
        elif entry.get("rows") != part["rows"]:
            log.warning(
                "shard %s: part has %s rows, manifest says %s: redoing it", name, part["rows"], entry.get("rows")
            )
            todo.append(url)
        else:
            kept[name] = entry
    return todo, kept


def run_queue(
    todo: list[str],
    make_worker: Callable[[], Any],
    submit: Callable[[Any, str], Any],
    count: int,
    max_retries: int,
    in_flight_per_worker: int = 2,
) -> Iterator[tuple[str, dict[str, Any] | None, int, str]]:
    """Feed shards to ``count`` actors from a dynamic queue; yields (url, result, attempts, error).

    Each actor holds up to ``in_flight_per_worker`` shards so it never waits between two. When an
    actor dies its shards are re-queued (at most ``max_retries`` times each) and it is replaced;
    ``result`` is None for a shard that exhausted its retries, with ``error`` saying why.
    """
    import ray
    from ray.exceptions import RayActorError, RayError

    queue = deque(todo)
    attempts: Counter[str] = Counter()
    workers = [make_worker() for _ in range(count)]
    generation = [0] * count  # bumped when slot w gets a new actor
    load = [0] * count
    in_flight: dict[Any, tuple[int, int, str]] = {}

    def fill() -> None:
        for w in sorted(range(count), key=lambda i: load[i]):
            while queue and load[w] < in_flight_per_worker:
                url = queue.popleft()
                attempts[url] += 1
                in_flight[submit(workers[w], url)] = (w, generation[w], url)
                load[w] += 1

    fill()
    while in_flight:
        [ref], _ = ray.wait(list(in_flight), num_returns=1)
        w, born, url = in_flight.pop(ref)
        if born == generation[w]:
            load[w] -= 1
        try:
            yield url, ray.get(ref), attempts[url], ""
        except RayError as exc:
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            # The other shards of a dead actor fail too: replace it once, not once per shard.
            if isinstance(exc, RayActorError) and born == generation[w]:
                log.warning("worker %d died (%s): replacing it", w, reason)
                workers[w] = make_worker()
                generation[w] += 1
                load[w] = 0
            if attempts[url] <= max_retries:
                log.warning("shard %s: attempt %d failed (%s): re-queued", url, attempts[url], reason)
                queue.appendleft(url)
            else:
                yield url, None, attempts[url], reason
        fill()


def main(conf: IngestConfig, shards: str | list[str], output: Path | str) -> Path | str:
    """Ingest ``shards`` into ``output`` (a directory or an ``s3://`` prefix), one
    ``<shard>.parquet`` each; returns ``output``. Raises IngestFailed, after writing the report,
    when any shard failed. The model's weights are checked before Ray starts (WeightsError in
    seconds, not a dead actor per shard); a run that commits nothing leaves no record, and no
    directory it made."""
    check_weights(conf.model, conf.weights)
    made = location_of(output, conf.s3_endpoint_url).local_root
    made = made if made is not None and not made.exists() else None  # a directory this run makes
    try:
        return _ingest(conf, shards, output)
    except BaseException:
        if made is not None and made.is_dir() and not any(made.glob("*.parquet")):
            shutil.rmtree(made, ignore_errors=True)
        raise


def _ingest(conf: IngestConfig, shards: str | list[str], output: Path | str) -> Path | str:
    import ray

    # Local paths absolute: a worker's working directory is its Ray instance's, not this command's.
    storage = output_location(_absolute(str(output)), conf.s3_endpoint_url)
    previous = storage.read_json(INFO_FILE) or {}
    urls = [_absolute(url) for url in expand_shards(shards, conf.s3_endpoint_url)]
    ids = shard_ids(urls)
    committed = storage.committed()
    if not ray.is_initialized():
        connect_ray(conf.address)
    conf = with_shape_grid(conf)
    _check_same_settings(previous, conf, storage.url, bool(committed))
    manifest = storage.read_json(MANIFEST_FILE) or {}
    todo, entries = plan_shards(urls, committed, manifest, conf.overwrite)
    check_unchanged(entries, conf.s3_endpoint_url)
    log.info("%d shards: %d committed already, %d to do", len(urls), len(urls) - len(todo), len(todo))
    if not todo:
        if not previous:  # adopted parts only: record them once
            storage.write_json(MANIFEST_FILE, {"shards": entries})
            storage.write_json(INFO_FILE, merge_report({}, _report(conf, urls, [], entries, 0.0, {"extractors": []})))
        return output  # ingest_info.json of earlier runs stays as it is
    start = time.perf_counter()
    # fresh_info: how this run's workers make their columns (from the first result)
    results, fresh_info = _run_workers(conf, todo, ids, storage, entries, start)
    worker_info = {"extractors": fresh_info or previous.get("extractors", [])}
    report = _report(conf, urls, results, entries, time.perf_counter() - start, worker_info)
    if report["shards_ok"] or previous:
        storage.write_json(MANIFEST_FILE, {"shards": entries})
        storage.write_json(INFO_FILE, merge_report(previous, report))
    log.info(
        "ingest summary: %s",
        {
            k: report[k]
            for k in ("shards_ok", "shards_failed", "shards_retried", "images", "error_rows", "images_per_s")
        },
    )
    for image in report["failed_images"]:
        log.warning("image %s in %s failed: %s", image["key"], image["tar"], image["reason"])
    if report["failed_images_total"] > len(report["failed_images"]):
        log.warning("... %d failed images in all (ingest_info.json names the first %d)",
                    report["failed_images_total"], len(report["failed_images"]))  # fmt: skip
    if report["failed"]:
        raise IngestFailed(report["failed"])
    return output


def _absolute(url: str) -> str:
    return url if is_s3(url) else os.path.abspath(url)


def with_shape_grid(conf: IngestConfig) -> IngestConfig:
    """``conf`` with the shape grid its workers will use (None resolved for the cluster's device:
    a grid for a CNN on GPUs, exact shapes on CPUs), so that the job records, and a resumed job
    compares, the grid the descriptors were made with, never a default that depends on where."""
    import ray

    from embed.shape_plan import model_shape_grid

    if conf.shape_grid is not None:
        return conf
    device = _worker_layout(conf, ray.cluster_resources(), 1, cpus_per_gpu(ray.nodes()))[2]
    return replace(conf, shape_grid=model_shape_grid(conf.model, None, device))


def _run_workers(
    conf: IngestConfig, todo: list[str], ids: dict[str, int], storage: Any, entries: dict[str, Any], start: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Process ``todo`` on a pool of actors, recording each shard in ``entries`` and the manifest as
    it ends; returns (the shards' results, how the workers make their columns)."""
    from tqdm import tqdm

    # Each tar's fingerprint as it is read, recorded with its commit: a later run refuses it changed.
    prints = {url: tar_fingerprint(url, conf.s3_endpoint_url) for url in todo}
    total = count_samples(todo)  # the bar counts images (one tar can be minutes); tars where unknown (S3)
    make_worker, submit, count = _worker_pool(conf, len(todo), ids, storage.url)
    results: list[dict[str, Any]] = []
    fresh_info = None
    images = 0
    unit = ("img", total) if total else ("shard", len(todo))
    with tqdm(total=unit[1], unit=unit[0], desc="ingest", dynamic_ncols=True) as bar:
        for url, result, attempts, reason in run_queue(todo, make_worker, submit, count, conf.max_retries):
            result = _shard_result(url, result, attempts, reason)
            fresh_info = result.pop("extractors", None) or fresh_info
            results.append(result)
            entries[result["shard"]] = {**_manifest_entry(url, result), **(prints.get(url) or {})}
            if result["status"] == "ok":  # a run that commits nothing leaves no manifest
                storage.write_json(MANIFEST_FILE, {"shards": entries})
            images += result["rows"]
            elapsed = time.perf_counter() - start
            bar.set_postfix(tars=f"{len(results)}/{len(todo)}", img_s=f"{images / elapsed:.1f}")
            bar.update(result["rows"] if total else 1)
    return results, fresh_info


def _worker_pool(
    conf: IngestConfig, n_todo: int, ids: dict[str, int], out: str
) -> tuple[Callable[[], Any], Callable[[Any, str], Any], int]:
    """(make a worker actor, submit a shard to one, how many workers) for the cluster's resources."""
    import ray

    count, options, device, threads = _worker_layout(conf, ray.cluster_resources(), n_todo, cpus_per_gpu(ray.nodes()))
    log.info("starting %d %s workers (%s)", count, device, options)
    actor_cls = ray.remote(**options, scheduling_strategy="SPREAD")(IngestWorker)

    created = iter(range(1 << 30))
    tag = os.urandom(4).hex()

    def make_worker():
        # Named, so that operators (and the fault tests) can find a job's workers.
        return actor_cls.options(name=f"needle-ingest-{tag}-{next(created)}").remote(conf, device, threads)

    def submit(worker, url):
        return worker.process.remote(url, ids[url], out)

    return make_worker, submit, count


def _shard_result(url: str, result: dict[str, Any] | None, attempts: int, reason: str) -> dict[str, Any]:
    """A worker's result for the shard, or (None: its retries exhausted) a failed one saying why."""
    if result is None:
        result = {
            "url": url,
            "shard": shard_name(url),
            "status": "failed",
            "output": None,
            "rows": 0,
            "error_rows": 0,
            "seconds": 0.0,
            "reason": reason,
        }
    result["attempts"] = attempts
    return result


def _manifest_entry(url: str, result: dict[str, Any]) -> dict[str, Any]:
    return {
        "url": url,
        "state": "committed" if result["status"] == "ok" else "failed",
        "rows": result["rows"],
        "error_rows": result["error_rows"],
        "attempts": result["attempts"],
        "reason": result["reason"],
    }


class IngestFailed(RuntimeError):
    """Some shards could not be read; the others are committed."""

    def __init__(self, failed: dict[str, str]):
        super().__init__("shards failed: " + "; ".join(f"{url}: {why}" for url, why in sorted(failed.items())))
        self.failed = failed


def _report(
    conf: IngestConfig,
    urls: list[str],
    results: list[dict[str, Any]],
    entries: dict[str, Any],
    seconds: float,
    worker_info: dict[str, Any],
) -> dict[str, Any]:
    ok = [r for r in results if r["status"] == "ok"]
    images = sum(r["rows"] for r in ok)
    failed = {r["url"]: r["reason"] for r in results if r["status"] != "ok"}
    named, n_failed = failed_images(results)
    return {
        "schema_version": 1,
        "config": asdict(conf),
        "shards": len(urls),
        "shards_processed": len(results),
        "shards_ok": len(ok),
        "shards_failed": len(failed),
        "shards_retried": sum(1 for r in results if r.get("attempts", 1) > 1),
        "shards_committed_total": sum(1 for e in entries.values() if e["state"] == "committed"),
        "failed": failed,
        "images": images,
        "error_rows": sum(r["error_rows"] for r in ok),
        "seconds": round(seconds, 3),
        "images_per_s": round(images / seconds, 2) if seconds > 0 and images else None,
        "failed_images": named,  # the first of them, {key, tar, reason}
        "failed_images_total": n_failed,
        "results": sorted(results, key=lambda r: r["shard"]),
        **worker_info,
    }
