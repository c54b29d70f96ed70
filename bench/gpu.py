"""needle's GPU figures, without Ray: one JSON line per figure on stdout (and appended to --jsonl).

Each figure is what a user of the job's defaults gets on the device, measured in this one process:

- ``shape_plan``: Lite0's warm-up at worker start (every shape of the grid at every fixed batch
  size), then its first and second pass over real photos: ``first_pass_vs_warm`` (target >= 0.8);
  ``shape_plan_exact_baseline``: the old exact-shape plan's first pass over a few new shapes.
- ``ingest`` per model (Lite0, SigLIP-B16, SigLIP-L16): the model alone, decoding alone (PIL on the
  worker's threads, nvjpeg), and the ingest worker (``IngestWorker.process``, what each Ray actor
  runs) with each decoder: ``efficiency_*`` = worker / min(model, decode) (target >= 0.9).
- ``aliked``: ALIKED-N16 tokens at 512 px one image at a time vs batched (target >= 1,000 img/s),
  and their agreement (keypoints within 1 px, codes equal); ``worker_tokens``: the worker with
  Lite0 + ALIKED tokens against min(global + tokens, decode), and hours for 100M images on 8 GPUs.
- ``ames``: AMES on 1,000 candidates on the device (target <= 50 ms) against the CPU;
  ``spatial``: spatial verification of the same shortlist on the device and on the CPU.
- ``exact_resident``: exact search over a database held in GPU memory (10M x 512 fp16, 1,000
  queries, k=1000: target <= 0.1 ms per query); ``exact_streamed``: the same database streamed
  from host memory with the copy overlapping the compute, against the plain chunked scan.

    python bench/gpu.py [--only shape_plan,ingest,...] [--budget 420] [--jsonl FILE]
    python bench/gpu.py --dry-run     # CPU, tiny sizes: every code path in seconds (make test runs it)

Photos: ``--images DIR`` (default $NEEDLE_REALBENCH, else ../shared/data/realbench), repeated to
the sizes needed. A figure that fails prints its error and the others go on; the exit code is 1
when any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LITE0 = "tf_efficientnet_lite0.gem"
VITS = ("siglip_B16_384.head", "siglip_L16_384.head")  # random init: the speed of the published ones
STAGES = ("shape_plan", "ingest", "aliked", "ames", "spatial", "exact")


@dataclass
class Run:
    """What every figure needs: where it runs, how big, how long it may take, where lines go."""

    dry: bool
    device: str
    cpus: int
    images: Path
    deadline: float
    jsonl: Path | None
    failures: list[str] = field(default_factory=list)

    def left(self) -> float:
        return self.deadline - time.time()

    def emit(self, figure: str, **fields: Any) -> None:
        line = json.dumps({"figure": figure, "device": self.device, "dry_run": self.dry, **fields}, default=_plain)
        print(line, flush=True)
        if self.jsonl is not None:
            with open(self.jsonl, "a") as f:
                f.write(line + "\n")

    def sync(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else str(value)


def rate(n: int, seconds: float) -> float:
    return round(n / max(seconds, 1e-9), 2)


def usable_cpus() -> int:
    """CPUs this process may use (affinity; a container's cpu_count is the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def jpegs_of(run: Run, n: int) -> list[bytes]:
    from bench.ingest_throughput import collect_jpegs

    return collect_jpegs(run.images, n)


def decoded(jpegs: list[bytes], side: int, threads: int) -> tuple[list[np.ndarray], float]:
    from bench.ingest_throughput import decode_pil

    return decode_pil(jpegs, side, threads)


# --- the shape plan and the ingest worker ----------------------------------------------------------


def passes(run: Run, extractor: Any, images: list[np.ndarray], chunk: int) -> tuple[float, float]:
    """(first pass img/s, second pass img/s) of ``extractor`` over ``images`` in chunks."""
    rates = []
    for _ in range(2):
        start = time.perf_counter()
        for s in range(0, len(images), chunk):
            extractor(images[s : s + chunk])
        run.sync()
        rates.append(rate(len(images), time.perf_counter() - start))
    return rates[0], rates[1]


def stage_shape_plan(run: Run) -> None:
    """The old plan's first pass over new shapes, a chunk at a time until its time is up."""
    from embed.extract import GlobalExtractor

    if run.device != "cuda" and not run.dry:
        run.emit("shape_plan_exact_baseline", skipped="no GPU: no per-shape kernel set-up to show")
        return
    extractor = GlobalExtractor(LITE0, device=run.device, shape_grid=0, fixed_batches=False)
    images, _ = decoded(jpegs_of(run, 4 if run.dry else 256), extractor.resolution, run.cpus)
    cap = 1 if run.dry else min(25.0, run.left() / 6)
    done, start = 0, time.perf_counter()
    for s in range(0, len(images), 32):
        extractor(images[s : s + 32])
        done = min(len(images), s + 32)
        if time.perf_counter() - start > cap:
            break
    run.sync()
    first = time.perf_counter() - start
    shapes = len({im.shape for im in images[:done]})
    start = time.perf_counter()
    for s in range(0, done, 32):
        extractor(images[s : s + 32])
    run.sync()
    run.emit(
        "shape_plan_exact_baseline",
        model=LITE0,
        images=done,
        distinct_shapes=shapes,
        first_pass_s=round(first, 2),
        second_pass_s=round(time.perf_counter() - start, 2),
        first_pass_img_s=rate(done, first),
    )


def ingest_worker(run: Run, model: str, decoder: str, locals_preset: str | None = None) -> Any:
    from cluster.ingest_job import IngestWorker
    from embed.registry import RANDOM
    from embed.shape_plan import DEFAULT_GRID
    from ingest.config import IngestConfig

    weights = None if model == LITE0 else RANDOM
    # The dry run exercises a GPU worker's shape plan (a CPU worker's default is exact shapes).
    extra = {} if run.device == "cuda" else {"cpus_per_worker": run.cpus, "shape_grid": DEFAULT_GRID}
    conf = IngestConfig(model=model, weights=weights, decoder=decoder, locals=locals_preset, **extra)
    return IngestWorker(conf, run.device, run.cpus)


def worker_rate(run: Run, worker: Any, urls: list[str], out: Path) -> tuple[float, float]:
    """(img/s over the worker's shard seconds, the same without its first shard)."""
    seconds, rows = [], []
    for i, url in enumerate(urls):
        result = worker.process(url, i, str(out))
        if result["status"] != "ok":
            raise RuntimeError(f"shard {url}: {result['status']} {result.get('reason')}")
        seconds.append(result["seconds"])
        rows.append(result["rows"])
    first = 1 if len(urls) > 1 else 0
    return rate(sum(rows), sum(seconds)), rate(sum(rows[first:]), sum(seconds[first:]))


def write_shards(jpegs: list[bytes], directory: Path, shards: int) -> list[str]:
    from bench.ingest_throughput import write_tars

    directory.mkdir(parents=True, exist_ok=True)
    write_tars(jpegs, directory, -(-len(jpegs) // shards))
    return sorted(str(p) for p in directory.glob("*.tar"))


INGEST_N = {LITE0: 4000, "siglip_B16_384.head": 3000, "siglip_L16_384.head": 1500}


def stage_ingest(run: Run, model: str) -> dict[str, float]:
    """One model: the warm-up, model passes, decoders alone, the worker with each decoder."""
    import torch

    from bench.ingest_throughput import decode_nvjpeg

    torch.set_num_threads(run.cpus)  # building a ViT-L on one thread takes long; the worker resets it
    start = time.perf_counter()
    worker = ingest_worker(run, model, "pil")
    init_s = time.perf_counter() - start
    extractor = worker.extractors[0]
    n = 6 if run.dry else INGEST_N[model]
    jpegs = jpegs_of(run, n)
    images, decode_pil = decoded(jpegs, extractor.resolution, worker.decode_threads)
    first, warm = passes(run, extractor, images, worker.chunk_size)
    res: dict[str, Any] = {"model": model, "images": n, "resolution": extractor.resolution}
    res |= {"worker_init_s": round(init_s, 2), "warmed": worker.warmed, "shape_grid": extractor.shape_grid}
    res |= {"distinct_shapes": len({im.shape for im in images}), "batch_sizes": extractor.batch_sizes}
    res |= {"model_first_pass_img_s": first, "model_img_s": warm, "first_pass_vs_warm": round(first / warm, 3)}
    res |= {"decode_pil_img_s": decode_pil, "decode_threads": worker.decode_threads}
    if run.device == "cuda":
        _, res["decode_nvjpeg_img_s"] = decode_nvjpeg(jpegs, extractor.resolution, 64)
    with tempfile.TemporaryDirectory(prefix="needle-gpu-bench-") as tmp:
        urls = write_shards(jpegs, Path(tmp) / "tars", 2 if run.dry else 3)
        res["worker_pil_img_s"], res["worker_pil_steady_img_s"] = worker_rate(run, worker, urls, Path(tmp) / "pil")
        interval = sys.getswitchinterval()
        sys.setswitchinterval(0.0005)  # the GIL handed over 10x as often: is the model thread starved?
        try:
            res["worker_pil_switch_0_5ms_img_s"], _ = worker_rate(run, worker, urls, Path(tmp) / "pil_switch")
        finally:
            sys.setswitchinterval(interval)
        from ingest.process_decode import ProcessDecoder

        worker.batch_decoder = ProcessDecoder(worker.decode_threads)  # a GIL per decoder
        try:
            res["worker_pil_processes_img_s"], _ = worker_rate(run, worker, urls, Path(tmp) / "processes")
        finally:
            worker.batch_decoder.close()
            worker.batch_decoder = None
        if run.device == "cuda":
            from ingest.gpu_decode import GpuJpegDecoder

            worker.batch_decoder = GpuJpegDecoder(run.device)  # what decoder "auto" picks on a GPU
            res["worker_nvjpeg_img_s"], res["worker_nvjpeg_steady_img_s"] = worker_rate(
                run, worker, urls, Path(tmp) / "nvjpeg"
            )
    res["efficiency_pil"] = round(res["worker_pil_img_s"] / min(warm, decode_pil), 3)
    res["efficiency_pil_processes"] = round(res["worker_pil_processes_img_s"] / min(warm, decode_pil), 3)
    if "worker_nvjpeg_img_s" in res:
        res["efficiency_nvjpeg"] = round(res["worker_nvjpeg_img_s"] / min(warm, res["decode_nvjpeg_img_s"]), 3)
    if run.device == "cuda":
        res["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        torch.cuda.empty_cache()
    run.emit("ingest", **res)
    shape_plan = ("model", "warmed", "shape_grid", "batch_sizes", "distinct_shapes", "images")
    shape_plan += ("model_first_pass_img_s", "model_img_s", "first_pass_vs_warm")
    run.emit("shape_plan", **{key: res[key] for key in shape_plan})
    return res


# --- local tokens ----------------------------------------------------------------------------------


def stage_aliked(run: Run, global_img_s: float | None) -> None:
    import torch

    from embed.locals.extract import build_local_extractor

    torch.set_num_threads(1 if run.device == "cuda" else run.cpus)
    ext = build_local_extractor("aliked-n16", None, run.device)
    n = 2 if run.dry else 512
    images, _ = decoded(jpegs_of(run, n), ext.resolution, run.cpus)
    ext.net.batch(images[:8])  # warm-up: this shape mix's kernels
    run.sync()
    start = time.perf_counter()
    batched = ext.net.batch(images)
    run.sync()
    batch_s = time.perf_counter() - start
    m = n if run.dry else 64
    start = time.perf_counter()
    alone = [ext.net(image) for image in images[:m]]
    run.sync()
    alone_s = time.perf_counter() - start
    near, codes_equal, total = 0, 0, 0
    for (xy_b, _, desc_b), (xy_a, _, desc_a) in zip(batched[:m], alone):
        k = min(len(xy_a), len(xy_b))
        total += max(len(xy_a), len(xy_b))
        close = np.abs(xy_a[:k] - xy_b[:k]).max(1) <= 1
        near += int(close.sum())
        same = (ext.itq.binarize(desc_a[:k]) == ext.itq.binarize(desc_b[:k])).all(1)
        codes_equal += int((same & close).sum())
    tokens_img_s = rate(n, batch_s)
    res = {"images": n, "resolution": ext.resolution, "batched_img_s": tokens_img_s}
    res |= {"one_at_a_time_img_s": rate(m, alone_s), "speedup": round(tokens_img_s / rate(m, alone_s), 2)}
    res |= {
        "keypoints_within_1px": round(near / max(total, 1), 4),
        "codes_equal": round(codes_equal / max(total, 1), 4),
    }
    run.emit("aliked", **res)
    del ext
    if global_img_s:
        stage_worker_tokens(run, global_img_s, tokens_img_s)


def stage_worker_tokens(run: Run, global_img_s: float, tokens_img_s: float) -> None:
    """The worker with Lite0 + ALIKED tokens, against min(global + tokens on one GPU, decode)."""
    start = time.perf_counter()
    worker = ingest_worker(run, LITE0, "auto", "aliked-n16")
    init_s = time.perf_counter() - start
    n = 6 if run.dry else 3000
    jpegs = jpegs_of(run, n)
    sides = tuple(sorted({e.resolution for e in worker.extractors}))
    start = time.perf_counter()
    if worker.batch_decoder is not None:
        for s in range(0, n, 64):
            worker.batch_decoder([(str(i), d) for i, d in enumerate(jpegs[s : s + 64])], sides)
    else:
        decoded(jpegs, max(sides), worker.decode_threads)
    decode_img_s = rate(n, time.perf_counter() - start)
    with tempfile.TemporaryDirectory(prefix="needle-gpu-bench-") as tmp:
        urls = write_shards(jpegs, Path(tmp) / "tars", 3)
        worker_img_s, steady = worker_rate(run, worker, urls, Path(tmp) / "out")
    both = 1 / (1 / global_img_s + 1 / tokens_img_s)  # one GPU runs both models in turn
    limit = min(both, decode_img_s)
    run.emit(
        "worker_tokens",
        model=LITE0,
        locals="aliked-n16",
        images=n,
        worker_init_s=round(init_s, 2),
        decoder="nvjpeg" if worker.batch_decoder is not None else "pil",
        decode_img_s=decode_img_s,
        global_plus_tokens_img_s=round(both, 2),
        worker_img_s=worker_img_s,
        worker_steady_img_s=steady,
        efficiency=round(worker_img_s / limit, 3),
        hours_100m_on_8_gpus=round(1e8 / (8 * worker_img_s) / 3600, 2),
    )


# --- the query side --------------------------------------------------------------------------------


def shortlist(run: Run) -> tuple[Any, Any]:
    from bench.rerank_speed import SCALES, make_query, make_shortlist

    rng = np.random.default_rng(0)
    query = make_query(rng, 100, SCALES)  # 300 tokens: 100 at each of 3 scales
    return query, make_shortlist(rng, query, 8 if run.dry else 1000, 100, False)


def timed_ms(run: Run, fn: Any, repeats: int = 3) -> tuple[float, Any]:
    out = fn()  # warm-up
    run.sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        run.sync()
        best = min(best, time.perf_counter() - start)
    return round(1000 * best, 2), out


def stage_ames(run: Run) -> None:
    import torch

    from rerank.ames import AMES, AMESConfig, score_shortlist

    query, candidates = shortlist(run)
    torch.manual_seed(0)
    model = AMES(AMESConfig()).eval()  # the published architecture, random weights (timing only)
    torch.set_num_threads(run.cpus)
    cpu_n = min(len(candidates.codes), 128)
    cpu_ms, cpu_logits = timed_ms(run, lambda: score_shortlist(model, query, _first(candidates, cpu_n)), 1)
    res = {"candidates": len(candidates.codes), "cpu_threads": run.cpus, "cpu_ms_per_1000": cpu_ms * 1000 / cpu_n}
    if run.device == "cuda":
        on_gpu = AMES(AMESConfig())
        on_gpu.load_state_dict(model.state_dict())
        on_gpu = on_gpu.to(run.device).eval()
        res["device_ms"], logits = timed_ms(run, lambda: score_shortlist(on_gpu, query, candidates))
        res["max_abs_diff_vs_cpu"] = float(np.abs(logits[:cpu_n] - cpu_logits).max())
    run.emit("ames", **res)


def _first(batch: Any, n: int) -> Any:
    import dataclasses

    return type(batch)(**{f.name: getattr(batch, f.name)[:n] for f in dataclasses.fields(batch)})


def stage_spatial(run: Run) -> None:
    from rerank.rerank import RerankConfig, Reranker

    query, candidates = shortlist(run)
    conf = RerankConfig()
    cpu = Reranker(conf, device="cpu")
    cpu_ms, cpu_scores = timed_ms(run, lambda: cpu.local_scores(query, candidates))
    res = {"candidates": len(candidates.codes), "cpu_ms": cpu_ms, "method": conf.method}
    if run.device == "cuda":
        gpu = Reranker(conf, device=run.device)
        res["device_ms"], scores = timed_ms(run, lambda: gpu.local_scores(query, candidates))
        res["scores_equal"] = bool(np.array_equal(scores.raw, cpu_scores.raw))
    run.emit("spatial", **res)


def stage_exact(run: Run) -> None:
    """Resident vs streamed exact search (index.gpu.resident) over n x d float16."""
    import torch

    from index.gpu.engine import chunks_of, exact_search
    from index.gpu.resident import ResidentDatabase

    n, d, nq, k = (20_000, 64, 10, 10) if run.dry else (10_000_000, 512, 1000, 1000)
    rng = np.random.default_rng(0)
    base = rng.standard_normal((min(n, 1_000_000), d), dtype=np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    xb = np.tile(base.astype(np.float16), (-(-n // len(base)), 1))[:n]  # repeated rows: timing only
    xq = base[:nq] + 0.01 * rng.standard_normal((nq, d), dtype=np.float32)
    start = time.perf_counter()
    db: Any = ResidentDatabase(xb, run.device)
    run.sync()
    res = {"n": n, "d": d, "nq": nq, "k": k, "upload_s": round(time.perf_counter() - start, 2)}
    res["resident_ms"], (_, I) = timed_ms(run, lambda: db.search(xq, k))
    res["resident_ms_per_query"] = round(res["resident_ms"] / nq, 4)
    db = None  # frees its device memory before the streamed run
    if run.device == "cuda":
        torch.cuda.empty_cache()
    run.emit("exact_resident", **res)
    streamed_ms, (_, I2) = timed_ms(run, lambda: exact_search(xq, chunks_of(xb), k, device=run.device), 1)
    agree = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(I[:50], I2[:50])]))
    run.emit("exact_streamed", n=n, d=d, nq=nq, k=k, streamed_ms=streamed_ms, top_k_overlap_with_resident=agree)


# --- the run ---------------------------------------------------------------------------------------


def figure(run: Run, name: str, fn: Any, *args: Any) -> Any:
    """Run one figure; a failure is printed as a line of its own and the run goes on."""
    if run.left() < 5:
        run.emit(name, skipped=f"budget: {run.left():.0f} s left")
        return None
    try:
        return fn(run, *args)
    except Exception as exc:
        run.failures.append(name)
        run.emit(name, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-2000:])
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: every code path, in seconds")
    parser.add_argument(
        "--only",
        default=",".join(STAGES),
        help=f"comma-separated of {','.join(STAGES)}, run in that order; ingest:MODEL for one model",
    )
    parser.add_argument("--models", default=",".join((LITE0, *VITS)), help="the ingest figures' models")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all figures; the last are skipped")
    parser.add_argument("--images", type=Path, help="a folder of JPEGs (default: realbench)")
    parser.add_argument("--jsonl", type=Path, help="also append each line to this file")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    stages = args.only.split(",")
    unknown = sorted({s.split(":")[0] for s in stages} - set(STAGES))
    if unknown:
        parser.error(f"--only: unknown {unknown}; choose from {STAGES}")
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    images = args.images or Path(os.environ.get("NEEDLE_REALBENCH") or ROOT.parent / "shared" / "data" / "realbench")
    run = Run(args.dry_run, device, usable_cpus(), images, time.time() + args.budget, args.jsonl)
    gpu_name = torch.cuda.get_device_name() if device == "cuda" else None
    run.emit("env", gpu=gpu_name, torch=torch.__version__, cpus=run.cpus, budget_s=args.budget)
    if device == "cpu" and not args.dry_run:
        run.emit("env", warning="no CUDA device: CPU figures, not GPU ones")
    lite0 = None
    for stage in stages:  # in the order given: the first ones matter most when time is short
        if stage.startswith("ingest"):
            models = [stage.split(":", 1)[1]] if ":" in stage else args.models.split(",")
            for model in models:
                if args.dry_run and model != LITE0:
                    run.emit("ingest", model=model, skipped="dry run: ViTs on a CPU take minutes")
                    continue
                res = figure(run, "ingest", stage_ingest, model)
                lite0 = res["model_img_s"] if res and model == LITE0 else lite0
        elif stage == "shape_plan":
            figure(run, "shape_plan_exact_baseline", stage_shape_plan)
        elif stage == "aliked":
            figure(run, "aliked", stage_aliked, lite0)
        else:
            figure(run, stage, {"ames": stage_ames, "spatial": stage_spatial, "exact": stage_exact}[stage])
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
