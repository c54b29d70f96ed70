"""Random binary local tokens (codes, positions, scales) and near copies of their codes, for the
re-ranking tests of matching and spatial verification."""

from __future__ import annotations

import numpy as np

from core.tokens import CODE_BITS, LocalTokens

SCALES = np.array([0.707, 1.0, 1.414], np.float32)


def flip_bits(codes: np.ndarray, n_bits: np.ndarray | int, rng: np.random.Generator) -> np.ndarray:
    """Copies of ``codes`` (n, 16) with exactly ``n_bits`` (per row) bits flipped."""
    bits = np.unpackbits(codes, axis=-1)
    n_bits = np.broadcast_to(n_bits, len(codes))
    for row, k in zip(bits, n_bits):
        row[rng.choice(CODE_BITS, int(k), replace=False)] ^= 1
    return np.packbits(bits, axis=-1)


def tokens(
    codes: np.ndarray, rng: np.random.Generator, xy: np.ndarray | None = None, scale: np.ndarray | None = None
) -> LocalTokens:
    n = len(codes)
    return LocalTokens(
        codes,
        rng.uniform(0, 400, (n, 2)).astype(np.float32) if xy is None else xy.astype(np.float32),
        rng.choice(SCALES, n) if scale is None else scale.astype(np.float32),
        np.ones(n, np.float32),
    )


def random_codes(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, 256, (n, 16), dtype=np.uint8)
