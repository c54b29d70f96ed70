"""Extractors: callables that turn a list of decoded images into named descriptor columns.

An ingestion worker decodes each image once and hands the batch to a list of extractors; each adds
its own columns (the global descriptor now; local descriptors later), so several descriptor kinds
share one decode pass.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import torch

from embed.models import DEFAULT_MODEL, build_global_model, describe, get_model_config
from ingest.errors import NeedleInputError

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


class Extractor(Protocol):
    """What an ingestion worker needs from an extractor."""

    resolution: int  # longer side the images must be resized to

    def extra_fields(self) -> list[pa.Field]: ...  # columns beyond the schema's base ones

    def __call__(self, images: list[np.ndarray]) -> dict[str, np.ndarray]: ...

    def info(self) -> dict[str, Any]: ...  # how the columns were made, for the JSON beside the output


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def batches_by_shape(images: list[np.ndarray], batch_size: int) -> list[list[int]]:
    """Indices of ``images`` grouped into batches of identical (H, W), at most ``batch_size`` each.

    Images keep their aspect ratio (no crop, no padding, the ILIAS convention), so only images of
    the same size can share a forward pass.
    """
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, image in enumerate(images):
        groups[image.shape].append(i)
    return [idx[s : s + batch_size] for idx in groups.values() for s in range(0, len(idx), batch_size)]


class GlobalExtractor:
    """Global descriptors of a registry model: column ``global``, (n, D) float16, L2-normalised."""

    column = "global"

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        weights: str | Path | None = None,
        device: str = "cpu",
        precision: str = "auto",
        batch_size: int = 32,
        resolution: int | None = None,
    ):
        if precision not in PRECISIONS:
            raise NeedleInputError(f"unknown precision {precision!r}; choose from {PRECISIONS}")
        if batch_size < 1:
            raise NeedleInputError(f"batch_size must be >= 1, got {batch_size}")
        self.model_name = model
        self.config = get_model_config(model)
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.resolution = resolution or self.config.resolution
        self.net, self.weights_path = build_global_model(model, weights)
        self.net.to(self.device)
        self.precision = self._choose_precision(precision)
        self._mean = torch.tensor(self.config.mean, device=self.device).view(1, 3, 1, 1)
        self._std = torch.tensor(self.config.std, device=self.device).view(1, 3, 1, 1)
        self.dim = self._probe_dim()

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

    @torch.inference_mode()
    def forward_uint8(self, batch: np.ndarray) -> np.ndarray:
        """(B, H, W, 3) uint8 -> (B, D) float32 L2-normalised descriptors."""
        x = torch.from_numpy(batch).to(self.device).permute(0, 3, 1, 2).float().div_(255.0)
        x = (x - self._mean) / self._std
        with self._autocast():
            out = self.net(x)
        # Re-normalise in float32: autocast may leave the norm slightly off 1.
        return torch.nn.functional.normalize(out.float(), dim=-1).cpu().numpy()

    def extra_fields(self) -> list[pa.Field]:
        return []  # `global` is part of the base schema

    def __call__(self, images: list[np.ndarray]) -> dict[str, np.ndarray]:
        out = np.zeros((len(images), self.dim), dtype=np.float16)
        for idx in batches_by_shape(images, self.batch_size):
            out[idx] = self.forward_uint8(np.stack([images[i] for i in idx])).astype(np.float16)
        return {self.column: out}

    def info(self) -> dict[str, Any]:
        return {
            "extractor": "global",
            "model": describe(self.model_name),
            "weights": str(self.weights_path) if self.weights_path else None,
            "weights_sha256": file_sha256(self.weights_path) if self.weights_path else None,
            "resolution": self.resolution,
            "precision": self.precision,
            "dim": self.dim,
            "dtype": "float16",
        }
