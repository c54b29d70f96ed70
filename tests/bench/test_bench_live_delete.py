"""bench/live_delete.py at tiny sizes (``--dry-run``): every step runs, so that it cannot rot, and
its last JSON line carries the figures docs/live_index.md quotes."""

import pytest

from tests.support.bench import dry_run


@pytest.mark.slow
def test_live_delete_bench_dry_run():
    last = dry_run("live_delete.py")[-1]
    assert [d["keys"] for d in last["deletes"]] == [10, 100, 1000]
    assert [d["generation"] for d in last["deletes"]] == [1, 2, 3]
    assert last["keys"] == 1000 and last["keys_per_s"] > 0 and last["seconds"] > 0
