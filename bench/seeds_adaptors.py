"""Adaptors with attention fusion (GrAPPA-style) on the frozen EfficientNet-Lite0, on realbench.

Protocol: the adaptors and their fusion are trained on realbench's 1,518 *distractors* only
(unlabelled: pseudo-labels are k-means clusterings of their frozen descriptors, 8 / 32 / 128
clusters); they never see the evaluation groups. Evaluation: the realbench groups with at least two
images (131 images of 56 groups); every image queries all the others; MAP@R and R-Precision
(Musgrave et al., x 100) of the frozen backbone, of each single adaptor set, and of the fused
adaptors. Training crops are 224 x 224 (central square), evaluation images have their longer side
at 224 (aspect kept); adaptors follow Lite0's last two stages (stride 32), so the frozen stem up to
the stride-16 stage is computed once and cached under ``work``.

    python bench/seeds_adaptors.py [--work DIR]
"""

from __future__ import annotations

import argparse
import hashlib
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
GRANULARITIES = (8, 32, 128)
RESOLUTION = 224
EPOCHS = 4  # per adaptor set, and for the fusion
SEED = 0

log = logging.getLogger("seeds_adaptors")


def _cached(path: Path, make):
    """``make()`` saved with torch at ``path`` (atomically) the first time, loaded afterwards."""
    import torch

    from core.atomic import write_atomic

    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=True)
    value = make()
    write_atomic(path, lambda tmp: torch.save(value, tmp))
    return value


def paired_bootstrap(net, stems, labels, mode, draws: int = 2000, seed: int = 0) -> list[float]:
    """95% interval of MAP@R(mode) - MAP@R(frozen) (x 100) over queries resampled with replacement
    (the same queries for both): how much of a difference the 131 queries can tell apart."""
    import numpy as np

    from eval.class_retrieval import class_retrieval_per_query
    from similarity.adaptors.config import FROZEN
    from similarity.adaptors.evaluation import eval_descriptors

    per_query = []
    for m in (mode, FROZEN):
        x = eval_descriptors(net, stems, m).astype(np.float64)
        per_query.append(class_retrieval_per_query(x @ x.T, labels)[0])
    diff = 100.0 * (per_query[0] - per_query[1])
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), (draws, len(diff)))].mean(1)
    return [round(float(v), 2) for v in np.percentile(means, [2.5, 97.5])]


def run(realbench: Path = REALBENCH, work: Path | None = None) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ingest.torchvision_compat import ensure_torchvision_importable

    ensure_torchvision_importable()
    import torch

    from similarity.adaptors.config import FROZEN, FUSED, AdaptorsConfig, mode_names
    from similarity.adaptors.evaluation import class_images, evaluate_net
    from similarity.adaptors.files import save_adaptors
    from similarity.adaptors.net import build_adapted
    from similarity.adaptors.training import stem_features, train_adaptors
    from similarity.data import realbench_distractors, realbench_groups

    torch.set_num_threads(1)
    work = Path(work or Path(tempfile.gettempdir()) / "needle_seeds_adaptors")
    work.mkdir(parents=True, exist_ok=True)
    times = {}
    start = time.perf_counter()
    conf = AdaptorsConfig(
        granularities=GRANULARITIES, resolution=RESOLUTION, epochs=EPOCHS, fusion_epochs=EPOCHS, seed=SEED
    )
    net, backbone = build_adapted(conf)
    # Cached stems depend on the backbone's weights, the adapted stages and the resolution.
    key = hashlib.sha256(json.dumps([backbone["weights_sha256"], net.stage_ids, RESOLUTION]).encode()).hexdigest()[:12]

    train_paths = realbench_distractors(realbench)
    cache = _cached(
        work / f"adaptors_train_stem_{key}.pt",
        lambda: stem_features(net, train_paths, RESOLUTION, backbone["mean"], backbone["std"]),
    )
    groups = realbench_groups(realbench, min_size=2)
    eval_paths = [p for g in groups for p in groups[g]]
    labels = [g for g in groups for _ in groups[g]]
    stems = _cached(
        work / f"adaptors_eval_stem_{key}.pt",
        lambda: class_images(eval_paths, net, RESOLUTION, backbone["mean"], backbone["std"]),
    )
    times["features"] = round(time.perf_counter() - start, 1)

    t = time.perf_counter()
    record = train_adaptors(net, cache, conf)
    times["training"] = round(time.perf_counter() - t, 1)
    save_adaptors(net, conf, backbone, work / "adaptors.pt")

    t = time.perf_counter()
    results = evaluate_net(net, stems, labels, mode_names(conf.granularities))
    intervals = {
        name: paired_bootstrap(net, stems, labels, mode)
        for name, mode in mode_names(conf.granularities).items()
        if mode != FROZEN
    }
    times["evaluation"] = round(time.perf_counter() - t, 1)
    times["total"] = round(time.perf_counter() - start, 1)
    frozen = results[FROZEN]
    return {
        "method": "adaptors (GrAPPA-style granularity-aware adaptors + attention fusion, frozen Lite0)",
        "metric": "MAP@R and R-Precision x 100 (Musgrave et al.); each grouped image queries all other grouped images",
        "train": {
            "images": len(train_paths),
            "source": "realbench distractors (unlabelled)",
            "granularities": list(GRANULARITIES),
            "epochs": EPOCHS,
            "fusion_epochs": EPOCHS,
            "resolution": RESOLUTION,
            "stages": list(net.stage_ids),
            "trainable_parameters": sum(p.numel() for p in net.slots.parameters()),
        },
        "eval": {"images": len(eval_paths), "groups": len(groups), "resolution": RESOLUTION},
        "results": results,
        "fused_minus_frozen": {k: round(results[FUSED][k] - frozen[k], 3) for k in frozen},
        "minus_frozen_map_at_r_95ci": intervals,
        "training_losses": {
            **{f"k{g['k']}": [round(v, 3) for v in g["loss_per_epoch"]] for g in record["granularities"]},
            "fusion": [{k: round(v, 3) for k, v in e.items()} for e in record["fusion_loss_per_epoch"]],
        },
        "fusion_mean_weights": record["fusion_mean_weights"],
        "seconds": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--realbench", type=Path, default=REALBENCH)
    parser.add_argument("--work", type=Path, help="cache directory (default: a fixed folder in the system temp dir)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(json.dumps(run(args.realbench, args.work)))


if __name__ == "__main__":
    main()
