"""needle pack: a folder of images as WebDataset tars that needle ingest reads unchanged."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from core.errors import NeedleInputError, PackInputError
from ingest.pack import INFO_NAME, PackConfig, member_suffix, sample_key, unique_keys
from ingest.pack import main as pack
from ingest.pack.record import RECORD_NAME
from tests.support.tars import jpeg_bytes


def _png_bytes(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def _small(photo: np.ndarray, step: int = 8) -> np.ndarray:
    return np.ascontiguousarray(photo[::step, ::step])


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.fixture
def folder(tmp_path, photos) -> dict[str, bytes]:
    """A nested folder of real images with dots, clashes and a non-image file; returns {relative path: bytes}."""
    root = tmp_path / "photos"
    names = list(photos)
    files = {
        "a/b/photo.01.JPG": jpeg_bytes(_small(photos[names[0]])),
        "a/b/photo_01.png": _png_bytes(_small(photos[names[1]])),
        "a/b/photo.01.jpeg": jpeg_bytes(_small(photos[names[2]])),
        "holiday 2019/café.jpg": jpeg_bytes(_small(photos[names[3]])),
        "x.jpg": jpeg_bytes(_small(photos[names[4]])),
        "x.PNG": _png_bytes(_small(photos[names[5]])),
    }
    for rel, data in files.items():
        _write(root / rel, data)
    (root / "notes.txt").write_text("not an image\n")
    return files


def _members(tar_path: Path) -> list[tarfile.TarInfo]:
    with tarfile.open(tar_path) as tar:
        return tar.getmembers()


def _read_members(tar_path: Path) -> dict[str, bytes]:
    with tarfile.open(tar_path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- keys ----------------------------------------------------------------------------------------


def test_keys_from_relative_paths_drop_dots_and_unsafe_characters():
    assert sample_key("a/b/photo.01.JPG") == "a/b/photo_01"
    assert sample_key("x.jpg") == "x"
    assert sample_key("d.e/f g.tif") == "d_e/f_g"  # dots in directories too: no key holds a dot
    assert sample_key("holiday 2019/café.jpg") == "holiday_2019/caf_"
    assert sample_key("we~ird#name.png") == "we_ird_name"  # "~" is kept for clash suffixes
    assert sample_key("__meta__/x.jpg") == "-_meta__/x"  # webdataset would skip members under __meta__/
    assert sample_key("__x__.jpg") == "__x__"  # a top-level file is not: "__x__.jpg" is no metadata name
    assert member_suffix(".JPG") == member_suffix(".jpeg") == member_suffix(".JPEG") == "jpg"
    assert member_suffix(".TIFF") == "tif" and member_suffix(".PNG") == "png" and member_suffix(".webp") == "webp"


def test_clashing_keys_get_stable_suffixes_in_sorted_order():
    sources = ["a.b.jpg", "a_b.jpg", "x.jpg", "x.png", "x.webp", "y.jpg"]
    assert unique_keys(sources) == ["a_b", "a_b~1", "x", "x~1", "x~2", "y"]
    assert unique_keys(sources) == unique_keys(list(sources))  # a function of the list alone
    assert len(set(unique_keys(["p.q.jpg", "p_q.jpg", "p q.jpg", "p-q.jpg"]))) == 4


# --- tars ----------------------------------------------------------------------------------------


def test_pack_writes_original_bytes_keys_and_json(tmp_path, folder):
    out = pack(PackConfig(), tmp_path / "photos", tmp_path / "tars")
    assert out == tmp_path / "tars"
    assert sorted(p.name for p in out.iterdir()) == ["000000.tar", INFO_NAME, RECORD_NAME]
    members = _read_members(out / "000000.tar")
    # sorted by path components: "a/b/photo.01.JPG" < "a/b/photo.01.jpeg" < "a/b/photo_01.png" < ...
    expected = [
        ("a/b/photo.01.JPG", "a/b/photo_01", "jpg"),
        ("a/b/photo.01.jpeg", "a/b/photo_01~1", "jpg"),
        ("a/b/photo_01.png", "a/b/photo_01~2", "png"),
        ("holiday 2019/café.jpg", "holiday_2019/caf_", "jpg"),
        ("x.PNG", "x", "png"),
        ("x.jpg", "x~1", "jpg"),
    ]
    names = [m.name for m in _members(out / "000000.tar")]
    assert names == [n for _, key, suffix in expected for n in (f"{key}.{suffix}", f"{key}.json")]
    for source, key, suffix in expected:
        assert members[f"{key}.{suffix}"] == folder[source]  # stored as is, never re-encoded
        meta = json.loads(members[f"{key}.json"])
        with Image.open(io.BytesIO(folder[source])) as img:
            size, fmt = img.size, img.format
        assert meta == {
            "key": key,
            "source": source,
            "bytes": len(folder[source]),
            "width": size[0],
            "height": size[1],
            "format": fmt,
        }
    info = json.loads((out / INFO_NAME).read_text())
    assert info["status"] == "complete" and info["images"] == 6 and info["ignored_files"] == 1
    assert info["source"] == str(tmp_path / "photos") and info["skipped"] == []
    assert {r["source"]: r["key"] for r in info["renamed_keys"]} == {
        "a/b/photo.01.jpeg": "a/b/photo_01~1",
        "a/b/photo_01.png": "a/b/photo_01~2",
        "x.jpg": "x~1",
    }
    assert info["config"]["shard_size"] == 1000


def test_shards_split_by_shard_size(tmp_path, photos):
    for i in range(7):
        _write(tmp_path / "src" / f"img{i}.jpg", jpeg_bytes(_small(list(photos.values())[i % 6], 16)))
    out = pack(PackConfig(shard_size=3), tmp_path / "src", tmp_path / "tars")
    tars = sorted(out.glob("*.tar"))
    assert [t.name for t in tars] == ["000000.tar", "000001.tar", "000002.tar"]
    assert [len(_members(t)) // 2 for t in tars] == [3, 3, 1]
    assert [m.name for m in _members(tars[1])] == [f"img{i}.{s}" for i in (3, 4, 5) for s in ("jpg", "json")]
    info = json.loads((out / INFO_NAME).read_text())
    assert [(s["tar"], s["samples"], s["first_key"], s["last_key"]) for s in info["shards"]] == [
        ("000000.tar", 3, "img0", "img2"),
        ("000001.tar", 3, "img3", "img5"),
        ("000002.tar", 1, "img6", "img6"),
    ]
    assert info["ingest_shards"] == str(out / "{000000..000002}.tar") and info["num_shards"] == 3


def test_not_recursive_packs_the_top_level_only(tmp_path, folder):
    out = pack(PackConfig(recursive=False), tmp_path / "photos", tmp_path / "tars")
    assert [m.name for m in _members(out / "000000.tar")] == ["x.png", "x.json", "x~1.jpg", "x~1.json"]


def test_rerun_is_byte_identical_and_stale_tars_are_removed(tmp_path, folder, caplog):
    src, out = tmp_path / "photos", tmp_path / "tars"
    pack(PackConfig(shard_size=2), src, out)
    first = {p.name: _sha(p) for p in sorted(out.iterdir())}
    assert sorted(first) == ["000000.tar", "000001.tar", "000002.tar", INFO_NAME, RECORD_NAME]
    for info in _members(out / "000001.tar"):
        assert (info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode) == (0, 0, 0, "", "", 0o644)
    again = pack(PackConfig(shard_size=2), src, tmp_path / "again")  # same files, an empty directory
    assert {p.name: _sha(p) for p in sorted(again.glob("*.tar"))} == {n: h for n, h in first.items() if "tar" in n}
    for path in src.rglob("*"):  # new timestamps, and the listing order of the directory may change
        os.utime(path, (1_700_000_000, 1_700_000_000))
    pack(PackConfig(shard_size=2), src, out)
    tars = {n: h for n, h in first.items() if n.endswith(".tar")}
    assert {p.name: _sha(p) for p in sorted(out.glob("*.tar"))} == tars
    assert json.loads((out / INFO_NAME).read_text())["changed_sources"] == []  # same bytes, new mtimes

    (src / "x.jpg").unlink()
    (src / "x.PNG").unlink()
    (out / "000005.tar.tmp").write_bytes(b"left by a crashed run")
    with caplog.at_level(logging.WARNING):
        pack(PackConfig(shard_size=2), src, out)
    # gone files stay in their tars (descriptors were made of them): nothing is rewritten
    assert {p.name: _sha(p) for p in sorted(out.glob("*.tar"))} == tars
    assert not (out / "000005.tar.tmp").exists() and "000005.tar.tmp" in caplog.text
    info = json.loads((out / INFO_NAME).read_text())
    assert info["removed_stale_tars"] == ["000005.tar.tmp"] and info["images"] == 6
    assert info["missing_sources"] == ["x.PNG", "x.jpg"] and info["added_shards"] == []


def test_rerun_on_a_grown_folder_appends_new_tars(tmp_path, folder, photos, caplog):
    src, out = tmp_path / "photos", tmp_path / "tars"
    pack(PackConfig(shard_size=4), src, out)
    before = {p.name: _sha(p) for p in sorted(out.glob("*.tar"))}
    assert sorted(before) == ["000000.tar", "000001.tar"]
    names = list(photos)
    _write(src / "new/a.jpg", jpeg_bytes(_small(photos[names[0]], 6)))
    _write(src / "x.jpeg", jpeg_bytes(_small(photos[names[1]], 6)))  # its key clashes with packed x and x~1
    changed = src / "holiday 2019/café.jpg"
    changed.write_bytes(jpeg_bytes(_small(photos[names[2]], 5)))  # a packed file, rewritten
    with caplog.at_level(logging.WARNING):
        pack(PackConfig(shard_size=4), src, out)
    after = {p.name: _sha(p) for p in sorted(out.glob("*.tar"))}
    assert {n: after[n] for n in before} == before  # every existing tar byte-identical
    assert sorted(after) == ["000000.tar", "000001.tar", "000002.tar"]
    assert [m.name for m in _members(out / "000002.tar")] == ["new/a.jpg", "new/a.json", "x~2.jpg", "x~2.json"]
    info = json.loads((out / INFO_NAME).read_text())
    assert info["added_shards"] == ["000002.tar"] and info["added_images"] == 2 and info["images"] == 8
    assert info["num_shards"] == 3 and info["ingest_shards"].endswith("{000000..000002}.tar")
    [change] = info["changed_sources"]
    assert change["source"] == "holiday 2019/café.jpg" and "000000.tar" in change["reason"]
    assert "café.jpg changed since it was packed" in caplog.text

    pack(PackConfig(shard_size=4), src, out)  # nothing new: nothing written
    assert {p.name: _sha(p) for p in sorted(out.glob("*.tar"))} == after
    assert json.loads((out / INFO_NAME).read_text())["added_shards"] == []


def test_append_to_a_directory_an_earlier_pack_wrote_without_a_record(tmp_path, folder, photos):
    src, out = tmp_path / "photos", tmp_path / "tars"
    pack(PackConfig(shard_size=4), src, out)
    (out / RECORD_NAME).unlink()  # as needle pack wrote it before it kept a record
    _write(src / "zz.jpg", jpeg_bytes(_small(photos["coins"])))
    pack(PackConfig(shard_size=4), src, out)
    assert [m.name for m in _members(out / "000002.tar")] == ["zz.jpg", "zz.json"]
    record = [json.loads(line) for line in (out / RECORD_NAME).read_text().splitlines()]
    assert len(record) == 7 and {r["tar"] for r in record} == {"000000.tar", "000001.tar", "000002.tar"}


def test_refuses_a_tar_renamed_or_replaced_in_its_own_directory(tmp_path, folder):
    src, out = tmp_path / "photos", tmp_path / "tars"
    pack(PackConfig(shard_size=4), src, out)
    (out / "000001.tar").rename(out / "000007.tar")
    with pytest.raises(PackInputError, match=r"000001\.tar is recorded .* but missing"):
        pack(PackConfig(shard_size=4), src, out)
    (out / "000007.tar").rename(out / "000001.tar")
    (out / "000009.tar").write_bytes(b"a tar from elsewhere")
    with pytest.raises(PackInputError, match=r"000009\.tar was not written by needle pack"):
        pack(PackConfig(shard_size=4), src, out)
    assert (out / "000009.tar").read_bytes() == b"a tar from elsewhere"


def test_a_failed_first_pack_leaves_no_directory(tmp_path):
    src = _write(tmp_path / "src" / "broken.jpg", b"not a jpeg").parent
    with pytest.raises(PackInputError, match="no readable image"):
        pack(PackConfig(), src, tmp_path / "tars")
    assert not (tmp_path / "tars").exists()


def test_refuses_tars_it_did_not_write(tmp_path, folder):
    out = tmp_path / "tars"
    out.mkdir()
    (out / "000000.tar").write_bytes(b"someone else's shard")
    with pytest.raises(PackInputError, match=r"000000\.tar"):
        pack(PackConfig(), tmp_path / "photos", out)
    assert (out / "000000.tar").read_bytes() == b"someone else's shard"


def test_unreadable_files_are_reported_and_skipped(tmp_path, photos, caplog):
    src = tmp_path / "src"
    good = jpeg_bytes(_small(photos["astronaut"]))
    _write(src / "good.jpg", good)
    _write(src / "garbage.jpg", b"this is not a jpeg at all" * 10)
    _write(src / "empty.png", b"")
    _write(src / "truncated.jpg", good[: len(good) // 2])
    png = bytearray(_png_bytes(_small(photos["coins"])))
    png[len(png) // 2] ^= 0xFF  # a byte of the image data: opens, fails the CRC check of verify()
    _write(src / "corrupt.png", bytes(png))
    _write(src / "zz.jpg", jpeg_bytes(_small(photos["coffee"])))
    with caplog.at_level(logging.WARNING):
        out = pack(PackConfig(), src, tmp_path / "tars")
    for name in ("garbage.jpg", "empty.png", "corrupt.png"):
        assert str(src / name) in caplog.text
    info = json.loads((out / INFO_NAME).read_text())
    reasons = {s["source"]: s["reason"] for s in info["skipped"]}
    assert set(reasons) == {"corrupt.png", "empty.png", "garbage.jpg"}
    assert "empty" in reasons["empty.png"] and "not a decodable image" in reasons["garbage.jpg"]
    # PIL's header check passes a truncated JPEG: packed as is (ingestion makes it an error row)
    assert [m.name for m in _members(out / "000000.tar")][::2] == ["good.jpg", "truncated.jpg", "zz.jpg"]
    assert info["images"] == 3 and info["candidates"] == 6

    out = pack(PackConfig(full_check=True), src, tmp_path / "tars_checked")
    info = json.loads((out / INFO_NAME).read_text())
    assert {s["source"] for s in info["skipped"]} == {"corrupt.png", "empty.png", "garbage.jpg", "truncated.jpg"}
    assert [m.name for m in _members(out / "000000.tar")][::2] == ["good.jpg", "zz.jpg"]


def test_symlinks_skipped_unless_followed(tmp_path, photos):
    src = tmp_path / "src"
    _write(src / "real" / "a.jpg", jpeg_bytes(_small(photos["rocket"])))
    (src / "link.jpg").symlink_to(src / "real" / "a.jpg")
    (src / "linked_dir").symlink_to(src / "real", target_is_directory=True)
    (src / "real" / "loop").symlink_to(src, target_is_directory=True)
    out = pack(PackConfig(), src, tmp_path / "tars")
    info = json.loads((out / INFO_NAME).read_text())
    assert {s["source"] for s in info["skipped"]} == {"link.jpg", "linked_dir", "real/loop"}
    assert info["images"] == 1

    out = pack(PackConfig(follow_symlinks=True), src, tmp_path / "tars_followed")
    info = json.loads((out / INFO_NAME).read_text())
    # real/ is reached twice (as linked_dir/ first, in name order) and walked once; the loop is cut
    assert [m.name for m in _members(out / "000000.tar")][::2] == ["link.jpg", "linked_dir/a.jpg"]
    reasons = {s["source"]: s["reason"] for s in info["skipped"]}
    assert set(reasons) == {"linked_dir/loop", "real"} and "already walked" in reasons["real"]


@pytest.mark.parametrize("case", ["missing", "empty", "unreadable", "list", "shard_size", "out_is_file", "extension"])
def test_bad_input_raises_a_typed_error_naming_it(tmp_path, photos, case):
    src, out = tmp_path / "src", tmp_path / "tars"
    _write(src / "a.jpg", jpeg_bytes(_small(photos["coins"])))
    conf = PackConfig()
    if case == "missing":
        src, expected = tmp_path / "nope", str(tmp_path / "nope")
    elif case == "empty":
        src = tmp_path / "empty"
        _write(src / "readme.txt", b"no images here")
        expected = str(src)
    elif case == "unreadable":
        src = tmp_path / "broken"
        _write(src / "a.jpg", b"")
        _write(src / "b.png", b"\x89PNG garbage")
        expected = str(src)
    elif case == "list":
        src = _write(tmp_path / "list.txt", b"src/readme.txt\n\n")
        expected = "readme.txt"
    elif case == "shard_size":
        conf, expected = PackConfig(shard_size=0), "shard_size"
    elif case == "out_is_file":
        out.write_bytes(b"a file")
        expected = str(out)
    else:
        conf, expected = PackConfig(extensions=("jpg", "gif")), "gif"
    with pytest.raises(NeedleInputError, match=expected.replace(".", r"\.")) as caught:
        pack(conf, src, out)
    assert isinstance(caught.value, PackInputError)
    assert not (out / "000000.tar").exists()


def test_list_file_and_path_list_give_the_directory_keys(tmp_path, folder):
    src = tmp_path / "photos"
    by_dir = pack(PackConfig(shard_size=4), src, tmp_path / "by_dir")
    lists = tmp_path / "lists"
    lists.mkdir()
    entries = [os.path.relpath(src / rel, lists) for rel in reversed(list(folder))]  # relative to the list, any order
    entries[0] = str(src / list(folder)[-1])  # an absolute path
    listing = lists / "images.txt"
    listing.write_text("\n".join([*entries, "", entries[1], "../photos/notes.txt", "../photos/gone.jpg"]) + "\n")
    by_list = pack(PackConfig(shard_size=4), listing, tmp_path / "by_list")
    for name in ("000000.tar", "000001.tar"):
        assert _sha(by_list / name) == _sha(by_dir / name)
    info = json.loads((by_list / INFO_NAME).read_text())
    assert info["source"] == str(src)
    reasons = {s["source"]: s["reason"] for s in info["skipped"]}
    assert set(reasons) == {"x.jpg", "notes.txt", "gone.jpg"}
    assert "more than once" in reasons["x.jpg"] and "extension" in reasons["notes.txt"]
    assert "FileNotFoundError" in reasons["gone.jpg"]

    by_paths = pack(PackConfig(shard_size=4), [src / rel for rel in folder], tmp_path / "by_paths")
    assert _sha(by_paths / "000001.tar") == _sha(by_dir / "000001.tar")


# --- through needle's reader and pipeline --------------------------------------------------------


def test_packed_tars_read_back_with_keys_and_images_intact(tmp_path, folder):
    from ingest.reader import image_bytes, iter_samples
    from ingest.source_images import WDS_KEY as _WDS_KEY

    out = pack(PackConfig(shard_size=4), tmp_path / "photos", tmp_path / "tars")
    samples = [s for tar in sorted(out.glob("*.tar")) for s in iter_samples(str(tar))]
    assert len(samples) == len(folder)
    for sample in samples:
        meta = json.loads(sample["json"])
        assert sample["__key__"] == meta["key"]  # grouped as one sample: image and json together
        assert image_bytes(sample) == folder[meta["source"]]
        assert sorted(k for k in sample if not k.startswith("__")) in (["jpg", "json"], ["json", "png"])
    assert [s["__key__"] for s in samples][:3] == ["a/b/photo_01", "a/b/photo_01~1", "a/b/photo_01~2"]
    assert _WDS_KEY.match("a/b/photo_01~1.jpg").group(1) == "a/b/photo_01~1"  # the web page's thumbnail lookup


def test_a_first_directory_named_like_webdataset_metadata_is_still_read(tmp_path, photos):
    from ingest.reader import iter_samples

    data = jpeg_bytes(_small(photos["camera"]))
    _write(tmp_path / "src" / "__thumbs__" / "t.jpg", data)
    _write(tmp_path / "src" / "z.jpg", data)
    out = pack(PackConfig(), tmp_path / "src", tmp_path / "tars")
    samples = list(iter_samples(str(out / "000000.tar")))
    assert [(s["__key__"], s["jpg"]) for s in samples] == [("-_thumbs__/t", data), ("z", data)]


def test_long_paths_survive_the_tar_format(tmp_path, photos):
    from ingest.reader import iter_samples

    data = jpeg_bytes(_small(photos["coins"]))
    rel = "/".join(["a_rather_long_directory_name_" + "x" * 40] * 4) + "/photo.jpg"  # > 255 bytes: no USTAR name
    _write(tmp_path / "src" / rel, data)
    out = pack(PackConfig(), tmp_path / "src", tmp_path / "tars")
    [sample] = iter_samples(str(out / "000000.tar"))
    assert sample["__key__"] == rel[: -len(".jpg")] and sample["jpg"] == data


def test_packed_tars_through_process_shard(tmp_path, folder, extractor):
    import pyarrow.parquet as pq

    from ingest.pipeline import process_shard

    out = pack(PackConfig(shard_size=4), tmp_path / "photos", tmp_path / "tars")
    for i, tar in enumerate(sorted(out.glob("*.tar"))):
        result = process_shard(str(tar), i, tmp_path / "desc", [extractor])
        assert result.status == "ok", result.reason
    rows = [
        r
        for part in sorted((tmp_path / "desc").glob("*.parquet"))
        for r in pq.read_table(part, columns=["key", "status", "width", "global"]).to_pylist()
    ]
    assert [r["key"] for r in rows] == [
        "000000/a/b/photo_01",
        "000000/a/b/photo_01~1",
        "000000/a/b/photo_01~2",
        "000000/holiday_2019/caf_",
        "000001/x",
        "000001/x~1",
    ]
    assert all(r["status"] == "ok" for r in rows)
    assert all(abs(np.linalg.norm(np.asarray(r["global"], np.float32)) - 1) < 1e-2 for r in rows)


def test_cli_pack(tmp_path, folder):
    from cli.main import main as cli

    out = tmp_path / "tars"
    argv = ["pack", str(tmp_path / "photos"), "--out", str(out), "--shard-size", "5", "--extensions", "jpg, jpeg"]
    assert cli(argv) == 0
    info = json.loads((out / INFO_NAME).read_text())
    assert info["images"] == 4 and info["config"]["shard_size"] == 5 and info["config"]["extensions"] == ["jpg", "jpeg"]
    assert [s["samples"] for s in info["shards"]] == [4]
    assert cli(["pack", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert cli(["pack", str(tmp_path / "photos"), "--out", str(out), "--shard-size", "0"]) == 2
