import pytest

from core.errors import ShardSpecError
from ingest.shards import expand_shards, shard_ids, shard_name


def test_brace_and_glob_expansion(tmp_path):
    for i in range(3):
        (tmp_path / f"{i:06d}.tar").write_bytes(b"")
    brace = expand_shards(str(tmp_path / "{000000..000002}.tar"))
    assert [shard_name(u) for u in brace] == ["000000", "000001", "000002"]
    assert expand_shards(str(tmp_path / "*.tar")) == brace
    assert expand_shards(str(tmp_path)) == brace
    assert expand_shards([brace[1], brace[1], brace[0]]) == [brace[1], brace[0]]


def test_pattern_matching_nothing_is_named(tmp_path):
    with pytest.raises(ShardSpecError, match="matches no file"):
        expand_shards(str(tmp_path / "*.tar"))


def test_shard_ids_numeric_and_named():
    assert shard_ids(["/a/000007.tar", "/a/000003.tar"]) == {"/a/000007.tar": 7, "/a/000003.tar": 3}
    assert shard_ids(["/a/b.tar", "/a/a.tar"]) == {"/a/a.tar": 0, "/a/b.tar": 1}
    with pytest.raises(ShardSpecError, match="collide"):
        shard_ids(["/a/000001.tar", "/b/000001.tar"])
