"""Retrieval quality on real photos: ``../shared/data/realbench`` through the full pipeline.

The images are packed into WebDataset tars (in a temporary or given work directory, never in the
repo), ingested by the Ray job, indexed, and evaluated with the ILIAS protocol: every row of
``groups.csv`` whose group has another row is a query, its positives are the other rows of its group,
the database is every other row plus (or not) the 1,518 distractors. Prints one JSON line last.

132 distinct images of 57 instances (one singleton group: 131 queries). The reference measured
outside needle (Lite0 GeM at longer side 384, exact search) is 47.0 mAP@1k with all distractors and
50.2 without.

    python bench/realbench.py [--workdir DIR] [--model NAME] [--resolution N]
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import os
import sys
import tarfile
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REALBENCH = ROOT.parent / "shared" / "data" / "realbench"
REFERENCE = {"map_at_1k": 47.0, "map_at_1k_no_distractors": 50.2}
GROUPED_SHARD = "000000"
SAMPLES_PER_TAR = 250
IVF_NPROBE = 4  # of the plan's IVF lists: a real shortlist, not a scan of everything


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def pack_realbench(root: Path, shards_dir: Path) -> tuple[list[dict], list[str]]:
    """Write the grouped rows to shard 000000 and the distractors to 000001.. ; returns
    (rows with key/group/image, distractor keys)."""
    shards_dir.mkdir(parents=True, exist_ok=True)
    with open(root / "groups.csv") as f:
        groups = list(csv.DictReader(f))
    rows = []
    with tarfile.open(shards_dir / f"{GROUPED_SHARD}.tar", "w") as tar:
        for i, row in enumerate(groups):
            sample_key = f"g{i:04d}"
            _add(tar, f"{sample_key}.jpg", (root / "images" / f"{row['key']}.jpg").read_bytes())
            _add(tar, f"{sample_key}.json", json.dumps(row).encode())
            rows.append({"key": f"{GROUPED_SHARD}/{sample_key}", "group": row["group"], "image": row["key"]})
    with open(root / "distractors.csv") as f:
        distractor_files = [r["file"] for r in csv.DictReader(f)]
    distractor_keys = []
    for start in range(0, len(distractor_files), SAMPLES_PER_TAR):
        shard = f"{1 + start // SAMPLES_PER_TAR:06d}"
        with tarfile.open(shards_dir / f"{shard}.tar", "w") as tar:
            for j, name in enumerate(distractor_files[start : start + SAMPLES_PER_TAR]):
                sample_key = f"d{start + j:05d}"
                _add(tar, f"{sample_key}.jpg", (root / "distractors" / name).read_bytes())
                distractor_keys.append(f"{shard}/{sample_key}")
    return rows, distractor_keys


def row_queries(rows: list[dict]) -> list[dict]:
    by_group = defaultdict(list)
    for row in rows:
        by_group[row["group"]].append(row["key"])
    return [{"key": r["key"], "positives": [k for k in by_group[r["group"]] if k != r["key"]]} for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", help="keep tars, descriptors and indexes here (default: a temp dir)")
    parser.add_argument("--model", default="tf_efficientnet_lite0.gem")
    parser.add_argument("--resolution", type=int, help="longer side (default: the model's test resolution)")
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count())
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import ray

    from cluster.ingest_job import main as ingest
    from eval.evaluate import EvalConfig, evaluate
    from index.build.stage import IndexConfig
    from index.build.stage import main as build_index
    from ingest.config import IngestConfig

    if not REALBENCH.is_dir():
        sys.exit(f"realbench data not found at {REALBENCH}")
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="needle-realbench-")
    work = Path(args.workdir or tmp.name)
    rows, distractors = pack_realbench(REALBENCH, work / "shards")

    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    start = time.perf_counter()
    conf = IngestConfig(model=args.model, resolution=args.resolution, overwrite=True)
    ingest(conf, str(work / "shards" / "*.tar"), work / "descriptors")
    ingest_s = time.perf_counter() - start
    ray.shutdown()

    descriptors = work / "descriptors"
    grouped = descriptors / f"{GROUPED_SHARD}.parquet"
    build_index(IndexConfig(kind="flat"), descriptors, work / "index_all")
    build_index(IndexConfig(kind="flat"), [grouped], work / "index_grouped")
    # IVF-PQ with exact refine over the same descriptors: the default plan for the budget, forced
    # to IVF-PQ (auto would pick exact search for so few vectors).
    build_index(IndexConfig(kind="ivfpq", nprobe=IVF_NPROBE), descriptors, work / "index_ivfpq")

    k = 1000
    queries = [q for q in row_queries(rows) if q["positives"]]
    with_d = evaluate(work / "index_all", queries, EvalConfig(k=k))
    ivfpq = evaluate(work / "index_ivfpq", queries, EvalConfig(k=k))
    ivf_infos = json.loads((work / "index_ivfpq" / "index_infos.json").read_text())
    without_d = evaluate(work / "index_grouped", queries, EvalConfig(k=k))

    ingest_info = json.loads((descriptors / "ingest_info.json").read_text())
    result = {
        "map_at_1k": round(with_d[f"map_at_{k}"], 2),
        "map_at_1k_no_distractors": round(without_d[f"map_at_{k}"], 2),
        "map_at_1k_ivfpq_refine": round(ivfpq[f"map_at_{k}"], 2),
        "ivfpq_loss": round(with_d[f"map_at_{k}"] - ivfpq[f"map_at_{k}"], 2),
        "ivfpq_factory": ivf_infos["factory"],
        "ivfpq_nprobe": IVF_NPROBE,
        "n_queries": with_d["n_queries"],
        "database_size": with_d["database_size"] - 1,
        "distractors": len(distractors),
        "reference": REFERENCE,
        "meets_reference": round(with_d[f"map_at_{k}"], 1) >= REFERENCE["map_at_1k"]
        and round(without_d[f"map_at_{k}"], 1) >= REFERENCE["map_at_1k_no_distractors"],
        "model": args.model,
        "resolution": ingest_info["extractors"][0]["resolution"],
        "images": ingest_info["images"],
        "error_rows": ingest_info["error_rows"],
        "ingest_s": round(ingest_s, 1),
        "ingest_images_per_s": ingest_info["images_per_s"],
    }
    if tmp is not None:
        tmp.cleanup()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
