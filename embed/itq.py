"""ITQ binarisation of local descriptors to 128 bits (Gong & Lazebnik, iterative quantisation).

Learned on a sample: centre, PCA to 128 dimensions (zero-padded when the descriptor is shorter, so
that the rotation spreads the variance over all 128 bits), then 50 iterations alternating the
binary codes and the orthogonal rotation that best maps the data onto them (Procrustes). The
projection ``proj`` (d x 128) = PCA basis @ rotation is saved as ``.npz`` with key ``proj``, the
format AMES's binarisation layer loads; the mean (key ``mean``) is saved beside it and subtracted
before projecting. Codes are the signs of the projection, 128 bits packed into 16 bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.atomic import write_atomic
from core.errors import NeedleInputError
from embed.pca import fit_pca

log = logging.getLogger(__name__)

BITS = 128


class ITQFileError(NeedleInputError):
    """An ITQ projection file that is missing or malformed."""


@dataclass(frozen=True)
class ITQ:
    proj: np.ndarray  # (d, 128) float32: PCA basis times the learned rotation
    mean: np.ndarray  # (d,) float32, subtracted before projecting (zeros for a bare AMES file)

    @property
    def dim(self) -> int:
        return int(self.proj.shape[0])

    def project(self, x: np.ndarray) -> np.ndarray:
        """(n, d) descriptors -> (n, 128) real-valued projections (their signs are the bits)."""
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise NeedleInputError(f"descriptors of shape {x.shape} do not fit an ITQ projection for d={self.dim}")
        return (x - self.mean) @ self.proj

    def binarize(self, x: np.ndarray) -> np.ndarray:
        """(n, d) descriptors -> (n, 16) uint8 packed codes (bit set where the projection is >= 0)."""
        return np.packbits(self.project(x) >= 0, axis=1)

    def reconstruct(self, codes: np.ndarray) -> np.ndarray:
        """(n, 16) packed codes -> (n, d) unit descriptors whose codes they are, as near the originals
        as one bit per projection allows (a learned matcher's input where only codes are stored).

        Given only its sign, a projection's expected value is sign * sqrt(2/pi) * sigma; ITQ's rotation
        spreads the variance evenly over the bits, so one sigma serves all: unit descriptors around
        ``mean`` have a variance of (1 - |mean|^2) / 128 per projection. Back through the orthonormal
        ``proj`` and normalised; the codes of the result are ``codes`` unless the mean's share of the
        norm flips a projection near zero (none for unit descriptors with |mean| < 1)."""
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[1] != BITS // 8 or codes.dtype != np.uint8:
            raise NeedleInputError(f"codes must be (n, {BITS // 8}) uint8, got {codes.shape} {codes.dtype}")
        signs = np.unpackbits(codes, axis=1).astype(np.float32) * 2.0 - 1.0
        sigma = np.sqrt(max(1.0 - float(self.mean @ self.mean), 1e-6) / BITS)
        x = self.mean + (np.sqrt(2.0 / np.pi) * sigma * signs) @ self.proj.T
        return (x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def train_itq(x: np.ndarray, bits: int = BITS, iterations: int = 50, seed: int = 0) -> ITQ:
    """Learn an ITQ projection from (n, d) float descriptors."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or len(x) < 2:
        raise NeedleInputError(f"ITQ needs an (n >= 2, d) sample of descriptors, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise NeedleInputError("ITQ training descriptors contain NaN or inf")
    n, d = x.shape
    # PCA (embed/pca.py): the top principal directions with the solver's signs (the random
    # rotation below makes any orientation equivalent); with fewer than `bits` of them the basis is
    # zero-padded to `bits` columns.
    pca = fit_pca(x, bits, fix_signs=False, what="ITQ training descriptors")
    mean = pca.mean
    basis = np.zeros((d, bits))
    basis[:, : pca.dim] = pca.components.T
    v = (x - mean) @ basis
    rng = np.random.default_rng(seed)
    rotation, _ = np.linalg.qr(rng.normal(size=(bits, bits)))
    for _ in range(iterations):
        b = np.where(v @ rotation >= 0, 1.0, -1.0)
        # Procrustes: the orthogonal R minimising ||B - V R|| is U W^T from the SVD of V^T B.
        u, _, wt = np.linalg.svd(v.T @ b)
        rotation = u @ wt
    itq = ITQ((basis @ rotation).astype(np.float32), mean.astype(np.float32))
    log.info("ITQ: %d descriptors of d=%d -> %d bits, quantisation loss %.4f", n, d, bits, quantization_loss(itq, x))
    return itq


def quantization_loss(itq: ITQ, x: np.ndarray) -> float:
    """Mean squared distance between the projections and their signs (what ITQ minimises)."""
    z = itq.project(np.asarray(x, dtype=np.float32))
    return float(np.mean((np.where(z >= 0, 1.0, -1.0) - z) ** 2))


def save_itq(itq: ITQ, path: Path | str) -> Path:
    """Write ``proj`` and ``mean`` to an .npz atomically."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, proj=itq.proj, mean=itq.mean)

    return write_atomic(Path(path), write)


def load_itq(path: Path | str) -> ITQ:
    """An ITQ projection from .npz: ``proj`` (d x 128) and optional ``mean`` (AMES files have none)."""
    path = Path(path)
    if not path.is_file():
        raise ITQFileError(f"ITQ projection file {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as data:
            proj = np.asarray(data["proj"], dtype=np.float32)
            mean = np.asarray(data["mean"], dtype=np.float32) if "mean" in data else np.zeros(proj.shape[0], np.float32)
    except (OSError, ValueError, KeyError) as exc:
        raise ITQFileError(f"cannot read ITQ projection {path}: {type(exc).__name__}: {exc}") from exc
    if proj.ndim != 2 or proj.shape[1] != BITS or mean.shape != (proj.shape[0],):
        raise ITQFileError(
            f"ITQ projection {path}: proj {proj.shape}, mean {mean.shape}; expected (d, {BITS}) and (d,)"
        )
    return ITQ(proj, mean)
