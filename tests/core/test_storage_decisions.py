"""core.storage / core.location: the local/S3 decisions callers ask of a URL, on a local path and
on an ``s3://`` prefix (a moto server on 127.0.0.1)."""

import io
import tarfile
from pathlib import Path

import pytest

from core.errors import NeedleInputError
from core.location import LocalLocation, S3Location, build_output
from core.storage import (
    canonical_url,
    local_directory,
    may_exist,
    path_or_url,
    s3_client,
    s3_matches,
    tar_headers,
)


def tar_bytes(names: list[str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in names:
            data = name.encode() * 3
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture
def bucket(request, s3_endpoint):
    name = "dec-" + request.node.name.replace("_", "-")[:40].lower()
    client = s3_client(s3_endpoint)
    client.create_bucket(Bucket=name)
    return name, client


def test_canonical_url_of_a_path_and_a_url(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert canonical_url("idx") == str(tmp_path / "idx")
    assert canonical_url(Path("idx/")) == str(tmp_path / "idx")
    assert canonical_url("s3://b/idx/") == "s3://b/idx"


def test_path_or_url_keeps_a_url_as_given(tmp_path):
    assert path_or_url(str(tmp_path / "out")) == tmp_path / "out"
    assert isinstance(path_or_url("out"), Path)
    assert path_or_url("s3://b//out/") == "s3://b//out/"


def test_local_directory_and_may_exist(tmp_path):
    (tmp_path / "f.tar").write_bytes(b"")
    assert local_directory(str(tmp_path)) == tmp_path
    assert local_directory(str(tmp_path / "f.tar")) is None
    assert local_directory(str(tmp_path / "missing")) is None
    assert local_directory("s3://b/dir") is None
    assert may_exist(str(tmp_path / "f.tar")) and may_exist(str(tmp_path))
    assert not may_exist(str(tmp_path / "missing"))
    assert may_exist("s3://b/missing.tar")  # not checked: the read names it


def test_s3_matches_leaves_local_patterns(tmp_path):
    (tmp_path / "a.tar").write_bytes(b"")
    assert s3_matches(str(tmp_path / "*.tar")) is None
    assert s3_matches(str(tmp_path / "a.tar")) is None
    assert s3_matches("s3://b/x.tar", "http://127.0.0.1:1") == ["s3://b/x.tar"]  # no glob: no request


@pytest.mark.s3
def test_s3_matches_lists_a_glob(bucket, s3_endpoint):
    name, client = bucket
    for key in ("s/001.tar", "s/000.tar", "s/000.txt", "t/002.tar"):
        client.put_object(Bucket=name, Key=key, Body=b"x")
    assert s3_matches(f"s3://{name}/s/*.tar", s3_endpoint) == [f"s3://{name}/s/000.tar", f"s3://{name}/s/001.tar"]
    assert s3_matches(f"s3://{name}/u/*.tar", s3_endpoint) == []


def test_tar_headers_of_a_local_tar(tmp_path):
    path = tmp_path / "a.tar"
    path.write_bytes(tar_bytes(["k1.jpg", "k2.json"]))
    infos = list(tar_headers(str(path)))
    assert [i.name for i in infos] == ["k1.jpg", "k2.json"]
    data = path.read_bytes()
    assert data[infos[0].offset_data : infos[0].offset_data + infos[0].size] == b"k1.jpg" * 3


@pytest.mark.s3
def test_tar_headers_of_an_s3_tar(bucket, s3_endpoint):
    name, client = bucket
    data = tar_bytes(["k1.jpg", "k2.json"])
    client.put_object(Bucket=name, Key="a.tar", Body=data)
    infos = list(tar_headers(f"s3://{name}/a.tar", s3_endpoint))
    assert [i.name for i in infos] == ["k1.jpg", "k2.json"]
    assert data[infos[1].offset_data : infos[1].offset_data + infos[1].size] == b"k2.json" * 3


@pytest.mark.s3
def test_tar_headers_of_a_missing_s3_tar(bucket, s3_endpoint):
    name, _ = bucket
    with pytest.raises(FileNotFoundError, match=r"missing\.tar"):
        list(tar_headers(f"s3://{name}/missing.tar", s3_endpoint))


def test_build_output_of_a_directory_and_a_prefix(tmp_path):
    local = build_output(tmp_path / "out")
    assert isinstance(local, LocalLocation) and local.local_root == tmp_path / "out"
    assert not (tmp_path / "out").exists()  # not made here
    s3 = build_output("s3://b/idx/", "http://127.0.0.1:1")
    assert isinstance(s3, S3Location) and s3.url == "s3://b/idx" and s3.endpoint_url == "http://127.0.0.1:1"


@pytest.mark.parametrize("output", ["gs://b/idx", "s3:/b/idx", Path("s3://b/idx"), "http://h/x"])
def test_build_output_refuses_other_urls(output):
    with pytest.raises(NeedleInputError, match="is a URL needle index build cannot write"):
        build_output(output)


@pytest.mark.s3
def test_build_output_on_s3_reads_the_prefix(bucket, s3_endpoint):
    name, _ = bucket
    location = build_output(f"s3://{name}/idx", s3_endpoint)
    location.write_json("x.json", {"a": 1})
    assert location.local_root is None and location.read_json("x.json") == {"a": 1}
