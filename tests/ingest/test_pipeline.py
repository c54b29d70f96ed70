"""process_shard without Ray: one row per sample, error rows, failed shards, atomic output."""

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from ingest.descriptors import ROW_SHARD_SHIFT, read_global
from ingest.pipeline import process_shard
from tests.support.tars import jpeg_bytes, write_tar


def test_one_row_per_sample_and_unit_norm(tmp_path, tiny_shards, extractor):
    result = process_shard(str(tiny_shards[0]), 7, tmp_path / "out", [extractor])
    assert result.status == "ok" and result.rows == 3 and result.error_rows == 0
    table = pq.read_table(result.output)
    assert table["key"].to_pylist() == ["000000/00000", "000000/00001", "000000/00002"]
    assert table["row"].to_pylist() == [(7 << ROW_SHARD_SHIFT) + i for i in range(3)]
    assert set(table["status"].to_pylist()) == {"ok"}
    _, xb = read_global(result.output)
    assert xb.dtype == np.float16 and xb.shape == (3, extractor.dim)
    np.testing.assert_allclose(np.linalg.norm(xb.astype(np.float32), axis=1), 1.0, atol=2e-3)
    assert table["width"].to_pylist()[0] == 512  # the original size is recorded, not the resized one


def test_corrupt_and_empty_images_become_error_rows(tmp_path, photos, extractor):
    good = jpeg_bytes(photos["coffee"])
    shard = write_tar(
        tmp_path / "000003.tar",
        [
            ("a.jpg", good),
            ("b.jpg", good[: len(good) // 3]),  # truncated JPEG
            ("c.jpg", b""),  # zero-byte member
            ("d.jpg", b"not an image at all"),
            ("e.json", b"{}"),  # a sample with no image member
            ("f.jpg", good),
        ],
    )
    result = process_shard(str(shard), 3, tmp_path / "out", [extractor])
    assert result.status == "ok" and result.rows == 6 and result.error_rows == 4
    table = pq.read_table(result.output).to_pydict()
    status = dict(zip(table["key"], table["status"]))
    assert status == {
        "000003/a": "ok",
        "000003/b": "error",
        "000003/c": "error",
        "000003/d": "error",
        "000003/e": "error",
        "000003/f": "ok",
    }
    errors = dict(zip(table["key"], table["error"]))
    assert "empty" in errors["000003/c"] and "no image member" in errors["000003/e"]
    vectors = dict(zip(table["key"], table["global"]))
    assert vectors["000003/a"] == pytest.approx(vectors["000003/f"])  # same bytes, same descriptor
    assert not any(vectors["000003/d"])  # error rows hold zeros


def test_truncated_tar_fails_and_writes_nothing(tmp_path, tiny_shards, extractor):
    data = tiny_shards[0].read_bytes()
    broken = tmp_path / "000009.tar"
    broken.write_bytes(data[: len(data) // 2])
    result = process_shard(str(broken), 9, tmp_path / "out", [extractor])
    assert result.status == "failed" and result.output is None and result.reason
    assert not list((tmp_path / "out").glob("*")) if (tmp_path / "out").exists() else True


def test_missing_tar_fails_with_reason(tmp_path, extractor):
    result = process_shard(str(tmp_path / "nope.tar"), 0, tmp_path / "out", [extractor])
    assert result.status == "failed" and "not found" in result.reason


def test_rerun_replaces_output_atomically(tmp_path, tiny_shards, extractor):
    first = process_shard(str(tiny_shards[0]), 0, tmp_path, [extractor])
    second = process_shard(str(tiny_shards[0]), 0, tmp_path, [extractor])
    assert first.output == second.output
    assert [p.name for p in tmp_path.iterdir() if p.suffix != ".tar"] == ["000000.parquet"]


class CutStream:
    """A file whose first reading breaks with a connection reset half-way (an S3 stream cut)."""

    opened = 0

    def __init__(self, path):
        CutStream.opened += 1
        self.data = Path(path).read_bytes()
        self.limit = len(self.data) // 2 if CutStream.opened == 1 else len(self.data)
        self.pos = 0

    def read(self, n=-1):
        if self.pos >= self.limit and self.limit < len(self.data):
            raise ConnectionResetError("connection reset by peer")
        n = len(self.data) - self.pos if n is None or n < 0 else n
        end = min(self.pos + n, self.limit if self.limit < len(self.data) else len(self.data))
        chunk, self.pos = self.data[self.pos : end], end
        return chunk

    def close(self):
        pass


def test_transient_read_failure_reads_the_shard_again(tmp_path, tiny_shards, extractor, monkeypatch):
    import ingest.pipeline

    CutStream.opened = 0
    monkeypatch.setattr(ingest.pipeline, "open_url", lambda url, endpoint_url=None: CutStream(url))
    result = process_shard(str(tiny_shards[0]), 0, tmp_path / "out", [extractor], backoff_s=0.01)
    assert CutStream.opened == 2
    assert result.status == "ok" and result.rows == 3
    assert pq.read_table(result.output).num_rows == 3  # rows of the cut read are not kept twice
