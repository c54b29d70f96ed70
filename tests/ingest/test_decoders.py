"""The ingest worker's decoders: PIL in processes gives PIL's pixels and error rows, and which
batched decoder each setting means on a CPU and a GPU worker."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from cluster.ingest_job import make_batch_decoder
from core.errors import NeedleInputError
from embed.extract import GlobalExtractor
from ingest.config import IngestConfig
from ingest.pipeline import process_shard
from ingest.process_decode import ProcessDecoder
from tests.support.tars import jpeg_bytes, write_tar

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: one intra-op thread


def test_pil_in_processes_gives_the_threads_rows(tmp_path, photos):
    samples = [(f"{i:03d}.jpg", jpeg_bytes(photo)) for i, photo in enumerate(photos.values())]
    samples.append(("bad.jpg", b"not a jpeg"))
    url = str(write_tar(tmp_path / "000000.tar", samples))
    extractor = GlobalExtractor(resolution=64)
    decoder = ProcessDecoder(2)
    try:
        in_processes = process_shard(url, 0, tmp_path / "processes", [extractor], batch_decoder=decoder)
    finally:
        decoder.close()
    in_threads = process_shard(url, 0, tmp_path / "threads", [extractor])
    a, b = pq.read_table(in_processes.output).to_pydict(), pq.read_table(in_threads.output).to_pydict()
    assert in_processes.rows == len(samples) and in_processes.error_rows == 1
    assert a["status"] == b["status"] and a["key"] == b["key"]
    assert "bad" in a["key"][-1] and a["error"][-1]  # the undecodable sample is an error row, named
    np.testing.assert_array_equal(np.array(a["global"]), np.array(b["global"]))


def test_which_decoder_each_setting_means():
    assert IngestConfig().decoder == "auto"
    assert make_batch_decoder("auto", False, "cpu", 2) is None  # a CPU worker: PIL on threads
    assert make_batch_decoder("pil", True, "cuda", 2) is None
    assert make_batch_decoder("nvjpeg", False, "cpu", 2) is None  # nvjpeg needs a GPU: PIL
    decoder = make_batch_decoder("pil-processes", False, "cpu", 1)
    assert isinstance(decoder, ProcessDecoder) and decoder.concurrency == 1
    decoder.close()
    with pytest.raises(NeedleInputError, match="turbo"):
        IngestConfig(decoder="turbo")
