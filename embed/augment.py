"""``needle adapt make-classes``: training classes made from unlabelled images by augmentation.

Each decodable image becomes one class of ``views`` images: the first view is the whole image, only
resized (``keep_original``), the others are random augmentations of it (rotation by a few degrees
cropped to the largest upright rectangle inside, so no border shows; random resized crop; horizontal
flip; brightness, contrast and saturation jitter; sometimes grayscale; a random JPEG quality). The
views are the "matching pairs" a supervised adaptation (``needle adapt train``, learned whitening)
can be trained on without any human label, and without touching an evaluation's ground truth:
feed it distractor images, never the benchmark's query or positive images.

Written as WebDataset tars (``classes-000000.tar``, ...; members ``<key>.jpg`` and ``<key>.json``,
sample keys ``c<class:06d>_v<view:02d>``) that ``needle ingest`` reads as they are, plus
``labels.csv`` (``key,label``, keys as ingestion names them: ``<tar name without .tar>/<sample key>``)
and ``augment_info.json``. PIL only; deterministic for a seed: image ``i`` (in sorted file order)
draws from ``numpy.random.default_rng([seed, i])``, so a re-run writes identical bytes.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import tarfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageEnhance, ImageOps, UnidentifiedImageError
from tqdm import tqdm

from core.atomic import write_atomic, write_json_atomic
from core.errors import NeedleInputError
from embed import AugmentConfig
from ingest.images import RESAMPLE
from ingest.tar_writer import TarShardWriter

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")
TAR_PREFIX = "classes-"
QUALITY_KEY = "jpeg_quality"  # Image.info entry: the JPEG quality a view is to be written with


class AugmentError(NeedleInputError):
    """An image directory, image list or augmentation setting that cannot be used."""


def check_config(conf: AugmentConfig) -> None:
    """Raise AugmentError naming the first setting out of range."""
    problems = [
        (conf.views >= 1, f"views must be >= 1, got {conf.views}"),
        (conf.max_side >= 16, f"max_side must be >= 16, got {conf.max_side}"),
        (
            0 < conf.crop_scale[0] <= conf.crop_scale[1] <= 1,
            f"crop_scale must satisfy 0 < lo <= hi <= 1, got {conf.crop_scale}",
        ),
        (0 < conf.crop_ratio[0] <= conf.crop_ratio[1], f"crop_ratio must satisfy 0 < lo <= hi, got {conf.crop_ratio}"),
        (0 <= conf.max_rotation < 45, f"max_rotation must be in [0, 45) degrees, got {conf.max_rotation}"),
        (
            1 <= conf.jpeg_quality[0] <= conf.jpeg_quality[1] <= 100,
            f"jpeg_quality must satisfy 1 <= lo <= hi <= 100, got {conf.jpeg_quality}",
        ),
        (conf.samples_per_tar >= 1, f"samples_per_tar must be >= 1, got {conf.samples_per_tar}"),
    ]
    problems += [
        (0 <= p <= 1, f"{name} must be a probability, got {p}")
        for name, p in (
            ("flip_prob", conf.flip_prob),
            ("rotation_prob", conf.rotation_prob),
            ("grayscale_prob", conf.grayscale_prob),
        )
    ]
    problems += [
        (0 <= f < 1, f"{name} must be in [0, 1), got {f}")
        for name, f in (("brightness", conf.brightness), ("contrast", conf.contrast), ("saturation", conf.saturation))
    ]
    for ok, message in problems:
        if not ok:
            raise AugmentError(message)


# --- one image's views ------------------------------------------------------------------------------


def resize_max(image: Image.Image, max_side: int) -> Image.Image:
    """The image with its longer side at most ``max_side`` (aspect kept; never upscaled)."""
    width, height = image.size
    if max(width, height) <= max_side:
        return image
    scale = max_side / max(width, height)
    return image.resize((max(1, round(width * scale)), max(1, round(height * scale))), RESAMPLE)


def _inscribed_size(width: int, height: int, angle: float) -> tuple[float, float]:
    """The largest upright rectangle inside a ``width`` x ``height`` one rotated by ``angle`` radians."""
    long_side, short_side = max(width, height), min(width, height)
    sin_a, cos_a = abs(math.sin(angle)), abs(math.cos(angle))
    if short_side <= 2 * sin_a * cos_a * long_side or abs(sin_a - cos_a) < 1e-10:
        half = 0.5 * short_side
        return (half / sin_a, half / cos_a) if width >= height else (half / cos_a, half / sin_a)
    cos_2a = cos_a * cos_a - sin_a * sin_a
    return (width * cos_a - height * sin_a) / cos_2a, (height * cos_a - width * sin_a) / cos_2a


def rotate_no_border(image: Image.Image, degrees: float) -> Image.Image:
    """Rotate by ``degrees`` (counter-clockwise) and crop the largest upright rectangle inside, so
    that no filled corner shows."""
    if degrees == 0:
        return image
    rotated = image.rotate(degrees, resample=Image.Resampling.BICUBIC, expand=True)
    w, h = _inscribed_size(*image.size, math.radians(degrees))
    w, h = max(1, int(w)), max(1, int(h))
    left, top = (rotated.width - w) // 2, (rotated.height - h) // 2
    return rotated.crop((left, top, left + w, top + h))


def random_resized_crop_box(
    width: int, height: int, rng: np.random.Generator, scale: tuple[float, float], ratio: tuple[float, float]
) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of a crop covering a share of the area drawn from ``scale`` with an
    aspect ratio drawn log-uniformly from ``ratio`` (torchvision's RandomResizedCrop: ten tries,
    then the central crop of the nearest allowed aspect)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    aspect = min(max(width / height, ratio[0]), ratio[1])
    w, h = (
        (width, min(height, round(width / aspect)))
        if width / height < aspect
        else (min(width, round(height * aspect)), height)
    )
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def _colour_jitter(image: Image.Image, rng: np.random.Generator, conf: AugmentConfig) -> Image.Image:
    for enhancer, strength in (
        (ImageEnhance.Brightness, conf.brightness),
        (ImageEnhance.Contrast, conf.contrast),
        (ImageEnhance.Color, conf.saturation),
    ):
        if strength > 0:
            image = enhancer(image).enhance(float(rng.uniform(1 - strength, 1 + strength)))
    return image


def augment_once(image: Image.Image, rng: np.random.Generator, conf: AugmentConfig) -> Image.Image:
    """One random view of an RGB image, its longer side at most ``conf.max_side``."""
    if conf.max_rotation > 0 and rng.random() < conf.rotation_prob:
        image = rotate_no_border(image, float(rng.uniform(-conf.max_rotation, conf.max_rotation)))
    image = image.crop(random_resized_crop_box(*image.size, rng, conf.crop_scale, conf.crop_ratio))
    if rng.random() < conf.flip_prob:
        image = ImageOps.mirror(image)
    image = _colour_jitter(resize_max(image, conf.max_side), rng, conf)
    if rng.random() < conf.grayscale_prob:
        image = image.convert("L").convert("RGB")
    image.info[QUALITY_KEY] = int(rng.integers(conf.jpeg_quality[0], conf.jpeg_quality[1] + 1))
    return image


def augmented_views(
    image: Image.Image,
    n: int,
    rng: np.random.Generator,
    conf: AugmentConfig = AugmentConfig(),  # noqa: B008 (a frozen dataclass)
) -> list[Image.Image]:
    """``n`` views of one image (RGB, longer side at most ``conf.max_side``). With
    ``conf.keep_original`` the first is the whole image, only resized; the others are
    :func:`augment_once` draws from ``rng``. Each view's ``info["jpeg_quality"]`` is the quality to
    write it with (the top of ``conf.jpeg_quality`` for the original)."""
    image = image.convert("RGB")
    views = []
    for v in range(n):
        if v == 0 and conf.keep_original:
            view = resize_max(image, conf.max_side).copy()
            view.info[QUALITY_KEY] = conf.jpeg_quality[1]
        else:
            view = augment_once(image, rng, conf)
        views.append(view)
    return views


# --- inputs and outputs ---------------------------------------------------------------------------


def list_images(images: Path | str | Sequence[Path | str]) -> list[Path]:
    """A directory's image files (by suffix, not recursive, sorted by name), or a list of paths as given."""
    if isinstance(images, (str, Path)):
        folder = Path(images)
        if not folder.is_dir():
            raise AugmentError(f"image directory {folder} does not exist")
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise AugmentError(f"no image files ({', '.join(IMAGE_SUFFIXES)}) in {folder}")
        return files
    files = [Path(p) for p in images]
    if not files:
        raise AugmentError("the list of images is empty")
    return files


def load_image(path: Path, longer_side: int) -> Image.Image:
    """An image file as RGB, downscaled (never upscaled) to ``longer_side``; JPEGs use draft mode.
    Raises OSError, ValueError or SyntaxError (PIL's errors) for an undecodable file."""
    with Image.open(path) as img:
        if img.format == "JPEG":
            img.draft("RGB", (longer_side, longer_side))
        return resize_max(img.convert("RGB"), longer_side)


def _jpeg(view: Image.Image) -> bytes:
    buffer = io.BytesIO()
    view.save(buffer, format="JPEG", quality=int(view.info.get(QUALITY_KEY, 95)))
    return buffer.getvalue()


def _remove_stale(out_dir: Path, written: list[Path]) -> None:
    """Tars of an earlier, larger run in the same directory would add samples labels.csv lacks."""
    for stale in sorted(set(out_dir.glob(f"{TAR_PREFIX}*.tar")) - set(written)):
        log.warning("removing %s, left by an earlier run", stale)
        stale.unlink()


def _write_labels(rows: list[tuple[str, str]], path: Path) -> Path:
    def write(tmp: Path) -> None:
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(["key", "label"])
            writer.writerows(rows)

    return write_atomic(path, write)


def _work_side(conf: AugmentConfig) -> int:
    """Decoding size: large enough that the smallest crop still reaches ``max_side``."""
    return math.ceil(conf.max_side / math.sqrt(conf.crop_scale[0]))


def main(conf: AugmentConfig, images: Path | str | Sequence[Path | str], output: Path) -> Path:
    """Write the classes of ``images`` (a directory or a list of files) into ``output``; returns
    the path of ``labels.csv``. Undecodable images are skipped (logged and counted)."""
    check_config(conf)
    start = time.perf_counter()
    files = list_images(images)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    shards = TarShardWriter(output, conf.samples_per_tar, prefix=TAR_PREFIX, tar_format=tarfile.PAX_FORMAT)
    rows: list[tuple[str, str]] = []
    skipped: list[str] = []
    try:
        for index, path in enumerate(tqdm(files, desc="make-classes", unit="image")):
            try:
                image = load_image(path, _work_side(conf))
            except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
                log.warning("skipping %s: cannot decode it (%s: %s)", path, type(exc).__name__, exc)
                skipped.append(path.name)
                continue
            label = f"c{len(rows) // conf.views:06d}"
            for view_index, view in enumerate(
                augmented_views(image, conf.views, np.random.default_rng([conf.seed, index]), conf)
            ):
                meta = {
                    "class": int(label[1:]),
                    "view": view_index,
                    "source": path.name,
                    "width": view.width,
                    "height": view.height,
                }
                key = shards.add(
                    f"{label}_v{view_index:02d}",
                    [("jpg", _jpeg(view)), ("json", json.dumps(meta, sort_keys=True).encode())],
                )
                rows.append((key, label))
        shards.close()
    except BaseException:
        shards.abort()
        raise
    _remove_stale(output, shards.written)
    labels = _write_labels(rows, output / "labels.csv")
    _write_info(conf, images, files, rows, skipped, shards.written, output, time.perf_counter() - start)
    return labels


def _write_info(
    conf: AugmentConfig,
    images: Any,
    files: list[Path],
    rows: list,
    skipped: list[str],
    tars: list[Path],
    output: Path,
    seconds: float,
) -> None:
    classes = len(rows) // conf.views
    source = str(images) if isinstance(images, (str, Path)) else f"{len(files)} files"
    write_json_atomic(
        {
            "config": asdict(conf),
            "source": source,
            "images": len(files),
            "classes": classes,
            "samples": len(rows),
            "skipped": len(skipped),
            "skipped_files": skipped[:100],
            "tars": [t.name for t in tars],
            "seconds": round(seconds, 3),
        },
        output / "augment_info.json",
    )
    log.info(
        "make-classes: %d classes of %d views (%d images skipped) in %d tars at %s",
        classes,
        conf.views,
        len(skipped),
        len(tars),
        output,
    )
