"""A new generation opened beside the served one takes over its unchanged segments
(index/search.py ``reused_segments``): the same open files and Shard objects, answers equal to
opening the generation afresh, and nothing of a generation no longer served kept alive."""

import gc
import shutil
import weakref

import numpy as np

from index.build.stage import IndexConfig
from index.build.stage import main as build
from index.live.add_rows import AddConfig
from index.live.add_rows import main as add
from index.live.compact import CompactConfig
from index.live.compact import main as compact
from index.live.delete_rows import DeleteConfig
from index.live.delete_rows import main as delete
from index.search import load_index
from tests.support.index import clustered_unit_vectors, write_descriptor_file

D_IM = 32


def built(tmp_path):
    conf = IndexConfig(
        recall_target=None, kind="ivfpq", nlist=32, pq_bytes=8, points_per_list=60, nprobe=6, refine_factor=2, shards=2
    )
    pool = clustered_unit_vectors(4000, D_IM, seed=0, clusters=40)
    for i in range(4):
        write_descriptor_file(tmp_path / "desc", f"t{i}", i, pool[i * 800 : (i + 1) * 800])
    write_descriptor_file(tmp_path / "more", "a0", 10, pool[3200:3600])
    return build(conf, tmp_path / "desc", tmp_path / "index")


def same_answers(index, fresh, xq):
    for nprobe in (None, 32):
        D, I = index.search(xq, 30, nprobe=nprobe)
        D_fresh, I_fresh = fresh.search(xq, 30, nprobe=nprobe)
        np.testing.assert_array_equal(I, I_fresh)
        np.testing.assert_array_equal(D, D_fresh)
    return I


def test_unchanged_segments_are_kept_and_answers_equal_a_fresh_open(tmp_path):
    index_dir = built(tmp_path)
    xq = clustered_unit_vectors(9, D_IM, seed=5).astype(np.float32)
    g0 = load_index(index_dir)
    g0.warm()
    add(AddConfig(), tmp_path / "more", index_dir)
    g1 = load_index(index_dir, served=g0)
    g1.warm()
    assert g1.generation == 1 and len(g1.shards) == 3
    names = [e["name"] for e in g1.infos["shards"]]  # by shard: shard_000, the new segment, shard_001
    new = next(i for i, name in enumerate(names) if name.startswith("seg_"))
    kept = [i for i in range(3) if i != new]
    assert all(g1.shards[i] is s for i, s in zip(kept, g0.shards))
    same_answers(g1, load_index(index_dir), xq)

    # a delete in the added segment only: it gets a new Shard (its new delete set) over the same files
    doomed = [f"a0/{i:05d}" for i in range(0, 400, 2)]
    delete(DeleteConfig(), doomed, index_dir)
    g2 = load_index(index_dir, served=g1)
    g2.warm()
    assert all(g2.shards[i] is s for i, s in zip(kept, g0.shards))
    assert g2.shards[new] is not g1.shards[new] and g2.shards[new].files is g1.shards[new].files
    assert len(g2.shards[new].deletes) == 200 and not len(g1.shards[new].deletes)
    I = same_answers(g2, load_index(index_dir), xq)
    assert not set(doomed) & {k for row in g2.keys_of(I) for k in row}

    # the kept shards compared themselves with g1's added segment: they must not keep it alive
    gone = weakref.ref(g1.shards[new])
    del g1
    gc.collect()
    assert gone() is None

    # compaction rewrites the segment with deletes (a new name: opened afresh); what it leaves is kept
    compact(CompactConfig(), index_dir)
    g3 = load_index(index_dir, served=g2)
    before = {e["name"]: shard for e, shard in zip(g2.infos["shards"], g2.shards)}
    after = {e["name"]: shard for e, shard in zip(g3.infos["shards"], g3.shards)}
    assert names[new] not in after and not any(len(shard.deletes) for shard in g3.shards)
    assert all(
        shard is before[name] if name in before else all(shard is not s for s in g2.shards)
        for name, shard in after.items()
    )
    same_answers(g3, load_index(index_dir), xq)


def test_an_index_elsewhere_or_a_changed_segment_is_opened_afresh(tmp_path):
    index_dir = built(tmp_path)
    g0 = load_index(index_dir)
    copy = shutil.copytree(index_dir, tmp_path / "copy")
    assert not {id(s) for s in load_index(copy, served=g0).shards} & {id(s) for s in g0.shards}

    # a segment directory whose recorded files differ from the open one's is not the same segment
    infos = index_dir / g0.infos["shards"][0]["name"] / "shard_infos.json"
    infos.write_text(infos.read_text().replace('"rows"', '"rows" ', 1))  # same JSON: still the same
    assert load_index(index_dir, served=g0).shards[0] is g0.shards[0]
    g0.shards[0].files.infos["checksums"] = {}  # as if the open one had recorded other files
    assert load_index(index_dir, served=g0).shards[0] is not g0.shards[0]
