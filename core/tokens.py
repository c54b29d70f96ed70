"""Local tokens in memory: one image's tokens, and padded batches of them for vectorised re-ranking.

A token is a local descriptor binarised to 128 bits (16 bytes, ``np.packbits`` order), with where it
was found: ``xy`` in pixels of the image resized to the extractor's base resolution, ``scale`` the
resize factor of the image it was extracted from (0.707, 1, 1.414, ...; a token seen at factor f
covers ``stride / f`` base pixels, so a match between a query token at f_q and a database token at
f_d suggests the object is f_q / f_d times larger in the database image), and ``weight`` its
detector weight (feature-map L2 norm, AMES detector output, SIFT response). Optional float
descriptors (``desc``) serve the quality-first setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core.errors import NeedleInputError

CODE_BYTES = 16  # 128 bits
CODE_BITS = 8 * CODE_BYTES


@dataclass(frozen=True)
class LocalTokens:
    """The tokens of one image."""

    codes: np.ndarray  # (n, 16) uint8, packed 128-bit ITQ codes
    xy: np.ndarray  # (n, 2) float32, x and y in pixels of the base-resolution image
    scale: np.ndarray  # (n,) float32, resize factor of the image the token came from
    weight: np.ndarray  # (n,) float32, detector weight (higher = more salient)
    desc: np.ndarray | None = None  # (n, d) float32 L2-normalised descriptors, when kept
    # (n, 128) float32 ITQ projections whose signs are the codes: the query side keeps them for
    # asymmetric matching (float query against binary database codes); never stored.
    proj: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.codes)
        if self.codes.shape != (n, CODE_BYTES) or self.codes.dtype != np.uint8:
            raise NeedleInputError(
                f"token codes must be (n, {CODE_BYTES}) uint8, got {self.codes.shape} {self.codes.dtype}"
            )
        if self.xy.shape != (n, 2) or self.scale.shape != (n,) or self.weight.shape != (n,):
            raise NeedleInputError(
                f"token arrays disagree: codes {self.codes.shape}, xy {self.xy.shape}, "
                f"scale {self.scale.shape}, weight {self.weight.shape}"
            )
        if self.desc is not None and (self.desc.ndim != 2 or len(self.desc) != n):
            raise NeedleInputError(f"token descriptors have shape {self.desc.shape}, expected ({n}, d)")
        if self.proj is not None and self.proj.shape != (n, CODE_BITS):
            raise NeedleInputError(f"token projections have shape {self.proj.shape}, expected ({n}, {CODE_BITS})")

    def __len__(self) -> int:
        return len(self.codes)

    @staticmethod
    def empty(dim: int | None = None) -> LocalTokens:
        return LocalTokens(
            np.zeros((0, CODE_BYTES), np.uint8),
            np.zeros((0, 2), np.float32),
            np.zeros(0, np.float32),
            np.zeros(0, np.float32),
            None if dim is None else np.zeros((0, dim), np.float32),
        )

    def top(self, k: int) -> LocalTokens:
        """The ``k`` tokens of highest weight, in descending weight."""
        order = np.argsort(-self.weight, kind="stable")[:k]
        return LocalTokens(
            self.codes[order],
            self.xy[order],
            self.scale[order],
            self.weight[order],
            None if self.desc is None else self.desc[order],
            None if self.proj is None else self.proj[order],
        )


@dataclass(frozen=True)
class TokenBatch:
    """Several images' tokens padded to a common length T, for vectorised re-ranking."""

    codes: np.ndarray  # (B, T, 16) uint8, zeros where padded
    xy: np.ndarray  # (B, T, 2) float32
    scale: np.ndarray  # (B, T) float32 (1 where padded)
    weight: np.ndarray  # (B, T) float32 (0 where padded)
    mask: np.ndarray  # (B, T) bool, True for real tokens

    def __len__(self) -> int:
        return len(self.codes)

    @staticmethod
    def stack(images: Sequence[LocalTokens], length: int | None = None) -> TokenBatch:
        """Pad ``images`` to ``length`` tokens (default: the longest), keeping each one's first tokens."""
        T = max((len(t) for t in images), default=0) if length is None else length
        out = TokenBatch.padding(len(images), T)
        codes, xy, scale, weight, mask = out.codes, out.xy, out.scale, out.weight, out.mask
        for b, t in enumerate(images):
            n = min(len(t), T)
            codes[b, :n], xy[b, :n], scale[b, :n], weight[b, :n], mask[b, :n] = (
                t.codes[:n],
                t.xy[:n],
                t.scale[:n],
                t.weight[:n],
                True,
            )
        return out

    @staticmethod
    def padding(B: int, T: int) -> TokenBatch:
        """``B`` images of ``T`` padded slots (no real token): what ``stack`` and ``concat`` fill."""
        return TokenBatch(
            np.zeros((B, T, CODE_BYTES), np.uint8),
            np.zeros((B, T, 2), np.float32),
            np.ones((B, T), np.float32),
            np.zeros((B, T), np.float32),
            np.zeros((B, T), bool),
        )

    @staticmethod
    def concat(batches: Sequence[TokenBatch]) -> TokenBatch:
        """Several batches as one (their images in order), padded to the longest as ``stack`` pads."""
        out = TokenBatch.padding(sum(len(b) for b in batches), max(b.codes.shape[1] for b in batches))
        start = 0
        for b in batches:
            n, t = b.codes.shape[:2]
            for name in ("codes", "xy", "scale", "weight", "mask"):
                getattr(out, name)[start : start + n, :t] = getattr(b, name)
            start += n
        return out

    def image(self, b: int) -> LocalTokens:
        """Image ``b``'s real tokens."""
        m = self.mask[b]
        return LocalTokens(self.codes[b, m], self.xy[b, m], self.scale[b, m], self.weight[b, m])


def unpack_signs(codes: np.ndarray) -> np.ndarray:
    """Packed codes (..., 16) uint8 -> (..., 128) float32 of +1 (bit set) / -1 (bit clear)."""
    bits = np.unpackbits(codes, axis=-1)
    return bits.astype(np.float32) * 2.0 - 1.0


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Plain pairwise Hamming distances between (n, 16) and (m, 16) codes -> (n, m) int: the
    reference the fast paths are tested against."""
    x = np.bitwise_xor(a[:, None, :], b[None, :, :])
    return np.unpackbits(x, axis=-1).sum(-1).astype(np.int64)
