"""Ingestion from s3:// to s3:// against a real S3 server (moto, on 127.0.0.1)."""

import io
import json

import pyarrow.parquet as pq
import pytest

from core.location import S3Location, location_of
from core.storage import MARKER_SUFFIX, StorageError, open_url, s3_client

pytestmark = [pytest.mark.s3]


@pytest.fixture
def buckets(s3_endpoint, tiny_shards, request):
    client = s3_client(s3_endpoint)
    suffix = request.node.name.replace("_", "-")[:40].lower()
    src, dst = f"in-{suffix}", f"out-{suffix}"
    client.create_bucket(Bucket=src)
    client.create_bucket(Bucket=dst)
    for path in tiny_shards:
        client.upload_file(str(path), src, f"shards/{path.name}")
    return client, src, dst


def fail_first(client, operation: str, status: int = 500) -> list[str]:
    """Make the first ``operation`` request answer ``status``; returns the list of calls seen."""
    from botocore.awsrequest import AWSResponse

    class EmptyBody:  # what botocore reads from a raw HTTP response
        def stream(self, *args, **kwargs):
            yield b""

    calls = []

    def handler(request, **kwargs):
        calls.append(request.url)
        if len(calls) == 1:
            return AWSResponse(request.url, status, {}, EmptyBody())
        return None

    client.meta.events.register(f"before-send.s3.{operation}", handler)
    return calls


def test_injected_s3_failures_are_retried(s3_endpoint, buckets):
    _client, _src, dst = buckets
    storage = S3Location(f"s3://{dst}/x", s3_endpoint)
    calls = fail_first(storage.client, "PutObject", 503)
    storage.write_json("a.json", {"ok": 1})
    assert len(calls) == 2 and storage.read_json("a.json") == {"ok": 1}


def test_uncommitted_parts_are_invisible(s3_endpoint, buckets):
    client, _src, dst = buckets
    storage = S3Location(f"s3://{dst}/d", s3_endpoint)
    client.put_object(Bucket=dst, Key="d/000000.parquet", Body=b"half an upload")
    assert storage.committed() == {}
    client.put_object(Bucket=dst, Key="d/000000.parquet" + MARKER_SUFFIX, Body=b'{"rows": 3}')
    assert storage.committed() == {"000000.parquet": {"rows": 3}}


def test_missing_object_reads_as_not_found(s3_endpoint, buckets):
    _, src, _ = buckets
    with pytest.raises(FileNotFoundError):
        open_url(f"s3://{src}/shards/nope.tar", s3_endpoint)


def test_files_under_a_prefix_read_and_copy_as_under_a_directory(s3_endpoint, buckets, tiny_shards, tmp_path):
    _, src, _ = buckets
    local_root, name = str(tiny_shards[0].parent), tiny_shards[0].name
    expected = tiny_shards[0].read_bytes()
    for root in (f"s3://{src}/shards", local_root):
        location = location_of(root, s3_endpoint)
        assert location.read_required(name) == expected
        target = tmp_path / f"copy-{len(root)}"
        location.download(name, target)
        assert target.read_bytes() == expected
        with pytest.raises(StorageError, match=r"nope\.tar"):  # the error names the file
            location.read_required("nope.tar")


@pytest.mark.ray
@pytest.mark.slow
def test_ingest_s3_to_s3_then_index(s3_endpoint, buckets, ray_local, tmp_path):
    from cluster.ingest_job import main
    from ingest.config import IngestConfig

    client, src, dst = buckets
    conf = IngestConfig(resolution=160, batch_size=8, cpus_per_worker=1, s3_endpoint_url=s3_endpoint)
    main(conf, f"s3://{src}/shards/*.tar", f"s3://{dst}/desc")
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=dst, Prefix="desc/")["Contents"]}
    assert {
        "desc/000000.parquet",
        "desc/000001.parquet",
        "desc/000000.parquet.committed",
        "desc/manifest.json",
        "desc/ingest_info.json",
    } <= keys
    rows = []
    for name in ("000000", "000001"):
        body = client.get_object(Bucket=dst, Key=f"desc/{name}.parquet")["Body"].read()
        rows += pq.read_table(io.BytesIO(body))["key"].to_pylist()
    assert sorted(rows) == sorted(f"{s:06d}/{s:02d}{i:03d}" for s in range(2) for i in range(3))
    info = json.loads(client.get_object(Bucket=dst, Key="desc/ingest_info.json")["Body"].read())
    assert info["shards_ok"] == 2 and info["images"] == 6
    # The index builds from the committed parts on S3 and knows how they were made.
    from index.build.stage import IndexConfig
    from index.build.stage import main as build_index
    from index.search import load_index

    client.put_object(Bucket=dst, Key="desc/999999.parquet", Body=b"an upload without its marker")
    index = load_index(build_index(IndexConfig(s3_endpoint_url=s3_endpoint), f"s3://{dst}/desc", tmp_path / "index"))
    assert index.ntotal == 6 and index.infos["extractors"][0]["resolution"] == 160
    _D, I = index.search(index.vector_of("000001/01002")[None], 1)
    assert index.keys_of(I)[0] == ["000001/01002"]
    assert not (tmp_path / "index" / "staging").exists()
    # Run again: everything is committed (the tars' fingerprints match), nothing is redone, and the
    # summary of the run that did the work stays.
    main(conf, f"s3://{src}/shards/{{000000..000001}}.tar", f"s3://{dst}/desc")
    info = json.loads(client.get_object(Bucket=dst, Key="desc/ingest_info.json")["Body"].read())
    assert info["shards_processed"] == 2 and info["shards_committed_total"] == 2
    manifest = json.loads(client.get_object(Bucket=dst, Key="desc/manifest.json")["Body"].read())
    assert all(entry["tar_bytes"] > 0 and entry["tar_sha256_ends"] for entry in manifest["shards"].values())
