"""Distractor scaling and adaptation on realbench (``../shared/data/realbench``); one JSON line last.

1. Packs realbench as an ILIAS-style collection: one tar per instance group (so every id is
   ``<instance>/<sample>``, the ILIAS id rule) and the 1,518 distractors in tars of 250, in an order
   drawn once (seed 0), so that the first n distractors are a fixed random subset.
2. Ingests everything once (Ray job, Lite0 GeM at 384 plus ``lite0-s16`` local tokens).
3. ``needle eval scaling`` (eval/scaling.py) over 0, 100, 300, 1,000 and all 1,518 distractors with
   the realbench protocol (131 leave-one-out queries): exact, IVF-PQ (refine, nprobe 4) and IVF-PQ
   + spatial verification of the top 1,000; writes ``scaling.json`` and the PNG.
4. Adaptation at full scale (exact search, mAP@1k): none; PCA-whitening learned on the distractor
   descriptors (unsupervised); learned whitening (Radenović) and the ILIAS linear adaptation trained
   on classes made from the *distractors* by augmentation (each distractor is one class of
   ``--views`` augmented views; never the realbench groups); at 256 and 512 dimensions, with their
   bytes per image.
5. The ILIAS format check: realbench in the ILIAS layout (the first image of each group is the
   query, held out of the database; the rest are its positives), evaluated by ``needle eval map`` with
   the query images' own descriptors; the result pickle is scored by the ILIAS benchmark's logic
   (eval/ilias.py, and a second time here with scikit-learn as the benchmark's code does) and must
   equal ``needle eval map``'s mAP.

    python bench/scaling.py [--workdir DIR] [--plot bench/results/scaling_realbench.png]
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import os
import shutil
import sys
import tarfile
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REALBENCH = ROOT.parent / "shared" / "data" / "realbench"
SAMPLES_PER_TAR = 250
DISTRACTOR_SEED = 0
SIZES = (0, 100, 300, 1000, 1518)
IVF_NPROBE = 4
LONG_EPOCHS = 20
log = logging.getLogger("bench.scaling")


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def pack(root: Path, shards: Path) -> tuple[dict[str, list[str]], list[str], list[Path]]:
    """Instance tars and shuffled distractor tars; returns (keys per group in file order,
    distractor keys in their fixed order, distractor image paths in that order)."""
    shards.mkdir(parents=True, exist_ok=True)
    with open(root / "groups.csv") as f:
        rows = list(csv.DictReader(f))
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        groups[row["group"]].append(row)
    keys: dict[str, list[str]] = {}
    for group, members in groups.items():
        with tarfile.open(shards / f"{group}.tar", "w") as tar:
            for i, row in enumerate(members):
                _add(tar, f"s{i:03d}.jpg", (root / "images" / f"{row['key']}.jpg").read_bytes())
        keys[group] = [f"{group}/s{i:03d}" for i in range(len(members))]
    with open(root / "distractors.csv") as f:
        files = [r["file"] for r in csv.DictReader(f)]
    files = [files[i] for i in np.random.default_rng(DISTRACTOR_SEED).permutation(len(files))]
    distractor_keys = []
    for start in range(0, len(files), SAMPLES_PER_TAR):
        name = f"distractors-{start // SAMPLES_PER_TAR:06d}"
        with tarfile.open(shards / f"{name}.tar", "w") as tar:
            for j, file in enumerate(files[start : start + SAMPLES_PER_TAR]):
                _add(tar, f"d{start + j:05d}.jpg", (root / "distractors" / file).read_bytes())
                distractor_keys.append(f"{name}/d{start + j:05d}")
    return keys, distractor_keys, [root / "distractors" / f for f in files]


def leave_one_out_truth(keys: dict[str, list[str]]) -> list[dict]:
    """Every grouped image is a query of the other images of its group; the singleton group's
    image has no positive (skipped as a query) but stays in the database, as in realbench.py."""
    return [{"key": k, "positives": [p for p in members if p != k]} for members in keys.values() for k in members]


def write_ilias_layout(keys: dict[str, list[str]], distractors: list[str], directory: Path) -> tuple[list[str], Path]:
    """realbench in the ILIAS layout: the first image of each group (with positives) is its query;
    positives carry unknown scale and clutter (-1: in no bin)."""
    import gzip

    ids = directory / "image_ids"
    ids.mkdir(parents=True, exist_ok=True)
    queries = [members[0] for members in keys.values() if len(members) > 1]
    positives = [k for members in keys.values() if len(members) > 1 for k in members[1:]]
    (ids / "image_query_ids.txt").write_text("".join(f"{q},realbench\n" for q in queries))
    (ids / "text_query_ids.txt").write_text("")
    (ids / "positive_ids.txt").write_text("".join(f"{p},-1,-1\n" for p in positives))
    with gzip.open(ids / "distractor_ids.txt.gz", "wt") as f:
        f.write("".join(f"{d}\n" for d in distractors))
    return queries, directory


def sklearn_ilias_map(dataset_dir: Path, payload: dict, k: int) -> float:
    """The benchmark's AP, computed as its evaluation code does: scikit-learn's average precision
    of the top k by score, times hits / min(k, |gt|)."""
    from sklearn.metrics import average_precision_score

    gt = defaultdict(set)
    for line in (dataset_dir / "image_ids" / "positive_ids.txt").read_text().split():
        gt[line.split(",")[0].split("/")[0]].add(line.split(",")[0])
    db_ids = np.asarray(payload["db_ids"])
    aps = []
    for q, s, r in zip(payload["query_ids"], payload["sims"], payload["ranks"]):
        truth = gt[q.split("/")[0]]
        order = np.argsort(-s)
        y_true = np.isin(db_ids[r[order][:k]], list(truth))
        aps.append(
            0.0
            if not y_true.any()
            else 100 * average_precision_score(y_true, s[order][:k]) * y_true.sum() / min(k, len(truth))
        )
    return float(np.mean(aps))


def descriptors_of(directory: Path, keys: list[str]) -> np.ndarray:
    from eval.evaluate import read_query_vectors

    found = read_query_vectors(directory, keys)
    return np.stack([found[k] for k in keys])


def index_bytes(index_dir: Path) -> dict[str, float]:
    from eval.scaling import memory_per_image

    infos = json.loads((index_dir / "index_infos.json").read_text())
    memory = memory_per_image(index_dir, infos)
    return {
        "dim": infos["dim"],
        "index_bytes_per_image": memory["index_bytes_per_image"],
        "vectors_bytes_per_image": memory["vectors_bytes_per_image"],
    }


def adaptation_study(
    work: Path,
    descriptors: Path,
    truth: list[dict],
    distractor_keys: list[str],
    distractor_files: list[Path],
    views: int,
    num_cpus: int,
    model: str,
) -> dict:
    """mAP@1k (exact) with no adaptation, PCAw, Lw and the linear adaptation at 256 and 512 dims."""
    import ray

    from cluster.ingest_job import main as ingest
    from embed.adapt import AdaptConfig, labelled_descriptors, read_labels, save_adapter, train_adapter
    from embed.augment import AugmentConfig
    from embed.augment import main as make_classes
    from embed.whiten import learned_whitening, pca_whitening
    from eval.evaluate import EvalConfig, evaluate
    from index.build.stage import IndexConfig
    from index.build.stage import main as build_index
    from ingest.config import IngestConfig

    timings = {}
    start = time.perf_counter()
    classes = work / "classes"
    make_classes(AugmentConfig(views=views, seed=0), distractor_files, classes)
    timings["augment_s"] = round(time.perf_counter() - start, 1)
    start = time.perf_counter()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    ingest(IngestConfig(model=model), str(classes / "*.tar"), work / "class_descriptors")
    ray.shutdown()
    timings["ingest_classes_s"] = round(time.perf_counter() - start, 1)
    x_cls, y_cls, names = labelled_descriptors(work / "class_descriptors", read_labels(classes / "labels.csv"))
    x_distractors = descriptors_of(descriptors, distractor_keys)
    log.info(
        "adaptation data: %d distractor descriptors; %d augmented views of %d classes",
        len(x_distractors),
        len(x_cls),
        len(names),
    )

    adapters: dict[str, Path | None] = {"none": None}
    for dim in (256, 512):
        fits = {
            f"pcaw_{dim}": lambda d=dim: pca_whitening(x_distractors, d),
            f"lw_{dim}": lambda d=dim: learned_whitening(x_cls, y_cls, d),
            f"linear_{dim}": lambda d=dim: train_adapter(x_cls, y_cls, AdaptConfig(out_dim=d))[0],
            # ILIAS's 2 epochs are over ~1M images; on 7.6k views that is 118 steps: also show longer training.
            f"linear_{dim}_{LONG_EPOCHS}ep": lambda d=dim: train_adapter(
                x_cls, y_cls, AdaptConfig(out_dim=d, epochs=LONG_EPOCHS)
            )[0],
        }
        for name, fit in fits.items():
            t0 = time.perf_counter()
            adapters[name] = save_adapter(fit(), work / "adapters" / f"{name}.pt")
            timings[f"fit_{name}_s"] = round(time.perf_counter() - t0, 2)
    results = {}
    for name, path in adapters.items():
        index_dir = work / "adapted" / name
        build_index(IndexConfig(kind="flat", adapt=str(path) if path else None, locals=False), descriptors, index_dir)
        report = evaluate(index_dir, truth, EvalConfig(k=1000))
        results[name] = {"map_at_1k": round(report["map_at_1000"], 2), **index_bytes(index_dir)}
        shutil.rmtree(index_dir)
        log.info("adaptation %s: mAP@1k %.2f", name, results[name]["map_at_1k"])
    return {
        "results": results,
        "training": {
            "classes": len(names),
            "views_per_class": views,
            "samples": len(x_cls),
            "pcaw_samples": len(x_distractors),
        },
        "timings": timings,
    }


def ilias_check(work: Path, descriptors: Path, keys: dict[str, list[str]], distractors: list[str]) -> dict:
    """needle eval map on realbench in the ILIAS layout vs the benchmark's scoring of its pickle."""
    from eval.evaluate import EvalConfig, evaluate, load_truth
    from eval.ilias import evaluate_results, load_ilias, read_results_pickle
    from eval.scaling import scan_keys, write_subset
    from index.build.stage import IndexConfig
    from index.build.stage import main as build_index
    from ingest.descriptors import list_descriptor_files

    queries, dataset_dir = write_ilias_layout(keys, distractors, work / "ilias_realbench")
    # The database: every image but the held-out queries (left out as "excluded" rows).
    subset = write_subset(scan_keys(list_descriptor_files(descriptors)), set(), set(queries), work / "ilias_db")
    build_index(IndexConfig(kind="flat", locals=False), subset, work / "ilias_index")
    pickle_path = work / "ilias_results.pkl"
    report = evaluate(
        work / "ilias_index",
        load_truth(dataset_dir),
        EvalConfig(k=1000, query_descriptors=str(descriptors), ilias_pickle=str(pickle_path)),
    )
    payload = read_results_pickle(pickle_path)
    scored = evaluate_results(load_ilias(dataset_dir), **payload, k=1000)
    reference = sklearn_ilias_map(dataset_dir, payload, 1000)
    return {
        "n_queries": report["n_queries"],
        "database_size": report["database_size"],
        "needle_eval_map_at_1k": round(report["map_at_1000"], 4),
        "ilias_scoring_map_at_1k": round(scored["map"], 4),
        "sklearn_reference_map_at_1k": round(reference, 4),
        "equal": bool(
            abs(report["map_at_1000"] - scored["map"]) < 1e-9 and abs(report["map_at_1000"] - reference) < 1e-9
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", help="keep tars, descriptors and outputs here (default: a temp dir)")
    parser.add_argument("--model", default="tf_efficientnet_lite0.gem")
    parser.add_argument("--views", type=int, default=5, help="augmented views per distractor class")
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count())
    parser.add_argument(
        "--plot", default=str(ROOT / "bench" / "results" / "scaling_realbench.png"), help="PNG to write"
    )
    parser.add_argument("--skip-adaptation", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not REALBENCH.is_dir():
        sys.exit(f"realbench data not found at {REALBENCH}")

    import ray

    from cluster.ingest_job import main as ingest
    from eval.scaling import ScalingConfig
    from eval.scaling import main as scaling
    from ingest.config import IngestConfig

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="needle-scaling-")
    work = Path(args.workdir or tmp.name)
    keys, distractor_keys, distractor_files = pack(REALBENCH, work / "shards")
    truth = leave_one_out_truth(keys)
    (work / "truth.json").write_text(json.dumps({"queries": truth, "distractors": distractor_keys}))

    start = time.perf_counter()
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    ingest(IngestConfig(model=args.model, locals="lite0-s16"), str(work / "shards" / "*.tar"), work / "descriptors")
    ray.shutdown()
    ingest_s = time.perf_counter() - start

    start = time.perf_counter()
    conf = ScalingConfig(
        sizes=SIZES, modes=("exact", "ivfpq", "ivfpq+sp"), k=1000, nprobe=IVF_NPROBE, label="Lite0 GeM 384"
    )
    curve = json.loads(scaling(conf, [work / "descriptors"], work / "truth.json", work / "scaling").read_text())
    scaling_s = time.perf_counter() - start
    plot = Path(args.plot)
    plot.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(work / "scaling" / "scaling.png", plot)

    check = ilias_check(work, work / "descriptors", keys, distractor_keys)
    adaptation = (
        None
        if args.skip_adaptation
        else adaptation_study(
            work, work / "descriptors", truth, distractor_keys, distractor_files, args.views, args.num_cpus, args.model
        )
    )

    by_mode = defaultdict(dict)
    for p in curve["points"]:
        by_mode[p["mode"]][p["distractors"]] = {
            k: p[k]
            for k in (
                "database_size",
                "map",
                "recall",
                "search_ms_per_query",
                "index_bytes_per_image",
                "vectors_bytes_per_image",
                "local_bytes_per_image",
            )
        }
    result = {
        "scaling": {
            "model": args.model,
            "k": 1000,
            "n_queries": curve["points"][0]["n_queries"],
            "ivf_nprobe": IVF_NPROBE,
            "core_size": curve["core_size"],
            "modes": by_mode,
            "elapsed_s": round(scaling_s, 1),
        },
        "adaptation_map_at_1k": adaptation,
        "ilias_format_check": check,
        "plot": str(plot),
        "ingest_s": round(ingest_s, 1),
    }
    if tmp is not None:
        tmp.cleanup()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
