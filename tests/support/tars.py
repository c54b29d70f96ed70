"""Tiny WebDataset tars of real photos: JPEG bytes and tar members, for ingestion tests."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image


def jpeg_bytes(image: np.ndarray, quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path
