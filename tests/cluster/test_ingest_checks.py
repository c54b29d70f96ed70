"""What an ingestion job checks before it starts workers, and what it records beside its Parquet
files: weights checked in seconds without Ray, progress in images, settings differences by field,
failed images named, and a summary merged across runs."""

import json
import time

import pytest

from core.errors import NeedleInputError
from embed.registry import WeightsError
from ingest.config import IngestConfig
from ingest.job_record import count_samples, failed_images, merge_report, settings_diff
from tests.support.tars import write_tar


def test_a_model_without_weights_fails_before_ray_starts(tmp_path, tiny_shards, monkeypatch):
    import cluster.ingest_job
    from cluster.ingest_job import main

    def no_ray(*args, **kwargs):  # whether or not an earlier test left Ray running in this process
        raise AssertionError("Ray was started before the weights were checked")

    monkeypatch.setattr(cluster.ingest_job, "connect_ray", no_ray)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(WeightsError, match=r"'clip_B16_openai.head' has no packaged weights.*--weights FILE"):
        main(IngestConfig(model="clip_B16_openai.head"), str(tmp_path / "*.tar"), tmp_path / "desc")
    with pytest.raises(WeightsError, match=r"offline.*--weights FILE"):
        main(IngestConfig(model="clip_B16_openai.head", weights="pretrained"), str(tmp_path / "*.tar"), tmp_path / "d")
    assert time.perf_counter() - start < 10  # no actor, no local instance: the error came first
    assert not (tmp_path / "desc").exists() and not (tmp_path / "d").exists()


def test_cli_ingest_without_weights_exits_2_with_one_line(tmp_path, tiny_shards, caplog):
    from cli.main import main as cli

    argv = ["ingest", "--shards", str(tmp_path), "--out", str(tmp_path / "desc"), "--model", "clip_B16_openai.head"]
    assert cli(argv) == 2
    err = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(err) == 1 and "\n" not in err[0] and "clip_B16_openai.head" in err[0] and "--weights FILE" in err[0]
    assert not (tmp_path / "desc").exists()


def test_samples_are_counted_from_tar_headers(tmp_path, tiny_shards):
    write_tar(tmp_path / "odd.tar", [("a.jpg", b"x"), ("a.json", b"{}"), ("b.png", b"y"), ("__meta__/c.jpg", b"z")])
    assert count_samples([str(p) for p in tiny_shards]) == 6
    assert count_samples([str(tmp_path / "odd.tar")]) == 3
    assert count_samples(["s3://bucket/000000.tar"]) is None  # would stream the object whole


def test_settings_diff_names_only_the_fields_that_differ():
    before = {"model": "m", "resolution": 160, "locals": None}
    now = {"model": "m", "resolution": 192, "locals": "lite0-s16"}
    assert settings_diff(before, now) == "locals: None → 'lite0-s16'; resolution: 160 → 192"


def test_a_resume_with_other_settings_names_only_the_differing_fields(tmp_path):
    from cluster.ingest_job import _check_same_settings

    previous = {"config": json.loads(json.dumps(IngestConfig(resolution=160, shape_grid=0).__dict__))}
    with pytest.raises(NeedleInputError) as caught:
        _check_same_settings(previous, IngestConfig(resolution=192, shape_grid=0), "desc", committed=True)
    message = str(caught.value)
    assert "resolution: 160 → 192" in message and "model" not in message and "{" not in message
    # a record left by a run that committed nothing refuses nothing
    _check_same_settings(previous, IngestConfig(resolution=192, shape_grid=0), "desc", committed=False)


def test_failed_images_are_named_with_tar_and_reason_and_counted():
    results = [
        {"shard": "000000", "url": "t/000000.tar", "status": "ok", "error_rows": 60,
         "failed_images": [{"key": f"k{i}", "reason": "truncated"} for i in range(20)]},
        {"shard": "000001", "url": "t/000001.tar", "status": "ok", "error_rows": 40,
         "failed_images": [{"key": f"j{i}", "reason": "not an image"} for i in range(20)] * 2},
    ]  # fmt: skip
    named, total = failed_images(results)
    assert total == 100 and len(named) == 50
    assert named[0] == {"key": "000000/k0", "tar": "t/000000.tar", "reason": "truncated"}


def test_the_summary_keeps_earlier_runs_results():
    first = {"results": [{"shard": "000000", "url": "t/000000.tar"}], "shards_processed": 1, "images": 120}
    second = {"results": [{"shard": "000001", "url": "t/000001.tar"}], "shards_processed": 1, "images": 12}
    merged = merge_report(first, second)
    assert [r["shard"] for r in merged["results"]] == ["000000", "000001"]
    assert [run["images"] for run in merged["runs"]] == [120, 12] and merged["images"] == 12
