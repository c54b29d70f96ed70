"""Local tokens end to end: ITQ, the CNN extractor, schema-v2 Parquet, the local store, the ensemble
and the query path with re-ranking."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embed.itq import ITQ, ITQFileError, load_itq, quantization_loss, save_itq, train_itq
from ingest.descriptors import list_column, list_values

# --- ITQ ----------------------------------------------------------------------------------------


def _correlated(n: int, d: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) @ rng.normal(size=(d, d)) + 0.3
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_itq_codes_are_signs_of_the_projection_and_round_trip(tmp_path):
    x = _correlated(2000, 112)
    itq = train_itq(x, iterations=20)
    codes = itq.binarize(x[:50])
    assert codes.shape == (50, 16) and codes.dtype == np.uint8
    expected = np.packbits(((x[:50] - itq.mean) @ itq.proj) >= 0, axis=1)
    np.testing.assert_array_equal(codes, expected)
    loaded = load_itq(save_itq(itq, tmp_path / "itq.npz"))
    np.testing.assert_array_equal(loaded.proj, itq.proj)
    np.testing.assert_array_equal(loaded.binarize(x), itq.binarize(x))


def test_itq_pads_short_descriptors_to_128_informative_bits():
    x = _correlated(3000, 64)
    itq = train_itq(x, iterations=30)
    assert itq.proj.shape == (64, 128)
    bits = np.unpackbits(itq.binarize(x), axis=1)
    rate = bits.mean(0)
    assert ((rate > 0.02) & (rate < 0.98)).all(), "every bit should vary (the rotation spreads the PCA variance)"


def test_itq_rotation_lowers_the_quantisation_loss_of_pca():
    x = _correlated(3000, 128, seed=1)
    pca_only = train_itq(x, iterations=0)
    learned = train_itq(x, iterations=50)
    assert quantization_loss(learned, x) < quantization_loss(pca_only, x) - 1e-4


def test_itq_reads_ames_files_without_mean_and_refuses_bad_ones(tmp_path):
    proj = np.random.default_rng(0).normal(size=(768, 128)).astype(np.float32)
    np.savez(tmp_path / "ames.npz", proj=proj)
    itq = load_itq(tmp_path / "ames.npz")
    assert not itq.mean.any() and itq.dim == 768
    np.savez(tmp_path / "bad.npz", proj=proj[:, :64])
    with pytest.raises(ITQFileError, match=r"bad\.npz"):
        load_itq(tmp_path / "bad.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ITQFileError, match=r"junk\.npz"):
        load_itq(tmp_path / "junk.npz")
    with pytest.raises(ITQFileError, match=r"missing\.npz"):
        load_itq(tmp_path / "missing.npz")


# --- list columns -------------------------------------------------------------------------------


def test_list_columns_round_trip_every_value_kind():
    rng = np.random.default_rng(0)
    codes = [rng.integers(0, 256, (n, 16), dtype=np.uint8) if n is not None else None for n in (3, None, 0, 5)]
    descs = [rng.normal(size=(n, 7)).astype(np.float16) if n is not None else None for n in (3, None, 0, 5)]
    xs = [np.arange(n, dtype=np.int16) if n is not None else None for n in (3, None, 0, 5)]
    for values, type_ in (
        (codes, pa.list_(pa.binary(16))),
        (descs, pa.list_(pa.list_(pa.float16(), 7))),
        (xs, pa.list_(pa.int16())),
    ):
        column = list_column(values, type_)
        # Through Parquet and a slice, so that offsets do not start at 0.
        table = pq.read_table(pa.BufferReader(_parquet_bytes(pa.table({"c": column}))))
        offsets, flat = list_values(table["c"].slice(1))
        expected = [v if v is not None else None for v in values[1:]]
        for i, v in enumerate(expected):
            got = flat[offsets[i] : offsets[i + 1]]
            if v is None:
                assert len(got) == 0
            else:
                np.testing.assert_array_equal(got, v)


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue()


# --- the CNN extractor --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def local_extractor():
    from embed.locals.extract import LocalExtractor
    from embed.locals.presets import LITE0_ITQ, LocalConfig

    return LocalExtractor(LocalConfig(resolution=192, top_k=30, itq=LITE0_ITQ, keep_desc=True))


def test_cnn_tokens_follow_the_image_content(local_extractor, photos):
    """Cropping 32 px (two stride-16 cells) off the left moves the same tokens 32 px left."""
    from embed.locals.extract import _resize

    image = _resize(photos["astronaut"], 192)
    cropped = np.ascontiguousarray(image[:, 32:])
    full, crop = local_extractor.describe([image, cropped])
    assert len(full.desc) == 30 and (np.diff(full.weight) <= 0).all()
    assert np.allclose(np.linalg.norm(full.desc, axis=1), 1, atol=1e-4)
    # Base pixels of the crop: its own resize to 192 on the longer side (unchanged height).
    h, w = cropped.shape[:2]
    scale = 192 / max(h, w)
    moved = []
    for desc, xy in zip(crop.desc, crop.xy):
        j = int(np.argmax(full.desc @ desc))
        moved.append(full.xy[j] - (xy / scale + [32, 0]))
    moved = np.abs(np.array(moved))
    assert np.median(moved[:, 0]) <= 8 and np.median(moved[:, 1]) <= 8


def test_multi_scale_tokens_per_scale_and_codes(photos):
    from embed.locals.extract import LocalExtractor
    from embed.locals.presets import LITE0_ITQ, LocalConfig

    ex = LocalExtractor(LocalConfig(resolution=128, scales=(0.75, 1.0, 1.5), per_scale=True, top_k=12, itq=LITE0_ITQ))
    assert ex.resolution == 192
    from embed.locals.extract import _resize

    image = _resize(photos["coffee"], ex.resolution)
    [described] = ex.describe([image])
    assert np.bincount(described.scale_index, minlength=3).tolist() == [12, 12, 12]
    [tokens] = ex.tokens([image])
    np.testing.assert_array_equal(tokens.codes, ex.itq.binarize(described.desc))
    assert set(np.unique(tokens.scale).round(3)) == {0.75, 1.0, 1.5}
    base_w, base_h = 128, 128 * image.shape[0] / image.shape[1]
    assert (tokens.xy[:, 0] > 0).all() and (tokens.xy[:, 0] < base_w).all() and (tokens.xy[:, 1] < base_h + 1).all()


def test_local_extractor_refuses_missing_or_mismatched_itq(tmp_path):
    from core.errors import NeedleInputError
    from embed.locals.extract import LocalExtractor
    from embed.locals.presets import LocalConfig

    with pytest.raises(NeedleInputError, match="ITQ"):
        LocalExtractor(LocalConfig(resolution=64, itq=None))
    save_itq(ITQ(np.zeros((768, 128), np.float32), np.zeros(768, np.float32)), tmp_path / "vit.npz")
    with pytest.raises(NeedleInputError, match="d=768"):
        LocalExtractor(LocalConfig(resolution=64, itq=str(tmp_path / "vit.npz")))


# --- ingestion, the local store -----------------------------------------------------------------


@pytest.fixture
def local_descriptors(tmp_path, tiny_shards, extractor, local_extractor):
    """The tiny shards through the shard pipeline with global and local extractors; the second
    shard gets a corrupt sample (an error row)."""
    import tarfile

    from ingest.pipeline import process_shard

    with tarfile.open(tiny_shards[1], "a") as tar:
        import io

        info = tarfile.TarInfo("99999.jpg")
        info.size = 10
        tar.addfile(info, io.BytesIO(b"not a jpeg"))
    out = tmp_path / "desc"
    for i, shard in enumerate(tiny_shards):
        result = process_shard(str(shard), i, out, [extractor, local_extractor])
        assert result.status == "ok"
    # What the ingestion job records beside its parts: how the columns were made.
    (out / "ingest_info.json").write_text(json.dumps({"extractors": [extractor.info(), local_extractor.info()]}))
    return out


def test_schema_v2_rows_carry_their_tokens(local_descriptors, local_extractor):
    from index.locals import read_token_records

    path = local_descriptors / "000001.parquet"
    table = pq.read_table(path)
    assert table.schema.metadata[b"needle_schema_version"] == b"2"
    assert {"local_codes", "local_x", "local_y", "local_scale", "local_weight", "local_desc"} <= set(table.column_names)
    offsets, records = read_token_records(path)
    counts = np.diff(offsets)
    status = table["status"].to_pylist()
    assert status == ["ok", "ok", "ok", "error"]
    assert counts.tolist() == [30, 30, 30, 0]
    _, desc = list_values(table["local_desc"])
    np.testing.assert_array_equal(records["code"], local_extractor.itq.binarize(desc.astype(np.float32)))


@pytest.mark.parametrize("shards", [1, 2])
def test_local_store_returns_each_rows_tokens_exactly(tmp_path, local_descriptors, shards):
    from index.build.stage import IndexConfig
    from index.build.stage import main as build
    from index.errors import IndexFileError
    from index.locals import LocalStoreError, read_token_records
    from index.search import load_index

    out = build(IndexConfig(kind="flat", shards=shards), local_descriptors, tmp_path / "idx")
    index = load_index(out)
    infos = index.infos["locals"]
    assert infos["bytes_per_image"] > 0
    store = index.local_store
    assert len(store.segments) == shards  # each shard directory holds its own segment
    expected = []
    for path in sorted(local_descriptors.glob("*.parquet")):
        offsets, records = read_token_records(path)
        expected += [records[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
    for position, records in enumerate(expected):
        got = store.records(position)
        assert got.tobytes() == records.tobytes()
    positions = np.array([5, -1, 0, 6, 3])
    batch = store.batch(positions, length=25)
    for b, p in enumerate(positions):
        n = 0 if p < 0 else min(25, len(expected[p]))
        assert batch.mask[b].sum() == n
        if n:
            np.testing.assert_array_equal(batch.codes[b, :n], expected[p]["code"][:n])
            np.testing.assert_array_equal(batch.xy[b, :n, 0], expected[p]["x"][:n])
            np.testing.assert_array_equal(batch.weight[b, :n], expected[p]["weight"][:n].astype(np.float32))
    with pytest.raises(LocalStoreError, match="outside"):
        store.batch(np.array([len(expected)]))
    segment = out / store.segments[0].tokens
    segment.write_bytes(segment.read_bytes()[:-5])
    with pytest.raises(IndexFileError, match=rf"shard_000.*{segment.name} has .* bytes"):
        _ = load_index(out).local_store


# --- ensemble -----------------------------------------------------------------------------------


def test_ensemble_map_equals_the_metric_and_grid_search_uses_validation_only():
    from eval.metrics import average_precision_at_k
    from rerank.ensemble import EnsembleConfig, ValidationQuery, combine, grid_search, mean_ap, rerank_order

    rng = np.random.default_rng(0)
    queries = []
    for _ in range(20):
        c = 50
        positive = rng.random(c) < 0.1
        positive[rng.integers(c)] = True
        s_global = np.sort(rng.random(c))[::-1]
        raw = np.where(positive, rng.integers(3, 60, c), rng.integers(0, 8, c)).astype(float)  # inliers: informative
        has = rng.random(c) < 0.9
        chamfer = rng.uniform(-0.1, 0.5, c)  # SP's Chamfer similarities (the default ensemble's term)
        queries.append(
            ValidationQuery(np.arange(c) * 7, s_global, raw, has, positive, int(positive.sum()) + 1, chamfer)
        )
    conf = EnsembleConfig(lam=0.3)
    brute = []
    for q in queries:
        scores = combine("sp", q.s_global, q.raw_local, q.has_locals, conf, q.chamfer)
        ranking = sorted(range(len(scores)), key=lambda i: (-scores[i], q.rows[i]))
        positives = set(np.flatnonzero(q.positive)) | {-1}  # one positive outside the shortlist
        brute.append(average_precision_at_k(ranking, positives, 10))
        assert (
            combine("sp", q.s_global, q.raw_local, q.has_locals, conf, q.chamfer)[~q.has_locals]
            == q.s_global[~q.has_locals]
        ).all()
    assert mean_ap(queries, "sp", conf, 10) == pytest.approx(100 * np.mean(brute))
    best, value = grid_search(queries[:10], "sp", k=10)
    assert value == pytest.approx(mean_ap(queries[:10], "sp", best, 10))
    assert value >= mean_ap(queries[:10], "sp", EnsembleConfig(lam=1.0), 10)
    assert best.lam < 1.0  # the informative local score is used
    assert rerank_order(np.array([1.0, 2.0, 2.0]), np.array([9, 5, 3])).tolist() == [2, 1, 0]


# --- the query path -----------------------------------------------------------------------------


def test_query_and_eval_rerank_with_local_tokens(tmp_path, local_descriptors, capsys, caplog):
    from cli.main import main as cli
    from eval.evaluate import EvalConfig, evaluate
    from index.build.stage import IndexConfig
    from index.build.stage import main as build
    from rerank.rerank import RerankConfig

    out = build(IndexConfig(kind="flat"), local_descriptors, tmp_path / "idx")
    # Photo i of shard 0 and its mirror in shard 1 are each other's positives.
    truth = [{"key": f"000000/00{i:03d}", "positives": [f"000001/01{i:03d}"]} for i in range(3)]
    plain = evaluate(out, truth, EvalConfig(k=5))
    reranked = evaluate(out, truth, EvalConfig(k=5, rerank=RerankConfig(method="chamfer", shortlist=4)))
    assert reranked["n_queries"] == plain["n_queries"] == 3
    assert 0 <= reranked["map_at_5"] <= 100
    assert (
        cli(["query", "--index", str(out), "--key", "000000/00000", "--k", "3", "--rerank", "sp", "--shortlist", "5"])
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["results"][0]["key"] == "000000/00000"  # itself: every token matches in place
    assert result["results"][0]["inliers"] >= 5
    assert {"global_score", "local_score", "inliers"} <= set(result["results"][1])
    # the second verification is LightGlue for ALIKED: these are CNN tokens, a typed error naming it
    glue = ["query", "--index", str(out), "--key", "000000/00000", "--k", "3", "--rerank", "sp", "--glue-top", "3"]
    assert cli(glue) == 2
    assert "LightGlue for ALIKED tokens" in caplog.text


def test_train_itq_stage_learns_from_kept_descriptors(tmp_path, local_descriptors):
    from cli.main import main as cli
    from ingest.descriptors import DescriptorFileError

    out = tmp_path / "itq.npz"
    assert (
        cli(["locals", "train-itq", "--descriptors", str(local_descriptors), "--out", str(out), "--iterations", "5"])
        == 0
    )
    itq = load_itq(out)
    assert itq.proj.shape == (112, 128)
    record = json.loads((tmp_path / "itq.npz.json").read_text())
    assert record["trained_on"] == 6 * 30  # six photos, 30 tokens each and record["dim"] == 112
    from embed.train_itq import TrainITQConfig, main

    v1 = tmp_path / "v1"
    v1.mkdir()
    pq.write_table(
        pq.read_table(local_descriptors / "000000.parquet").drop_columns(["local_desc"]), v1 / "000000.parquet"
    )
    with pytest.raises(DescriptorFileError, match="local_desc"):
        main(TrainITQConfig(), v1, tmp_path / "x.npz")


@pytest.mark.slow
def test_ames_train_cli_and_ames_reranking(tmp_path, local_descriptors, photos):
    """`needle ames train` on a few photos writes a checkpoint in the published layout that
    `needle eval --rerank ames` then uses."""
    from PIL import Image

    from cli.main import main as cli
    from index.build.stage import IndexConfig
    from index.build.stage import main as build
    from rerank.ames import load_ames

    images = tmp_path / "images"
    images.mkdir()
    for name, photo in photos.items():
        Image.fromarray(photo).save(images / f"{name}.jpg")
    ckpt = tmp_path / "ames.pt"
    assert (
        cli(
            [
                "ames",
                "train",
                "--images",
                str(images),
                "--out",
                str(ckpt),
                "--pairs",
                "12",
                "--epochs",
                "2",
                "--layers",
                "1",
            ]
        )
        == 0
    )
    model = load_ames(ckpt)
    assert model.conf.binarized and model.conf.local_dim == 112
    record = json.loads(ckpt.with_suffix(".json").read_text())
    assert record["pairs"] == 12 and len(record["loss_history"]) == 2
    out = build(IndexConfig(kind="flat"), local_descriptors, tmp_path / "idx")
    truth = tmp_path / "truth.json"
    truth.write_text(
        json.dumps({"queries": [{"key": f"000000/00{i:03d}", "positives": [f"000001/01{i:03d}"]} for i in range(3)]})
    )
    report = tmp_path / "report.json"
    assert (
        cli(
            [
                "eval",
                "map",
                "--index",
                str(out),
                "--ground-truth",
                str(truth),
                "--out",
                str(report),
                "--k",
                "5",
                "--rerank",
                "ames",
                "--ames",
                str(ckpt),
                "--shortlist",
                "4",
            ]
        )
        == 0
    )
    result = json.loads(report.read_text())
    assert result["config"]["rerank"]["method"] == "ames" and result["n_queries"] == 3


def test_serve_reranks_key_and_image_queries_with_evidence(tmp_path, local_descriptors, tiny_shards):
    import tarfile

    from index.build.stage import IndexConfig
    from index.build.stage import main as build
    from index.search import load_index
    from rerank.rerank import RerankConfig
    from webapi.query_service import QueryService

    index = load_index(build(IndexConfig(kind="flat"), local_descriptors, tmp_path / "idx"))
    service = QueryService(index, rerank=RerankConfig(method="sp", shortlist=5))
    [by_key] = service.search_json({"keys": ["000000/00001"], "k": 3})
    top = by_key["results"][0]
    assert top["key"] == "000000/00001" and top["inliers"] >= 5
    assert len(top["matches"]["query_xy"]) == len(top["matches"]["db_xy"]) == top["inliers"]
    with tarfile.open(tiny_shards[0]) as tar:
        data = tar.extractfile("00001.jpg").read()
    [by_image] = service.search_image(data, 3, None)
    assert by_image["results"][0]["key"] == "000000/00001"  # the same photo, re-extracted at the query scales
    assert by_image["results"][0]["inliers"] >= 5
    [by_vector] = service.search_json({"vectors": index.vector_of("000000/00001").tolist(), "k": 3})
    assert "inliers" not in by_vector["results"][0]  # no tokens: global scores only


def test_serve_image_queries_go_through_the_adapter_and_rerank_per_request(tmp_path, local_descriptors, tiny_shards):
    """An image query of an adapted index is embedded, then adapted, as ingestion + build did; a
    service started without re-ranking re-ranks a request that asks for it."""
    import tarfile

    from embed.adapt import LinearAdapter, save_adapter
    from index.build.stage import IndexConfig
    from index.build.stage import main as build
    from index.search import load_index
    from rerank.rerank import RerankConfig
    from webapi.query_service import QueryService

    adapter_path = save_adapter(LinearAdapter(1280, 64), tmp_path / "a.pt")
    index = load_index(build(IndexConfig(kind="flat", adapt=str(adapter_path)), local_descriptors, tmp_path / "idx"))
    service = QueryService(index)
    with tarfile.open(tiny_shards[0]) as tar:
        data = tar.extractfile("00001.jpg").read()
    [out] = service.search_image(data, 3, None)
    xq, tokens = service.embed_image(data)
    assert xq.shape == (1, 64) and tokens is None
    _, I = index.search(xq, 3)
    assert [r["key"] for r in out["results"]] == index.keys_of(I)[0]
    assert out["results"][0]["key"] == "000000/00001" and "inliers" not in out["results"][0]
    [reranked] = service.search_image(data, 3, None, rerank=RerankConfig(method="sp", shortlist=5))
    assert reranked["results"][0]["key"] == "000000/00001" and reranked["results"][0]["inliers"] >= 5


@pytest.mark.ray
def test_ray_sharded_index_reranks_like_the_single_process_one(tmp_path, local_descriptors, ray_local):
    from cluster.serve import serve_sharded
    from index.build.stage import IndexConfig
    from index.build.stage import main as build
    from index.search import load_index
    from query.retrieve import QueryConfig, search, stored_tokens
    from rerank.expand import ExpansionConfig
    from rerank.rerank import RerankConfig

    out = build(IndexConfig(kind="flat", shards=2), local_descriptors, tmp_path / "idx")
    keys = ["000000/00000", "000001/01002"]
    indexes = (load_index(out), serve_sharded(out))
    # no expansion (the default), and α-QE whose second scoring the actors do
    for expansion in (ExpansionConfig(), ExpansionConfig(top=3, min_inliers=1)):
        conf = QueryConfig(k=4, rerank=RerankConfig(method="sp", shortlist=6, expansion=expansion))
        results = []
        for index in indexes:
            xq = np.stack([index.vector_of(k) for k in keys])
            D, I, details = search(index, xq, conf, stored_tokens(index, keys))
            results.append((D, I, [d["inliers"] for d in details], [d["expanded_with"] for d in details]))
        (D1, I1, n1, e1), (D2, I2, n2, e2) = results
        np.testing.assert_array_equal(I1, I2)
        np.testing.assert_allclose(D1, D2)
        for a, b in zip(n1, n2):
            np.testing.assert_array_equal(a, b)
        assert e1 == e2 and (expansion.top == 0) == (max(e1) == 0)
