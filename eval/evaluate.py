"""``needle eval``: mAP@k (ILIAS protocol) of an index against a ground-truth JSON.

Ground truth: ``{"queries": [{"key": K, "positives": [K, ...]}, ...]}`` with keys as in the Parquet
``key`` column. Each query is searched with its stored descriptor; the query itself is removed from
its ranking (the database is every other image). Queries without positives are skipped and counted.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Collection
from typing import Any

import numpy as np

from eval.metrics import average_precision_at_k
from index.search import load_index
from ingest.descriptors import write_json_atomic
from ingest.errors import NeedleInputError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalConfig:
    k: int = 1000  # rank cut-off of mAP@k
    nprobe: int | None = None  # IVF lists visited; None: the index's setting
    batch: int = 256  # queries searched at once


def load_ground_truth(path: Path) -> list[dict[str, Any]]:
    try:
        truth = json.loads(Path(path).read_text())
        queries = truth["queries"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise NeedleInputError(f"ground truth {path}: expected JSON with a 'queries' list ({exc})") from exc
    for i, q in enumerate(queries):
        if not isinstance(q, dict) or "key" not in q or "positives" not in q:
            raise NeedleInputError(f"ground truth {path}: query {i} needs 'key' and 'positives'")
    return queries


def evaluate(index_dir: Path, queries: list[dict[str, Any]], conf: EvalConfig, ignore: Collection[str] = ()) -> dict[str, Any]:
    """Search every query key and compute AP@k per query and mAP@k x 100.

    ``ignore``: keys removed from every ranking (they count neither as hits nor as misses).
    """
    ignore = set(ignore)
    index = load_index(index_dir)
    usable = [q for q in queries if q["positives"]]
    if not usable:
        raise NeedleInputError("no query with positives to evaluate")
    per_query = []
    for start in range(0, len(usable), conf.batch):
        chunk = usable[start : start + conf.batch]
        xq = np.stack([index.vector_of(q["key"]) for q in chunk])
        # +1: the query finds itself; ignored keys may take places in the shortlist too.
        D, I = index.search(xq, conf.k + 1 + len(ignore), conf.nprobe)
        for q, keys in zip(chunk, index.keys_of(I)):
            ranking = [k for k in keys if k is not None and k != q["key"] and k not in ignore][: conf.k]
            per_query.append({"key": q["key"], "ap": average_precision_at_k(ranking, q["positives"], conf.k)})
    return {
        f"map_at_{conf.k}": 100.0 * float(np.mean([p["ap"] for p in per_query])),
        "k": conf.k,
        "n_queries": len(per_query),
        "skipped_without_positives": len(queries) - len(usable),
        "database_size": index.ntotal,
        "index": str(Path(index_dir).resolve()),
        "index_kind": index.infos.get("kind"),
        "config": asdict(conf),
        "per_query": per_query,
    }


def main(conf: EvalConfig, index_dir: Path, ground_truth: Path, output: Path) -> Path:
    """Evaluate ``index_dir`` on ``ground_truth``; write the JSON report to ``output``."""
    report = evaluate(index_dir, load_ground_truth(ground_truth), conf)
    write_json_atomic(report, Path(output))
    log.info("mAP@%d = %.2f over %d queries", conf.k, report[f"map_at_{conf.k}"], report["n_queries"])
    return Path(output)
