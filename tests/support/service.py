"""A small IVF-PQ index (SERVED_IVFPQ, built once a session) and a TestClient of ``needle serve``'s
app in front of it, with the limits asked, shared by the tests of the service's limits, errors,
guard and connections."""

from __future__ import annotations

import struct
import zlib

import pytest

from index.search import load_index
from tests.support.indexes import SERVED_IVFPQ

JSON = {"Content-Type": "application/json"}
OCTETS = {"Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def index_dir(synthetic_indexes):
    return synthetic_indexes.get(SERVED_IVFPQ)[0]


@pytest.fixture(scope="module")
def index(index_dir):
    return load_index(index_dir)


def app_client(index, **limits):
    from fastapi.testclient import TestClient

    from webapi.limits import ServiceLimits
    from webapi.query_service import QueryService
    from webapi.webapp import create_app

    service = QueryService(index, limits=ServiceLimits(**limits))
    return TestClient(create_app(service), base_url="http://localhost", raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(index):
    with app_client(index, max_queries=50, max_k_total=200, max_text_length=20, max_image_pixels=10_000) as c:
        yield c


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header says width x height: PIL reads its size without decoding (no valid data)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"\x00" * 8) + chunk(b"IEND", b"")


KEY = "000000/00001"
