"""``needle eval``: mAP@k (ILIAS protocol) of an index against a ground-truth JSON.

Ground truth: ``{"queries": [{"key": K, "positives": [K, ...]}, ...]}`` with keys as in the Parquet
``key`` column. Each query is searched with its stored descriptor; the query itself is removed from
its ranking (the database is every other image). Queries without positives are skipped and counted.

With ``rerank`` the global shortlist of each query is re-ranked with local tokens (query/retrieve.py):
the query's tokens come from ``query_locals`` (descriptors of the query images ingested with a
query-side preset, e.g. ``--locals lite0-s16-query``) or, without it, from the index's local store.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Collection
from typing import Any

import numpy as np

from eval.ilias import write_results_json, write_results_pickle
from eval.metrics import average_precision_at_k, recall_at_k
from index.search import load_index
from query.retrieve import QueryConfig, search, stored_tokens
from rerank.rerank import Reranker, RerankConfig
from rerank.tokens import LocalTokens
from ingest.descriptors import write_json_atomic
from ingest.errors import NeedleInputError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalConfig:
    k: int = 1000  # rank cut-off of mAP@k
    nprobe: int | None = None  # IVF lists visited; None: the index's setting
    batch: int = 256  # queries searched at once
    rerank: RerankConfig | None = None  # re-rank each shortlist with local tokens; None: global only
    query_locals: str | None = None  # descriptor directory of query-side local tokens; None: the index's store
    qe_top: int = 0  # query expansion with the top-n (0: off)
    ilias_pickle: str | None = None  # also write the rankings as the ILIAS benchmark's result pickle
    ilias_json: str | None = None  # ... and/or its result JSON ({query: {db_id: score}})


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
    # +1: the query finds itself; ignored keys may take places in the shortlist too.
    query_conf = QueryConfig(k=min(index.ntotal, conf.k + 1 + len(ignore)), nprobe=conf.nprobe, rerank=conf.rerank,
                             qe_top=conf.qe_top)
    reranker = Reranker(conf.rerank) if conf.rerank else None
    query_tokens = read_query_tokens(conf.query_locals, [q["key"] for q in usable]) if conf.rerank and conf.query_locals else None
    per_query = []
    for start in range(0, len(usable), conf.batch):
        chunk = usable[start : start + conf.batch]
        xq = np.stack([index.vector_of(q["key"]) for q in chunk])
        tokens = None
        if conf.rerank:
            tokens = [query_tokens[q["key"]] for q in chunk] if query_tokens else stored_tokens(index, [q["key"] for q in chunk])
        D, I, _ = search(index, xq, query_conf, tokens, reranker)
        for q, keys, scores in zip(chunk, index.keys_of(I), D):
            kept = [(k, float(s)) for k, s in zip(keys, scores) if k is not None and k != q["key"] and k not in ignore][: conf.k]
            ranking = [k for k, _ in kept]
            per_query.append({"key": q["key"], "ap": average_precision_at_k(ranking, q["positives"], conf.k),
                              "recall": recall_at_k(ranking, q["positives"], conf.k),
                              "ranking": ranking, "scores": [s for _, s in kept]})
    rankings = [p.pop("ranking") for p in per_query]
    scores = [p.pop("scores") for p in per_query]
    if conf.ilias_pickle:
        write_results_pickle(conf.ilias_pickle, [p["key"] for p in per_query], rankings, scores)
    if conf.ilias_json:
        write_results_json(conf.ilias_json, [p["key"] for p in per_query], rankings, scores)
    return {
        f"map_at_{conf.k}": 100.0 * float(np.mean([p["ap"] for p in per_query])),
        # ILIAS's oracle: the positives in the top k over all positives (a perfect re-ranking's bound).
        f"recall_at_{conf.k}": 100.0 * float(np.mean([p["recall"] for p in per_query])),
        "k": conf.k,
        "n_queries": len(per_query),
        "skipped_without_positives": len(queries) - len(usable),
        "database_size": index.ntotal,
        "index": str(Path(index_dir).resolve()),
        "index_kind": index.infos.get("kind"),
        "config": asdict(conf),
        "per_query": per_query,
    }


def read_query_tokens(directory: str | Path, keys: list[str]) -> dict[str, LocalTokens]:
    """Query-side local tokens by key from a descriptor directory (schema v2 with codes); every
    key must be there."""
    import pyarrow.parquet as pq

    from index.locals import read_token_records, tokens_from_records
    from ingest.descriptors import list_descriptor_files

    wanted = set(keys)
    found: dict[str, LocalTokens] = {}
    info_path = Path(directory) / "ingest_info.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    local = next((e for e in info.get("extractors", []) if e.get("extractor") == "local"), {})
    scales = np.asarray(local.get("scales", [1.0]), np.float32)
    for path in list_descriptor_files(Path(directory)):
        table_keys = pq.read_table(path, columns=["key"])["key"].to_pylist()
        if not wanted.intersection(table_keys):
            continue
        offsets, records = read_token_records(path)
        for i, key in enumerate(table_keys):
            if key in wanted:
                found[key] = tokens_from_records(records[offsets[i] : offsets[i + 1]], scales)
    missing = [k for k in keys if k not in found]
    if missing:
        raise NeedleInputError(f"query descriptors {directory} lack local tokens of {len(missing)} queries, e.g. {missing[:3]}")
    return found


def main(conf: EvalConfig, index_dir: Path, ground_truth: Path, output: Path) -> Path:
    """Evaluate ``index_dir`` on ``ground_truth``; write the JSON report to ``output``."""
    report = evaluate(index_dir, load_ground_truth(ground_truth), conf)
    write_json_atomic(report, Path(output))
    log.info("mAP@%d = %.2f over %d queries", conf.k, report[f"map_at_{conf.k}"], report["n_queries"])
    return Path(output)
