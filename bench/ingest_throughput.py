"""Ingestion throughput: bare model vs decode vs the whole Ray pipeline, measured in one run.

Uses real photos (default ``../shared/data/realbench``; ``--images DIR`` for any folder of JPEGs),
repeated to reach ``--n`` images and packed into tars in a temporary directory. Per model, with the
job's default settings for the device (batching, chunk size, precision, threads):

(a) ``model_img_s``: the extractor on pre-decoded, pre-resized images, in the pipeline's chunks
    (so with the batches the mix of aspect ratios allows), measured before and after (c) and
    averaged (``model_img_s_before``/``_after`` show the drift of a shared machine);
    ``model_uniform_img_s``: the same number of images all of one shape (the photo whose area is
    nearest the mix's mean), in full batches: what the model could do at the same pixels per
    image without the mix
(b) ``decode_img_s``: JPEG decode + isotropic resize with PIL on all the worker's decode threads;
    on GPU also ``decode_nvjpeg_img_s`` (batched nvjpeg + resize on the GPU, copied back)
(c) ``pipeline_img_s``: ``needle ingest`` on a local Ray instance, wall time from the job's start
    (actor start and model loading included) to the last commit; ``worker_img_s``: images over the
    time the worker spent in its shards (the steady state; equal to the wall rate for a long job);
    ``cpu_s_workers``/``_driver``/``_other``: CPU seconds the ingest workers, the job's driver and
    everything else on the machine (Ray's daemons) used meanwhile, of ``cpu_s_available``

CPU: the model and decoding share the cores, so the best a pipeline can do is the serial limit
1 / (1/model + 1/decode); ``efficiency`` = pipeline / that limit. GPU: they run on different
hardware, so ``efficiency_gpu`` = worker / min(model, decode of the chosen decoder)
(``efficiency_gpu_wall`` with the wall rate). Prints one JSON line per model.

    python bench/ingest_throughput.py [--n 5000] [--model NAME ...] [--device cpu|cuda] [--decoder pil|nvjpeg]
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
REALBENCH = ROOT.parent / "shared" / "data" / "realbench"
# ILIAS families at their ILIAS test resolutions: a CNN, a ViT-B and a ViT-L.
GPU_MODELS = ("tf_efficientnet_lite0.gem", "siglip_B16_384.head", "siglip_L16_384.head")


def collect_jpegs(directory: Path, n: int) -> list[bytes]:
    files = sorted(directory.rglob("*.jpg"))
    if not files:
        sys.exit(f"no .jpg images under {directory}")
    data = [f.read_bytes() for f in files]
    return [data[i % len(data)] for i in range(n)]


def write_tars(jpegs: list[bytes], directory: Path, per_tar: int) -> str:
    for start in range(0, len(jpegs), per_tar):
        with tarfile.open(directory / f"{start // per_tar:06d}.tar", "w") as tar:
            for i, data in enumerate(jpegs[start : start + per_tar]):
                info = tarfile.TarInfo(f"{start + i:08d}.jpg")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(directory / "*.tar")


def rate(n: int, seconds: float) -> float:
    return round(n / seconds, 2)


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def decode_pil(jpegs: list[bytes], side: int, threads: int) -> tuple[list, float]:
    from ingest.images import decode_resized

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        images = list(pool.map(lambda d: decode_resized(d, side)[0], jpegs, chunksize=16))
    return images, rate(len(images), time.perf_counter() - start)


def decode_nvjpeg(jpegs: list[bytes], side: int, batch: int) -> tuple[list, float]:
    from ingest.gpu_decode import GpuJpegDecoder

    decoder = GpuJpegDecoder("cuda")
    decoder([("warm-up", jpegs[0])], (side,))
    start = time.perf_counter()
    images = []
    for s in range(0, len(jpegs), batch):
        results = decoder([(str(i), d) for i, d in enumerate(jpegs[s : s + batch], s)], (side,))
        images += [r[0][side] for r in results]
    return images, rate(len(images), time.perf_counter() - start)


def model_rate(extractor, images: list, chunk: int, device: str) -> float:
    extractor(images[:chunk])  # warm-up: kernels and allocator for these shapes
    synchronize(device)
    start = time.perf_counter()
    for s in range(0, len(images), chunk):
        extractor(images[s : s + chunk])
    synchronize(device)
    return rate(len(images), time.perf_counter() - start)


def typical_image(images: list):
    """The image whose pixel count is nearest the mean: a one-shape run at the same compute per
    image as the mix (the first photo could be half the mean area and flatter the comparison)."""
    import numpy as np

    areas = np.array([im.shape[0] * im.shape[1] for im in images], dtype=np.float64)
    return images[int(np.argmin(np.abs(areas - areas.mean())))]


def min_cosine(extractor, a: list, b: list) -> float:
    import numpy as np

    da = extractor(a)["global"].astype(np.float32)
    db = extractor(b)["global"].astype(np.float32)
    return round(float(np.min(np.sum(da * db, axis=1))), 5)


class CpuAccount:
    """CPU seconds each process on the machine used while the job ran, sampled every second
    (a process that exits keeps its last sample), summed into the ingest workers, this process
    and everything else (Ray's own daemons: raylet, GCS, dashboard agent, idle workers)."""

    def __init__(self, period_s: float = 1.0):
        import threading

        self.period_s, self.first, self.last, self.names = period_s, {}, {}, {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.poll, daemon=True)

    def sample(self) -> None:
        import psutil
        import ray  # noqa: F401  (puts the psutil that Ray bundles on sys.path; it is not a dependency of ours)

        for proc in psutil.process_iter(["name", "cmdline", "cpu_times"]):
            times = proc.info["cpu_times"]
            if times is None:
                continue
            used = times.user + times.system
            self.first.setdefault(proc.pid, used if not self.thread.is_alive() else 0.0)
            self.last[proc.pid] = used
            self.names[proc.pid] = " ".join(proc.info["cmdline"] or [proc.info["name"] or ""])

    def poll(self) -> None:
        while not self.stop.wait(self.period_s):
            self.sample()

    def __enter__(self) -> CpuAccount:
        self.sample()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.sample()
        self.stop.set()
        self.thread.join()

    def totals(self) -> dict[str, float]:
        out = {"cpu_s_workers": 0.0, "cpu_s_driver": 0.0, "cpu_s_other": 0.0}
        for pid, used in self.last.items():
            delta = used - self.first.get(pid, 0.0)
            group = (
                "cpu_s_workers"
                if "IngestWorker" in self.names[pid]
                else "cpu_s_driver"
                if pid == os.getpid()
                else "cpu_s_other"
            )
            out[group] += delta
        return {k: round(v, 1) for k, v in out.items()}


def run_pipeline(args, model: str, jpegs: list[bytes], cpus: int, decoder: str) -> dict:
    import ray

    from cluster.ingest_job import main as ingest
    from ingest.config import IngestConfig

    with tempfile.TemporaryDirectory(prefix="needle-throughput-") as tmp:
        pattern = write_tars(jpegs, Path(tmp), args.per_tar)
        ray.init(
            address="local",
            num_cpus=cpus,
            num_gpus=1 if args.device == "cuda" else 0,
            include_dashboard=False,
            log_to_driver=False,
        )
        # The job's defaults: on CPU only the thread count is the machine's (cpus_per_worker).
        conf = IngestConfig(
            model=model,
            weights=args.weights,
            batch_size=args.batch_size,
            decoder=decoder,
            **({} if args.device == "cuda" else {"cpus_per_worker": cpus}),
        )
        start = time.perf_counter()
        with CpuAccount() as account:
            ingest(conf, pattern, Path(tmp) / "out")
        wall = time.perf_counter() - start
        info = json.loads((Path(tmp) / "out" / "ingest_info.json").read_text())
        ray.shutdown()
    busy = sum(r["seconds"] for r in info["results"])
    return {
        "pipeline_img_s": rate(len(jpegs), wall),
        "worker_img_s": rate(len(jpegs), busy),
        "error_rows": info["error_rows"],
        **account.totals(),
        "cpu_s_available": round(wall * cpus, 1),
    }


def measure(args, model: str, jpegs: list[bytes], cpus: int) -> dict:
    import numpy as np
    import torch

    from embed.extract import GlobalExtractor
    from ingest.pipeline import CHUNK_SIZE, GPU_CHUNK_SIZE

    gpu = args.device == "cuda"
    torch.set_num_threads(1 if gpu else cpus)  # as the ingest worker sets it
    extractor = GlobalExtractor(model, args.weights, device=args.device, batch_size=args.batch_size)
    chunk = GPU_CHUNK_SIZE if gpu else CHUNK_SIZE
    side = extractor.resolution

    images, decode_img_s = decode_pil(jpegs, side, cpus)
    result = {
        "model": model,
        "resolution": side,
        "precision": extractor.precision,
        "device": args.device,
        "cpus": cpus,
        "batch_size": args.batch_size,
        "chunk_size": chunk,
        "n": len(jpegs),
        "decode_img_s": decode_img_s,
    }
    distinct = len({im.shape for im in images})
    model_before = model_rate(extractor, images, chunk, args.device)
    uniform = [typical_image(images)] * len(images)
    result["model_uniform_img_s"] = model_rate(extractor, uniform, chunk, args.device)
    del uniform
    if gpu:
        gpu_images, result["decode_nvjpeg_img_s"] = decode_nvjpeg(jpegs, side, 64)
        sample = min(len(images), 256)
        result["nvjpeg_cosine_min"] = min_cosine(extractor, images[:sample], gpu_images[:sample])
        del gpu_images
    if gpu:
        torch.cuda.empty_cache()
    decoder = args.decoder
    result.update(run_pipeline(args, model, jpegs, cpus, decoder))
    # The bare model again, after the job: this machine's speed drifts by 10-20% over minutes
    # (other tenants), so the pipeline is compared with the mean of the runs around it.
    model_after = model_rate(extractor, images, chunk, args.device)
    del images, extractor
    result.update(
        {
            "model_img_s": round((model_before + model_after) / 2, 2),
            "model_img_s_before": model_before,
            "model_img_s_after": model_after,
        }
    )
    decode = result["decode_nvjpeg_img_s"] if decoder == "nvjpeg" else decode_img_s
    serial_limit = 1.0 / (1.0 / result["model_img_s"] + 1.0 / decode)
    result.update(
        {
            "decoder": decoder,
            "distinct_shapes": distinct,
            "serial_limit_img_s": round(serial_limit, 2),
            "efficiency": round(result["pipeline_img_s"] / serial_limit, 3),
            "efficiency_gpu": round(result["worker_img_s"] / min(result["model_img_s"], decode), 3),
            "efficiency_gpu_wall": round(result["pipeline_img_s"] / min(result["model_img_s"], decode), 3),
        }
    )
    if gpu:
        result["gpu"] = torch.cuda.get_device_name()
    return {k: (float(v) if isinstance(v, np.floating) else v) for k, v in result.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000, help="images")
    parser.add_argument("--per-tar", type=int, default=500)
    parser.add_argument("--model", nargs="+", help=f"models (default: the default one on CPU, {GPU_MODELS} on GPU)")
    parser.add_argument("--weights", help="local weights file (default: the preset's, else random init: same speed)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--decoder", default="pil", choices=("pil", "nvjpeg"), help="the pipeline's decoder")
    parser.add_argument("--images", type=Path, default=REALBENCH, help="folder of JPEGs (searched recursively)")
    parser.add_argument("--cpus", type=int, default=os.cpu_count(), help="CPUs for the model and for decoding")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    models = args.model or (list(GPU_MODELS) if args.device == "cuda" else ["tf_efficientnet_lite0.gem"])
    jpegs = collect_jpegs(args.images, args.n)
    for model in models:
        print(json.dumps(measure(args, model, jpegs, args.cpus)), flush=True)


if __name__ == "__main__":
    main()
