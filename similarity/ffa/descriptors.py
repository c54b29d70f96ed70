"""FFA descriptors: each image's foreground tokens pooled (``crop-feat``), or the tokens of a second
pass over its foreground box (``crop-img``), L2-normalised. Numpy only; the token maps come from
any extractor (similarity/ffa/tokens.py for the frozen CNN)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from similarity.ffa.config import POOLINGS, FFAConfig, FFAError
from similarity.ffa.masks import MaskFn, get_mask_fn


def pool_tokens(
    tokens: np.ndarray, mask: np.ndarray | None, pooling: str = "avg", p: float = 3.0, eps: float = 1e-6
) -> np.ndarray:
    """(d,) float32 L2-normalised pool of the masked tokens of (h, w, d): their mean, or GeM
    ((mean of clamp(x, eps)^p)^(1/p), as embed.pooling.gem)."""
    h, w, d = tokens.shape
    x = tokens.reshape(h * w, d).astype(np.float64)
    if mask is not None:
        x = x[np.asarray(mask, dtype=bool).reshape(h * w)]
    if len(x) == 0:
        raise FFAError("cannot pool an empty set of tokens")
    if pooling == "gem":
        pooled = np.power(np.power(np.maximum(x, eps), p).mean(axis=0), 1.0 / p)
    elif pooling == "avg":
        pooled = x.mean(axis=0)
    else:
        raise FFAError(f"unknown pooling {pooling!r}; choose from {POOLINGS}")
    return (pooled / max(float(np.linalg.norm(pooled)), 1e-12)).astype(np.float32)


def foreground_box(mask: np.ndarray, image_shape: tuple[int, ...], margin: int = 0) -> tuple[int, int, int, int]:
    """Pixel box (top, bottom, left, right; bottom/right exclusive) of the foreground cells of an
    (h, w) mask, grown by ``margin`` cells, on an image of ``image_shape`` (H, W, ...). Cell (i, j)
    covers rows [i H / h, (i + 1) H / h) and columns alike."""
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    if len(rows) == 0:
        raise FFAError("an empty mask has no box")
    h, w = mask.shape
    big_h, big_w = image_shape[:2]
    r0, r1 = max(0, rows[0] - margin), min(h, rows[-1] + 1 + margin)
    c0, c1 = max(0, cols[0] - margin), min(w, cols[-1] + 1 + margin)
    return (
        math.floor(r0 * big_h / h),
        math.ceil(r1 * big_h / h),
        math.floor(c0 * big_w / w),
        math.ceil(c1 * big_w / w),
    )


def crop_resized(image: np.ndarray, box: tuple[int, int, int, int], longer_side: int) -> np.ndarray:
    """The box of ``image``, resized isotropically so its longer side is ``longer_side``."""
    from PIL import Image

    from ingest.images import RESAMPLE, resized_size

    top, bottom, left, right = box
    crop = Image.fromarray(np.ascontiguousarray(image[top:bottom, left:right]))
    return np.asarray(crop.resize(resized_size(crop.width, crop.height, longer_side), RESAMPLE))


def ffa_descriptors(
    conf: FFAConfig,
    images: Sequence[np.ndarray],
    extract: Callable[[Sequence[np.ndarray]], list[np.ndarray]],
    maps: Sequence[np.ndarray] | None = None,
    mask_fn: MaskFn | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """(n, d) L2-normalised FFA descriptors of ``images`` and mask statistics.

    ``extract`` turns images into token maps (a :class:`TokenMaps`); ``maps`` are the whole
    images' maps when already computed (every mode starts from them); ``mask_fn`` overrides the
    configured mask (a segmentation model, say).
    """
    mask_fn = mask_fn or get_mask_fn(conf)
    maps = list(maps) if maps is not None else extract(images)
    if len(maps) != len(images):
        raise FFAError(f"{len(maps)} token maps for {len(images)} images")
    masks, fallbacks = [], 0
    for i, (tokens, image) in enumerate(zip(maps, images)):
        mask = np.asarray(mask_fn(tokens, image), dtype=bool)
        if mask.shape != tokens.shape[:2]:
            raise FFAError(
                f"mask {mask_fn.name!r} gave shape {mask.shape} for image {i}'s token grid {tokens.shape[:2]}"
            )
        if mask.sum() < conf.min_tokens:
            mask, fallbacks = np.ones_like(mask), fallbacks + 1
        masks.append(mask)
    stats: dict[str, Any] = {
        "mask": mask_fn.name,
        "foreground_fraction": float(np.mean([m.mean() for m in masks])) if masks else None,
        "fallbacks": fallbacks,
    }
    if conf.mode == "crop-feat":
        desc = [pool_tokens(t, m, conf.pooling, conf.gem_p) for t, m in zip(maps, masks)]
    else:
        boxes = [foreground_box(m, img.shape, conf.crop_margin) for m, img in zip(masks, images)]
        whole = [b == (0, img.shape[0], 0, img.shape[1]) for b, img in zip(boxes, images)]
        todo = [i for i, full in enumerate(whole) if not full]
        # A box covering the whole image is the image itself: its map is already there.
        crops = extract([crop_resized(images[i], boxes[i], conf.resolution) for i in todo]) if todo else []
        crop_maps = dict(zip(todo, crops))
        desc = [pool_tokens(crop_maps.get(i, maps[i]), None, conf.pooling, conf.gem_p) for i in range(len(images))]
        stats["crop_area_fraction"] = (
            float(
                np.mean(
                    [(b[1] - b[0]) * (b[3] - b[2]) / (img.shape[0] * img.shape[1]) for b, img in zip(boxes, images)]
                )
            )
            if images
            else None
        )
        stats["cropped_images"] = len(todo)
    return (np.stack(desc) if desc else np.zeros((0, maps[0].shape[-1] if maps else 0), np.float32)), stats
