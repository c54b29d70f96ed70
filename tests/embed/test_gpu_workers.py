"""GPU workers: batching by model input shape, worker layout, batched decoding, and (marked
``gpu``, skipped without CUDA) the CUDA extractor and nvjpeg decoder against CPU references."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from cluster.ingest_job import _worker_layout, cpus_per_gpu
from core.errors import ImageDecodeError, NeedleInputError
from embed.extract import GlobalExtractor
from embed.registry import RANDOM
from embed.shape_plan import plan_batches
from ingest.config import IngestConfig
from ingest.images import decode_resized_many
from ingest.pipeline import process_shard
from tests.support.tars import jpeg_bytes, write_tar


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
REALBENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "realbench"


def _mixed_images(rng: np.random.Generator, longer: int = 96, n: int = 12) -> list[np.ndarray]:
    """Random photos-like arrays with the longer side ``longer`` and assorted aspect ratios,
    several sharing a ViT input shape (shorter sides that round up to the same patch multiple)."""
    shorter = [48, 50, 56, 64, 64, 70, 72, 96, 90, 61, 63, 64][:n]
    out = []
    for i, s in enumerate(shorter):
        shape = (s, longer) if i % 2 else (longer, s)
        out.append(rng.integers(0, 256, size=(*shape, 3), dtype=np.uint8))
    return out


# -- batching ------------------------------------------------------------------------------------


def test_vit_batches_of_mixed_shapes_equal_per_image_descriptors():
    """Images of different sizes padding to one patch grid share a batch: same descriptors as alone."""
    import torch

    torch.manual_seed(0)
    extractor = GlobalExtractor(
        "timm:vit_small_patch16_224@cls", RANDOM, resolution=96, batch_size=8, precision="fp32", shape_grid=0
    )
    images = _mixed_images(np.random.default_rng(0))
    plan = plan_batches([im.shape[:2] for im in images], 8, extractor.net.input_shape)
    assert len(plan) < len({im.shape for im in images})  # the point: fewer, fuller batches
    batched = extractor(images)["global"].astype(np.float32)
    alone = np.stack([extractor.forward_uint8(im[None])[0] for im in images])
    # Equal up to float32 summation order, then the float16 storage rounding.
    assert np.abs(batched - alone.astype(np.float16).astype(np.float32)).max() <= 1e-4


def test_cnn_batches_only_equal_shapes():
    extractor = GlobalExtractor(resolution=160, batch_size=8, shape_grid=0)  # exact shapes
    images = _mixed_images(np.random.default_rng(1))
    plan = plan_batches([im.shape[:2] for im in images], 8, extractor.net.input_shape)
    assert all(len({images[i].shape for i in idx}) == 1 for idx, _, _ in plan)
    batched = extractor(images)["global"].astype(np.float32)
    alone = np.stack([extractor.forward_uint8(im[None])[0] for im in images])
    np.testing.assert_allclose(batched, alone, atol=2e-3)


# -- worker layout -------------------------------------------------------------------------------


def test_gpu_worker_reserves_its_nodes_cpu_share():
    nodes = [
        {"Alive": True, "Resources": {"CPU": 32.0, "GPU": 4.0}},
        {"Alive": True, "Resources": {"CPU": 16.0, "GPU": 1.0}},
        {"Alive": True, "Resources": {"CPU": 64.0}},  # CPU-only node: not where GPU actors go
        {"Alive": False, "Resources": {"CPU": 2.0, "GPU": 2.0}},
    ]
    assert cpus_per_gpu(nodes) == 8
    assert cpus_per_gpu([{"Alive": True, "Resources": {"CPU": 8.0}}]) == 1
    count, options, device, threads = _worker_layout(IngestConfig(), {"CPU": 112.0, "GPU": 5.0}, 100, 8)
    assert (count, options, device, threads) == (5, {"num_gpus": 1, "num_cpus": 8}, "cuda", 8)
    count, options, _, threads = _worker_layout(IngestConfig(cpus_per_gpu_worker=3), {"CPU": 112.0, "GPU": 5.0}, 2, 8)
    assert (count, options, threads) == (2, {"num_gpus": 1, "num_cpus": 3}, 3)
    count, options, device, threads = _worker_layout(IngestConfig(), {"CPU": 8.0}, 100)
    assert (count, options, device, threads) == (4, {"num_cpus": 2}, "cpu", 2)


def test_unknown_decoder_is_refused():
    with pytest.raises(NeedleInputError, match="decoder"):
        IngestConfig(decoder="turbo")


# -- batched decoding through the pipeline ---------------------------------------------------------


class PilBatchDecoder:
    """The batched-decoder interface over PIL: the pipeline's plumbing, testable without a GPU."""

    batch = 64  # samples per call, as nvjpeg's
    concurrency = 1  # one call at a time, as nvjpeg's

    def __init__(self):
        self.calls = 0

    def __call__(self, items, longer_sides):
        self.calls += 1
        out = []
        for key, data in items:
            try:
                out.append(decode_resized_many(data, longer_sides, key))
            except ImageDecodeError as exc:
                out.append(exc)
        return out


def _shard_with_errors(tmp_path, photos, n: int = 70):
    names = list(photos)
    members = []
    for i in range(n):
        if i == 5:
            members.append((f"{i:04d}.jpg", b"not a jpeg"))
        elif i == 9:
            members.append((f"{i:04d}.json", b"{}"))  # no image member
        else:
            members.append((f"{i:04d}.jpg", jpeg_bytes(photos[names[i % len(names)]][:, : 200 + i])))
    return write_tar(tmp_path / "000000.tar", members)


def test_batch_decoder_path_writes_what_the_thread_path_writes(tmp_path, photos, extractor):
    shard = _shard_with_errors(tmp_path, photos)
    plain = process_shard(str(shard), 0, tmp_path / "plain", [extractor], decode_threads=2)
    decoder = PilBatchDecoder()
    batched = process_shard(str(shard), 0, tmp_path / "batched", [extractor], decode_threads=2, batch_decoder=decoder)
    assert decoder.calls == 2  # 69 image samples in batches of 64
    a, b = pq.read_table(plain.output).to_pydict(), pq.read_table(batched.output).to_pydict()
    errors_a, errors_b = a.pop("error"), b.pop("error")
    assert a == b
    assert [e.split(" <")[0] for e in errors_a] == [e.split(" <")[0] for e in errors_b]  # PIL names an object address
    assert batched.error_rows == 2 and batched.rows == 70


def test_taking_turns_writes_what_overlapping_writes(tmp_path, photos, extractor):
    """The CPU worker's default (decode a chunk on all threads, then the model) and the GPU
    worker's (decode ahead while the model runs) give the same rows, errors included, across a
    chunk boundary and a short last chunk."""
    shard = _shard_with_errors(tmp_path, photos)
    overlapped = process_shard(str(shard), 0, tmp_path / "overlap", [extractor], decode_threads=2, chunk_size=32)
    turns = process_shard(
        str(shard), 0, tmp_path / "turns", [extractor], decode_threads=2, chunk_size=32, overlap=False
    )
    a, b = pq.read_table(overlapped.output).to_pydict(), pq.read_table(turns.output).to_pydict()
    errors_a, errors_b = a.pop("error"), b.pop("error")
    assert a == b and a["key"] == [f"000000/{i:04d}" for i in range(70)]
    assert [e.split(" <")[0] for e in errors_a] == [e.split(" <")[0] for e in errors_b]
    assert turns.error_rows == 2 and turns.rows == 70


def test_cpu_workers_take_turns_on_all_their_cpus():
    import torch

    from cluster.ingest_job import IngestWorker

    threads = torch.get_num_threads()  # a worker sets its process's torch threads
    try:
        worker = IngestWorker(IngestConfig(model="tf_efficientnet_lite0.gem"), "cpu", 2)
        assert worker.decode_threads == 2 and worker.overlap is False and worker.chunk_size == 64
        assert (
            IngestWorker(IngestConfig(model="tf_efficientnet_lite0.gem", decode_threads=1), "cpu", 2).decode_threads
            == 1
        )
    finally:
        torch.set_num_threads(threads)


def _pil_decode_jpeg(tensors, mode=None, device="cpu"):
    """torchvision's decode_jpeg signature over PIL (CHW uint8): the GPU decoder's logic on CPU."""
    import io

    import torch
    from PIL import Image

    def one(t):
        with Image.open(io.BytesIO(t.numpy().tobytes())) as img:
            return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1).contiguous()

    if isinstance(tensors, list):
        return [one(t) for t in tensors]  # a bad one fails the batch, as nvjpeg does
    return one(tensors)


def test_gpu_decoder_logic_on_cpu(photos):
    """Resizes, the PNG and corrupt-JPEG fallbacks, and the one-by-one retry of a failed batch."""
    import io

    from PIL import Image

    from ingest.gpu_decode import GpuJpegDecoder

    calls = []

    def decode(tensors, mode=None, device="cpu"):
        calls.append(len(tensors) if isinstance(tensors, list) else 1)
        try:
            return _pil_decode_jpeg(tensors, mode, device)
        except OSError as exc:
            raise RuntimeError(str(exc)) from exc

    jpegs = [jpeg_bytes(photo) for photo in photos.values()]
    png = io.BytesIO()
    Image.fromarray(np.full((40, 60, 3), 128, np.uint8)).save(png, format="PNG")
    items = [(f"k{i}", d) for i, d in enumerate(jpegs)] + [
        ("png", png.getvalue()),
        ("bad", b"\xff\xd8\xffjunk"),
        ("empty", b""),
    ]
    out = GpuJpegDecoder("cpu", decode_jpeg=decode)(items, (96, 160))
    assert calls == [7] + [1] * 7  # the batch failed on "bad": each JPEG again, alone
    for (key, data), (images, w, h) in zip(items[:6], out[:6]):
        reference, width, height = decode_resized_many(data, (96, 160), key)
        assert (w, h) == (width, height)
        for side in (96, 160):
            assert images[side].shape == reference[side].shape and images[side].dtype == np.uint8
            # torch's antialiased bicubic of the full decode vs PIL's draft decode + bicubic
            assert np.abs(images[side].astype(int) - reference[side].astype(int)).mean() < 6.0
    assert out[6][0][96].shape == (64, 96, 3)  # the PNG, through PIL
    assert isinstance(out[7], ImageDecodeError) and out[7].key == "bad"
    assert isinstance(out[8], ImageDecodeError) and "empty" in out[8].reason


# -- on a GPU --------------------------------------------------------------------------------------


def _realbench_jpegs(n: int) -> list[bytes]:
    files = sorted((REALBENCH / "images").glob("*.jpg"))[:n]
    if not files:
        pytest.skip(f"no realbench images under {REALBENCH}")
    return [f.read_bytes() for f in files]


@gpu
@needs_cuda
@pytest.mark.parametrize("model", ["timm:tf_efficientnet_lite0@gem", "timm:vit_small_patch16_224@cls"])
def test_cuda_extractor_matches_cpu(model):
    import torch

    from ingest.images import decode_resized

    torch.manual_seed(0)
    cpu = GlobalExtractor(model, RANDOM, resolution=224, precision="fp32")
    cuda = GlobalExtractor(model, RANDOM, resolution=224, device="cuda")  # fp16 autocast, channels-last CNNs
    cuda.net.load_state_dict(cpu.net.state_dict())  # same weights for the random-init ViT
    images = [decode_resized(d, 224)[0] for d in _realbench_jpegs(24)]
    a = cpu(images)["global"].astype(np.float32)
    b = cuda(images)["global"].astype(np.float32)
    assert cuda.precision == "fp16"
    assert np.min(np.sum(a * b, axis=1)) > 0.995


@gpu
@needs_cuda
def test_nvjpeg_decoder_matches_pil_and_falls_back():
    from PIL import Image

    from ingest.gpu_decode import GpuJpegDecoder

    jpegs = _realbench_jpegs(16)
    buffer = __import__("io").BytesIO()
    Image.fromarray(np.full((40, 60, 3), 128, np.uint8)).save(buffer, format="PNG")
    items = [(f"k{i}", d) for i, d in enumerate(jpegs)] + [("png", buffer.getvalue()), ("bad", b"\xff\xd8\xffjunk")]
    out = GpuJpegDecoder("cuda")(items, (224, 384))
    for (key, data), result in zip(items[:16], out[:16]):
        reference, width, height = decode_resized_many(data, (224, 384), key)
        images, w, h = result
        assert (w, h) == (width, height)
        for side in (224, 384):
            assert images[side].shape == reference[side].shape and images[side].dtype == np.uint8
            # torch's antialiased bicubic vs PIL's: a few grey levels apart on average
            assert np.abs(images[side].astype(int) - reference[side].astype(int)).mean() < 4.0
    assert out[16][0][224].shape == (149, 224, 3)  # the PNG, through PIL
    assert isinstance(out[17], ImageDecodeError) and "bad" in str(out[17])


@gpu
@needs_cuda
@pytest.mark.ray
def test_ingest_job_on_a_gpu(tmp_path):
    import json
    import os

    import ray

    from cluster.ingest_job import main as ingest

    jpegs = _realbench_jpegs(40)
    shards = [
        str(
            write_tar(
                tmp_path / f"{s:06d}.tar", [(f"{s}{i:03d}.jpg", d) for i, d in enumerate(jpegs[20 * s : 20 * s + 20])]
            )
        )
        for s in range(2)
    ]
    ray.init(address="local", num_cpus=os.cpu_count(), num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        outputs = {}
        for decoder in ("pil", "nvjpeg"):
            out = tmp_path / decoder
            conf = IngestConfig(model="timm:tf_efficientnet_lite0@gem", resolution=224, batch_size=8, decoder=decoder)
            ingest(conf, shards, out)
            info = json.loads((out / "ingest_info.json").read_text())
            assert info["images"] == 40 and info["shards_ok"] == 2 and info["error_rows"] == 0
            assert info["extractors"][0]["precision"] == "fp16"
            outputs[decoder] = np.concatenate(
                [
                    np.stack(pq.read_table(out / f"{s:06d}.parquet")["global"].to_numpy(zero_copy_only=False))
                    for s in range(2)
                ]
            ).astype(np.float32)
    finally:
        ray.shutdown()
    # Two decoders, two resizes (PIL's bicubic after a draft decode, torch's antialiased bicubic):
    # near, not equal. Random-init weights, so this bounds the pixels' effect only loosely.
    assert np.min(np.sum(outputs["pil"] * outputs["nvjpeg"], axis=1)) > 0.95
