"""Packed query vectors in a /search body (webapi/packed_vectors.py): the same answers as a list of
numbers, every field checked and named before any byte is decoded."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from tests.support.service import JSON, app_client

# pytest fixtures and the fixtures they request, imported by name (``x as x``: on purpose, not unused)
from tests.support.service import client as client
from tests.support.service import index as index
from tests.support.service import index_dir as index_dir
from webapi.packed_vectors import pack_vectors

D = 32  # tests.support.service's index


def search(client, vectors, k=5):
    response = client.post("/search", content=json.dumps({"k": k, "vectors": vectors}), headers=JSON)
    assert response.status_code == 200, response.json()
    return [[(r["key"], r["score"]) for r in answer["results"]] for answer in response.json()]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_packed_vectors_answer_as_the_same_numbers_in_a_list(client, dtype):
    xq = np.random.default_rng(0).standard_normal((7, D)).astype(dtype)
    assert search(client, pack_vectors(xq, dtype)) == search(client, xq.astype(np.float32).tolist())


def packed(**change):
    body = pack_vectors(np.ones((2, D), np.float32))
    body.update(change)
    return {key: value for key, value in body.items() if value is not None}


@pytest.mark.parametrize(
    "vectors,status,field",
    [
        (packed(dtype="float64"), 400, "vectors.dtype"),
        (packed(dtype=None), 400, "vectors.dtype"),
        (packed(shape=[2, D + 1]), 400, "vectors.shape"),
        (packed(shape=[0, D]), 400, "vectors.shape"),
        (packed(shape=[2]), 400, "vectors.shape"),
        (packed(shape=[True, D]), 400, "vectors.shape"),
        (packed(shape="2x32"), 400, "vectors.shape"),
        (packed(shape=[3, D]), 400, "vectors.base64"),  # fewer bytes than the shape says
        (packed(base64=None), 400, "vectors.base64"),
        (packed(base64=["AAAA"]), 400, "vectors.base64"),
        (packed(base64="!" * len(packed()["base64"])), 400, "vectors.base64"),
        (packed(base64=base64.b64encode(np.full((2, D), np.nan, np.float32).tobytes()).decode()), 400, "vectors"),
        (packed(base64=base64.b64encode(np.full((2, D), np.inf, np.float32).tobytes()).decode()), 400, "vectors"),
        ({**packed(), "order": "F"}, 400, "vectors"),
        (packed(shape=[51, D]), 413, "vectors"),  # --max-queries 50: refused before the bytes are read
    ],
)
def test_every_packed_field_is_checked_and_named(client, vectors, status, field, monkeypatch):
    if status == 413:
        monkeypatch.setattr(base64, "b64decode", lambda *a, **k: pytest.fail("decoded past --max-queries"))
    response = client.post("/search", content=json.dumps({"vectors": vectors}), headers=JSON)
    assert response.status_code == status, response.json()
    assert response.json()["field"] == field


def test_a_packed_body_is_bounded_by_the_byte_cap_as_any_body(index):
    with app_client(index, max_json_mb=1) as small:
        body = json.dumps({"vectors": pack_vectors(np.ones((10_000, D), np.float32))})  # 1.7 MB of base64
        response = small.post("/search", content=body, headers=JSON)
    assert response.status_code == 413 and "--max-json-mb" in response.json()["error"], response.json()
