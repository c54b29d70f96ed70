"""The coordinator of shards served elsewhere, without Ray: ShardActor objects in this process
behind ``LocalShards``. It merges, routes and re-ranks exactly like the single-process index
(ties included), stages shards with their checksums, and answers 503 or partial, bounded in
time, when shards do not answer."""

import json
import time
from dataclasses import replace

import numpy as np
import pytest
from helpers_index import write_descriptors_with_tokens, write_source_tars

from index.build import SHARD_INFOS_FILE, IndexConfig, main
from index.errors import IndexFileError, UnknownKeyError
from index.merge import merge_shortlists
from index.search import load_index
from query.retrieve import QueryConfig, search, stored_tokens
from rerank.rerank import RerankConfig
from shards.coordinator import ShardedIndex, ShardsUnavailable
from shards.local_shards import LocalShards
from shards.shard_actor import ShardActor
from shards.staging import StageConfig, read_index_infos, stage_shard

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


def test_search_and_keys_equal_the_single_index(built, sharded):
    _, out, xb = built
    single = load_index(out)
    xq = queries(xb)
    for k, nprobe, factor in ((10, None, None), (25, 1, None), (40, 16, 1), (130, 16, 4), (1400, 16, 1)):
        D1, I1 = single.search(xq, k, nprobe, refine_factor=factor)
        D2, I2 = sharded.search(xq, k, nprobe, refine_factor=factor)
        np.testing.assert_array_equal(I1, I2)
        np.testing.assert_array_equal(D1, D2)
        assert sharded.keys_of(I2) == single.keys_of(I1)  # routed to the owning shards
        with sharded.request() as state:  # within a request: the keys came with the candidates
            _, I3 = sharded.search(xq, k, nprobe, refine_factor=factor)
            assert state.keys and sharded.keys_of(I3) == single.keys_of(I1)
    assert sharded.ntotal == single.ntotal and sharded.d == single.d == D


def test_query_expansion_reads_the_neighbours_from_their_shards(built, sharded):
    _, out, xb = built
    conf = QueryConfig(k=12, qe_top=5)
    D1, I1, _ = search(load_index(out), queries(xb), conf)
    D2, I2, _ = search(sharded, queries(xb), conf)
    np.testing.assert_array_equal(I1, I2)
    np.testing.assert_array_equal(D1, D2)


def test_key_lookups_are_routed(built, sharded):
    _, out, _ = built
    single = load_index(out)
    for key in ("000000/00000", "000002/00399", "000007/00123", "000003/00005"):
        assert sharded.position_of(key) == single.position_of(key)
        np.testing.assert_array_equal(sharded.vector_of(key), single.vector_of(key))
        a, b = sharded.tokens_of_key(key), single.tokens_of_key(key)
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_array_equal(a.xy, b.xy)
    with pytest.raises(UnknownKeyError, match="not in the index"):
        sharded.vector_of("nope")
    rows = single.search(queries(built[2])[:3], 5)[1]
    np.testing.assert_array_equal(sharded.vectors_of_rows(rows), single.vectors_of_rows(rows))


@pytest.fixture(scope="module")
def ames_checkpoint(tmp_path_factory):
    import torch

    from rerank.ames import AMES, AMESConfig, save_ames

    torch.manual_seed(0)  # an untrained model: its logits still depend on every token
    return str(save_ames(AMES(AMESConfig(layers=2, ff_dim=64)).eval(), tmp_path_factory.mktemp("ames") / "ames.pt"))


@pytest.mark.parametrize("method", ["sp", "chamfer", "ames"])
def test_reranking_on_the_shards_equals_the_single_index(built, sharded, method, ames_checkpoint):
    _, out, _ = built
    single = load_index(out)
    keys = [f"{s:06d}/{i:05d}" for s in SIZES for i in (1, 17, 90)]
    ames = ames_checkpoint if method == "ames" else None
    conf = QueryConfig(k=15, rerank=RerankConfig(method=method, shortlist=60, ames=ames))
    answers = []
    for index in (single, sharded):
        xq = np.stack([index.vector_of(k) for k in keys])
        answers.append(search(index, xq, conf, stored_tokens(index, keys), evidence=True))
    (D1, I1, d1), (D2, I2, d2) = answers
    np.testing.assert_array_equal(I1, I2)
    np.testing.assert_array_equal(D1, D2)
    assert any((d["local_score"] > 0).any() for d in d1)  # the tokens did match: a real re-ranking
    for a, b in zip(d1, d2):
        for name in ("global_score", "local_score"):
            np.testing.assert_array_equal(a[name], b[name])
        if method == "sp":
            np.testing.assert_array_equal(a["inliers"], b["inliers"])
            assert a["evidence"] == b["evidence"]
    if method == "ames":  # gathered to the index's longest row (recorded; asked of the shards for older builds)
        older = ShardedIndex(
            {**sharded.infos, "locals": {**sharded.infos["locals"], "max_tokens": None}}, str(out), sharded.backend
        )
        assert older.max_tokens() == sharded.max_tokens() == single.local_store.max_tokens == 12


def test_thumbnails_are_made_by_the_shard_that_owns_the_key(built, sharded):
    import io

    from PIL import Image

    from index.images import ImageSource

    _, out, _ = built
    single = ImageSource(load_index(out))
    for name in read_index_infos(out)["shards"]:  # each shard records its rows' tars: nothing is read at the top
        files = json.loads((out / name["name"] / SHARD_INFOS_FILE).read_text())["files"]
        assert all(f["tar"].endswith(f"/{f['path'].rsplit('/', 1)[1].removesuffix('.parquet')}.tar") for f in files)
    for key in ("000000/00003", "000002/00019", "000007/00000"):
        jpeg = sharded.thumbnail(key, 24)
        assert jpeg == single.thumbnail(key, 24) and max(Image.open(io.BytesIO(jpeg)).size) == 24
    assert sharded.thumbnail("000002/00019", 24) != sharded.thumbnail("000007/00019", 24)
    with pytest.raises(UnknownKeyError, match="not in the index"):
        sharded.thumbnail("000000/99999", 24)
    with pytest.raises(FileNotFoundError, match="00300"):  # in the index, not in its tar
        sharded.thumbnail("000002/00300", 24)
    replicas = sharded.backend
    replicas.down.update({(s, r) for s in range(len(sharded.names)) for r in range(replicas.replicas[s])})
    try:
        with pytest.raises(ShardsUnavailable):
            sharded.thumbnail("000000/00003", 24)
    finally:
        replicas.down.clear()


def test_in_process_thumbnails_read_the_tars_each_shard_recorded(built, monkeypatch):
    """An index searched in this process reads a key's tar from its shard's ``shard_infos.json`` (as a
    shard actor does), so thumbnails work where the descriptors' ingestion record is gone."""
    import io

    from PIL import Image

    import index.images
    from index.images import ImageSource

    _, out, _ = built
    monkeypatch.setattr(index.images, "recorded_tar_urls", lambda *a, **k: ({}, None))  # no record beside them
    single = ImageSource(load_index(out))
    for key in ("000000/00003", "000007/00000"):
        assert max(Image.open(io.BytesIO(single.thumbnail(key, 24))).size) == 24


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


def test_query_service_answers_like_the_single_index(built, sharded):
    from webapi.query_service import QueryService

    _, out, xb = built
    rerank = RerankConfig(method="sp", shortlist=40)
    one, many = QueryService(load_index(out), rerank=rerank), QueryService(sharded, rerank=rerank)
    for body in ({"keys": ["000001/00007", "000007/00300"], "k": 12}, {"vectors": xb[5:8].tolist(), "k": 9}):
        assert many.search_json(body) == one.search_json(body)
    with pytest.raises(Exception, match="'partial' must be true or false"):
        many.search_json({"keys": ["000001/00007"], "partial": "yes"})


def test_staging_verifies_checksums_and_reuses_the_cache(built, tmp_path):
    _, out, _ = built
    conf = StageConfig(str(tmp_path / "cache-{node}"))
    first = stage_shard(str(out), "shard_001", conf, "n1")
    assert first.fetched > 0 and first.reused == 0 and str(first.directory).startswith(str(tmp_path / "cache-n1"))
    again = stage_shard(str(out), "shard_001", conf, "n1")
    assert (again.fetched, again.reused) == (0, first.fetched)
    (again.directory / "keys.bin").write_bytes(b"changed")  # a damaged cached copy is fetched again
    assert stage_shard(str(out), "shard_001", conf, "n1").fetched == 1
    assert stage_shard(str(out), "shard_001", conf, "n2").fetched == first.fetched  # another node: its own copy
    source = tmp_path / "source"
    import shutil

    shutil.copytree(out, source)
    data = bytearray((source / "shard_002" / "keys.bin").read_bytes())
    data[0] ^= 1  # same size, other bytes
    (source / "shard_002" / "keys.bin").write_bytes(bytes(data))
    with pytest.raises(IndexFileError, match=r"shard_002.*keys\.bin does not match"):
        stage_shard(str(source), "shard_002", conf, "n1")
    infos = json.loads((out / "index_infos.json").read_text())
    with pytest.raises(IndexFileError, match="says"):
        stage_shard(str(out), "shard_001", conf, "n1", {**infos["shards"][1], "rows": 1})
    assert json.loads((first.directory / SHARD_INFOS_FILE).read_text())["name"] == "shard_001"
    in_place = stage_shard(str(out), "shard_001", replace(conf, copy_local=False), "n3")
    assert (in_place.directory, in_place.fetched) == (out / "shard_001", 0) and not (tmp_path / "cache-n3").exists()


def test_a_dead_replica_is_replaced_and_a_dead_shard_is_named(built, sharded):
    _, out, xb = built
    single = load_index(out)
    xq = queries(xb)
    _, I1 = single.search(xq, 20)
    backend = sharded.backend
    try:
        backend.down = {(0, 0), (2, 1)}  # one replica of two shards: the other answers
        for _ in range(4):
            np.testing.assert_array_equal(sharded.search(xq, 20)[1], I1)
        backend.down = {(1, 0), (1, 1)}  # no live replica of shard_001
        with pytest.raises(ShardsUnavailable, match="shard_001") as caught:
            sharded.search(xq, 20)
        assert caught.value.missing == ["shard_001"]
        with sharded.request(partial=True) as state:
            D2, I2 = sharded.search(xq, 20)
        assert state.missing == {"shard_001"}
        assert (sharded.shard_of_rows(I2.reshape(-1)) != 1).all()  # what it has is from the live shards
        assert (np.diff(D2, axis=1) <= 0).all() and (I2 >= 0).all()
    finally:
        backend.down = set()
    np.testing.assert_array_equal(sharded.search(xq, 20)[1], I1)  # exact again


def test_keys_of_rows_routed_with_padding_repeats_and_a_missing_shard(built, sharded):
    """The keys of any block of row ids equal the single index's: one query's rows (its padding
    None), rows shared by several queries, rows of one shard only, rows known from the request's
    search mixed with rows it did not return; in a partial request a dead shard's rows are None."""
    _, out, xb = built
    single = load_index(out)
    rows = single.rows
    one = np.concatenate([rows[::41], [-1, -1]])[None]  # one query: every shard, then padding
    shared = np.stack([rows[::53][:12], rows[::53][:12][::-1], rows[7:19]])  # rows repeated across queries
    alone = rows[sharded.shard_of_rows(rows) == 2][:9][None]
    for I in (one, shared, alone, np.full((2, 3), -1)):
        assert sharded.keys_of(I) == single.keys_of(I)
    xq = queries(xb)[:1]
    with sharded.request():
        _, I = sharded.search(xq, 5)
        mixed = np.concatenate([I[0], rows[::97]])[None]  # 5 known from the search, the rest asked
        assert sharded.keys_of(mixed) == single.keys_of(mixed)
    backend = sharded.backend
    try:
        backend.down = {(1, 0), (1, 1)}  # no live replica of shard 1
        with sharded.request(partial=True) as state:
            got = sharded.keys_of(one)[0]
        assert state.missing == {sharded.names[1]}
        owners = sharded.shard_of_rows(one[0])
        expected = single.keys_of(one)[0]
        assert [k for k, s in zip(got, owners) if s != 1] == [k for k, s in zip(expected, owners) if s != 1]
        assert all(k is None for k, s in zip(got, owners) if s == 1) and (owners == 1).sum() > 0
    finally:
        backend.down = set()


def test_a_hung_replica_is_hedged_on_another_and_then_avoided(built, tmp_path):
    _, out, xb = built
    index = coordinator(out, tmp_path / "cache", replicas=2, timeout=1.0)
    xq = queries(xb)
    _, I1 = load_index(out).search(xq, 20)
    index.backend.slow = {(2, 0): 5.0, (2, 1): 5.0}  # shard_002 hangs on both: 503 within the timeout
    start = time.monotonic()
    with pytest.raises(ShardsUnavailable, match="shard_002"):
        index.search(xq, 20)
    assert time.monotonic() - start < 1.5
    index.backend.slow = {(2, 0): 5.0}  # one replica hangs: the other answers after the hedge
    index.suspect.clear()
    start = time.monotonic()
    np.testing.assert_array_equal(index.search(xq, 20)[1], I1)
    assert 0.25 < time.monotonic() - start < 0.9 and index.is_suspect(2, 0) and not index.is_suspect(2, 1)
    for _ in range(3):  # then the hung replica is asked after the other: no hedge delay
        start = time.monotonic()
        np.testing.assert_array_equal(index.search(xq, 20)[1], I1)
        assert time.monotonic() - start < 0.25


def test_http_503_partial_and_health(built, tmp_path):
    from fastapi.testclient import TestClient

    from webapi.query_service import QueryService
    from webapi.webapp import check_shards, create_app

    _, out, xb = built
    index = coordinator(out, tmp_path / "cache", replicas=1, timeout=0.5)
    single = QueryService(load_index(out))
    body = {"vectors": xb[:2].tolist(), "k": 5}
    with TestClient(
        create_app(QueryService(index)), base_url="http://localhost", raise_server_exceptions=False
    ) as client:
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["ok"] is True
        assert {r["status"] for r in health.json()["replicas"]} == {"ready"} and len(health.json()["replicas"]) == 4
        assert client.post("/search", json=body).json() == single.search_json(body)
        index.backend.slow[(3, 0)] = 3.0  # shard_003 hangs: the request does not
        start = time.monotonic()
        response = client.post("/search", json=body)
        assert time.monotonic() - start < 2.5
        assert response.status_code == 503 and response.json()["missing_shards"] == ["shard_003"]
        response = client.post("/search?partial=1", json=body)
        assert response.status_code == 200
        out_partial = response.json()
        assert all(q["partial"] is True and q["missing_shards"] == ["shard_003"] for q in out_partial)
        assert all(r["key"] is not None for q in out_partial for r in q["results"])
        response = client.post("/search", json={**body, "partial": True})
        assert response.status_code == 200 and response.json()[0]["partial"] is True
        response = client.post("/search", json={"keys": ["000007/00001"], "k": 3})
        assert response.status_code == 503 and "shard_003" in response.json()["error"]
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["unavailable_shards"] == ["shard_003"]
        with pytest.raises(ShardsUnavailable, match="shard_003"):  # Ray Serve's check_health
            check_shards(QueryService(index))
        check_shards(single)  # one process: nothing to check
        del index.backend.slow[(3, 0)]
        time.sleep(3.0)  # the hung calls finish
        assert client.post("/search", json=body).json() == single.search_json(body)
        assert client.get("/health").status_code == 200


def test_old_layout_is_refused_for_serving_across_nodes(built, tmp_path):
    from helpers_index import to_old_layout

    old = to_old_layout(built[1], tmp_path / "old")
    with pytest.raises(IndexFileError, match="built before shard directories"):
        read_index_infos(old)


def test_serve_flags_for_shards():
    from cli.flags import config_from_args
    from cli.main import build_parser
    from cluster.serve_run import ServeConfig, shard_serving

    args = build_parser().parse_args(
        [
            *("serve", "--index", "s3://b/i", "--ray-shards", "--shard-replicas", "2", "--shard-timeout", "3"),
            *("--cache-dir", "/data/needle-{node}", "--s3-endpoint-url", "http://127.0.0.1:9000"),
        ]
    )
    serving = shard_serving(config_from_args(ServeConfig, args))
    assert (serving.placement.replicas, serving.timeout, serving.placement.cpus) == (2, 3.0, None)
    assert serving.stage == StageConfig("/data/needle-{node}", "http://127.0.0.1:9000")
    args = build_parser().parse_args(["serve", "--index", "idx", "--ray-shards", "--no-stage-local"])
    assert shard_serving(config_from_args(ServeConfig, args)).stage.copy_local is False
    with pytest.raises(Exception, match="shard-timeout"):
        shard_serving(replace(ServeConfig(), shard_timeout=0))
    args = build_parser().parse_args(["serve", "--index", "idx", "--ray-shards", "--shard-cpus", "3"])
    assert shard_serving(config_from_args(ServeConfig, args)).placement.cpus == 3.0
    with pytest.raises(Exception, match="shard-cpus"):
        shard_serving(replace(ServeConfig(), shard_cpus=0))
    assert shard_serving(ServeConfig()).transport == "direct"
    args = build_parser().parse_args(["serve", "--index", "idx", "--ray-shards", "--shard-transport", "ray"])
    assert shard_serving(config_from_args(ServeConfig, args)).transport == "ray"
    with pytest.raises(Exception, match="shard-transport must be one of direct, ray, got 'grpc'"):
        shard_serving(replace(ServeConfig(), shard_transport="grpc"))


def brute_force_expanded(index, xq, tokens, conf):
    """α-QE after SP from first principles: the exact global scores of the shortlist, SP's inliers,
    the first order, the verified top averaged in (rerank.expand.expanded_scores, the function
    bench/rerank.py scores with, over the shortlist's own vectors), and the order again."""
    from rerank.ensemble import combine, rerank_order
    from rerank.expand import expanded_scores
    from rerank.rerank import Reranker

    reranker, out = Reranker(conf), []
    D, I = index.search(xq, conf.shortlist)
    for q in range(len(xq)):
        rows, s_global = I[q], D[q].astype(np.float64)
        local = reranker.local_scores(tokens[q], index.local_store.batch(index.positions_of_rows(rows)))
        first = rerank_order(combine("sp", s_global, local.raw, local.has_locals, conf.ensemble, local.chamfer), rows)
        vectors = index.vectors_of_rows(rows)[0]
        second = None  # a query without tokens: nothing verified, nothing expanded
        if local.inliers is not None:
            second = expanded_scores(xq[q], vectors, first, local.inliers, conf.expansion)
        s = s_global if second is None else second
        final = combine("sp", s, local.raw, local.has_locals, conf.ensemble, local.chamfer)
        out.append((rows[rerank_order(final, rows)], second is not None))
    return out


def test_expansion_after_reranking_equals_brute_force_on_the_shards(built, sharded):
    """α-QE over the verified top (--rerank-qe): the single index and the shards answer alike,
    and as the brute-force computation; the expansion changes the answers of some queries."""
    from rerank.expand import ExpansionConfig

    _, out, _ = built
    single = load_index(out)
    keys = [f"{s:06d}/{i:05d}" for s in SIZES for i in (1, 17, 90, 101)]
    # the keys' vectors blurred (a query is never its stored row): the verified row pulls them back
    xq = np.stack([single.vector_of(k) for k in keys]) + 0.25 * np.random.default_rng(0).standard_normal((len(keys), D))
    xq = (xq / np.linalg.norm(xq, axis=1, keepdims=True)).astype(np.float32)
    tokens = stored_tokens(single, keys)
    from rerank.ensemble import EnsembleConfig

    # global-heavy: the second global scoring then decides between the verified results; with SP's
    # Chamfer term, whose similarities the shards send back
    plain = RerankConfig(
        method="sp",
        shortlist=60,
        ensemble=EnsembleConfig(lam=0.9, chamfer_weight=0.05),
        expansion=ExpansionConfig(top=0),
    )
    qe = replace(plain, expansion=ExpansionConfig(top=5, min_inliers=2))
    D0, I0, _ = search(single, xq, QueryConfig(k=15, rerank=plain), tokens)
    D1, I1, d1 = search(single, xq, QueryConfig(k=15, rerank=qe), tokens)
    D2, I2, d2 = search(sharded, xq, QueryConfig(k=15, rerank=qe), stored_tokens(sharded, keys))
    np.testing.assert_array_equal(I1, I2)
    np.testing.assert_array_equal(D1, D2)
    assert [d["expanded_with"] for d in d1] == [d["expanded_with"] for d in d2]
    for a, b in zip(d1, d2):
        np.testing.assert_array_equal(a["chamfer"], b["chamfer"])
    assert any((d["chamfer"] > 0).any() for d in d1)  # the term is at work (not all zeros)
    reference = brute_force_expanded(single, xq, tokens, qe)
    for q, (order, expanded) in enumerate(reference):
        np.testing.assert_array_equal(I1[q], order[:15])
        assert (d1[q]["expanded_with"] > 0) == expanded
    assert sum(d["expanded_with"] > 0 for d in d1) >= len(keys) // 4
    assert (D0 != D1).any() and (I0 != I1).any()  # the expansion moved results
    # the default: no expansion
    D3, I3, d3 = search(single, xq, QueryConfig(k=15, rerank=replace(plain, expansion=ExpansionConfig())), tokens)
    np.testing.assert_array_equal(I3, I0)
    np.testing.assert_array_equal(D3, D0)
    assert all(d["expanded_with"] == 0 for d in d3)


@pytest.fixture(scope="module")
def aliked_index(tmp_path_factory):
    """Two index shards of rows whose tokens are recorded as ALIKED's (the packaged ITQ)."""
    root = tmp_path_factory.mktemp("glue_shards")
    sizes = {0: 40, 1: 30}
    xb = write_descriptors_with_tokens(root / "desc", sizes, D, seed=5, aliked=True)
    return main(IndexConfig(kind="flat", shards=2), root / "desc", root / "index"), xb


def test_second_verification_on_shards_equals_the_single_index(aliked_index, tmp_path):
    """LightGlue over the top 4, each shard verifying its own rows (descriptors rebuilt from their
    codes with the recorded ITQ), answers as the single index does; its top is re-ordered only
    among itself."""
    from rerank.glue import GlueConfig

    out, _ = aliked_index
    single, sharded = load_index(out), coordinator(out, tmp_path / "cache")
    keys = ["000000/00003", "000001/00007", "000000/00021"]
    glue = GlueConfig(top=4, weight=0.5, cap=5)
    answers = []
    for index in (single, sharded):
        xq = np.stack([index.vector_of(k) for k in keys])
        tokens = stored_tokens(index, keys)
        first = search(index, xq, QueryConfig(k=8, rerank=RerankConfig(method="sp", shortlist=10)), tokens)
        conf = QueryConfig(k=8, rerank=RerankConfig(method="sp", shortlist=10, glue=glue))
        answers.append((first, search(index, xq, conf, tokens)))
    ((_, I1, _), (D2, I2, details)), ((_, I3, _), (D4, I4, details_sharded)) = answers
    np.testing.assert_array_equal(I1, I3)
    np.testing.assert_array_equal(I2, I4)
    # LightGlue's float sums differ in the last bits between batches of other compositions
    np.testing.assert_allclose(D2, D4, rtol=1e-5)
    for a, b in zip(details, details_sharded):
        np.testing.assert_allclose(a["glue_matches"], b["glue_matches"], rtol=1e-5)
    for q in range(len(keys)):
        assert set(I2[q, :4]) == set(I1[q, :4]) and np.array_equal(I2[q, 4:], I1[q, 4:])
        assert np.isfinite(details[q]["glue_matches"][:4]).all() and np.isnan(details[q]["glue_matches"][4:]).all()
    assert any(not np.array_equal(I2[q, :4], I1[q, :4]) for q in range(len(keys)))  # the stage did re-order
