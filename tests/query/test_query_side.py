"""Query-side options from ILIAS: multi-scale and 4-rotation extraction of query images, and text
queries read from ILIAS-style ``Txxx.txt`` files."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from core.errors import NeedleInputError
from core.multiscale import check_scales_rotations
from embed.extract import GlobalExtractor, parse_scales
from tests.support.tars import jpeg_bytes

ILIAS_SCALES = (0.707, 1.0, 1.414)
RES = 96  # small: every test image and variant stays cheap on 2 CPU cores


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: one intra-op thread


@pytest.fixture(scope="module")
def plain() -> GlobalExtractor:
    return GlobalExtractor(resolution=RES, batch_size=8, precision="fp32")


@pytest.fixture(scope="module")
def multi() -> GlobalExtractor:
    return GlobalExtractor(resolution=RES, batch_size=8, precision="fp32", scales=ILIAS_SCALES, rotations=4)


@pytest.fixture(scope="module")
def images(photos) -> list[np.ndarray]:
    """Three photos at the extractor's resolution: landscape, portrait (a crop) and square."""
    from ingest.images import decode_resized

    sources = [photos["chelsea"], np.ascontiguousarray(photos["rocket"][:, 170:470]), photos["astronaut"]]
    out = [decode_resized(jpeg_bytes(image), RES)[0] for image in sources]
    assert len({im.shape for im in out}) > 1  # batching by shape is exercised
    return out


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def brute_force(extractor: GlobalExtractor, image: np.ndarray, scales, rotations: int) -> np.ndarray:
    """The ILIAS recipe written out variant by variant, one forward pass each: resize by each
    scale (bicubic, floor of the scaled side), turn, describe, L2-normalise, average, L2-normalise."""
    h, w = image.shape[:2]
    acc = np.zeros(extractor.dim, np.float64)
    for s in scales:
        scaled = (
            image
            if s == 1.0
            else np.asarray(Image.fromarray(image).resize((int(w * s), int(h * s)), Image.Resampling.BICUBIC))
        )
        for r in range(rotations):
            turned = np.array(np.rot90(scaled, k=r * (4 // rotations)))  # a writable, contiguous copy
            d = extractor.forward_uint8(turned[None])[0].astype(np.float64)
            acc += d / np.linalg.norm(d)
    return acc / np.linalg.norm(acc)


# --- multi-scale / rotation descriptors ------------------------------------------------------
def test_multiscale_rotation_equals_brute_force_reference(multi, images):
    out = multi(images)["global"]
    assert out.dtype == np.float16 and out.shape == (len(images), multi.dim)
    reference = np.stack([brute_force(multi, im, ILIAS_SCALES, 4) for im in images])
    assert cosine(out, reference).min() > 1 - 1e-3
    np.testing.assert_allclose(np.linalg.norm(out.astype(np.float32), axis=1), 1.0, atol=2e-3)


@pytest.mark.parametrize("scales,rotations", [((1.0,), 2), ((0.5, 1.0), 1)])
def test_other_combinations_equal_brute_force(plain, images, scales, rotations):
    extractor = GlobalExtractor(resolution=RES, batch_size=3, precision="fp32", scales=scales, rotations=rotations)
    out = extractor(images)["global"]
    reference = np.stack([brute_force(plain, im, scales, rotations) for im in images])
    assert cosine(out, reference).min() > 1 - 1e-3


def test_variant_descriptor_differs_from_plain(plain, multi, images):
    # Not a no-op: averaging over scales and turns moves the descriptor (but keeps it close).
    c = cosine(plain(images)["global"], multi(images)["global"])
    assert (c < 0.999).all() and (c > 0.3).all()


def test_default_is_the_plain_single_pass(plain, images):
    explicit = GlobalExtractor(resolution=RES, batch_size=8, precision="fp32", scales=(1.0,), rotations=1)
    assert not plain.multi_variant and not explicit.multi_variant
    out = plain(images)["global"]
    np.testing.assert_array_equal(out, explicit(images)["global"])
    # The pre-existing computation: one forward pass per image, cast to float16.
    expected = np.stack([plain.forward_uint8(np.array(im)[None])[0] for im in images]).astype(np.float16)
    np.testing.assert_allclose(out.astype(np.float32), expected.astype(np.float32), atol=2e-3)
    assert "scales" not in plain.info() and "rotations" not in plain.info()
    assert plain.info() == explicit.info()


def test_info_records_non_default_options(multi):
    info = multi.info()
    assert info["scales"] == list(ILIAS_SCALES) and info["rotations"] == 4
    json.dumps(info)


def test_four_rotations_are_invariant_to_a_quarter_turn(multi, images):
    extractor = GlobalExtractor(resolution=RES, batch_size=8, precision="fp32", rotations=4)
    for image in images[:2]:
        turned = np.ascontiguousarray(np.rot90(image))
        a, b = extractor([image, turned])["global"].astype(np.float32)
        assert cosine(a, b) > 1 - 1e-4  # the same four variants, summed in another order
        # With scales, the resize of a turned image is the turn of the resized one up to PIL's
        # per-pass rounding: equal within fp tolerance.
        a, b = multi([image, turned])["global"].astype(np.float32)
        assert cosine(a, b) > 1 - 1e-3
    plain = GlobalExtractor(resolution=RES, batch_size=8, precision="fp32")
    a, b = plain([images[0], np.ascontiguousarray(np.rot90(images[0]))])["global"].astype(np.float32)
    assert cosine(a, b) < 0.99  # a single-rotation descriptor is not invariant: the test means something


def test_tiny_image_keeps_a_minimum_size(multi):
    tiny = np.random.default_rng(0).integers(0, 255, (18, 20, 3), dtype=np.uint8)
    out = multi([tiny])["global"]
    assert np.isfinite(out.astype(np.float32)).all() and abs(np.linalg.norm(out.astype(np.float32)) - 1) < 2e-3


def test_empty_batch(multi):
    assert multi([])["global"].shape == (0, multi.dim)


@pytest.mark.parametrize(
    "scales,rotations,named",
    [
        ((), 1, "()"),
        ((0.0, 1.0), 1, "0.0"),
        ((-1.0,), 1, "-1.0"),
        (("big",), 1, "big"),
        ((float("nan"),), 1, "nan"),
        ((1.0,), 3, "3"),
        ((1.0,), 0, "0"),
        ((1.0,), True, "True"),
    ],
)
def test_bad_values_are_refused(scales, rotations, named):
    with pytest.raises(NeedleInputError, match=named.replace("(", r"\(").replace(")", r"\)")):
        check_scales_rotations(scales, rotations)


def test_bad_values_refused_by_extractor_and_configs():
    from ingest.config import IngestConfig
    from query.retrieve import QueryConfig

    with pytest.raises(NeedleInputError, match="rotations"):
        GlobalExtractor(resolution=64, rotations=3)
    with pytest.raises(NeedleInputError, match=r"-0\.5"):
        GlobalExtractor(resolution=64, scales=(1.0, -0.5))
    with pytest.raises(NeedleInputError, match="rotations"):
        IngestConfig(query_rotations=5)
    with pytest.raises(NeedleInputError, match=r"0\.0"):
        IngestConfig(query_scales=(0.0,))
    with pytest.raises(NeedleInputError, match="rotations"):
        QueryConfig(rotations=3)
    assert QueryConfig(scales=[0.707, 1, 1.414]).scales == ILIAS_SCALES
    assert IngestConfig(query_scales=[1, 2]).query_scales == (1.0, 2.0)


def test_parse_scales():
    assert parse_scales("0.707,1,1.414") == ILIAS_SCALES
    assert parse_scales(" 1 ") == (1.0,)
    with pytest.raises(NeedleInputError, match=r"0\.7;1"):
        parse_scales("0.7;1")
    with pytest.raises(NeedleInputError, match="positive"):
        parse_scales("1,0")


# --- ingestion with query-side options -------------------------------------------------------
def test_ingest_worker_records_query_options(tmp_path, tiny_shards):
    from cluster.ingest_job import IngestWorker, _check_same_settings, _report
    from ingest.config import IngestConfig

    conf = IngestConfig(resolution=RES, batch_size=8, query_scales=ILIAS_SCALES, query_rotations=4)
    assert pickle.loads(pickle.dumps(conf)) == conf  # what a Ray actor receives
    worker = IngestWorker(conf, "cpu", 1)  # the Ray actor's class, called directly
    result = worker.process(str(tiny_shards[0]), 0, str(tmp_path / "out"))
    assert result["status"] == "ok" and result["rows"] == 3
    extractors = result.pop("extractors")
    assert extractors[0]["scales"] == list(ILIAS_SCALES) and extractors[0]["rotations"] == 4

    # The job's info file, written as main() writes it, round-tripped through JSON.
    report = json.loads(json.dumps(_report(conf, [str(tiny_shards[0])], [result], {}, 1.0, {"extractors": extractors})))
    assert report["config"]["query_scales"] == list(ILIAS_SCALES) and report["config"]["query_rotations"] == 4
    assert report["extractors"][0]["scales"] == list(ILIAS_SCALES)

    # Resuming: the same options match what JSON made of them; other ones are refused.
    _check_same_settings(report, conf, "out", committed=True)
    with pytest.raises(NeedleInputError, match="overwrite"):
        _check_same_settings(report, IngestConfig(resolution=RES, batch_size=8), "out", committed=True)
    plain = json.loads(json.dumps(_report(IngestConfig(resolution=RES), [], [], {}, 1.0, {"extractors": []})))
    _check_same_settings(plain, IngestConfig(resolution=RES), "out", committed=True)
    del plain["config"]["query_scales"], plain["config"]["query_rotations"]  # an info file from before them
    _check_same_settings(plain, IngestConfig(resolution=RES), "out", committed=True)


def test_ingest_cli_flags_reach_the_config(monkeypatch, tmp_path):
    import cluster.ingest_job
    from cli.main import main

    seen = {}
    monkeypatch.setattr(cluster.ingest_job, "main", lambda conf, shards, out: seen.setdefault("conf", conf))
    assert (
        main(
            ["ingest", "--shards", "x.tar", "--out", str(tmp_path), "--multiscale", "0.707,1,1.414", "--rotations", "4"]
        )
        == 0
    )
    assert seen["conf"].query_scales == ILIAS_SCALES and seen["conf"].query_rotations == 4
    assert main(["ingest", "--shards", "x.tar", "--out", str(tmp_path), "--multiscale", "1,zero"]) == 2


# --- image queries through an index -----------------------------------------------------------
def write_ingest_info(directory: Path, extractor_info: dict) -> None:
    (directory / "ingest_info.json").write_text(json.dumps({"schema_version": 1, "extractors": [extractor_info]}))


@pytest.fixture(scope="module")
def image_index(tmp_path_factory, photos, plain):
    """A flat index of the six photos, described at RES by the default extractor."""
    from index.build.stage import IndexConfig, main
    from ingest.images import decode_resized
    from tests.support.index import write_descriptor_file

    root = tmp_path_factory.mktemp("image_index")
    images = [decode_resized(jpeg_bytes(photo), RES)[0] for photo in photos.values()]
    write_descriptor_file(root / "desc", "000000", 0, plain(images)["global"])
    write_ingest_info(root / "desc", plain.info())
    main(IndexConfig(kind="flat"), root / "desc", root / "index")
    return root


def test_image_query_with_multiscale_and_rotations(image_index, photos, multi, tmp_path, capsys):
    from cli.main import main
    from index.search import load_index
    from query.retrieve import embed_image_files

    path = tmp_path / "coffee.jpg"
    path.write_bytes(jpeg_bytes(photos["coffee"]))
    index = load_index(image_index / "index")
    xq = embed_image_files(index, [path], scales=ILIAS_SCALES, rotations=4)
    from ingest.images import decode_resized

    expected = multi([decode_resized(path.read_bytes(), RES)[0]])["global"].astype(np.float32)
    assert cosine(xq, expected)[0] > 1 - 1e-3
    assert cosine(xq, embed_image_files(index, [path]))[0] < 0.999  # the flags change the query

    assert (
        main(
            [
                "query",
                "--index",
                str(image_index / "index"),
                "--image",
                str(path),
                "--k",
                "2",
                "--multiscale",
                "0.707,1,1.414",
                "--rotations",
                "4",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["query"] == {"image": str(path)} and out["results"][0]["key"] == "000000/00002"  # coffee
    assert out["results"][0]["score"] == pytest.approx(float(cosine(xq, index.vector_of("000000/00002"))[0]), abs=1e-2)


# --- text queries from files ------------------------------------------------------------------
@pytest.fixture
def ilias_text_tree(tmp_path) -> Path:
    root = tmp_path / "text_queries"
    (root / "inst_b" / "query").mkdir(parents=True)
    (root / "inst_a").mkdir()
    (root / "inst_a" / "T001.txt").write_text("  a tabby cat on a red chair\n")
    (root / "inst_b" / "query" / "T002.txt").write_text("a rocket on its launch pad")
    (root / "inst_a" / "notes.txt").write_text("not a query")  # not T*.txt: ignored
    return root


def test_read_text_queries_from_a_directory(ilias_text_tree):
    from query.retrieve import read_text_queries

    assert read_text_queries(ilias_text_tree) == [
        ("inst_a/T001.txt", "a tabby cat on a red chair"),
        ("inst_b/query/T002.txt", "a rocket on its launch pad"),
    ]
    assert read_text_queries(str(ilias_text_tree)) == read_text_queries([ilias_text_tree])


def test_read_text_queries_from_files(ilias_text_tree):
    from query.retrieve import read_text_queries

    given = str(ilias_text_tree / "inst_b" / "query" / "T002.txt")
    other = ilias_text_tree / "inst_a" / "notes.txt"  # a file given by name need not be called T*.txt
    assert read_text_queries([given, other]) == [(given, "a rocket on its launch pad"), (str(other), "not a query")]


def test_read_text_queries_refuses_bad_input(ilias_text_tree, tmp_path):
    from query.retrieve import read_text_queries

    empty = ilias_text_tree / "inst_c" / "T003.txt"
    empty.parent.mkdir()
    empty.write_text(" \n\t")
    with pytest.raises(NeedleInputError, match=r"T003\.txt is empty"):
        read_text_queries(ilias_text_tree)
    with pytest.raises(NeedleInputError, match=r"nope\.txt does not exist"):
        read_text_queries([tmp_path / "nope.txt"])
    (tmp_path / "bare").mkdir()
    with pytest.raises(NeedleInputError, match=r"no T.*bare"):
        read_text_queries(tmp_path / "bare")
    binary = tmp_path / "T9.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(NeedleInputError, match=r"cannot read text-query file .*T9\.txt"):
        read_text_queries([binary])
    with pytest.raises(NeedleInputError, match="no text-query files"):
        read_text_queries([])


def test_text_file_query_on_an_image_only_model_is_refused(image_index, ilias_text_tree, caplog):
    from cli.main import main

    assert main(["query", "--index", str(image_index / "index"), "--text-file", str(ilias_text_tree), "--k", "1"]) == 2
    assert "no text tower" in caplog.text


def test_text_file_that_is_empty_is_refused_before_the_index_loads(ilias_text_tree, tmp_path, caplog):
    from cli.main import main

    (ilias_text_tree / "inst_a" / "T001.txt").write_text("")
    assert main(["query", "--index", str(tmp_path / "no_index"), "--text-file", str(ilias_text_tree)]) == 2
    assert "T001.txt is empty" in caplog.text


@pytest.fixture(scope="module")
def clip_index(tmp_path_factory):
    """A flat index of random 512-d vectors recorded as made by the (seeded random initialisation, as
    `--random-init` records it: no weights are downloaded) open_clip ViT-B/16: enough to exercise the
    text tower end to end."""
    from embed.registry import describe
    from index.build.stage import IndexConfig, main
    from tests.support.indexes import CLIP_DESCRIPTORS, write_synthetic

    root = tmp_path_factory.mktemp("clip_index")
    write_synthetic(CLIP_DESCRIPTORS, root)
    write_ingest_info(
        root / "desc",
        {
            "extractor": "global",
            "model": describe("open_clip.ViT-B-16.head"),
            "weights": "random",
            "resolution": 224,
            "precision": "fp32",
            "dim": 512,
            "dtype": "float16",
        },
    )
    main(IndexConfig(kind="flat"), root / "desc", root / "index")
    return root / "index"


def test_text_file_query_end_to_end(clip_index, ilias_text_tree, capsys):
    from cli.main import main

    assert main(["query", "--index", str(clip_index), "--text-file", str(ilias_text_tree), "--k", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [q["query"] for q in out] == [
        {"id": "inst_a/T001.txt", "text": "a tabby cat on a red chair"},
        {"id": "inst_b/query/T002.txt", "text": "a rocket on its launch pad"},
    ]
    for q in out:
        assert q["k"] == 3 and len(q["results"]) == 3
        assert set(q["results"][0]) == {"key", "row", "score"}
        scores = [r["score"] for r in q["results"]]
        assert scores == sorted(scores, reverse=True)


def test_text_file_queries_rank_like_plain_texts(clip_index, ilias_text_tree):
    from index.search import load_index
    from query.retrieve import QueryConfig, query, read_text_queries

    index = load_index(clip_index)
    pairs = read_text_queries(ilias_text_tree)
    # One call embeds both with the same text tower (random weights differ between model builds).
    out = query(index, QueryConfig(k=5), texts=[t for _, t in pairs], text_queries=pairs)
    assert [q["query"] for q in out[:2]] == [{"text": t} for _, t in pairs]
    assert [q["query"]["id"] for q in out[2:]] == [i for i, _ in pairs]
    for plain, from_file in zip(out[:2], out[2:]):
        assert plain["results"] == from_file["results"]
