"""A small IVF-PQ index of four shards (with local tokens and source tars) and a coordinator that
serves it from ShardActor objects in this process (``LocalShards``), shared by the tests of serving
shards."""

import numpy as np
import pytest

from index.build.stage import IndexConfig, main
from shards.coordinator import ShardedIndex
from shards.local_shards import LocalShards
from shards.shard_actor import ShardActor
from shards.staging import StageConfig, read_index_infos
from tests.support.index import write_descriptors_with_tokens, write_source_tars

SIZES = {0: 300, 1: 250, 2: 400, 3: 120, 7: 330}
D = 24
IVF = IndexConfig(kind="ivfpq", nlist=16, pq_bytes=8, points_per_list=20, nprobe=4, refine_factor=3, shards=4)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_shards")
    xb = write_descriptors_with_tokens(root / "desc", SIZES, D, seed=3)
    write_source_tars(root / "desc", root / "tars", SIZES)
    out = main(IVF, root / "desc", root / "index")
    return root, out, xb


def coordinator(out, cache, replicas=1, timeout=10.0):
    infos = read_index_infos(out)
    actors = [
        [ShardActor(str(out), e["name"], StageConfig(str(cache)), r, e) for r in range(replicas)]
        for e in infos["shards"]
    ]
    return ShardedIndex(infos, str(out), LocalShards(actors), timeout)


@pytest.fixture(scope="module")
def sharded(built, tmp_path_factory):
    return coordinator(built[1], tmp_path_factory.mktemp("cache"), replicas=2)


def queries(xb):
    return np.ascontiguousarray(xb[::37], dtype=np.float32)


@pytest.fixture(scope="module")
def ames_checkpoint(tmp_path_factory):
    import torch

    from rerank.ames import AMES, AMESConfig, save_ames

    torch.manual_seed(0)  # an untrained model: its logits still depend on every token
    return str(save_ames(AMES(AMESConfig(layers=2, ff_dim=64)).eval(), tmp_path_factory.mktemp("ames") / "ames.pt"))
