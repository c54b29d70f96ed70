"""2AFC on realbench: accuracy of each similarity model, majority vote and the context-sensitive
ensemble (similarity/twoafc/*.py) on triplets with a known answer; one JSON line last.

Triplets (``make_triplets``, seed 0): the 56 groups with two or more images are split in half
(``val`` / ``test``, 28 groups each; the singleton and the 1,518 distractors are split in half too,
so no group and no image is in both). Per group at most 12 ordered (R, A) pairs, drawn at random
(all pairs of the groups of two; 12 of the 20 to 90 of the larger ones). Each pair gets four B's:

- ``distractor``: a random distractor of the split;
- ``other_group``: a random image of another group of the split;
- ``hard:tiny-32``: drawn among the 5 images nearest to R under tiny images (32 x 32 thumbnails,
  cosine), searched in the split's other groups and 300 of its distractors (seeded sample);
- ``hard:lite0-gem-320``: the same under Lite0 GeM at 320 px, a model not evaluated but of the
  GeM family (so adversarial to the three Lite0 global models, less so to Chamfer and colour).

The closer image is put on the A or B side at random. Models: Lite0 GeM cosine at 384 and 224 px,
Lite0 multi-stage (blocks 4, 5 and the GeM head, mean of the 3 cosines) at 384, Chamfer of Lite0's
stride-16 binary tokens (``lite0-s16``), RGB histogram intersection (8 bins per channel).

Two folds: the ensemble's regressors are trained on the ``val`` triplets and tested on ``test``, then
the other way round; every triplet is tested once, by an ensemble that never saw its groups. The
pooled report gives each method's 2AFC accuracy (%), its binomial standard error, counts, the
accuracy per kind of B, and how often the ensemble beat / lost to the best single model on the same
triplet. ``ensemble`` uses the paper's weights (predicted probabilities normalised to sum to one),
``ensemble_log_odds`` max(0, log p / (1 - p)) normalised, ``mean_margin`` uniform weights on the same
scaled margins (the ensemble without its context). Features are cached under ``work``; torch runs on
one thread (the machine is shared).

    python bench/seeds_2afc.py [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
REALBENCH = ROOT.parent / "shared" / "data" / "realbench"

TRIPLETS = {
    "seed": 0,
    "val_fraction": 0.5,
    "max_pairs_per_group": 12,
    "random_distractors": 1,
    "other_groups": 1,
    "hard": 1,
    "hard_pool": 5,
    "hard_distractors": 300,
    "miners": ("tiny-32", "lite0-gem-320"),
}
FOLDS = (("val", "test"), ("test", "val"))


def run(realbench: Path, work: Path) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(Path(realbench), Path(work))
    finally:
        torch.set_num_threads(threads)  # the other parts of bench/seeds.py run in this process


def _run(realbench: Path, work: Path) -> dict:
    from similarity.twoafc.config import EnsembleConfig
    from similarity.twoafc.ensemble import load_ensemble, train_ensemble
    from similarity.twoafc.evaluation import Evaluation, evaluate_triplets, report
    from similarity.twoafc.features import FeatureStore
    from similarity.twoafc.mining import TripletConfig, make_triplets
    from similarity.twoafc.triplets import read_triplets

    start = time.perf_counter()
    store = FeatureStore(work / "features")
    csv_path = make_triplets(TripletConfig(**TRIPLETS), realbench, work / "triplets.csv", cache=work / "features")
    made = json.loads(csv_path.with_name(csv_path.name + ".json").read_text())
    parts, folds = [], []
    for train_split, test_split in FOLDS:
        conf = EnsembleConfig(split=train_split)
        ens_path = train_ensemble(conf, csv_path, work / f"ensemble_{train_split}.pt", store=store)
        trained = json.loads(ens_path.with_name(ens_path.name + ".json").read_text())
        test = read_triplets(csv_path, test_split)
        ev = evaluate_triplets(test, conf.models, load_ensemble(ens_path), store)
        parts.append(ev)
        fold = report(ev)
        folds.append(
            {
                "train": train_split,
                "test": test_split,
                "n_train": trained["n"],
                "n_test": fold["n"],
                "accuracy_pct": {m: s["accuracy_pct"] for m, s in fold["methods"].items()},
                "train_accuracy_pct": trained["train_accuracy_pct"],
                "mean_weights": fold["ensemble_mean_weights"],
            }
        )
    pooled = report(Evaluation.concatenate(parts))
    return {
        "triplets": {
            "n": made["triplets"],
            "config": made["config"],
            "splits": {s: {k: made["splits"][s][k] for k in ("triplets", "groups", "kinds")} for s in made["splits"]},
        },
        "pooled_test": pooled,
        "folds": folds,
        "seconds": round(time.perf_counter() - start, 1),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--work", default="/tmp/needle_seeds_2afc", help="work directory (feature cache, triplets, ensembles)"
    )
    parser.add_argument("--realbench", default=str(REALBENCH))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(json.dumps(run(Path(args.realbench), Path(args.work))))
