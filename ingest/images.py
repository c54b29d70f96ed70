"""Decoding image bytes and resizing them isotropically (longer side to a target size)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, UnidentifiedImageError

from core.errors import ImageDecodeError

# Resampling used for every resize, so that ingestion and `needle query --image` agree exactly.
RESAMPLE = Image.Resampling.BICUBIC


def resized_size(width: int, height: int, longer_side: int) -> tuple[int, int]:
    """(width, height) with the longer side equal to ``longer_side`` and the aspect ratio kept."""
    if width >= height:
        return longer_side, max(1, round(height * longer_side / width))
    return max(1, round(width * longer_side / height)), longer_side


def decode_resized(data: bytes, longer_side: int, key: str = "?") -> tuple[np.ndarray, int, int]:
    """Decode image bytes to RGB uint8 (H, W, 3) with the longer side at ``longer_side``.

    Returns the array and the original width and height. JPEGs use PIL's draft mode, which lets
    libjpeg decode at 1/2, 1/4 or 1/8 scale when the target is that much smaller (about 3x faster
    decoding of large photos); the final size is then reached with a bicubic resize.
    Raises ImageDecodeError naming ``key`` for empty, truncated or non-image bytes.
    """
    images, width, height = decode_resized_many(data, (longer_side,), key)
    return images[longer_side], width, height


def decode_resized_many(
    data: bytes, longer_sides: tuple[int, ...], key: str = "?"
) -> tuple[dict[int, np.ndarray], int, int]:
    """Decode once, resize to each of ``longer_sides`` (each from the decoded image, so every size
    is exactly what :func:`decode_resized` gives alone, as long as the draft-mode scale is the same:
    the draft is taken for the largest size). Returns ({longer side: array}, width, height)."""
    if not data:
        raise ImageDecodeError(key, "empty image bytes")
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            largest = resized_size(width, height, max(longer_sides))
            if img.format == "JPEG":
                img.draft("RGB", largest)
            rgb = img.convert("RGB")
            out = {}
            for side in longer_sides:
                target = resized_size(width, height, side)
                out[side] = np.asarray(rgb if rgb.size == target else rgb.resize(target, RESAMPLE), dtype=np.uint8)
            return out, width, height
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageDecodeError(key, f"{type(exc).__name__}: {exc}") from exc
