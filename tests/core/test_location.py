"""core.location: the same operations give the same answers on a local directory and on an
``s3://`` prefix (a moto server on 127.0.0.1)."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.atomic import replace_durably
from core.location import LocalLocation, S3Location, location_of, output_location
from core.storage import MARKER_SUFFIX, StorageError, s3_client


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def location(request, tmp_path):
    if request.param == "local":
        yield location_of(tmp_path / "root")
        return
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = "loc-" + request.node.name.replace("_", "-").replace("[", "-").replace("]", "")[:40].lower()
    s3_client(endpoint).create_bucket(Bucket=bucket)
    found = location_of(f"s3://{bucket}/root/", endpoint)
    yield found
    found.cleanup()


def test_location_of_tells_a_directory_from_a_prefix(tmp_path):
    assert isinstance(location_of(tmp_path), LocalLocation)
    s3 = location_of("s3://bucket/a/b/", "http://127.0.0.1:1")
    assert isinstance(s3, S3Location) and s3.url == "s3://bucket/a/b" and s3.local_root is None
    assert s3.url_of("x/y.json") == "s3://bucket/a/b/x/y.json" and s3.endpoint_url == "http://127.0.0.1:1"
    assert location_of(tmp_path).url_of("x") == str(tmp_path / "x")


def test_output_location_makes_a_directory(tmp_path):
    location = output_location(tmp_path / "out" / "desc")
    assert location.local_root is not None and location.local_root.is_dir()


def test_json_and_bytes(location):
    assert location.read_bytes("a.json") is None and location.read_json("a.json") is None
    url = location.write_json("a.json", {"b": 1, "a": [2]})
    assert url == location.url_of("a.json")
    assert location.read_bytes("a.json") == b'{\n  "a": [\n    2\n  ],\n  "b": 1\n}\n'
    assert location.read_json("a.json") == {"a": [2], "b": 1}
    location.write_json("sub/c.json", {"c": 3})  # a directory is made where needed
    assert location.read_json("sub/c.json") == {"c": 3}
    assert location.read_required("sub/c.json") == location.read_bytes("sub/c.json")
    with pytest.raises(StorageError, match=r"sub/nope\.json"):  # the error names the file
        location.read_required("sub/nope.json")


def test_exclusive_create_and_replace(location):
    location.create_exclusive("g/000001.json", b"first")
    with pytest.raises(FileExistsError):
        location.create_exclusive("g/000001.json", b"second")
    assert location.read_bytes("g/000001.json") == b"first"
    location.replace("g/000001.json", b"0123456789")
    assert location.read_bytes("g/000001.json") == b"0123456789"
    assert location.read_range("g/000001.json", 3, 4) == b"3456"
    assert location.read_range("g/000001.json", 3, 0) == b""
    assert location.list("g") == ["g/000001.json"]


def test_upload_download_and_local_copy(location, tmp_path):
    source = tmp_path / "made" / "v.npy"
    source.parent.mkdir()
    np.save(source, np.arange(5))
    data = source.read_bytes()
    location.upload("seg/v.npy", source, sha256="abc")
    stat = location.stat("seg/v.npy")
    assert stat is not None and stat.size == len(data)
    assert stat.sha256 == (None if location.local_root is not None else "abc")  # a directory keeps no checksum
    assert location.stat("seg/nope.npy") is None
    target = tmp_path / "copy.npy"
    location.download("seg/v.npy", target)
    assert target.read_bytes() == data
    copy = location.local_copy("seg/v.npy", tmp_path / "cache")
    assert copy.read_bytes() == data
    assert (location.local_root is None) == (copy == tmp_path / "cache" / "seg" / "v.npy")


def test_list_and_remove(location):
    for name in ("seg_a/x.bin", "seg_a/y.bin", "seg_b/x.bin", "deletes/1.npy"):
        location.replace(name, b"x")
    assert location.list("seg_a") == ["seg_a/x.bin", "seg_a/y.bin"]
    assert location.list("nope") == []
    location.remove(["seg_a", "deletes/1.npy"])
    assert location.list("seg_a") == [] and location.list("deletes") == []
    assert location.read_bytes("seg_b/x.bin") == b"x"


def test_commit_parts(location):
    assert location.committed() == {}
    scratch = location.local_scratch()
    scratch.mkdir(parents=True, exist_ok=True)
    part = scratch / "000000.parquet.tmp"
    pq.write_table(pa.table({"key": ["a", "b", "c"]}), part)
    url = location.commit_file("000000.parquet", part, {"rows": 3})
    assert url == location.url_of("000000.parquet") and not part.exists()
    assert location.committed() == {"000000.parquet": {"rows": 3}}
    if location.local_root is None:  # the marker is a small JSON beside the object
        assert json.loads(location.read_bytes("000000.parquet" + MARKER_SUFFIX)) == {"rows": 3}


def test_scratch_of_a_prefix_is_removed_by_cleanup(location):
    scratch = location.local_scratch()
    if location.local_root is not None:
        assert scratch == location.local_root  # made in place: the final rename is atomic
        return
    assert scratch.is_dir()
    location.cleanup()
    assert not scratch.exists()


def test_listing_the_top_level_names_every_entry(location):
    """``list("")`` lists the location's own top level, on S3 as in a directory (it once listed
    ``<prefix>//`` and found nothing, so compaction never removed a superseded segment on S3)."""
    for name in ("a.json", "seg_a/x.bin", "seg_a/sub/y.bin", "deletes/1.npy"):
        location.replace(name, b"x")
    assert location.list("") == ["a.json", "deletes", "seg_a"]
    assert location.list("seg_a") == ["seg_a/sub", "seg_a/x.bin"]
    assert location.list("seg_a/") == ["seg_a/sub", "seg_a/x.bin"]


@pytest.mark.s3
def test_listing_the_root_of_a_bucket(s3_endpoint):
    s3_client(s3_endpoint).create_bucket(Bucket="loc-top")
    location = location_of("s3://loc-top", s3_endpoint)
    location.replace("a.json", b"{}")
    location.replace("d/b.json", b"{}")
    assert location.list("") == ["a.json", "d"] and location.list("d") == ["d/b.json"]


def test_removing_a_link_removes_the_link_never_its_target(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    root = tmp_path / "index"
    root.mkdir()
    (root / "seg_link").symlink_to(outside)
    location_of(root).remove(["seg_link"])
    assert not (root / "seg_link").exists() and (outside / "keep.txt").read_text() == "mine"


def test_a_file_moves_across_filesystems_whole(tmp_path, monkeypatch):
    """``upload`` of a local index renames its file into place; where the scratch is on another
    filesystem (EXDEV), it copies beside the target and renames that."""
    import errno
    import os as os_module

    real = os_module.replace
    source = tmp_path / "scratch.npy"
    source.write_bytes(b"rows")

    def cross_device(a, b):
        if Path(a) == source:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(a, b)

    monkeypatch.setattr("core.location.os.replace", cross_device)
    location_of(tmp_path / "index").upload("deletes/1.npy", source)
    assert (tmp_path / "index" / "deletes" / "1.npy").read_bytes() == b"rows" and not source.exists()
    assert [p.name for p in (tmp_path / "index" / "deletes").iterdir()] == ["1.npy"]


def test_replace_durably_leaves_no_temporary_file(tmp_path):
    target = replace_durably(tmp_path / "d" / "CURRENT.json", b"1")
    replace_durably(target, b"2")
    assert target.read_bytes() == b"2" and [p.name for p in target.parent.iterdir()] == ["CURRENT.json"]
