"""`needle eval scaling`: nested distractor subsets through the production index builder, checked
against a brute-force mAP over exactly the same database at every size."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from eval.metrics import average_precision_at_k
from tests.support.index import write_descriptor_file

CORE_INSTANCES, PER_INSTANCE, DIM = 6, 5, 32


@pytest.fixture
def scaling_data(tmp_path):
    """A core of 6 instances x 5 views (each view's first is a query, leave-one-out) and three
    distractor files of 100 vectors, some of them close to the instances (hard distractors)."""
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(CORE_INSTANCES, DIM))
    core = np.repeat(centers, PER_INSTANCE, axis=0) + 0.9 * rng.normal(size=(CORE_INSTANCES * PER_INSTANCE, DIM))
    desc = tmp_path / "desc"
    desc.mkdir()
    files = {"core": core}
    for s in range(3):
        hard = centers[rng.integers(0, CORE_INSTANCES, 100)] + 1.3 * rng.normal(size=(100, DIM))
        files[f"dist{s}"] = np.where(rng.random((100, 1)) < 0.5, hard, rng.normal(size=(100, DIM)))
    vectors = {}
    for shard_id, (name, x) in enumerate(files.items()):
        x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)
        write_descriptor_file(desc, name, shard_id, x)
        vectors.update({f"{name}/{i:05d}": x[i].astype(np.float32) for i in range(len(x))})
    queries = []
    for inst in range(CORE_INSTANCES):
        keys = [f"core/{inst * PER_INSTANCE + j:05d}" for j in range(PER_INSTANCE)]
        for key in keys:
            queries.append({"key": key, "positives": [k for k in keys if k != key]})
    truth = tmp_path / "gt.json"
    truth.write_text(json.dumps({"queries": queries}))
    return desc, truth, queries, vectors


def brute_force_map(queries, vectors, db_keys, k):
    xb = np.stack([vectors[key] for key in db_keys])
    aps = []
    for q in queries:
        scores = xb @ vectors[q["key"]]
        order = np.lexsort((np.arange(len(db_keys)), -scores))
        ranking = [db_keys[i] for i in order if db_keys[i] != q["key"]]
        aps.append(average_precision_at_k(ranking, q["positives"], k))
    return 100.0 * float(np.mean(aps))


def test_scaling_points_equal_brute_force_on_the_same_nested_databases(tmp_path, scaling_data, caplog):
    from eval.scaling import ScalingConfig, main

    desc, truth, queries, vectors = scaling_data
    k = 20  # smaller than every database: the cut matters
    conf = ScalingConfig(sizes=(0, 50, 100, 250, 10_000), modes=("exact",), k=k)
    out = main(conf, [desc], truth, tmp_path / "scaling")
    result = json.loads(out.read_text())
    assert result["sizes"] == [0, 50, 100, 250]  # 10,000 > the 300 available: dropped, with a warning
    assert "sizes [10000] dropped" in caplog.text
    assert result["core_size"] == 30 and result["distractors_available"] == 300
    core = sorted(k for k in vectors if k.startswith("core/"))
    distractors = [k for k in vectors if not k.startswith("core/")]  # file order
    # IVF-PQ, all lists probed, refine shortlist 2 x (k + 1) past the largest database: exact too.
    ivf_k = 150
    ivf = json.loads(
        main(
            ScalingConfig(sizes=(0, 100, 250), modes=("ivfpq",), k=ivf_k, nlist=8, nprobe=8),
            [desc],
            truth,
            tmp_path / "scaling_ivf",
        ).read_text()
    )
    assert {p["factory"].split(",")[0] for p in ivf["points"]} == {"IVF8"}
    for p, kk in [(p, k) for p in result["points"]] + [(p, ivf_k) for p in ivf["points"]]:
        n = p["distractors"]
        assert p["database_size"] == 30 + n
        assert p["map"] == pytest.approx(brute_force_map(queries, vectors, core + distractors[:n], kk), abs=1e-9), p
        assert p["n_queries"] == len(queries)
        assert p["vectors_bytes_per_image"] == DIM * 2 and p["index_bytes_per_image"] > 0
        assert p["local_bytes_per_image"] == 0
    exact = [p["map"] for p in result["points"] if p["mode"] == "exact"]
    assert exact[0] > exact[-1]  # hard distractors push positives down
    png = (tmp_path / "scaling" / "scaling.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "scaling" / "indexes").exists() and not (tmp_path / "scaling" / "subsets").exists()


def test_subsets_are_nested_prefixes_and_cut_files_keep_consecutive_rows(tmp_path, scaling_data):
    from eval.evaluate import load_truth
    from eval.scaling import STATUS_EXCLUDED, ScalingConfig, distractor_order, scan_keys, write_subset
    from ingest.descriptors import list_descriptor_files

    desc, truth_path, _, _ = scaling_data
    truth = load_truth(truth_path)
    scanned = scan_keys(list_descriptor_files(desc))
    for conf in (ScalingConfig(order="file"), ScalingConfig(order="shuffle", seed=3)):
        order = distractor_order(scanned, truth, truth_path, conf)
        assert order == distractor_order(scanned, truth, truth_path, conf)  # the same order every run
        assert len(order) == 300 and not any(k.startswith("core/") for k in order)
    order = distractor_order(scanned, truth, truth_path, ScalingConfig(order="file"))
    subset = write_subset(scanned, set(order[:150]), set(order), tmp_path / "subset")
    names = sorted(p.name for p in subset.glob("*.parquet"))
    assert names == ["core.parquet", "dist0.parquet", "dist1.parquet"]  # dist2 holds no chosen row
    assert (subset / "dist0.parquet").is_symlink() and not (subset / "dist1.parquet").is_symlink()
    cut = pq.read_table(subset / "dist1.parquet")
    original = pq.read_table(desc / "dist1.parquet")
    assert cut["row"].to_pylist() == original["row"].to_pylist()
    assert cut["status"].to_pylist() == ["ok"] * 50 + [STATUS_EXCLUDED] * 50
    assert cut.schema.metadata == original.schema.metadata


def test_distractor_list_in_the_ground_truth_sets_the_order(tmp_path, scaling_data):
    from eval.evaluate import load_truth
    from eval.scaling import ScalingConfig, distractor_order, scan_keys
    from ingest.descriptors import list_descriptor_files

    desc, _, queries, _ = scaling_data
    listed = [f"dist2/{i:05d}" for i in range(10)] + ["dist0/00003", "missing/00000"]
    custom = tmp_path / "gt_listed.json"
    custom.write_text(json.dumps({"queries": queries, "distractors": listed}))
    order = distractor_order(scan_keys(list_descriptor_files(desc)), load_truth(custom), custom, ScalingConfig())
    assert order == listed[:-1]  # in the listed order; the absent one dropped


def test_bad_scaling_inputs_are_named(tmp_path, scaling_data):
    from core.errors import NeedleInputError
    from eval.scaling import ScalingConfig, main

    desc, truth, _, _ = scaling_data
    with pytest.raises(NeedleInputError, match="unknown scaling mode 'hnsw'"):
        main(ScalingConfig(modes=("hnsw",)), [desc], truth, tmp_path / "a")
    with pytest.raises(NeedleInputError, match="sizes must be >= 0"):
        main(ScalingConfig(sizes=(-5,)), [desc], truth, tmp_path / "b")


def test_cli_scaling_and_plot_overlay(tmp_path, scaling_data, capsys):
    from cli.main import main

    desc, truth, _, _ = scaling_data
    assert (
        main(
            [
                "eval",
                "scaling",
                "--descriptors",
                str(desc),
                "--ground-truth",
                str(truth),
                "--sizes",
                "0,100",
                "--modes",
                "exact",
                "--k",
                "10",
                "--out",
                str(tmp_path / "a"),
                "--label",
                "model A",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "eval",
                "scaling",
                "--descriptors",
                str(desc),
                "--ground-truth",
                str(truth),
                "--sizes",
                "0,300",
                "--modes",
                "exact,exact+sp",
                "--k",
                "10",
                "--order",
                "shuffle",
                "--out",
                str(tmp_path / "b"),
            ]
        )
        == 0
    )
    run_b = json.loads((tmp_path / "b" / "scaling.json").read_text())
    assert {p["mode"] for p in run_b["points"]} == {"exact"}  # no local tokens: +sp skipped
    assert run_b["label"] == "descriptors"
    assert (
        main(
            [
                "eval",
                "plot",
                str(tmp_path / "a" / "scaling.json"),
                str(tmp_path / "b" / "scaling.json"),
                "--out",
                str(tmp_path / "both.png"),
            ]
        )
        == 0
    )
    assert (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["eval", "map", "--index", str(tmp_path)]) == 2  # eval map without --ground-truth/--out: a named error
    assert (
        main(
            [
                "eval",
                "scaling",
                "--descriptors",
                str(desc),
                "--ground-truth",
                str(truth),
                "--sizes",
                "1,x",
                "--out",
                str(tmp_path / "c"),
            ]
        )
        == 2
    )
