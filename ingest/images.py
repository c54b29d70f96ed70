"""Decoding image bytes and resizing them isotropically (longer side to a target size).

Every image is opened through ``open_image``: only the formats of an allow-list are tried (no
other Pillow plugin runs on the bytes: EPS would run Ghostscript), and a JPEG may have at most
``MAX_JPEG_SCANS`` scans. Why the scan cap: the pixel cap bounds a decode's memory, not its time;
each scan of a progressive JPEG costs a pass over every block of the image (about 30 ms at
24 MP, measured), and a small file can hold thousands of scans. A camera or encoder writes
1 (baseline) to ~10 (progressive; mozjpeg ~12), so 64 leaves room and bounds a decode to ~2 s.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from PIL import Image, UnidentifiedImageError

from core.errors import ImageDecodeError

# Resampling used for every resize, so that ingestion and `needle query --image` agree exactly.
RESAMPLE = Image.Resampling.BICUBIC
# Formats ingestion decodes: what the tar members the reader takes hold (ingest/reader.py), GIF and MPO.
DECODE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "MPO", "TIFF")
# Formats a server decodes (query images, thumbnails). TIFF is left out: libtiff sizes its buffers
# from the file's tile and strip tags and has the longest record of decoder CVEs of these, while
# no browser or camera sends a TIFF as a query. A TIFF in an ingested tar is indexed but gets no
# thumbnail (a clear error naming the format).
SERVE_FORMATS = tuple(f for f in DECODE_FORMATS if f != "TIFF")
MAX_JPEG_SCANS = 64  # scans of one JPEG decoded (SOS markers); more: refused before decoding
JPEG_LIKE = ("JPEG", "MPO")


class TooManyScans(ImageDecodeError):
    """A JPEG with more scans than allowed: refused before its decoder runs."""

    def __init__(self, key: str, scans: int, max_scans: int):
        super().__init__(key, f"a JPEG of {scans} scans, over the limit of {max_scans}")
        self.scans, self.max_scans = scans, max_scans


def jpeg_scans(data: bytes) -> int:
    """Scans in JPEG bytes: start-of-scan markers (0xFFDA). Entropy-coded data stuffs every 0xFF
    byte with 0x00, so the pair occurs only as a marker (an upper bound where a thumbnail is embedded)."""
    return data.count(b"\xff\xda")


@contextmanager
def open_image(
    data: bytes, key: str = "?", formats: tuple[str, ...] = DECODE_FORMATS, max_scans: int = MAX_JPEG_SCANS
) -> Iterator[Image.Image]:
    """The image in ``data`` opened (its header read, nothing decoded) by the plugins of ``formats``
    only, a JPEG of at most ``max_scans`` scans: else ImageDecodeError (TooManyScans) naming ``key``."""
    if not data:
        raise ImageDecodeError(key, "empty image bytes")
    Image.init()  # every plugin registered: Image.open with formats= looks only among those
    try:
        image = Image.open(io.BytesIO(data), formats=[f for f in formats if f in Image.OPEN])
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageDecodeError(key, f"not an image of {', '.join(formats)} ({type(exc).__name__}: {exc})") from exc
    with image:
        if image.format in JPEG_LIKE and (scans := jpeg_scans(data)) > max_scans:
            raise TooManyScans(key, scans, max_scans)
        yield image


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
    data: bytes,
    longer_sides: tuple[int, ...],
    key: str = "?",
    formats: tuple[str, ...] = DECODE_FORMATS,
    max_scans: int = MAX_JPEG_SCANS,
) -> tuple[dict[int, np.ndarray], int, int]:
    """Decode once, resize to each of ``longer_sides`` (each from the decoded image, so every size
    is exactly what :func:`decode_resized` gives alone, as long as the draft-mode scale is the same:
    the draft is taken for the largest size). Returns ({longer side: array}, width, height).
    ``formats``, ``max_scans``: what ``open_image`` allows (a server passes SERVE_FORMATS)."""
    try:
        with open_image(data, key, formats, max_scans) as img:
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
    except ImageDecodeError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageDecodeError(key, f"{type(exc).__name__}: {exc}") from exc
