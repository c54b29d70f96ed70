"""`needle` commands given an index built before shard directories, or a directory that is no
index: exit status 2 and one line naming `needle index build` (no traceback, no "has no ids.arrow")."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from cli.main import main
from index.build.stage import IndexConfig
from index.build.stage import main as build
from tests.support.index import clustered_unit_vectors, to_old_layout, write_descriptor_file


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    root = tmp_path_factory.mktemp("old_cli")
    for s in range(2):
        write_descriptor_file(root / "desc", f"{s:06d}", s, clustered_unit_vectors(40, 8, seed=s))
    out = build(IndexConfig(kind="flat", shards=2), root / "desc", root / "index")
    np.save(root / "q.npy", clustered_unit_vectors(2, 8, seed=9).astype(np.float32))
    return root, out, to_old_layout(out, root / "old")


def test_query_of_an_old_index_exits_2_naming_the_rebuild(indexes, caplog):
    root, out, old = indexes
    assert main(["query", "--index", str(out), "--vectors", str(root / "q.npy"), "--k", "1"]) == 0
    with caplog.at_level(logging.ERROR):
        assert main(["query", "--index", str(old), "--vectors", str(root / "q.npy"), "--k", "1"]) == 2
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert f"index {old} was built before shard directories" in record.getMessage()
    assert f"`needle index build --descriptors {root / 'desc'} --out {old}`" in record.getMessage()
    command = record.getMessage().split("`")[-2].split()  # the fix it names, run as given
    assert main([*command[1:], "--kind", "flat"]) == 0
    assert main(["query", "--index", str(old), "--vectors", str(root / "q.npy"), "--k", "1"]) == 0


def test_query_of_a_directory_that_is_no_index_exits_2(indexes, caplog, tmp_path):
    root = indexes[0]
    with caplog.at_level(logging.ERROR):
        assert main(["query", "--index", str(tmp_path), "--vectors", str(root / "q.npy"), "--k", "1"]) == 2
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert (
        record.getMessage() == f"{tmp_path} is not an index (no index_infos.json): build one with `needle index build`"
    )
