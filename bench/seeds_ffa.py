"""Foreground feature averaging on realbench: top-1 / mAP within groups, K=2 k-means ARI and
odd-one-out accuracy (eval/groups.py) with and without FFA (similarity/ffa/*.py); one JSON line last.

EfficientNet-Lite0 with the shipped ImageNet weights, images at longer side 384. Rows:

- ``last_avg`` / ``last_gem``: tokens = the last feature map (1280 channels, stride 32), pooled by
  mean / GeM p=3 (``last_gem``'s baseline is needle's global descriptor);
- ``s16_avg``: tokens = the stride-16 stage (112 channels, block 4, as embed/locals/extract.py), mean;
- ``d300_last_avg``: as ``last_avg`` with 300 seeded distractors added to the pool, each a group
  of one (harder retrieval; the odd image of a trial is then mostly a distractor).

Each row holds ``baseline`` (mask none: every token) and ``{pca,norm}_{crop_feat,crop_img}``.
Evaluated sets: the 132 grouped images (57 groups, one singleton: 131 queries); all 1,540 pairs of
the 56 groups with two or more images for the ARI; 2,000 odd-one-out trials (seed 0) drawn from
the 6 groups with three or more images, the same trials for every variant (paired), reported with
a 95% binomial half-width. Descriptors are cached under ``work``.

    python bench/seeds_ffa.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
REALBENCH = ROOT.parent / "shared" / "data" / "realbench"

RESOLUTION = 384
DISTRACTORS = 300
ODD_TRIALS = 2000
VARIANTS = {  # row key -> (mask, mode)
    "baseline": ("none", "crop-feat"),
    "pca_crop_feat": ("pca", "crop-feat"),
    "pca_crop_img": ("pca", "crop-img"),
    "norm_crop_feat": ("norm", "crop-feat"),
    "norm_crop_img": ("norm", "crop-img"),
}


class MemoTokens:
    """Token maps memoised by image content: a crop recurs across poolings and rows."""

    def __init__(self, tokens):
        self.tokens = tokens
        self.memo: dict[str, np.ndarray] = {}

    @staticmethod
    def key(image: np.ndarray) -> str:
        return hashlib.sha1(image.tobytes() + str(image.shape).encode()).hexdigest()

    def __call__(self, images):
        keys = [self.key(im) for im in images]
        todo = [i for i, k in enumerate(keys) if k not in self.memo]
        for i, m in zip(todo, self.tokens([images[i] for i in todo]) if todo else []):
            self.memo[keys[i]] = m
        return [self.memo[k] for k in keys]


def _descriptors(conf, images, tokens, cache: Path) -> tuple[np.ndarray, dict]:
    """FFA descriptors of ``images``, cached under ``cache`` by configuration and image count."""
    from similarity.ffa.descriptors import ffa_descriptors

    tag = hashlib.sha1(json.dumps([dataclasses.asdict(conf), len(images)], sort_keys=True).encode()).hexdigest()[:16]
    path = cache / f"{tag}.npz"
    if path.is_file():
        with np.load(path) as f:
            return f["desc"], json.loads(str(f["stats"]))
    desc, stats = ffa_descriptors(conf, images, tokens)
    cache.mkdir(parents=True, exist_ok=True)
    np.savez(path, desc=desc, stats=json.dumps(stats))
    return desc, stats


def _row(conf, eval_conf, images, labels, tokens, cache: Path) -> tuple[dict, dict]:
    """Every variant of ``conf`` evaluated; (row, the evaluation's counts)."""
    from eval.groups import evaluate_groups

    row = {}
    for name, (mask, mode) in VARIANTS.items():
        desc, stats = _descriptors(dataclasses.replace(conf, mask=mask, mode=mode), images, tokens, cache)
        report = evaluate_groups(desc, labels, eval_conf)
        n = report["counts"]["odd_trials"]
        p = report["odd_one_out"] / 100.0
        row[name] = {
            "top1": round(report["top1"], 2),
            "map": round(report["map"], 2),
            "ari": round(report["ari"], 4),
            "odd_one_out": round(report["odd_one_out"], 2),
            "odd_ci95": round(100.0 * 1.96 * math.sqrt(p * (1 - p) / n), 2),
            "foreground_fraction": round(stats["foreground_fraction"], 3),
            **({"crop_area_fraction": round(stats["crop_area_fraction"], 3)} if "crop_area_fraction" in stats else {}),
        }
    return row, report["counts"]


def run(realbench: Path, work: Path) -> dict:
    import torch

    from eval.groups import GroupEvalConfig
    from similarity.ffa.config import FFAConfig
    from similarity.ffa.stages import load_images, load_items
    from similarity.ffa.tokens import TokenMaps

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    start = time.perf_counter()
    eval_conf = GroupEvalConfig(seed=0, odd_trials=ODD_TRIALS)
    paths, labels = load_items(realbench, DISTRACTORS, seed=0)
    n = len(paths) - DISTRACTORS  # the grouped images come first
    images = load_images(paths, RESOLUTION)
    cache = work / "descriptors"
    # Token maps are computed only for descriptors missing from the cache (the memo shares whole
    # images' maps across variants; a crop-img crop is the same for both poolings).
    last, s16 = MemoTokens(TokenMaps()), MemoTokens(TokenMaps(feature_stage=4))
    result: dict = {"resolution": RESOLUTION}
    for pooling in ("avg", "gem"):
        conf = FFAConfig(resolution=RESOLUTION, pooling=pooling)
        result[f"last_{pooling}"], counts = _row(conf, eval_conf, images[:n], labels[:n], last, cache)
    result["s16_avg"], _ = _row(
        FFAConfig(resolution=RESOLUTION, feature_stage=4), eval_conf, images[:n], labels[:n], s16, cache
    )
    result[f"d{DISTRACTORS}_last_avg"], _ = _row(
        FFAConfig(resolution=RESOLUTION), eval_conf, images, labels, last, cache
    )
    result["counts"] = {
        **{k: counts[k] for k in ("images", "groups", "queries", "ari_pairs", "odd_trials", "odd_eligible_groups")},
        "distractors": DISTRACTORS,
    }
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", help="cache descriptors here (default: a temp dir)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not REALBENCH.is_dir():
        sys.exit(f"realbench data not found at {REALBENCH}")
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="needle-seeds-ffa-")
    work = Path(args.workdir or tmp.name)
    result = run(REALBENCH, work)
    if tmp is not None:
        tmp.cleanup()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
