"""Random binary local tokens (codes, positions, scales) and near copies of their codes, for the
re-ranking tests of matching and spatial verification."""

from __future__ import annotations

import numpy as np

from core.tokens import CODE_BITS, LocalTokens, TokenBatch

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


def realish(
    seed: int, C: int = 40, Q: int = 60, T: int = 30, empty: tuple[int, ...] = ()
) -> tuple[LocalTokens, TokenBatch]:
    """A query and candidates of which many hold noisy, rotated and scaled copies of query tokens
    (so SP finds matches, inliers and outliers); ``empty``: candidates without any token."""
    rng = np.random.default_rng(seed)
    proj = rng.normal(size=(Q, 128)).astype(np.float32)
    scale = rng.choice(np.array([0.75, 1.0, 1.5], np.float32), Q)
    query = LocalTokens(
        np.packbits(proj >= 0, axis=1),
        rng.uniform(0, 400, (Q, 2)).astype(np.float32),
        scale,
        np.ones(Q, np.float32),
        None,
        proj,
    )
    cands = []
    for c in range(C):
        n = 0 if c in empty else int(rng.integers(1, T + 1))
        shared = min(n, int(rng.integers(0, 25)))
        codes = rng.integers(0, 256, (n, 16), dtype=np.uint8)
        xy = rng.uniform(0, 400, (n, 2)).astype(np.float32)
        src = rng.choice(Q, shared, replace=False)
        bits = np.unpackbits(query.codes[src], axis=1) ^ (rng.random((shared, 128)) < 0.06)
        codes[:shared] = np.packbits(bits, axis=1)
        th, s = rng.uniform(-0.5, 0.5), rng.uniform(0.7, 1.4)
        rot = s * np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])
        xy[:shared] = query.xy[src] @ rot.T + rng.uniform(-40, 40, 2) + rng.normal(0, 3, (shared, 2))
        if shared > 3:  # exact duplicates: ties between hypotheses and between nearest tokens
            codes[shared - 1], xy[shared - 1] = codes[0], xy[0]
        sc = np.ones(n, np.float32)
        sc[:shared] = scale[src]
        cands.append(LocalTokens(codes, xy, sc, np.ones(n, np.float32)))
    return query, TokenBatch.stack(cands)


def random_shortlist(rng: np.random.Generator, most: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A shortlist of 1..``most`` candidates: (inlier counts, has tokens (~90%), global scores)."""
    c = int(rng.integers(1, most))
    return rng.integers(0, 70, c).astype(float), rng.random(c) < 0.9, rng.random(c)
