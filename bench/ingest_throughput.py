"""Ingestion throughput: bare model vs decode vs the whole Ray pipeline, measured in one run.

Uses the real photos of ``../shared/data/realbench`` (repeated to reach ``--n`` images), packed
into tars in a temporary directory. Same model, batching, precision and thread counts for all three:

(a) ``model_img_s``: the extractor's forward passes on pre-decoded, pre-resized images
(b) ``decode_img_s``: JPEG decode + isotropic resize only, on the pipeline's decode threads
(c) ``pipeline_img_s``: ``needle ingest`` on a local Ray instance, wall time from job start
    (workers' model loading included) to the last commit

On a CPU-only machine the model and decoding share the cores, so the best a pipeline can do is
the serial limit 1 / (1/model + 1/decode); ``efficiency`` = pipeline / that limit. With a GPU the
two run on different hardware: ``efficiency_gpu`` = pipeline / min(model, decode).
Prints one JSON line last.

    python bench/ingest_throughput.py [--n 5000] [--model NAME] [--device cpu|cuda]
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


def collect_jpegs(n: int) -> list[bytes]:
    files = sorted((REALBENCH / "images").glob("*.jpg")) + sorted((REALBENCH / "distractors").glob("*.jpg"))
    if not files:
        sys.exit(f"no images under {REALBENCH}")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000, help="images")
    parser.add_argument("--per-tar", type=int, default=500)
    parser.add_argument("--model", default="tf_efficientnet_lite0.gem")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cpus", type=int, default=os.cpu_count(), help="CPUs for the model and for decoding")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from cluster.ingest_job import IngestConfig
    from cluster.ingest_job import main as ingest
    from embed.extract import GlobalExtractor
    from ingest.images import decode_resized
    from ingest.pipeline import CHUNK_SIZE

    jpegs = collect_jpegs(args.n)
    torch.set_num_threads(args.cpus)
    extractor = GlobalExtractor(args.model, device=args.device, precision=args.precision, batch_size=args.batch_size)

    # (b) decode + resize on the pipeline's decode threads
    start = time.perf_counter()
    with ThreadPoolExecutor(args.cpus) as pool:
        images = list(pool.map(lambda d: decode_resized(d, extractor.resolution)[0], jpegs))
    decode_img_s = len(images) / (time.perf_counter() - start)

    # (a) bare model forward, in the pipeline's chunks
    extractor(images[: min(64, len(images))])  # warm-up
    start = time.perf_counter()
    for s in range(0, len(images), CHUNK_SIZE):
        extractor(images[s : s + CHUNK_SIZE])
    model_img_s = len(images) / (time.perf_counter() - start)
    del images

    # (c) the whole Ray pipeline
    import ray

    with tempfile.TemporaryDirectory(prefix="needle-throughput-") as tmp:
        pattern = write_tars(jpegs, Path(tmp), args.per_tar)
        ray.init(address="local", num_cpus=args.cpus, num_gpus=1 if args.device == "cuda" else 0,
                 include_dashboard=False, log_to_driver=False)
        conf = IngestConfig(model=args.model, batch_size=args.batch_size, precision=args.precision,
                            cpus_per_worker=args.cpus)
        start = time.perf_counter()
        ingest(conf, pattern, Path(tmp) / "out")
        pipeline_img_s = len(jpegs) / (time.perf_counter() - start)
        info = json.loads((Path(tmp) / "out" / "ingest_info.json").read_text())
        ray.shutdown()

    serial_limit = 1.0 / (1.0 / model_img_s + 1.0 / decode_img_s)
    result = {
        "n": len(jpegs),
        "model": args.model,
        "resolution": extractor.resolution,
        "precision": extractor.precision,
        "device": args.device,
        "cpus": args.cpus,
        "batch_size": args.batch_size,
        "model_img_s": round(model_img_s, 2),
        "decode_img_s": round(decode_img_s, 2),
        "pipeline_img_s": round(pipeline_img_s, 2),
        "serial_limit_img_s": round(serial_limit, 2),
        "efficiency": round(pipeline_img_s / serial_limit, 3),
        "efficiency_gpu": round(pipeline_img_s / min(model_img_s, decode_img_s), 3),
        "error_rows": info["error_rows"],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
