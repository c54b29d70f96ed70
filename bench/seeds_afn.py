"""Adaptation function (``needle similarity afn``) on realbench pairs: aR@{1,5,20} before and after
adaptation, mean +- 2 std over 20 random 75/25 splits, for sigma in {1, 1.5, 15}.

Pairs: the first two images of each realbench group with at least two (56 pairs: 42 train, 14
test per split). Two galleries: the test pairs' other sides only (the TLL protocol; with 14 test
pairs aR@20 is 100 by construction), and the same plus realbench's 1,518 distractors in both
directions. Frozen features (Lite0 stages, longer side 224) are cached under ``work``; one run
takes about a minute on 2 cores (features ~20 s the first time, 60 trainings of 150 full-batch
steps). Prints one JSON line last.

    python bench/seeds_afn.py [--work DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REALBENCH = ROOT.parent / "shared" / "data" / "realbench"
SIGMAS = (1.0, 1.5, 15.0)
SPLITS = 20
FEATURES = "afn_realbench_features.npz"


def _compact(rows: dict) -> dict:
    return {row: {k: {"mean": v["mean"], "two_std": v["two_std"]} for k, v in ks.items()} for row, ks in rows.items()}


def _one_blas_thread():
    """numpy's BLAS limited to one thread where threadpoolctl is installed (it comes with
    scikit-learn): on a shared machine a multi-threaded SVD of the 84 x 1,984 training features
    stalls for seconds instead of taking 15 ms."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(1)


def run(realbench: Path = REALBENCH, work: Path | None = None) -> dict:
    """Features (cached under ``work``), then the split protocol for each sigma; JSON-serialisable."""
    with _one_blas_thread():
        return _run(Path(realbench), work)


def _run(realbench: Path, work: Path | None) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared: one thread avoids oversubscription stalls
    try:
        return _measure(realbench, work)
    finally:
        torch.set_num_threads(threads)


def _measure(realbench: Path, work: Path | None) -> dict:
    from similarity.afn.config import AdaptationFunctionError, AfnConfig, EvalConfig, FeatureConfig
    from similarity.afn.evaluation import evaluate_splits
    from similarity.afn.pair_features import pair_features_for, save_pair_features

    work = Path(work or tempfile.mkdtemp(prefix="needle-afn-"))
    work.mkdir(parents=True, exist_ok=True)
    feature_conf = FeatureConfig()
    cache = work / FEATURES
    start = time.perf_counter()
    feats = None
    if cache.is_file():
        try:
            feats = pair_features_for(cache, feature_conf)
        except AdaptationFunctionError:
            feats = None  # made with other settings: extract again
    cached = feats is not None
    if feats is None:
        feats = pair_features_for(realbench, feature_conf, distractors=realbench)
        save_pair_features(feats, cache)
    features_s = time.perf_counter() - start

    conf = AfnConfig()
    result = evaluate_splits(feats, conf, EvalConfig(splits=SPLITS), SIGMAS)
    protocol = result["protocol"]
    return {
        "method": "afn",
        "pairs": protocol["pairs"],
        "train_pairs": protocol["train_pairs"],
        "test_pairs": protocol["test_pairs"],
        "distractors": protocol["distractors"],
        "splits": SPLITS,
        "pca_dim": protocol["pca_dim"],
        "epochs": conf.epochs,
        "features": f"{feature_conf.backbone} {'+'.join(feature_conf.layers)} @{feature_conf.resolution}px",
        "metric": "aR@k x100, mean and 2 std over splits; before_raw: cosine on the concatenated layers, "
        "before_pca: on their PCA, sigma=s: after adaptation trained with logits s*cos",
        "gallery_test_pairs": _compact(result["pairs"]),
        "gallery_with_distractors": _compact(result["with_distractors"]),
        "final_train_loss": {k: v["mean"] for k, v in result["final_train_loss"].items()},
        "features_cached": cached,
        "seconds": {"features": round(features_s, 1), "splits": protocol["seconds"]},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", help="cache features here (default: a temp dir)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not REALBENCH.is_dir():
        sys.exit(f"realbench data not found at {REALBENCH}")
    print(json.dumps(run(REALBENCH, Path(args.work) if args.work else None)))
