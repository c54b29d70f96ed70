"""Extractors: callables that turn a list of decoded images into named descriptor columns.

An ingestion worker decodes each image once and hands the batch to a list of extractors; each adds
its own columns (the global descriptor now; local descriptors later), so several descriptor kinds
share one decode pass.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from core.errors import NeedleInputError
from core.hashing import file_sha256
from core.multiscale import check_scales_rotations
from embed.models import build_global_model
from embed.registry import DEFAULT_MODEL, PRETRAINED, RANDOM, describe, get_model_config
from embed.shape_plan import fixed_batch_sizes, model_shape_grid, plan_batches, snap, warm_shapes
from ingest.config import PRECISIONS

log = logging.getLogger(__name__)

MIN_SCALED_SIDE = 16  # a down-scaled variant keeps at least this many pixels per side (CNN strides)


def batches_by_shape(images: list[np.ndarray], batch_size: int) -> list[list[int]]:
    """Indices of ``images`` grouped into batches of identical (H, W), at most ``batch_size`` each.

    Images keep their aspect ratio (no crop, no padding, the ILIAS convention), so only images of
    the same size can share a forward pass.
    """
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, image in enumerate(images):
        groups[image.shape].append(i)
    return [idx[s : s + batch_size] for idx in groups.values() for s in range(0, len(idx), batch_size)]


def parse_scales(text: str) -> tuple[float, ...]:
    """A comma-separated list of scales (``--multiscale 0.707,1,1.414``) as validated floats."""
    try:
        scales = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise NeedleInputError(f"scales must be comma-separated numbers like 0.707,1,1.414, got {text!r}") from None
    return check_scales_rotations(scales, 1)[0]


def scale_image(image: np.ndarray, scale: float) -> np.ndarray:
    """``image`` (H, W, 3) uint8 resized by ``scale`` (bicubic, as ingestion resizes), each side
    floor(side * scale) like torch's ``interpolate(scale_factor=...)`` in the ILIAS reference, and at
    least MIN_SCALED_SIDE pixels."""
    if scale == 1.0:
        return image
    from PIL import Image

    from ingest.images import RESAMPLE

    height, width = image.shape[:2]
    size = (max(MIN_SCALED_SIDE, int(width * scale)), max(MIN_SCALED_SIDE, int(height * scale)))
    return np.asarray(Image.fromarray(image).resize(size, RESAMPLE), dtype=np.uint8)


def query_variants(image: np.ndarray, scales: tuple[float, ...], rotations: int) -> list[np.ndarray]:
    """Every scale x rotation variant of ``image``, scale-major.

    Rotations are exact quarter turns (np.rot90 of the uint8 array) rather than the ILIAS
    reference's arbitrary-angle tensor rotation: for multiples of 90 degrees a quarter turn loses
    no pixel to cropping and adds no interpolation, and a 4-rotation descriptor of an image then
    equals that of the image turned by 90 degrees (the variants are the same set).
    """
    step = 4 // rotations  # quarter turns between two rotations: 4 -> 1 (90 deg), 2 -> 2 (180 deg)
    out = []
    for scale in scales:
        scaled = scale_image(image, scale)
        out += [np.ascontiguousarray(np.rot90(scaled, k=r * step)) for r in range(rotations)]
    return out


class GlobalExtractor:
    """Global descriptors of a registry model: column ``global``, (n, D) float16, L2-normalised.

    With ``scales`` other than (1.0,) or ``rotations`` > 1 (the ILIAS query-side options, meant for
    query images only, never the database) each image's descriptor is the L2-normalised mean of the
    L2-normalised descriptors of its scale x rotation variants (see :func:`query_variants`).
    """

    column = "global"

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        weights: str | Path | None = None,
        device: str = "cpu",
        precision: str = "auto",
        batch_size: int = 32,
        resolution: int | None = None,
        scales: tuple[float, ...] = (1.0,),
        rotations: int = 1,
        shape_grid: int | None = None,
        fixed_batches: bool | None = None,
    ):
        """``shape_grid``: snap each input side to a multiple of this many pixels (embed/shape_plan.py);
        0: exact shapes (what indexes made before the grid existed record); None: the model's default
        on ``device`` (``model_shape_grid``: a grid for CNNs on a GPU, else exact). ``fixed_batches``: cut batches
        into fixed sizes only, padding the last (None: on a GPU, where each new size costs set-up)."""
        if precision not in PRECISIONS:
            raise NeedleInputError(f"unknown precision {precision!r}; choose from {PRECISIONS}")
        if batch_size < 1:
            raise NeedleInputError(f"batch_size must be >= 1, got {batch_size}")
        self.model_name = model
        self.config = get_model_config(model)
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.resolution = resolution or self.config.resolution
        self.scales, self.rotations = check_scales_rotations(scales, rotations)
        self.shape_grid = model_shape_grid(model, shape_grid, torch.device(device).type)
        # The plain path stays exactly the pre-existing one (speed and bytes) unless asked otherwise.
        self.multi_variant = self.scales != (1.0,) or self.rotations != 1
        self.net, self.weights_path = build_global_model(model, weights)
        # The published weights (via timm/open_clip) or a seeded random initialisation: recorded by name.
        self.weights_name = str(weights) if weights is not None and str(weights) in (PRETRAINED, RANDOM) else None
        self.net.to(self.device)
        # cuDNN runs fp16 convolutions fastest on NHWC tensors; CPU kernels and ViTs gain nothing.
        self.channels_last = self.device.type == "cuda" and self.config.pooling == "gem"
        if self.channels_last:
            self.net.to(memory_format=torch.channels_last)
        self.precision = self._choose_precision(precision)
        on_gpu = self.device.type == "cuda"
        self.batch_sizes = fixed_batch_sizes(batch_size) if (on_gpu if fixed_batches is None else fixed_batches) else ()
        self._mean = torch.tensor(self.config.mean, device=self.device).view(1, 3, 1, 1)
        self._std = torch.tensor(self.config.std, device=self.device).view(1, 3, 1, 1)
        self.dim = self._probe_dim()
        if self.multi_variant:
            log.info(
                "global descriptors averaged over %d variants per image: scales %s x %d rotations",
                len(self.scales) * self.rotations,
                self.scales,
                self.rotations,
            )

    def _choose_precision(self, precision: str) -> str:
        if precision != "auto":
            return precision
        if self.device.type == "cuda":
            return "fp16"
        return "bf16" if self.config.bf16_on_cpu else "fp32"

    def _autocast(self):
        if self.precision == "fp32":
            return nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _probe_dim(self) -> int:
        probe = np.zeros((64, 64, 3), dtype=np.uint8)
        return int(self.forward_uint8(np.stack([probe])).shape[1])

    def forward_uint8(self, batch: np.ndarray) -> np.ndarray:
        """(B, H, W, 3) uint8 -> (B, D) float32 L2-normalised descriptors (at the snapped size
        under a shape grid, as in a batch)."""
        shape = snap(*batch.shape[1:3], self.shape_grid)
        return self._forward_batch(list(batch), shape).cpu().numpy()

    @torch.inference_mode()
    def _forward_batch(
        self, images: list[np.ndarray], shape: tuple[int, int], padded: int | None = None
    ) -> torch.Tensor:
        """Descriptors (rows, D) float32, left on the device, of ``images`` brought to ``shape``:
        resized to it under a shape grid, else zero-padded to it (in normalised space, as the model
        pads). ``padded``: rows of the batch (blank images after ``images``, whose rows the caller
        drops), one of the fixed sizes a GPU has warmed. Returning before the copy back lets the next
        batch be assembled on the host while the device computes."""
        height, width = shape
        rows = max(len(images), padded or 0)
        sizes = [im.shape[:2] for im in images]
        canvas = (max([height] + [h for h, _ in sizes]), max([width] + [w for _, w in sizes]))
        if rows == len(images) and all(size == canvas for size in sizes):
            batch = np.stack(images)
        else:
            batch = np.zeros((rows, *canvas, 3), dtype=np.uint8)
            for j, im in enumerate(images):
                batch[j, : im.shape[0], : im.shape[1]] = im
                if self.shape_grid:  # the resize reads past the last row and column: their copies
                    batch[j, : im.shape[0], im.shape[1] :] = im[:, -1:]
                    batch[j, im.shape[0] :] = batch[j, im.shape[0] - 1]
        x = torch.from_numpy(batch)
        if self.device.type == "cuda":
            x = x.pin_memory().to(self.device, non_blocking=True)
        x = x.permute(0, 3, 1, 2).float().div_(255.0)
        if self.shape_grid and any(size != shape for size in sizes):
            x = self._resample(x, sizes, shape)
        x = (x - self._mean) / self._std
        if not self.shape_grid and any(size != shape for size in sizes):
            # Padding is zero after normalisation, as the model pads (blank rows: anything).
            x = x * self._valid_mask(sizes + [shape] * (rows - len(images)), height, width)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with self._autocast():
            out = self.net(x)
        # Re-normalise in float32: autocast may leave the norm slightly off 1.
        return torch.nn.functional.normalize(out.float(), dim=-1)

    def _resample(self, x: torch.Tensor, sizes: list[tuple[int, int]], shape: tuple[int, int]) -> torch.Tensor:
        """Each image of ``x`` (rows, 3, canvas) in its top-left (h, w) resized to ``shape``, all in
        one bilinear ``grid_sample`` (pixel centres map to pixel centres; a snap moves a side by at
        most half a grid step, so no antialiasing is needed). Blank rows stay blank."""
        rows, canvas_h, canvas_w = x.shape[0], x.shape[2], x.shape[3]
        scale = torch.ones(rows, 2, dtype=x.dtype)
        for j, (h, w) in enumerate(sizes):
            scale[j, 0], scale[j, 1] = w / canvas_w, h / canvas_h
        theta = torch.zeros(rows, 2, 3, dtype=x.dtype)
        theta[:, 0, 0], theta[:, 1, 1] = scale[:, 0], scale[:, 1]
        theta[:, :, 2] = scale - 1  # the image's region starts at the canvas' top-left corner
        grid = torch.nn.functional.affine_grid(theta.to(x.device), [rows, 3, *shape], align_corners=False)
        return torch.nn.functional.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)

    @torch.inference_mode()
    def warm(self) -> dict[str, Any]:
        """Run each input shape the plan can build at each fixed batch size once, so that a GPU
        worker pays every kernel set-up at start, not in its first hours of web photos: the grid's
        shapes, or a ViT's patch multiples. Returns what it ran and how long it took (logged); a
        CNN's exact shapes are not a bounded set, and nothing is warmed."""
        start = time.perf_counter()
        shapes = warm_shapes(self.resolution, self.shape_grid, self.net.input_shape)
        if shapes is None:
            log.info("exact shapes of a CNN (shape grid 0): no bounded set of shapes to warm")
            return {"shapes": 0, "batches": 0, "seconds": 0.0}
        sizes = self.batch_sizes or (self.batch_size,)
        for shape in shapes:
            blank = np.zeros((*shape, 3), dtype=np.uint8)
            for size in sizes:
                self._forward_batch([blank], shape, size)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        log.info("warmed %d shapes x batch sizes %s in %.1f s", len(shapes), sizes, seconds)
        return {"shapes": len(shapes), "batches": len(shapes) * len(sizes), "seconds": round(seconds, 3)}

    def _valid_mask(self, sizes: list[tuple[int, int]], height: int, width: int) -> torch.Tensor:
        rows = torch.tensor([s[0] for s in sizes], device=self.device)
        cols = torch.tensor([s[1] for s in sizes], device=self.device)
        mask = (torch.arange(height, device=self.device)[None, :, None] < rows[:, None, None]) & (
            torch.arange(width, device=self.device)[None, None, :] < cols[:, None, None]
        )
        return mask[:, None].float()

    def extra_fields(self) -> list[pa.Field]:
        return []  # `global` is part of the base schema

    def __call__(self, images: list[np.ndarray]) -> dict[str, np.ndarray]:
        if self.multi_variant:
            return {self.column: self._describe_variants(images).astype(np.float16)}
        out = np.zeros((len(images), self.dim), dtype=np.float16)
        if not images:
            return {self.column: out}
        shapes = [im.shape[:2] for im in images]
        plan = plan_batches(shapes, self.batch_size, self.net.input_shape, self.shape_grid, self.batch_sizes)
        results = [
            self._forward_batch([images[i] for i in idx], shape, padded)[: len(idx)] for idx, shape, padded in plan
        ]
        order = np.concatenate([idx for idx, _, _ in plan])
        out[order] = torch.cat(results).cpu().numpy().astype(np.float16)  # one copy back per call
        return {self.column: out}

    def _describe_variants(self, images: list[np.ndarray]) -> np.ndarray:
        """(n, D) float32: per image the L2-normalised mean of its variants' (already L2-normalised)
        descriptors; variants of equal shape, across images, share forward passes."""
        variants, owner = [], []
        for i, image in enumerate(images):
            parts = query_variants(image, self.scales, self.rotations)
            variants += parts
            owner += [i] * len(parts)
        owner_arr = np.asarray(owner, dtype=np.int64)
        total = np.zeros((len(images), self.dim), dtype=np.float32)
        for idx in batches_by_shape(variants, self.batch_size):
            # Accumulate in float32; np.add.at since two variants of one image can share a batch.
            np.add.at(total, owner_arr[idx], self.forward_uint8(np.stack([variants[v] for v in idx])))
        norms = np.linalg.norm(total, axis=1, keepdims=True)
        return total / np.maximum(norms, 1e-12)

    def info(self) -> dict[str, Any]:
        return {
            "extractor": "global",
            "model": describe(self.model_name),
            "weights": self.weights_name or (str(self.weights_path) if self.weights_path else None),
            "weights_sha256": file_sha256(self.weights_path) if self.weights_path else None,
            "resolution": self.resolution,
            "precision": self.precision,
            "dim": self.dim,
            "dtype": "float16",
            "shape_grid": self.shape_grid,
            # Only when not the default, so that single-scale infos stay byte-identical to before.
            **({"scales": list(self.scales), "rotations": self.rotations} if self.multi_variant else {}),
        }
