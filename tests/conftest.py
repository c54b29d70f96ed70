"""Shared fixtures: tiny real-image tars, a session Ray instance, a small-resolution extractor, the
synthetic indexes (tests/support/indexes.py: each kind built once a session)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.support.indexes import flat_index as flat_index
from tests.support.indexes import live_flat_index as live_flat_index
from tests.support.indexes import synthetic_indexes as synthetic_indexes
from tests.support.tars import photo_tars

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# S3 tests talk to a moto server on 127.0.0.1, which accepts any credentials. Set before Ray
# starts, so that worker processes inherit them through the standard AWS credential chain.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "needle-test")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "needle-test")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "coins")


@pytest.fixture(scope="session", autouse=True)
def faiss_blas_as_served() -> None:
    """FAISS's BLAS threshold as every process that opens a shard sets it (core/blas.py),
    from the first test on: no test's exact scores depend on which test opened a shard first."""
    from core.blas import prefer_blas_for_batches

    prefer_blas_for_batches()


@pytest.fixture(scope="session")
def photos() -> dict[str, np.ndarray]:
    from ingest.demo_data import load_skimage_photo

    return {name: load_skimage_photo(name) for name in PHOTOS}


@pytest.fixture
def tiny_shards(tmp_path: Path, photos) -> list[Path]:
    """Two tars of three real photos each (the second tar's photos are mirrored)."""
    return photo_tars(tmp_path, photos)


@pytest.fixture(scope="session")
def extractor():
    """The default model (real ImageNet weights) at a small resolution, to keep tests fast."""
    from embed.extract import GlobalExtractor

    return GlobalExtractor(resolution=160, batch_size=8)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tests: on a shared 2-core box, OpenMP's spinning threads
    slow many small ops by 10-50x whenever another process holds a core (measured: SIFT 0.2 s -> 5 s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1 (any credentials), for the module's tests."""
    import socket

    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()
