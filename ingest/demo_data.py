"""The built-in demo collection: real photos shipped with scikit-image turned into instances.

Each instance photo yields several views made with kornia (random resized crop, rotation,
perspective, colour and brightness change, blur); held-out photos yield distractor views. The views
are written as JPEGs in WebDataset tars (``{000000..}.tar``, members ``<key>.jpg`` and
``<key>.json``, the img2dataset layout), with the ground truth beside them.
"""

from __future__ import annotations

import io
import json
import logging
import random
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from core.atomic import atomic_path, write_json_atomic
from ingest.config import DemoConfig

log = logging.getLogger(__name__)


def load_skimage_photo(name: str) -> np.ndarray:
    """A scikit-image sample as RGB uint8 (grey is replicated, alpha dropped)."""
    import skimage.data

    image = getattr(skimage.data, name)()
    if isinstance(image, tuple):  # stereo pairs: the left view
        image = image[0]
    image = np.asarray(image)
    if image.dtype != np.uint8:
        image = (np.clip(image.astype(np.float64), 0, 1) * 255).astype(np.uint8)
    if image.ndim == 2:
        image = np.repeat(image[..., None], 3, axis=2)
    return np.ascontiguousarray(image[..., :3])


def make_views(photo: np.ndarray, count: int, rng: random.Random, longer_range: tuple[int, int]) -> list[np.ndarray]:
    """``count`` augmented views of one photo, each RGB uint8 with its own size and aspect."""
    import kornia.augmentation as K
    import torch

    views = []
    source = torch.from_numpy(photo).permute(2, 0, 1)[None].float() / 255.0
    h, w = photo.shape[:2]
    with torch.random.fork_rng():
        torch.manual_seed(rng.randrange(2**31))
        for _ in range(count):
            longer = rng.randint(*longer_range)
            aspect = rng.uniform(0.7, 1.4) * w / h
            size = (round(longer / aspect), longer) if aspect >= 1 else (longer, round(longer * aspect))
            augment = K.AugmentationSequential(
                K.RandomResizedCrop(size, scale=(0.35, 1.0), ratio=(0.75, 1.33), p=1.0),
                K.RandomRotation(degrees=25.0, p=0.7),
                K.RandomPerspective(distortion_scale=0.3, p=0.6),
                K.ColorJitter(brightness=0.35, contrast=0.3, saturation=0.3, hue=0.04, p=0.9),
                K.RandomGaussianBlur((7, 7), (0.1, 2.0), p=0.4),
            )
            view = augment(source)[0].clamp(0, 1).mul(255).round().byte().permute(1, 2, 0).numpy()
            views.append(np.ascontiguousarray(view))
    return views


def _jpeg(image: np.ndarray, quality: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def build_demo(out_dir: Path, conf: DemoConfig = DemoConfig()) -> dict[str, Any]:  # noqa: B008 (a frozen dataclass)
    """Write the demo tars and ``ground_truth.json`` into ``out_dir``; return the ground truth.

    Ground truth: ``queries`` (key, instance, positives) for every instance view; positives are
    the other views of the same photo; ``database`` lists every key.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(conf.seed)
    items: list[tuple[str, bool, np.ndarray]] = []  # (photo, is_instance, view)
    for name in conf.instances + conf.distractors:
        is_instance = name in conf.instances
        count = conf.views_per_instance if is_instance else conf.views_per_distractor
        photo = load_skimage_photo(name)
        items += [(name, is_instance, view) for view in make_views(photo, count, rng, conf.longer_side)]
    rng.shuffle(items)

    per_shard = -(-len(items) // conf.num_shards)
    keys_of: dict[str, list[str]] = {}
    database = []
    for shard in range(conf.num_shards):
        shard_items = items[shard * per_shard : (shard + 1) * per_shard]
        tar_path = out_dir / f"{shard:06d}.tar"
        with atomic_path(tar_path) as tmp, tarfile.open(tmp, "w") as tar:
            for i, (name, is_instance, view) in enumerate(shard_items):
                key = f"{shard:06d}{i:04d}"
                meta = {
                    "photo": name,
                    "role": "instance" if is_instance else "distractor",
                    "width": int(view.shape[1]),
                    "height": int(view.shape[0]),
                }
                _add_member(tar, f"{key}.jpg", _jpeg(view, conf.jpeg_quality))
                _add_member(tar, f"{key}.json", json.dumps(meta).encode())
                full_key = f"{shard:06d}/{key}"
                database.append(full_key)
                if is_instance:
                    keys_of.setdefault(name, []).append(full_key)

    queries = [
        {"key": key, "instance": name, "positives": [k for k in keys if k != key]}
        for name, keys in sorted(keys_of.items())
        for key in keys
    ]
    truth = {"queries": queries, "database": sorted(database), "num_shards": conf.num_shards}
    write_json_atomic(truth, out_dir / "ground_truth.json")
    log.info("demo: %d images (%d queries) in %d shards at %s", len(database), len(queries), conf.num_shards, out_dir)
    return truth
