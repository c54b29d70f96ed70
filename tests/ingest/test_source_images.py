"""A key's image read again from its source tar: every member's bytes exactly as tarfile extracts
them, from a local tar (seek) and from S3 (one ranged GET after one listing pass); bounded memory
per tar; tars found through what the index or ingestion recorded, or a tar dir."""

import io
import json
import tarfile

import numpy as np
import pytest
from PIL import Image

from ingest.source_images import (
    SourceImages,
    SourceImagesConfig,
    recorded_tar_urls,
    tar_urls_of_files,
    thumbnail_jpeg,
)
from tests.support.tars import jpeg_bytes, write_tar


def sample_tar(path, n=12, seed=0):
    """A tar of n samples (a JPEG and a JSON each; one sample's image is a PNG)."""
    rng = np.random.default_rng(seed)
    members = []
    for i in range(n):
        image = rng.integers(0, 256, (20 + i, 30, 3), dtype=np.uint8)
        if i == 5:
            buffer = io.BytesIO()
            Image.fromarray(image).save(buffer, format="PNG")
            members.append((f"{i:05d}.png", buffer.getvalue()))
        else:
            members.append((f"{i:05d}.jpg", jpeg_bytes(image)))
        members.append((f"{i:05d}.json", json.dumps({"i": i}).encode()))
    return write_tar(path, members)


def extracted(path):
    """Each sample's image bytes as tarfile extracts them (the reference)."""
    with tarfile.open(path) as tar:
        return {
            m.name.split(".")[0]: tar.extractfile(m).read()
            for m in tar.getmembers()
            if m.name.endswith((".jpg", ".png"))
        }


def test_local_tar_members_read_exactly(tmp_path):
    tar = sample_tar(tmp_path / "000003.tar")
    images = SourceImages({"000003": str(tar)})
    for key, data in extracted(tar).items():
        assert images.image_bytes(f"000003/{key}") == data
    with pytest.raises(FileNotFoundError, match="00099"):
        images.image_bytes("000003/00099")
    with pytest.raises(FileNotFoundError, match="--shard-dir"):
        images.image_bytes("000004/00001")
    jpeg = thumbnail_jpeg(images.image_bytes("000003/00005"), 16)
    assert max(Image.open(io.BytesIO(jpeg)).size) == 16


def test_member_offsets_kept_for_a_bounded_number_of_tars(tmp_path):
    tars = {f"{s:06d}": str(sample_tar(tmp_path / f"{s:06d}.tar", 3, s)) for s in range(5)}
    images = SourceImages(tars, SourceImagesConfig(max_tars=2))
    for shard in tars:
        images.image_bytes(f"{shard}/00001")
    assert list(images._members) == [tars["000003"], tars["000004"]]  # the two most recently used


def test_tar_dirs_and_image_directories(tmp_path):
    (tmp_path / "tars").mkdir()
    tar = sample_tar(tmp_path / "tars" / "000001.tar")
    reference = extracted(tar)
    gone = SourceImages(
        {"000001": str(tmp_path / "moved" / "000001.tar")}, SourceImagesConfig((str(tmp_path / "tars"),))
    )
    assert gone.image_bytes("000001/00002") == reference["00002"]  # the recorded path is gone: found in a tar dir
    with pytest.raises(FileNotFoundError, match="moved"):
        SourceImages({"000001": str(tmp_path / "moved" / "000001.tar")}).image_bytes("000001/00002")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.jpg").write_bytes(reference["00000"])
    assert SourceImages({"folder": str(tmp_path / "folder")}).image_bytes("folder/a") == reference["00000"]


def test_tar_urls_from_shard_infos_or_ingestion_records(tmp_path):
    desc = tmp_path / "desc"
    desc.mkdir()
    (desc / "ingest_info.json").write_text(
        json.dumps({"results": [{"shard": "000002", "url": "/data/000002.tar"}], "config": {"s3_endpoint_url": "x"}})
    )
    (desc / "manifest.json").write_text(json.dumps({"shards": {"000005": {"url": "s3://b/000005.tar"}}}))
    assert recorded_tar_urls(desc) == ({"000002": "/data/000002.tar", "000005": "s3://b/000005.tar"}, "x")
    files = [
        {"path": "s3://bucket/desc/000001.parquet", "tar": "s3://bucket/tars/000001.tar"},
        {"path": str(desc / "000002.parquet")},  # built before `tar` was recorded: the record beside it
        {"path": str(desc / "000009.parquet")},  # recorded nowhere
    ]
    assert tar_urls_of_files(files) == {"000001": "s3://bucket/tars/000001.tar", "000002": "/data/000002.tar"}


@pytest.mark.s3
def test_s3_tar_members_read_by_ranged_gets(tmp_path, s3_endpoint):
    from core.storage import s3_client

    tar = sample_tar(tmp_path / "000007.tar", 30)
    client = s3_client(s3_endpoint)
    client.create_bucket(Bucket="images")
    client.upload_file(str(tar), "images", "tars/000007.tar")
    images = SourceImages({"000007": "s3://images/tars/000007.tar"}, SourceImagesConfig(endpoint_url=s3_endpoint))
    for key, data in extracted(tar).items():
        assert images.image_bytes(f"000007/{key}") == data
    assert len(images._members) == 1
    with pytest.raises(FileNotFoundError):
        SourceImages(
            {"000008": "s3://images/tars/000008.tar"}, SourceImagesConfig(endpoint_url=s3_endpoint)
        ).image_bytes("000008/00001")
