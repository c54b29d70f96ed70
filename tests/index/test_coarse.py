"""One coarse assignment for many segments (index/coarse.py): each segment's candidates equal those
of its own FAISS search, for the index kinds the build makes (plain, OPQ, HNSW quantizer),
with deleted rows skipped; segments of other quantizers never share."""

import faiss
import numpy as np
import pytest

from index.build.merge import merge_shortlists, search_params, trim_to_shortlist
from index.build.stage import IndexConfig
from index.build.stage import main as build
from index.coarse import assign, coarse_key, coarse_stage, same_coarse, search_assigned
from index.live.add_rows import AddConfig
from index.live.add_rows import main as add
from index.live.delete_rows import DeleteConfig
from index.live.delete_rows import main as delete
from index.live.deletes import DeleteSet
from index.search import load_index
from index.shard import shared_assignments, with_selector
from tests.support.index import clustered_unit_vectors, write_descriptor_file

FACTORIES = ["IVF32,PQ8x4fsr", "OPQ8,IVF32,PQ16x4fsr", "IVF32_HNSW8,PQ8x4fsr", "IVF32,PQ8"]


def segments_of(factory: str, xb: np.ndarray, parts: int) -> list:
    """One trained index, then ``parts`` segments: copies of it with their own rows (as
    ``needle index add`` makes them from ``generations/trained.faiss``)."""
    trained = faiss.index_factory(xb.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
    trained.train(xb)
    segments = []
    for part, rows in enumerate(np.array_split(np.arange(len(xb)), parts)):
        segment = faiss.deserialize_index(faiss.serialize_index(trained))
        segment.add_with_ids(xb[rows], (rows + 1000 * part).astype(np.int64))
        segments.append(segment)
    return segments


@pytest.mark.parametrize("factory", FACTORIES)
def test_a_shared_assignment_gives_each_segment_its_own_answer(factory):
    rng = np.random.default_rng(0)
    xb = clustered_unit_vectors(3000, 32, seed=1).astype(np.float32)
    xq = clustered_unit_vectors(7, 32, seed=2).astype(np.float32)
    segments = segments_of(factory, xb, 3)
    stages = [coarse_stage(s) for s in segments]
    assert len({coarse_key(s) for s in stages}) == 1 and all(same_coarse(stages[0], s) for s in stages)
    for nprobe in (1, 5, 32, 64):  # 64 > nlist: capped as the build's search is
        doomed = np.sort(rng.choice(np.arange(3000) + 1000, 300, replace=False)).astype(np.int64)
        deletes = DeleteSet(doomed, len(doomed))
        params = [with_selector(search_params(s, nprobe, 8), deletes) for s in segments]
        assigned = assign(stages[0], xq, params[0])
        for segment, stage, p in zip(segments, stages, params):
            D_own, I_own = segment.search(xq, 40, params=p)
            D, I = search_assigned(stage, assigned, 40, p)
            np.testing.assert_array_equal(I, I_own)
            np.testing.assert_array_equal(D, D_own)
            assert not np.isin(I, doomed).any()


def test_segments_of_other_quantizers_never_share():
    xb = clustered_unit_vectors(2000, 32, seed=1).astype(np.float32)
    one = segments_of("IVF32,PQ8x4fsr", xb, 1)[0]
    other = segments_of("IVF32,PQ8x4fsr", xb[::-1].copy(), 1)[0]  # trained on another order: other centroids
    assert not same_coarse(coarse_stage(one), coarse_stage(other))
    assert coarse_stage(faiss.IndexFlatIP(32)) is None


def test_a_living_index_shares_one_assignment_and_answers_as_each_segment_alone(tmp_path, monkeypatch):
    """After two adds (one file each) and a delete, 2 shards hold 4 segments: all are assigned
    once (one trained quantizer), and every segment's candidates and the index's answers equal those of
    each segment searched by itself."""
    d = 32
    conf = IndexConfig(
        recall_target=None, kind="ivfpq", nlist=32, pq_bytes=8, points_per_list=60, nprobe=6, refine_factor=2, shards=2
    )
    pool = clustered_unit_vectors(4000, d, seed=0, clusters=40)
    for i in range(4):
        write_descriptor_file(tmp_path / "desc", f"t{i}", i, pool[i * 800 : (i + 1) * 800])
    index_dir = build(conf, tmp_path / "desc", tmp_path / "index")
    for j in range(2):
        write_descriptor_file(tmp_path / f"more{j}", f"a{j}", 10 + j, pool[3200 + j * 300 : 3500 + j * 300])
        add(AddConfig(), tmp_path / f"more{j}", index_dir)
    delete(DeleteConfig(), [f"t0/{i:05d}" for i in range(0, 800, 3)] + [f"a1/{i:05d}" for i in range(50)], index_dir)
    index = load_index(index_dir)
    assert len(index.shards) == 4  # each add's one file went to one shard
    import index.shard as shard_module

    index.warm()  # as a server does when it opens a generation: the segments compared now
    assert len(shard_module.coarse_classes(index.shards)) == 1

    def compared_again(*args):
        raise AssertionError("a request compared coarse stages: warm() should have")

    monkeypatch.setattr(shard_module, "same_coarse", compared_again)
    xq = clustered_unit_vectors(9, d, seed=5).astype(np.float32)
    for nprobe in (None, 3, 32):
        assigned = shared_assignments(index.shards, xq, nprobe)
        assert all(a is assigned[0] for a in assigned) and assigned[0] is not None
        for shard, a in zip(index.shards, assigned):
            D, I = shard.candidates(xq, 50, nprobe, a)
            D_own, I_own = shard.candidates(xq, 50, nprobe)
            np.testing.assert_array_equal(I, I_own)
            np.testing.assert_array_equal(D, D_own)
    D, I = index.search(xq, 20, nprobe=32)  # the same merge over each segment's own search:
    kk = index.shortlist_size(20)
    parts = trim_to_shortlist([s.candidates(xq, kk, 32) for s in index.shards], kk)
    scored = [(Dp, Ip, s.exact_scores(xq, Dp, Ip)) for s, (Dp, Ip) in zip(index.shards, parts)]
    D_own, I_own = merge_shortlists(scored, kk, 20)
    np.testing.assert_array_equal(I, I_own)
    np.testing.assert_array_equal(D, D_own)
