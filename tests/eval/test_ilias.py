"""ILIAS layout, result formats and scoring: needle eval's mAP equals the benchmark's own scoring
of the pickle and JSON needle writes."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from sklearn.metrics import average_precision_score

from eval.ilias import (
    SCALE_GROUPS,
    ILIASDataError,
    evaluate_results,
    load_ilias,
    read_results_pickle,
    score_query,
    sklearn_average_precision,
    write_results_json,
)
from eval.metrics import average_precision_at_k
from tests.support.ilias_benchmark import ILIAS
from tests.support.tars import jpeg_bytes, write_tar


def test_average_precision_equals_scikit_learn_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        y_true = rng.random(n) < 0.3
        y_score = rng.integers(0, 6, n).astype(float)  # many ties
        if not y_true.any():
            assert sklearn_average_precision(y_true, y_score) == 0.0
            continue
        assert sklearn_average_precision(y_true, y_score) == pytest.approx(average_precision_score(y_true, y_score))


def test_benchmark_ap_equals_needle_ap_without_ties():
    rng = np.random.default_rng(1)
    for _ in range(100):
        n, k = 60, int(rng.integers(1, 60))
        ids = np.array([f"i{j}" for j in range(n)])
        scores = rng.random(n)
        gt = set(rng.choice(ids, int(rng.integers(1, 10)), replace=False)) | {"elsewhere/never-retrieved"}
        ap, oracle = score_query(ids, scores, gt, k)
        ranking = list(ids[np.argsort(-scores)])
        assert ap == pytest.approx(average_precision_at_k(ranking, gt, k))
        assert oracle == pytest.approx(sum(i in gt for i in ranking[:k]) / len(gt))


@pytest.fixture
def ilias_like(tmp_path, photos, extractor):
    """Tars named by instance (the ILIAS id layout): each instance tar holds a query view and two
    positives; a distractor tar holds other photos. Returns (index dir, ground truth, dataset dir)."""
    from index.build.stage import IndexConfig
    from index.build.stage import main as build
    from ingest.pipeline import process_shard

    names = list(photos)
    shards = tmp_path / "shards"
    shards.mkdir()
    dataset = tmp_path / "ilias" / "image_ids"
    dataset.mkdir(parents=True)
    queries, positives = [], []
    for i, name in enumerate(names[:3]):
        photo = photos[name]
        views = [
            photo,
            np.ascontiguousarray(photo[:, ::-1]),
            np.ascontiguousarray(photo[photo.shape[0] // 6 :, : photo.shape[1] * 5 // 6]),
        ]
        write_tar(shards / f"inst{i}.tar", [(f"v{j}.jpg", jpeg_bytes(v)) for j, v in enumerate(views)])
        queries.append(f"inst{i}/v0")
        positives += [(f"inst{i}/v1", 0.1 * (i + 1), 10 * i), (f"inst{i}/v2", 0.3, 40)]
    write_tar(shards / "distractors.tar", [(f"d{j}.jpg", jpeg_bytes(photos[n])) for j, n in enumerate(names[3:])])
    for i, shard in enumerate(sorted(shards.glob("*.tar"))):
        process_shard(str(shard), i, tmp_path / "desc", [extractor])
    index = build(IndexConfig(kind="flat"), tmp_path / "desc", tmp_path / "index")
    (dataset / "image_query_ids.txt").write_text("".join(f"{q},query\n" for q in queries))
    (dataset / "text_query_ids.txt").write_text("".join(f"inst{i}/T{i:03d}\n" for i in range(3)))
    (dataset / "positive_ids.txt").write_text("".join(f"{p},{s},{c}\n" for p, s, c in positives))
    truth = [
        {"key": q, "positives": [p for p, _, _ in positives if p.startswith(q.split("/")[0] + "/")]} for q in queries
    ]
    return index, truth, tmp_path / "ilias"


def _assert_benchmark_agrees(benchmark: dict, report: dict, k: int) -> None:
    assert benchmark["map"] == pytest.approx(report[f"map_at_{k}"], abs=1e-9)
    assert benchmark["oracle"] == pytest.approx(report[f"oracle_at_{k}"], abs=1e-9)


def test_ilias_pickle_and_json_score_like_needle_eval(tmp_path, ilias_like):
    from eval.evaluate import EvalConfig, evaluate

    index, truth, dataset_dir = ilias_like
    k = 4  # smaller than the database, so the cut matters
    conf = EvalConfig(k=k, ilias_pickle=str(tmp_path / "r.pkl"), ilias_json=str(tmp_path / "r.json"))
    report = evaluate(index, truth, conf)
    payload = pickle.loads((tmp_path / "r.pkl").read_bytes())
    # The names the benchmark's current ILIAS.evaluate takes: evaluate(**pickle) must not raise.
    assert set(payload) == {"query_ids", "db_ids", "sims", "ranks"}
    assert payload["sims"].shape == payload["ranks"].shape == (3, k)
    benchmark = ILIAS(dataset_dir, check_ids=False)
    from_pickle = benchmark.evaluate(**payload, k=k, report=True)
    _assert_benchmark_agrees(from_pickle, report, k)
    ours = evaluate_results(load_ilias(dataset_dir), **payload, k=k)
    assert ours["map"] == pytest.approx(report[f"map_at_{k}"])
    assert ours["scale"] == pytest.approx(from_pickle["scale"]) and ours["clutter"] == pytest.approx(
        from_pickle["clutter"]
    )
    assert set(ours["scale"]) <= {f"{a}-{b}" for a, b in SCALE_GROUPS}
    # The JSON, read as the benchmark reads it, scores the same.
    from_json = json.loads((tmp_path / "r.json").read_text())
    _assert_benchmark_agrees(benchmark.evaluate(all_similarities=from_json, k=k, report=True), report, k)
    assert list(from_json) == payload["query_ids"]
    for q, s, r in zip(payload["query_ids"], payload["sims"], payload["ranks"]):
        assert list(from_json[q]) == [payload["db_ids"][i] for i in r]
        np.testing.assert_allclose(list(from_json[q].values()), s, rtol=1e-6)


def test_result_pickles_of_either_revision_read_back(tmp_path):
    from eval.ilias import write_results_pickle

    path = write_results_pickle(tmp_path / "r.pkl", ["a/q"], [["x/1", "a/2"]], [[0.9, 0.5]])
    payload = read_results_pickle(path)
    assert payload["db_ids"].tolist() == ["a/2", "x/1"] and payload["ranks"].tolist() == [[1, 0]]
    legacy = {
        "query_ids": ["a/q"],
        "db_ids": payload["db_ids"],
        "similarities": payload["sims"],
        "ranks": payload["ranks"],
    }
    (tmp_path / "old.pkl").write_bytes(pickle.dumps(legacy))
    np.testing.assert_array_equal(read_results_pickle(tmp_path / "old.pkl")["sims"], payload["sims"])
    (tmp_path / "bad.pkl").write_bytes(pickle.dumps({"query_ids": [], "scores": []}))
    with pytest.raises(ILIASDataError, match=r"bad\.pkl.*expected the keys"):
        read_results_pickle(tmp_path / "bad.pkl")
    (tmp_path / "junk.pkl").write_bytes(b"not a pickle")
    with pytest.raises(ILIASDataError, match=r"junk\.pkl"):
        read_results_pickle(tmp_path / "junk.pkl")


def test_breakdown_removes_positives_outside_the_bin():
    from eval.ilias import ILIASDataset

    dataset = ILIASDataset(["a/q"], [], {"a/p1": (0.01, 5), "a/p2": (0.5, 60)})
    db_ids = np.array(["a/p2", "x/d", "a/p1"])
    # p2 (large, cluttered) first, then a distractor, then p1 (small, clean).
    report = evaluate_results(dataset, ["a/q"], db_ids, np.array([[0.9, 0.8, 0.7]]), np.array([[0, 1, 2]]), k=3)
    assert report["map"] == pytest.approx(100 * (1 + 2 / 3) / 2)
    small = f"{0.0}-{0.06880213760855043}"
    assert report["scale"][small] == pytest.approx(100 * 1 / 2)  # p2 removed: p1 at rank 2
    assert report["clutter"]["53-inf"] == pytest.approx(100.0)  # p1 removed: p2 at rank 1


def test_bad_ilias_inputs_are_named(tmp_path):
    from eval.ilias import write_results_pickle

    with pytest.raises(ILIASDataError, match=r"positive_ids\.txt"):
        load_ilias(tmp_path)
    with pytest.raises(ILIASDataError, match="same number"):
        write_results_pickle(tmp_path / "r.pkl", ["a/q", "b/q"], [["x"], ["x", "y"]], [[1.0], [1.0, 0.5]])
    assert write_results_json(tmp_path / "r.json", ["a/q"], [["x"]], [[1.0]]).is_file()


def test_query_expansion_searches_with_the_weighted_average(ilias_like):
    from index.search import load_index
    from query.retrieve import QueryConfig, expand_queries, search

    index_dir, _, _ = ilias_like
    index = load_index(index_dir)
    xq = np.stack([index.vector_of("inst0/v0"), index.vector_of("inst1/v0")])
    D, I = index.search(xq, 2)
    positions = index.positions_of_rows(I)
    manual = xq + (D[..., None] * index.vectors[positions].astype(np.float32)).sum(1)
    manual /= np.linalg.norm(manual, axis=1, keepdims=True)
    np.testing.assert_allclose(expand_queries(index, xq, QueryConfig(qe_top=2)), manual, rtol=1e-5, atol=1e-6)
    D_qe, I_qe, _ = search(index, xq, QueryConfig(k=5, qe_top=2))
    D_ref, I_ref = index.search(manual.astype(np.float32), 5)
    np.testing.assert_array_equal(I_qe, I_ref)
    np.testing.assert_allclose(D_qe, D_ref, rtol=1e-5)


@pytest.fixture
def ilias_dataset(tmp_path, photos, extractor):
    """The real ILIAS workflow: instance tars of positives and a distractor tar form the database;
    the query images sit in their own instance-named tars, ingested on their own. Returns
    (index dir, query descriptor dir, dataset dir)."""
    from index.build.stage import IndexConfig
    from index.build.stage import main as build
    from ingest.pipeline import process_shard

    names = list(photos)
    db, qs = tmp_path / "db_shards", tmp_path / "query_shards"
    db.mkdir()
    qs.mkdir()
    image_ids = tmp_path / "ilias" / "image_ids"
    image_ids.mkdir(parents=True)
    queries, positives = [], []
    for i, name in enumerate(names[:3]):
        photo = photos[name]
        h, w = photo.shape[:2]
        write_tar(qs / f"inst{i}.tar", [("q0.jpg", jpeg_bytes(photo[h // 8 :, w // 8 :]))])
        write_tar(
            db / f"inst{i}.tar",
            [
                ("p1.jpg", jpeg_bytes(np.ascontiguousarray(photo[:, ::-1]))),
                ("p2.jpg", jpeg_bytes(photo[: h * 3 // 4, : w * 3 // 4])),
            ],
        )
        queries.append(f"inst{i}/q0")
        positives += [(f"inst{i}/p1", 0.05 * (i + 1), 10 * i), (f"inst{i}/p2", 0.3, 40 + i)]
        (tmp_path / "ilias" / f"inst{i}").mkdir()
        (tmp_path / "ilias" / f"inst{i}" / f"T{i:03d}.txt").write_text(f"a photo of {name}\n")
    write_tar(db / "yfcc-000000.tar", [(f"d{j}.jpg", jpeg_bytes(photos[n][::2, ::2])) for j, n in enumerate(names[3:])])
    for i, shard in enumerate(sorted(db.glob("*.tar"))):
        process_shard(str(shard), i, tmp_path / "desc", [extractor])
    for i, shard in enumerate(sorted(qs.glob("*.tar"))):
        process_shard(str(shard), i, tmp_path / "desc_queries", [extractor])
    index = build(IndexConfig(kind="flat"), tmp_path / "desc", tmp_path / "index")
    (image_ids / "image_query_ids.txt").write_text("".join(f"{q},query\n" for q in queries))
    (image_ids / "text_query_ids.txt").write_text("".join(f"inst{i}/T{i:03d}.txt\n" for i in range(3)))
    (image_ids / "positive_ids.txt").write_text("".join(f"{p},{s},{c}\n" for p, s, c in positives))
    import gzip

    with gzip.open(image_ids / "distractor_ids.txt.gz", "wt") as f:
        f.write("".join(f"yfcc-000000/d{j}\n" for j in range(len(names) - 3)))
    return index, tmp_path / "desc_queries", tmp_path / "ilias"


def test_eval_on_an_ilias_directory_scores_like_the_benchmark(tmp_path, ilias_dataset):
    from cli.main import main

    index, query_desc, dataset_dir = ilias_dataset
    k = 3
    assert (
        main(
            [
                "eval",
                "map",
                "--index",
                str(index),
                "--ground-truth",
                str(dataset_dir),
                "--query-descriptors",
                str(query_desc),
                "--k",
                str(k),
                "--out",
                str(tmp_path / "report.json"),
                "--ilias-pickle",
                str(tmp_path / "r.pkl"),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["n_queries"] == 3 and report["database_size"] == 9
    payload = pickle.loads((tmp_path / "r.pkl").read_bytes())
    assert payload["query_ids"] == ["inst0/q0", "inst1/q0", "inst2/q0"]
    assert not set(payload["query_ids"]) & set(payload["db_ids"])  # queries are not in the database
    ours = evaluate_results(load_ilias(dataset_dir), **payload, k=k)
    assert ours["map"] == pytest.approx(report[f"map_at_{k}"])
    _assert_benchmark_agrees(ILIAS(dataset_dir, check_ids=True).evaluate(**payload, k=k, report=True), report, k)
    assert ours["oracle"] == pytest.approx(report[f"oracle_at_{k}"])
    assert report["breakdowns"]["scale"] == pytest.approx(ours["scale"])
    assert report["breakdowns"]["clutter"] == pytest.approx(ours["clutter"])
    # The query vectors are the query images' own: searching the index with them reproduces the pickle.
    from eval.evaluate import read_query_vectors
    from index.search import load_index

    vectors = read_query_vectors(query_desc, payload["query_ids"])
    loaded = load_index(index)
    _, I = loaded.search(np.stack([vectors[q] for q in payload["query_ids"]]), k)
    assert [[payload["db_ids"][r] for r in row] for row in payload["ranks"]] == loaded.keys_of(I)
    # Without --query-descriptors the ILIAS queries are not in the index: a clear error.
    assert (
        main(
            [
                "eval",
                "map",
                "--index",
                str(index),
                "--ground-truth",
                str(dataset_dir),
                "--out",
                str(tmp_path / "x.json"),
            ]
        )
        == 2
    )
    # Text queries need a model with a text tower: Lite0 has none.
    assert (
        main(
            [
                "eval",
                "map",
                "--index",
                str(index),
                "--ground-truth",
                str(dataset_dir),
                "--query-descriptors",
                str(query_desc),
                "--text-queries",
                "--out",
                str(tmp_path / "t.json"),
            ]
        )
        == 2
    )


def test_ilias_text_queries_read_their_files(ilias_dataset):
    from eval.evaluate import load_truth
    from eval.ilias import text_query_texts

    _, _, dataset_dir = ilias_dataset
    truth = load_truth(dataset_dir, text_queries=True)
    texts = [q for q in truth.queries if "text" in q]
    assert [q["key"] for q in texts] == ["inst0/T000.txt", "inst1/T001.txt", "inst2/T002.txt"]
    assert texts[0]["text"] == "a photo of astronaut" and texts[0]["positives"] == ["inst0/p1", "inst0/p2"]
    (dataset_dir / "inst1" / "T001.txt").write_text("  \n")
    with pytest.raises(ILIASDataError, match=r"T001\.txt is empty"):
        text_query_texts(dataset_dir, ["inst1/T001.txt"])
    with pytest.raises(ILIASDataError, match="no file"):
        text_query_texts(dataset_dir, ["inst9/T009"])


def test_json_attributes_break_the_map_down_like_brute_force():
    from eval.evaluate import GroundTruth, _scores
    from eval.metrics import binned_ap

    rng = np.random.default_rng(5)
    db = [f"d{i}" for i in range(40)]
    values = {key: float(rng.random()) for key in db}
    bins = [(0.0, 0.5), (0.5, 1.0)]
    results, truth_queries = [], []
    for q in range(20):
        positives = list(rng.choice(db, int(rng.integers(1, 6)), replace=False))
        ranking = list(rng.permutation(db))
        truth_queries.append({"key": f"q{q}", "positives": positives})
        results.append((truth_queries[-1], ranking, list(np.linspace(1, 0, len(ranking)))))
    report = _scores(results, GroundTruth(truth_queries, {"size": (bins, values)}), k=10)
    for low, high in bins:
        expected = []
        for q, ranking, _ in results:
            inside = [p for p in q["positives"] if low <= values[p] < high]
            if not inside:
                continue
            kept = [d for d in ranking if d not in set(q["positives"]) - set(inside)]
            expected.append(average_precision_at_k(kept, inside, 10))
            assert binned_ap(ranking, q["positives"], values, [(low, high)], 10)[f"{low}-{high}"] == expected[-1]
        assert report["breakdowns"]["size"][f"{low}-{high}"] == pytest.approx(100 * np.mean(expected))
