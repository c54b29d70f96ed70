"""`needle` subcommands end to end on real images: ingest -> index build -> query / eval."""

import json
import subprocess
import sys

import pytest

from tests.support.tars import jpeg_bytes

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def needle(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def built_index(tmp_path_factory, photos):
    from tests.support.tars import write_tar

    root = tmp_path_factory.mktemp("cli")
    for s in range(2):
        names = list(photos)[3 * s : 3 * s + 3]
        write_tar(root / f"{s:06d}.tar", [(f"k{s}{i}.jpg", jpeg_bytes(photos[n])) for i, n in enumerate(names)])
    run = needle(
        "ingest",
        "--shards",
        str(root / "{000000..000001}.tar"),
        "--out",
        str(root / "desc"),
        "--resolution",
        "160",
        "--cpus-per-worker",
        "1",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    run = needle("index", "build", "--descriptors", str(root / "desc"), "--out", str(root / "index"))
    assert run.returncode == 0, run.stderr[-3000:]
    return root


def test_query_by_stored_key_returns_it_first(built_index):
    run = needle(
        "query", "--index", str(built_index / "index"), "--key", "000001/k11", "--k", "3", "--refine-factor", "3"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["results"][0]["key"] == "000001/k11"
    assert out["results"][0]["score"] == pytest.approx(1.0, abs=1e-2)
    assert len(out["results"]) == 3


def test_query_by_image_file_finds_its_stored_copy(built_index, photos, tmp_path):
    image = tmp_path / "coffee.jpg"
    image.write_bytes(jpeg_bytes(photos["coffee"]))
    run = needle("query", "--index", str(built_index / "index"), "--image", str(image), "--k", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["results"][0]["key"] == "000000/k02"  # coffee is the third photo of shard 0
    assert out["results"][0]["score"] > 0.99


def test_unknown_key_is_a_clear_error(built_index):
    run = needle("query", "--index", str(built_index / "index"), "--key", "nope/1", "--k", "3")
    assert run.returncode == 2 and "nope/1" in run.stderr


def test_eval_writes_report(built_index, tmp_path):
    truth = {"queries": [{"key": "000000/k00", "positives": ["000000/k01"]}]}
    (tmp_path / "gt.json").write_text(json.dumps(truth))
    run = needle(
        "eval",
        "map",
        "--index",
        str(built_index / "index"),
        "--ground-truth",
        str(tmp_path / "gt.json"),
        "--out",
        str(tmp_path / "report.json"),
        "--k",
        "5",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["n_queries"] == 1 and 0 <= report["map_at_5"] <= 100


def test_k_larger_than_the_index_returns_every_row(built_index):
    run = needle("query", "--index", str(built_index / "index"), "--key", "000000/k00", "--k", "50")
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout)["results"]  # one query: its answer alone
    assert len(results) == 6 and results[0]["key"] == "000000/k00"  # the six rows there are


def test_query_by_vectors_file(built_index, tmp_path):
    import numpy as np

    from index.search import load_index

    index = load_index(built_index / "index")
    np.save(tmp_path / "q.npy", np.stack([index.vector_of("000000/k01"), index.vector_of("000001/k10")]))
    run = needle("query", "--index", str(built_index / "index"), "--vectors", str(tmp_path / "q.npy"), "--k", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert [q["results"][0]["key"] for q in out] == ["000000/k01", "000001/k10"]
    np.save(tmp_path / "bad.npy", np.zeros((2, 7), np.float32))
    run = needle("query", "--index", str(built_index / "index"), "--vectors", str(tmp_path / "bad.npy"), "--k", "1")
    assert run.returncode == 2 and "(2, 7)" in run.stderr


def test_text_query_on_an_image_only_model_is_refused(built_index):
    run = needle("query", "--index", str(built_index / "index"), "--text", "a cat", "--k", "1")
    assert run.returncode == 2 and "no text tower" in run.stderr


def test_query_through_ray_shard_actors(built_index):
    run = needle("query", "--index", str(built_index / "index"), "--key", "000000/k02", "--k", "2", "--ray-shards")
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)["results"][0]["key"] == "000000/k02"
