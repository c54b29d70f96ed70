"""``needle index compact --retrain --ray``: a retrain's shards re-encoded as Ray tasks (issue 56)."""

import faiss
import numpy as np
import pytest

from index.build.stage import IndexConfig
from index.build.stage import main as build
from index.live.compact import CompactConfig
from index.live.compact import main as compact
from index.live.delete_rows import DeleteConfig
from index.live.delete_rows import main as delete
from index.live.generations import read_manifest
from index.search import load_index
from index.shard_files import read_ids
from tests.support.index import clustered_unit_vectors, write_descriptor_file
from tests.support.live import Live

D = 32


@pytest.mark.ray
def test_a_retrain_re_encodes_its_shards_as_ray_tasks_into_the_segments_a_single_process_writes(tmp_path, ray_local):
    """Each shard's segment is, to the byte, the new trained index with that shard's live rows added
    in row order (what the in-process retrain writes), and the index holds exactly the live rows."""
    from cluster.index_job import ray_shard_reencoder
    from core.location import location_of

    pool = clustered_unit_vectors(3 * 400, D, seed=3, clusters=20)
    live = Live()
    for i in range(3):
        xb = pool[i * 400 : (i + 1) * 400]
        write_descriptor_file(tmp_path / "desc", f"t{i}", i, xb)
        live.add_file(f"t{i}", i, xb)
    conf = IndexConfig(kind="ivfpq", nlist=8, pq_bytes=8, points_per_list=40, nprobe=8, refine_factor=4, shards=3)
    index_dir = build(conf, tmp_path / "desc", tmp_path / "index")
    doomed = [f"t1/{i:05d}" for i in range(0, 400, 2)]
    delete(DeleteConfig(), doomed, index_dir)
    for key in doomed:
        del live.rows[key]

    change = compact(CompactConfig(retrain="always", recall_target=None), index_dir, ray_shard_reencoder())

    assert change["retrained"] and len(change["rewritten"]) == 3
    manifest = read_manifest(location_of(index_dir))
    by_row = dict(live.rows.values())
    for segment in manifest.segments:
        rows = read_ids(index_dir / segment.name / "ids.arrow")["row"].to_numpy()
        expected = faiss.read_index(str(index_dir / manifest.training.index))
        expected.add_with_ids(np.stack([by_row[r] for r in rows.tolist()]).astype(np.float32), rows)
        assert faiss.serialize_index(expected).tobytes() == (index_dir / segment.name / "index.faiss").read_bytes()
    index = load_index(index_dir)
    assert index.ntotal == len(live.rows) == 1000
    keys = sorted(live.rows)[::97]  # each finds itself first: every list visited, every candidate re-scored
    xq = np.stack([live.rows[key][1] for key in keys]).astype(np.float32)
    assert [found[0] for found in index.keys_of(index.search(xq, 5, 8, True, 200)[1])] == keys
    assert not list(index_dir.glob(".retrain-*")), "the retrain's scratch is removed"
