"""A small IVF-PQ index of four shards with local tokens and source tars (SHARDED_TOKENS, built once
a session) and a coordinator that serves it from ShardActor objects in this process
(``LocalShards``), shared by the tests of serving shards."""

import numpy as np
import pytest

from shards.coordinator import ShardedIndex
from shards.local_shards import LocalShards
from shards.shard_actor import ShardActor
from shards.staging import StageConfig, read_index_infos
from tests.support.indexes import SHARDED_TOKENS

SIZES = SHARDED_TOKENS.sizes
D = SHARDED_TOKENS.d


@pytest.fixture(scope="module")
def built(synthetic_indexes):
    """(its root, the index, its vectors): SHARDED_TOKENS, built once a session."""
    out, xb = synthetic_indexes.get(SHARDED_TOKENS)
    return out.parent, out, xb


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
