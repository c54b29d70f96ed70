"""The calls between the coordinator and its shards, without Ray: the typed messages counted as
traffic, calls abandoned on a shard's direct channel holding their slot, and a shard group
(--shards-per-actor) answering and scoring its members' calls at once, each as the member would."""

import time

import numpy as np
import pytest

from index.build.merge import merge_shortlists
from index.search import load_index
from query.retrieve import stored_tokens
from rerank.rerank import RerankConfig
from shards.staging import StageConfig, read_index_infos
from tests.support.serve_shards import SIZES, queries

# pytest fixtures and the fixtures they request, imported by name (``x as x``: on purpose, not unused)
from tests.support.serve_shards import ames_checkpoint as ames_checkpoint
from tests.support.serve_shards import built as built
from tests.support.serve_shards import sharded as sharded


def test_traffic_counts_the_typed_messages_not_pickles(built, sharded, monkeypatch):
    """Without a wire (LocalShards) the coordinator counts the typed message each call and answer
    would be (shards/messages.py: a request and an answer per shard), not a pickle of them."""
    import pickle

    import shards.messages as coordinator  # where the coordinator counts a call's messages

    _, _, xb = built
    xq = queries(xb)[:2]
    sizes = {"sent": [], "received": []}
    pack, answers = coordinator.pack_request, coordinator.pack_answers
    monkeypatch.setattr(coordinator, "pack_request", lambda *a: sizes["sent"].append(len(m := pack(*a))) or m)
    monkeypatch.setattr(coordinator, "pack_answers", lambda a: sizes["received"].append(len(m := answers(a))) or m)
    assert not sharded.counts_wire
    before = (sharded.traffic.sent, sharded.traffic.received, sharded.traffic.calls)
    sharded.traffic.count = True
    try:
        sharded.search(xq, 10)
    finally:
        sharded.traffic.count = False
    traffic = sharded.traffic
    got = (traffic.sent - before[0], traffic.received - before[1], traffic.calls - before[2])
    assert got == (sum(sizes["sent"]), sum(sizes["received"]), len(sizes["sent"])) and got[2] >= len(sharded.names)
    one = sharded.backend.actors[0][0].search(xq, 30, None, True)
    assert len(answers([("ok", one)])) < len(pickle.dumps(one, protocol=5))  # not the pickle's size


def test_abandoned_channel_calls_count_against_the_concurrency_until_they_end(built, tmp_path):
    """A call the coordinator gave up on (its connection closed) keeps running on the shard: it
    holds its slot of --shard-concurrency until it ends, so repeated expensive calls wait instead
    of piling up beyond it (before, each new connection got a thread and ran at once)."""
    import itertools
    import threading

    from shards.direct import DirectChannel, readable
    from shards.messages import pack_request, unpack_answers
    from shards.shard_group import ShardGroup

    _, out, xb = built
    entries = read_index_infos(out)["shards"][:1]
    group = ShardGroup(str(out), entries, StageConfig(str(tmp_path / "cache")), concurrency=1)
    member = group.members[0]
    search = member.search
    spans, lock = [], threading.Lock()

    def slow(*args):
        start = time.monotonic()
        time.sleep(0.6)
        with lock:
            spans.append((start, time.monotonic()))
        return search(*args)

    member.search = slow
    channel = DirectChannel(group.endpoint())
    request = pack_request("search", [(0, (queries(xb)[:1], 10, None, True))])
    try:
        for _ in range(3):  # three calls given up on at once: their connections closed
            channel.send(request).close()
        time.sleep(0.1)
        call = channel.send(request)
        assert readable([call], 10) == [call]
        [(status, answer)] = unpack_answers(call.receive(10))
        assert status == "ok" and answer[1].shape == (1, 10)
        time.sleep(1.0)  # the abandoned ones end too
        spans.sort()
        assert len(spans) == 4 and group.waited >= 3
        assert all(later[0] >= earlier[1] - 0.01 for earlier, later in itertools.pairwise(spans))  # one at a time
    finally:
        channel.close()
        group._server.close()


def run_typed(group, method: str, calls: list) -> list:
    """``group``'s answers to ``calls``, packed and unpacked as a Ray shard group's travel (over
    its channel or through Ray: cluster.ray_shards.RayShardGroup.run)."""
    from shards.messages import answer_request, pack_request, unpack_answers

    return unpack_answers(answer_request(group.answer, pack_request(method, calls), len(group.members)))


@pytest.mark.parametrize("threads", [1, 3])
def test_a_shard_group_answers_its_members_calls_at_once(built, tmp_path, threads):
    """--shards-per-actor: one call carries several members' calls (even one member twice: two
    requests batched together, one of them twice the same); each answer equals the member's own,
    an error stays its own. The calls and answers travel as the shard actors' do: typed messages
    (shards/wire.py)."""
    from shards.shard_group import ShardGroup

    _, out, xb = built
    entries = read_index_infos(out)["shards"][:3]
    group = ShardGroup(str(out), entries, StageConfig(str(tmp_path / "cache")), threads=threads)
    assert group.threads == threads
    xq = queries(xb)[:2]
    same = (xq, 30, None, True)
    calls = [(0, same), (2, same), (0, (xq[:1], 5, 2, True)), (0, same)]
    answers = run_typed(group, "search", calls)
    assert all(status == "ok" for status, _ in answers)
    own = [group.members[member].search(*args) for member, args in calls]
    # the two members' searches of one batch come back trimmed to their joint shortlist: same merge
    mine, theirs = [answers[0][1], answers[1][1]], own[:2]
    assert sum(p[1].shape[1] for p in mine) < sum(p[1].shape[1] for p in theirs)
    for a, b in zip(merge_shortlists([p[:3] for p in mine], 30, 12), merge_shortlists([p[:3] for p in theirs], 30, 12)):
        np.testing.assert_array_equal(a, b)
    keys = {i: k for p in mine for row_i, row_k in zip(p[1].tolist(), p[3]) for i, k in zip(row_i, row_k) if i >= 0}
    assert all(
        keys[i] == k
        for p in theirs
        for row_i, row_k in zip(p[1].tolist(), p[3])
        for i, k in zip(row_i, row_k)
        if i in keys
    )
    for slot in (2, 3):  # the other request's search, and a second one of the first: as the member answers them
        for a, b in zip(answers[slot][1], own[slot]):
            np.testing.assert_array_equal(np.asarray(a, dtype=object), np.asarray(b, dtype=object))
    # a key of member 1 past the images its tar holds, and a key nobody holds
    owned = next(
        f"{s:06d}/{n - 1:05d}" for s, n in SIZES.items() if group.members[1].shard.position_of(f"{s:06d}/00000") >= 0
    )
    (status, error), (ok, found) = run_typed(group, "thumbnail", [(1, (owned, 8)), (1, ("000000/99999", 8))])
    assert status == "error" and isinstance(error, FileNotFoundError) and (ok, found) == ("ok", None)
    assert [i["shard"] for i in group.info()] == [e["name"] for e in entries]


@pytest.mark.parametrize("method", ["sp", "chamfer", "ames"])
def test_a_shard_group_scores_its_members_shortlists_together(built, tmp_path, method, ames_checkpoint, caplog):
    """One gathering and one scoring per query for a group's members: each member's scores equal
    its own to the bit; evidence comes for the group's best members and equals the member's own
    (calls and answers as typed messages, shards/wire.py: the conf and each query's tokens arrive
    as one object for every member, as the group's batching needs)."""
    import dataclasses

    from rerank.rerank import candidate_width
    from shards.shard_group import ShardGroup

    _, out, _ = built
    single = load_index(out)
    entries = read_index_infos(out)["shards"][:3]
    group = ShardGroup(str(out), entries, StageConfig(str(tmp_path / "cache")))
    keys = [f"{s:06d}/{i:05d}" for s in SIZES for i in (1, 90)]
    tokens = stored_tokens(single, keys)
    tokens[1] = None  # a query without tokens: no member scores it
    D, I = single.search(np.stack([single.vector_of(k) for k in keys]), 40)
    conf = RerankConfig(method=method, shortlist=40, ames=ames_checkpoint if method == "ames" else None)
    conf = dataclasses.replace(conf, db_tokens=candidate_width(conf, lambda: single.local_store.max_tokens))
    owned = [np.isin(I >> 32, [int(p) for p in m.shard.files.infos["shard_offsets"]]) for m in group.members]
    calls = [
        (m, (conf, [I[q][own[q]] for q in range(len(keys))], [D[q][own[q]] for q in range(len(keys))], tokens, 5))
        for m, own in enumerate(owned)
    ]
    answers = run_typed(group, "score_shortlists", calls)
    assert "member by member" not in caplog.text  # scored together, not after a failure
    sent = 0
    for (member, args), (status, parts) in zip(calls, answers):
        assert status == "ok"
        for q, (mine, own) in enumerate(zip(parts, group.members[member].score_shortlists(*args))):
            assert (mine is None) == (own is None) == (tokens[q] is None or not len(args[1][q]))
            if mine is None:
                continue
            for name in ("raw", "has_locals", "inliers"):
                np.testing.assert_array_equal(mine[name], own[name])
            if method == "sp":
                assert all(own["evidence"].get(i, e) == e for i, e in mine["evidence"].items())
                sent += len(mine["evidence"])
    if method == "sp":  # the group's best 5 + margin per query, not each member's
        assert 0 < sent <= (len(keys) - 1) * (5 + 8)
    assert any((a[1][q]["raw"] > 0).any() for a in answers for q in (0, 2, 3) if a[1][q] is not None)
