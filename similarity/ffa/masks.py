"""FFA's foreground masks on the token grid: the first principal component of an image's own tokens
(``pca``), the tokens of largest norm (``norm``), every token (``none``), or any segmenter's pixel
mask (:class:`PixelMaskFn`). Numpy only."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from embed.pca import fit_pca
from similarity.ffa.config import FFAConfig, FFAError


class MaskFn(Protocol):
    """A foreground mask on the token grid; anything with this call plugs into FFA."""

    name: str  # recorded in reports

    def __call__(self, tokens: np.ndarray, image: np.ndarray) -> np.ndarray:
        """tokens (h, w, d) float32 and the image they come from (H, W, 3) uint8 -> (h, w) bool."""
        ...


def centredness(h: int, w: int) -> np.ndarray:
    """(h, w): 1 at the grid centre, 0 on the outermost ring (normalised Chebyshev distance)."""
    ys = np.abs(np.arange(h) - (h - 1) / 2) / max((h - 1) / 2, 1e-9) if h > 1 else np.zeros(1)
    xs = np.abs(np.arange(w) - (w - 1) / 2) / max((w - 1) / 2, 1e-9) if w > 1 else np.zeros(1)
    return 1.0 - np.maximum(ys[:, None], xs[None, :])


def first_component_projection(tokens: np.ndarray) -> np.ndarray:
    """(h, w) projections of the centred tokens on their first principal direction, the sign
    chosen so that the projection correlates non-negatively with :func:`centredness`."""
    h, w, d = tokens.shape
    x = tokens.reshape(h * w, d).astype(np.float64)
    centred = x - x.mean(axis=0)
    if h * w < 2 or not np.any(centred):
        return np.zeros((h, w))
    # The PCA's thin SVD of the (n, d) tokens: its top right singular vector is the covariance's top
    # eigenvector. Its sign is chosen below, so the solver's is kept.
    direction = fit_pca(x, 1, fix_signs=False, what="tokens", error=FFAError).components[0]
    proj = centred @ direction
    centre = centredness(h, w).ravel()
    if float(proj @ (centre - centre.mean())) < 0:
        proj = -proj
    return proj.reshape(h, w)


@dataclass(frozen=True)
class PCAMask:
    threshold: float = 0.0  # in standard deviations of the projection above its mean (0)
    name: str = "pca"

    def __call__(self, tokens: np.ndarray, image: np.ndarray) -> np.ndarray:
        proj = first_component_projection(tokens)
        return proj > self.threshold * proj.std()


@dataclass(frozen=True)
class NormMask:
    fraction: float = 0.5  # share of cells kept (at least one), those of largest token norm
    name: str = "norm"

    def __call__(self, tokens: np.ndarray, image: np.ndarray) -> np.ndarray:
        h, w, _ = tokens.shape
        norms = np.linalg.norm(tokens.reshape(h * w, -1).astype(np.float64), axis=1)
        keep = max(1, math.ceil(self.fraction * h * w))
        # Stable sort on the negated norms: equal norms keep the lower cell index.
        top = np.argsort(-norms, kind="stable")[:keep]
        mask = np.zeros(h * w, dtype=bool)
        mask[top] = True
        return mask.reshape(h, w)


@dataclass(frozen=True)
class FullMask:
    name: str = "none"

    def __call__(self, tokens: np.ndarray, image: np.ndarray) -> np.ndarray:
        return np.ones(tokens.shape[:2], dtype=bool)


def grid_mask_from_pixels(mask: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """A pixel mask (H, W) on a token grid (h, w): a cell is foreground when more than half of the
    pixels under it are (area average, each cell covering H/h x W/w pixels)."""
    from PIL import Image

    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise FFAError(f"a pixel mask must be (H, W), got shape {mask.shape}")
    h, w = grid
    # Area (box) resampling averages exactly the pixels under each cell, fractional edges weighted.
    coverage = Image.fromarray(mask.astype(np.float32)).resize((w, h), Image.Resampling.BOX)
    return np.asarray(coverage) > 0.5


@dataclass(frozen=True)
class PixelMaskFn:
    """Adapts a segmenter ``image (H, W, 3) uint8 -> foreground (H, W)`` (bool or probabilities in
    [0, 1], thresholded at 0.5) to a :class:`MaskFn`."""

    segment: Callable[[np.ndarray], np.ndarray]
    name: str = "segmentation"

    def __call__(self, tokens: np.ndarray, image: np.ndarray) -> np.ndarray:
        pixels = np.asarray(self.segment(image))
        if pixels.shape != image.shape[:2]:
            raise FFAError(
                f"segmenter {self.name!r} gave a mask of shape {pixels.shape} for an image of {image.shape[:2]}"
            )
        return grid_mask_from_pixels(pixels > 0.5 if pixels.dtype != bool else pixels, tokens.shape[:2])


def get_mask_fn(conf: FFAConfig) -> MaskFn:
    if conf.mask == "pca":
        return PCAMask(conf.pca_threshold)
    if conf.mask == "norm":
        return NormMask(conf.norm_fraction)
    return FullMask()
