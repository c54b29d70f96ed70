"""The README's "Keep it current" recipe, end to end (issue 57): photos copied into the folder, then
``needle pack`` (appends a tar), ``needle ingest`` (the new tar only) and ``needle index add``
(the new Parquet file only) while ``needle serve --reload-interval`` answers; the served index
follows with the new photos, and nothing made before is rewritten."""

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cli.main import main as needle
from tests.support.ports import free_port, urlopen_json

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def _save(path: Path, photo: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.ascontiguousarray(photo[::4, ::4])).save(path, format="JPEG", quality=90)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _wait_for_health(url: str, server: subprocess.Popen, deadline_s: float = 60) -> dict:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            status, health = urlopen_json(f"{url}/health")
            if status == 200:
                return health
        except OSError:
            pass
        assert server.poll() is None and time.monotonic() < deadline, "needle serve did not start"
        time.sleep(0.2)


def test_grow_a_served_collection_from_a_folder(tmp_path, photos, ray_local, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = list(photos)
    for name in names[:3]:
        _save(Path("photos/first") / f"{name}.jpg", photos[name])
    assert needle(["pack", "photos/", "--out", "tars/"]) == 0
    assert needle(["ingest", "--shards", "tars/", "--out", "desc/", "--cpus-per-worker", "1"]) == 0
    assert needle(["index", "build", "--descriptors", "desc/", "--out", "idx/"]) == 0
    first_tar, first_part = _sha(Path("tars/000000.tar")), _sha(Path("desc/000000.parquet"))

    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", "--index", str(tmp_path / "idx"), "--port", str(port),
         "--reload-interval", "0.5"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        assert _wait_for_health(url, server)["ntotal"] == 3
        for name in names[3:5]:  # new photos copied into the folder
            _save(Path("photos/later") / f"{name}.jpg", photos[name])
        assert needle(["pack", "photos/", "--out", "tars/"]) == 0
        assert needle(["ingest", "--shards", "tars/", "--out", "desc/", "--cpus-per-worker", "1"]) == 0
        assert needle(["index", "add", "--index", "idx/", "--descriptors", "desc/", "--wait-for", url]) == 0

        assert sorted(p.name for p in Path("tars").glob("*.tar")) == ["000000.tar", "000001.tar"]
        assert _sha(Path("tars/000000.tar")) == first_tar and _sha(Path("desc/000000.parquet")) == first_part
        info = json.loads(Path("desc/ingest_info.json").read_text())
        assert [r["shard"] for r in info["results"]] == ["000000", "000001"] and info["images"] == 2
        health = _wait_for_health(url, server)
        assert health["ntotal"] == 5 and health["generation"] >= 1
        new_key = f"000001/later/{names[3]}"
        status, out = urlopen_json(f"{url}/search", {"keys": [new_key], "k": 5})
        assert status == 200 and out[0]["results"][0]["key"] == new_key
        status, out = urlopen_json(f"{url}/search", {"keys": [f"000001/later/{names[4]}"], "k": 1})
        assert status == 200 and out[0]["results"][0]["key"] == f"000001/later/{names[4]}"
    finally:
        server.terminate()
        server.wait(20)
