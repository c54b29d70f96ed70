"""What snapping input sides to a grid (embed/shape_plan.py) costs in retrieval quality: realbench
mAP@1k with exact shapes and with each grid, same model, same decode, exact search.

Every image of ``../shared/data/realbench`` (132 grouped + 1,518 distractors) is decoded once at the
model's resolution; each setting extracts all of them; the ILIAS protocol of bench/realbench.py
scores them (each grouped image a query, its group the positives, everything else the database).
Prints one JSON line: per grid the mAP@1k, its difference to exact shapes, the number of input
shapes the images fell into, and the lowest and median cosine of each descriptor to its exact-shape
one. CPU is enough (the descriptors do not depend on the device beyond fp16 rounding).

    python bench/shape_grid.py [--grids 0,32,64] [--model NAME] [--limit N] [--threads 1]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REALBENCH = ROOT.parent / "shared" / "data" / "realbench"


def realbench_files(root: Path, limit: int | None) -> tuple[list[Path], list[str]]:
    """(image files: grouped first, then distractors; each grouped file's group, "" for distractors)."""
    with open(root / "groups.csv") as f:
        grouped = list(csv.DictReader(f))
    with open(root / "distractors.csv") as f:
        distractors = [r["file"] for r in csv.DictReader(f)][:limit]
    files = [root / "images" / f"{r['key']}.jpg" for r in grouped] + [root / "distractors" / d for d in distractors]
    return files, [r["group"] for r in grouped] + [""] * len(distractors)


def map_at_1k(x: np.ndarray, groups: list[str]) -> tuple[float, int]:
    """ILIAS mAP@1k (x 100) of every grouped row with a positive against all other rows."""
    from eval.metrics import map_at_k

    members = defaultdict(list)
    for i, group in enumerate(groups):
        if group:
            members[group].append(i)
    queries = [i for i, g in enumerate(groups) if g and len(members[g]) > 1]
    scores = x[queries] @ x.T
    scores[np.arange(len(queries)), queries] = -np.inf  # a query is not in its own database
    positives = [set(members[groups[q]]) - {q} for q in queries]
    return map_at_k(scores, positives, 1000), len(queries)  # already x 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grids", default="0,32", help="comma-separated grids in pixels; 0: exact shapes")
    parser.add_argument("--model", default="tf_efficientnet_lite0.gem")
    parser.add_argument("--limit", type=int, help="distractors to use (default: all 1,518)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from embed.extract import GlobalExtractor
    from embed.shape_plan import snap
    from ingest.images import decode_resized

    torch.set_num_threads(args.threads)
    if not REALBENCH.is_dir():
        sys.exit(f"realbench data not found at {REALBENCH}")
    files, groups = realbench_files(REALBENCH, args.limit)
    grids = [int(g) for g in args.grids.split(",")]
    probe = GlobalExtractor(args.model, shape_grid=0)
    images = [decode_resized(path.read_bytes(), probe.resolution, str(path))[0] for path in files]
    result: dict = {"model": args.model, "resolution": probe.resolution, "images": len(images), "grids": {}}
    exact = None
    for grid in grids:
        extractor = probe if grid == 0 else GlobalExtractor(args.model, shape_grid=grid)
        start = time.perf_counter()
        x = extractor(images)["global"].astype(np.float32)
        seconds = time.perf_counter() - start
        m, n_queries = map_at_1k(x, groups)
        shapes = {extractor.net.input_shape(*snap(*im.shape[:2], grid)) for im in images}
        entry = {"map_at_1k": round(m, 2), "input_shapes": len(shapes), "extract_s": round(seconds, 1)}
        if grid == 0:
            exact = (x, m)
        elif exact is not None:
            cos = (x * exact[0]).sum(1)
            entry |= {
                "delta_vs_exact": round(m - exact[1], 2),
                "cosine_to_exact_min": round(float(cos.min()), 4),
                "cosine_to_exact_median": round(float(np.median(cos)), 4),
            }
        result["grids"][str(grid)] = entry
        result["n_queries"] = n_queries
    print(json.dumps(result))


if __name__ == "__main__":
    main()
