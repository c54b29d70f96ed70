"""Shared by the 2AFC tests: one torch thread per test (an autouse fixture, imported by name) and small
block-pattern images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _image(path: Path, seed: int, size: tuple[int, int] = (48, 40)) -> Path:
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(5, 6, 3), dtype=np.uint8)
    array = np.asarray(Image.fromarray(blocks).resize(size, Image.Resampling.NEAREST))
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, quality=95)
    return path
