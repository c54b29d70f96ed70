"""The coordinator of shards served elsewhere, without Ray: ShardActor objects in this process
behind ``LocalShards``. It searches, routes key lookups, re-ranks (query expansion and LightGlue
included) and makes thumbnails exactly like the single-process index (ties included)."""

import json
from dataclasses import replace

import numpy as np
import pytest

from index.build.stage import SHARD_INFOS_FILE
from index.errors import UnknownKeyError
from index.search import load_index
from query.retrieve import QueryConfig, search, stored_tokens
from rerank.rerank import RerankConfig
from shards.coordinator import ShardedIndex, ShardsUnavailable
from shards.staging import read_index_infos
from tests.support.indexes import ALIKED_FLAT
from tests.support.serve_shards import SIZES, D, coordinator, queries

# pytest fixtures and the fixtures they request, imported by name (``x as x``: on purpose, not unused)
from tests.support.serve_shards import ames_checkpoint as ames_checkpoint
from tests.support.serve_shards import built as built
from tests.support.serve_shards import sharded as sharded


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


def test_query_service_answers_like_the_single_index(built, sharded):
    from webapi.query_service import QueryService

    _, out, xb = built
    rerank = RerankConfig(method="sp", shortlist=40)
    one, many = QueryService(load_index(out), rerank=rerank), QueryService(sharded, rerank=rerank)
    for body in ({"keys": ["000001/00007", "000007/00300"], "k": 12}, {"vectors": xb[5:8].tolist(), "k": 9}):
        assert many.search_json(body) == one.search_json(body)
    with pytest.raises(Exception, match="'partial' must be true or false"):
        many.search_json({"keys": ["000001/00007"], "partial": "yes"})


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
def aliked_index(synthetic_indexes):
    """Two index shards of rows whose tokens are recorded as ALIKED's (the packaged ITQ)."""
    return synthetic_indexes.get(ALIKED_FLAT)


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
