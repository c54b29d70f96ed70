"""The Ray ingestion job on tiny tars."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cluster.ingest_job import IngestFailed, main
from ingest.config import IngestConfig
from tests.support.tars import jpeg_bytes, write_tar

pytestmark = [pytest.mark.ray, pytest.mark.slow]
CONF = IngestConfig(resolution=160, batch_size=8, cpus_per_worker=1)


def test_two_tars_one_row_per_sample(tmp_path, tiny_shards, ray_local):
    out = main(CONF, str(tmp_path / "{000000..000001}.tar"), tmp_path / "desc")
    table = pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("*.parquet")))
    assert table.num_rows == 6
    assert len(set(table["key"].to_pylist())) == 6 and len(set(table["row"].to_pylist())) == 6
    info = json.loads((out / "ingest_info.json").read_text())
    assert info["shards_ok"] == 2 and info["images"] == 6 and info["error_rows"] == 0
    assert info["extractors"][0]["model"]["name"] == "tf_efficientnet_lite0.gem"


def test_unreadable_jpeg_gives_error_row_and_job_goes_on(tmp_path, photos, ray_local):
    good = jpeg_bytes(photos["rocket"])
    write_tar(tmp_path / "000000.tar", [("x.jpg", good), ("y.jpg", b"\xff\xd8\xff garbage")])
    write_tar(tmp_path / "000001.tar", [("z.jpg", good)])
    out = main(CONF, str(tmp_path / "*.tar"), tmp_path / "desc")
    table = pq.read_table(out / "000000.parquet").to_pydict()
    assert dict(zip(table["key"], table["status"])) == {"000000/x": "ok", "000000/y": "error"}
    assert table["error"][1]
    assert pq.read_table(out / "000001.parquet").num_rows == 1
    info = json.loads((out / "ingest_info.json").read_text())
    [failed] = info["failed_images"]
    assert failed["key"] == "000000/y" and failed["tar"] == str(tmp_path / "000000.tar") and failed["reason"]
    assert info["failed_images_total"] == 1


def test_missing_shard_is_reported_and_others_commit(tmp_path, tiny_shards, ray_local):
    with pytest.raises(IngestFailed, match="000002"):
        main(CONF, str(tmp_path / "{000000..000002}.tar"), tmp_path / "desc")
    assert sorted(p.name for p in (tmp_path / "desc").glob("*.parquet")) == ["000000.parquet", "000001.parquet"]
    info = json.loads((tmp_path / "desc" / "ingest_info.json").read_text())
    assert info["shards_failed"] == 1 and list(info["failed"]) == [str(tmp_path / "000002.tar")]


def test_committed_shards_are_skipped_unless_overwrite(tmp_path, tiny_shards, ray_local):
    out = main(CONF, str(tmp_path / "*.tar"), tmp_path / "desc")
    stamp = {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")}
    summary = (out / "ingest_info.json").read_bytes()
    main(CONF, str(tmp_path / "*.tar"), out)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")} == stamp
    assert (out / "ingest_info.json").read_bytes() == summary  # never replaced by an empty summary
    info = json.loads(summary)
    assert info["shards_processed"] == 2 and info["extractors"]


def test_a_tar_changed_since_its_commit_is_refused_naming_it(tmp_path, tiny_shards, photos, ray_local):
    from ingest.job_record import TarChangedError

    out = main(CONF, str(tmp_path / "*.tar"), tmp_path / "desc")
    write_tar(tiny_shards[0], [("a.jpg", jpeg_bytes(photos["rocket"])), ("b.jpg", jpeg_bytes(photos["coins"]))])
    with pytest.raises(TarChangedError, match=r"000000\.tar changed since its shard 000000 was committed"):
        main(CONF, str(tmp_path / "*.tar"), out)


def test_a_run_that_commits_nothing_leaves_nothing_behind(tmp_path, tiny_shards, ray_local):
    with pytest.raises(IngestFailed, match="000009"):
        main(CONF, str(tmp_path / "000009.tar"), tmp_path / "desc")
    assert not (tmp_path / "desc").exists()
    other = IngestConfig(resolution=192, batch_size=8, cpus_per_worker=1)
    out = main(other, str(tmp_path / "*.tar"), tmp_path / "desc")  # the corrected command runs
    assert len(list(out.glob("*.parquet"))) == 2


def test_resume_with_other_model_settings_is_refused(tmp_path, tiny_shards, ray_local):
    from core.errors import NeedleInputError

    out = main(CONF, str(tmp_path / "*.tar"), tmp_path / "desc")
    other = IngestConfig(resolution=192, batch_size=8, cpus_per_worker=1)
    with pytest.raises(NeedleInputError, match=r"resolution: 160 → 192.*overwrite"):
        main(other, str(tmp_path / "*.tar"), out)
