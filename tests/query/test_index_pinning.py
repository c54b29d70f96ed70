"""What a living index offers, declared by the ``Index`` protocol (query/index_protocol.py): every
index answers its ``generation``, warms ahead (``warm``) and pins a request to one generation
(``pinned``, the one way to); ``LiveIndex`` (query/live_index.py) answers each member of the
protocol explicitly, from the generation a request is pinned to, and no product code probes an
index with ``getattr``."""

import re
import subprocess
import threading
from pathlib import Path

import numpy as np

from index.live.delete_rows import DeleteConfig
from index.live.delete_rows import main as delete
from index.search import load_index
from query.index_protocol import Index
from query.live_index import LiveIndex
from tests.support.index import clustered_unit_vectors
from tests.support.live import D

ROOT = Path(__file__).resolve().parents[2]


def protocol_members() -> set[str]:
    return {name for name in vars(Index) if not name.startswith("_")}


def follow(path):
    """A LiveIndex over ``path`` that reloads only when asked (as cluster.serve.follow_index opens it)."""
    from core.location import location_of
    from index.live.generations import latest_number

    return LiveIndex(
        lambda n, served: load_index(path, generation=n, served=served), lambda: latest_number(location_of(path)), 0
    )


def test_the_protocol_declares_generation_warm_up_and_pinning():
    assert {"generation", "warm", "pinned", "request"} <= protocol_members()


def test_live_index_answers_every_member_itself_never_by_delegating_unknown_names():
    assert "__getattr__" not in vars(LiveIndex)
    assert protocol_members() <= set(vars(LiveIndex))


def test_an_index_that_never_changes_pins_to_itself(live_flat_index):
    index = load_index(live_flat_index)
    index.warm()
    with index.pinned() as view:
        assert view is index and view.generation == 0


def test_a_sharded_index_pins_to_itself(tmp_path, live_flat_index):
    from tests.support.serve_shards import coordinator

    sharded = coordinator(live_flat_index, tmp_path / "cache")
    sharded.warm()  # the shard actors warmed their shards as they started
    with sharded.pinned() as view:
        assert view is sharded and view.generation == sharded.generation == 0


def test_a_pinned_view_and_the_live_index_answer_from_one_generation(live_flat_index):
    live = follow(live_flat_index)
    xq = clustered_unit_vectors(3, D, seed=9).astype(np.float32)
    with live.pinned() as view:
        assert view.generation == 0 and view.ntotal == 120
        delete(DeleteConfig(), ["t1/00003"], live_flat_index)
        assert live.reload()  # new requests get generation 1 ...
        # ... this one goes on with generation 0, through the view and through the live index
        assert view.generation == live.generation == 0 and live.ntotal == 120
        np.testing.assert_array_equal(live.search(xq, 5)[1], view.search(xq, 5)[1])
        assert live.position_of("t1/00003") == view.position_of("t1/00003")
        with live.pinned() as inner:  # nested: the outer block's generation
            assert inner is view
    assert live.generation == 1 and live.ntotal == 119


def test_a_request_scope_is_pinned_to_the_generation_it_started_on(live_flat_index):
    live = follow(live_flat_index)
    entered, release, seen = threading.Event(), threading.Event(), []

    def request():
        with live.request(partial=True) as scope:
            seen.append(live.generation)
            entered.set()
            release.wait(5)
            seen.append((live.generation, set(scope.missing)))

    thread = threading.Thread(target=request)
    thread.start()
    entered.wait(5)
    delete(DeleteConfig(), ["t0/00000"], live_flat_index)
    assert live.reload() and live.generation == 1
    release.set()
    thread.join(5)
    assert seen == [0, (0, set())]


def test_every_generation_is_warmed_as_it_is_opened():
    warmed = []

    class Generation:
        def __init__(self, number):
            self.generation = number

        def warm(self):
            warmed.append(self.generation)

    newest = {"n": 0}
    live = LiveIndex(lambda n, _: Generation(n or 0), lambda: newest["n"], reload_interval=0)
    newest["n"] = 3
    assert live.reload() and warmed == [0, 3]
    live.warm()  # nothing more: each generation was warmed once, as it was opened
    assert warmed == [0, 3]


def test_no_product_code_probes_an_index_with_getattr():
    """Issue "The house, third pass", item 4: what an index offers is declared, never probed."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    probe = re.compile(r"getattr\((self\.)?index,")
    found = [
        f"{name}:{n}"
        for name in tracked.stdout.split()
        if not name.startswith("tests/") and (ROOT / name).exists()
        for n, line in enumerate((ROOT / name).read_text().splitlines(), 1)
        if probe.search(line)
    ]
    assert not found, found
