"""The coordinator's row routing (shards/routing.py): the lookup table for dense Parquet ids and
the binary search for sparse ones give the same owner for every row id, the padding and rows of
unknown Parquet files included; grouping keeps each shard's rows in their order."""

import numpy as np
import pytest

from ingest.descriptors import ROW_SHARD_SHIFT
from shards.routing import RowRouter


def infos_of(parquet_ids_per_shard):
    return {"shards": [{"parquet_shard_ids": ids} for ids in parquet_ids_per_shard]}


def brute_force(parquet_ids_per_shard, rows):
    owner = {p: s for s, ids in enumerate(parquet_ids_per_shard) for p in ids}
    return np.array([owner.get(int(r) >> ROW_SHARD_SHIFT, -1) if r >= 0 else -1 for r in rows], np.int64)


@pytest.mark.parametrize(
    "layout, dense",
    [
        ([[0, 3, 4], [1, 2], [5]], True),
        ([[7, 9], [], [8, 12]], True),
        ([[0, 1 << 30], [5]], False),  # sparse ids: the binary search
        ([[], []], True),
    ],
)
def test_owner_of_every_row_equals_a_brute_force(layout, dense):
    router = RowRouter(infos_of(layout))
    assert (router.table is not None) == dense
    ids = sorted({p for ids in layout for p in ids} | {6, 11, 13, 1 << 29, (1 << 30) + 1})
    rows = np.array([-1, -2, -(1 << 40)] + [(p << ROW_SHARD_SHIFT) | o for p in ids for o in (0, 1, 12345)], np.int64)
    np.testing.assert_array_equal(router.shard_of_rows(rows), brute_force(layout, rows))
    np.testing.assert_array_equal(router.shard_of_rows(rows.reshape(3, -1)), brute_force(layout, rows).reshape(3, -1))


def test_grouped_keeps_each_shards_rows_in_order_and_leaves_out_the_padding():
    router = RowRouter(infos_of([[0], [1], [2], [3]]))
    owners = np.array([2, -1, 0, 2, 3, 0, -1, 2])
    order, asks = router.grouped(owners)
    assert asks == {0: (2, 4), 2: (4, 7), 3: (7, 8)}  # shard 1 owns none: not asked
    assert {s: order[lo:hi].tolist() for s, (lo, hi) in asks.items()} == {0: [2, 5], 2: [0, 3, 7], 3: [4]}
