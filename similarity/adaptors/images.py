"""The adaptors' images: the unlabelled training images of a source, their square training crops,
and batches of images normalised as the backbone expects. Importing this module stays light."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from similarity.data import IMAGE_SUFFIXES, SimilarityDataError, load_rgb, realbench_distractors

if TYPE_CHECKING:
    import torch


def training_images(source: Path | str) -> list[Path]:
    """Unlabelled training images: a realbench directory's distractors (never its groups), or
    every image file under a directory (sorted)."""
    source = Path(source)
    if (source / "distractors.csv").is_file():
        return realbench_distractors(source)
    if not source.is_dir():
        raise SimilarityDataError(f"training image directory {source} does not exist")
    paths = sorted(p for p in source.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not paths:
        raise SimilarityDataError(f"{source} holds no image file ({', '.join(IMAGE_SUFFIXES)})")
    return paths


def load_square(path: Path, side: int) -> np.ndarray:
    """(side, side, 3) uint8: the image's central square, resized (the training crop)."""
    from PIL import Image, ImageOps

    from ingest.images import RESAMPLE

    image = Image.fromarray(load_rgb(path, 2 * side))
    return np.asarray(ImageOps.fit(image, (side, side), RESAMPLE), dtype=np.uint8)


def normalised_batch(batch: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """(B, 3, H, W) float32 images normalised by the backbone's ``mean`` and ``std`` from (B, H, W, 3) uint8."""
    import torch

    x = torch.from_numpy(np.array(batch, dtype=np.uint8)).permute(0, 3, 1, 2).float().div_(255.0)  # a writable copy
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
