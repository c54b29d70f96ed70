"""Tiny WebDataset tars of real photos: JPEG bytes and tar members, for ingestion tests."""

from __future__ import annotations

import io
import json
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


def photo_tars(directory: Path, photos: dict[str, np.ndarray]) -> list[Path]:
    """Two tars of three real photos each in ``directory`` (the second tar's photos mirrored), each
    sample a JPEG and a JSON naming its photo."""
    directory.mkdir(parents=True, exist_ok=True)
    names = list(photos)
    shards = []
    for s in range(2):
        members = []
        for i, name in enumerate(names[3 * s : 3 * s + 3]):
            image = photos[name] if s == 0 else np.ascontiguousarray(photos[name][:, ::-1])
            members += [
                (f"{s:02d}{i:03d}.jpg", jpeg_bytes(image)),
                (f"{s:02d}{i:03d}.json", json.dumps({"photo": name}).encode()),
            ]
        shards.append(write_tar(directory / f"{s:06d}.tar", members))
    return shards
