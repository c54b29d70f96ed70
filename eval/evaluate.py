"""``needle eval``: mAP@k (ILIAS protocol) of an index against a ground truth.

Ground truth, either
- a JSON ``{"queries": [{"key": K, "positives": [K, ...]}, ...]}`` with keys as in the Parquet
  ``key`` column, optionally with per-positive attributes to break the mAP down by,
  ``"attributes": {NAME: {"bins": [[low, high], ...], "values": {K: v, ...}}}``; or
- an ILIAS dataset directory (``image_ids/``, eval/ilias.py): its image queries, each with every
  positive of its instance, broken down by the benchmark's scale and clutter bins, and with
  ``text_queries`` its text queries (``Txxx.txt``) through the model's text tower.

Query vectors come from the index when the queries were indexed with the database (realbench's
leave-one-out protocol: each query is removed from its own ranking), or from ``query_descriptors``,
the Parquet of the query images ingested on their own (ILIAS: queries are not in the database;
query-side options such as ``--multiscale`` apply there). Queries without positives are skipped
and counted.

With ``rerank`` the global shortlist of each query is re-ranked with local tokens (query/retrieve.py):
the query's tokens come from ``query_locals`` (descriptors of the query images ingested with a
query-side preset, e.g. ``--locals lite0-s16-query``) or, without it, from the index's local store.

The report holds mAP@k, recall@k, ILIAS's oracle, the breakdowns, the search time per query and
every query's AP; the rankings can also be written as the ILIAS benchmark's pickle and JSON.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.atomic import write_json_atomic
from core.errors import NeedleInputError
from core.tokens import LocalTokens
from eval.config import EvalConfig
from eval.ilias import (
    CLUTTER_GROUPS,
    SCALE_GROUPS,
    is_ilias_dataset,
    load_ilias,
    text_query_texts,
    write_results_json,
    write_results_pickle,
)
from eval.metrics import average_precision_at_k, binned_ap, ilias_oracle, recall_at_k
from index.search import load_index
from query.index_protocol import Index
from query.recorded import QueryFiles
from query.retrieve import QueryConfig, adapt_queries, embed_texts, search, stored_tokens, token_kind
from query.verify_top import make_reranker

log = logging.getLogger(__name__)


@dataclass
class GroundTruth:
    queries: list[dict[str, Any]]  # {"key", "positives"[, "text"]}: "text" marks a text query
    attributes: dict[str, tuple[list[tuple[float, float]], dict[str, float]]] = field(
        default_factory=dict
    )  # name -> (bins, value per positive)
    source: str = ""


def _parse_attributes(path: Path, raw: Any) -> dict[str, tuple[list[tuple[float, float]], dict[str, float]]]:
    out = {}
    for name, spec in (raw or {}).items():
        try:
            bins = [(float(lo), float(hi)) for lo, hi in spec["bins"]]
            values = {str(k): float(v) for k, v in spec["values"].items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise NeedleInputError(
                f"ground truth {path}: attribute {name!r} needs 'bins' [[low, high], ...] and "
                f"'values' {{key: number}} ({exc})"
            ) from exc
        out[name] = (bins, values)
    return out


def load_ground_truth(path: Path) -> list[dict[str, Any]]:
    """The query list of a ground-truth JSON file."""
    return load_truth(path).queries


def load_truth(path: Path | str, text_queries: bool = False) -> GroundTruth:
    """A ground-truth JSON file or an ILIAS dataset directory."""
    path = Path(path)
    if is_ilias_dataset(path):
        return ilias_truth(path, text_queries)
    if text_queries:
        raise NeedleInputError(f"text queries come from an ILIAS dataset directory; {path} is not one")
    try:
        truth = json.loads(path.read_text())
        queries = truth["queries"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise NeedleInputError(
            f"ground truth {path}: expected JSON with a 'queries' list or an ILIAS dataset directory ({exc})"
        ) from exc
    for i, q in enumerate(queries):
        if not isinstance(q, dict) or "key" not in q or "positives" not in q:
            raise NeedleInputError(f"ground truth {path}: query {i} needs 'key' and 'positives'")
    return GroundTruth(queries, _parse_attributes(path, truth.get("attributes")), str(path))


def ilias_truth(dataset_dir: Path, text_queries: bool = False) -> GroundTruth:
    """The ILIAS protocol as a ground truth: each image query's positives are every positive of its
    instance; the positives' scale and clutter give the benchmark's breakdowns."""
    dataset = load_ilias(dataset_dir)
    gt = dataset.gt
    queries = [{"key": q, "positives": sorted(gt.get(q.split("/")[0], ()))} for q in dataset.image_query_ids]
    if text_queries:
        texts = text_query_texts(dataset_dir, dataset.text_query_ids)
        queries += [
            {"key": q, "positives": sorted(gt.get(q.split("/")[0], ())), "text": texts[q]}
            for q in dataset.text_query_ids
        ]
    attributes = {
        "scale": ([tuple(b) for b in SCALE_GROUPS], {p: s for p, (s, _) in dataset.positive_info.items()}),
        "clutter": ([tuple(b) for b in CLUTTER_GROUPS], {p: float(c) for p, (_, c) in dataset.positive_info.items()}),
    }
    return GroundTruth(queries, attributes, str(dataset_dir))


def read_query_vectors(directory: str | Path, keys: list[str]) -> dict[str, np.ndarray]:
    """Global descriptors (float32) by key from a descriptor directory; every key must be there
    with status ok."""
    import pyarrow.compute as pc

    from ingest.descriptors import STATUS_OK, list_descriptor_files, read_global

    wanted = set(keys)
    found: dict[str, np.ndarray] = {}
    for path in list_descriptor_files(Path(directory)):
        table, x = read_global(path, ("key", "status"))
        ok = pc.equal(table["status"], STATUS_OK).to_numpy(zero_copy_only=False)
        for i, key in enumerate(table["key"].to_pylist()):
            if key in wanted and ok[i]:
                found[key] = x[i].astype(np.float32)
    missing = [k for k in keys if k not in found]
    if missing:
        raise NeedleInputError(
            f"query descriptors {directory} lack {len(missing)} of {len(keys)} queries "
            f"(or they failed to decode), e.g. {missing[:3]}"
        )
    return found


def _query_vectors(
    index: Index, chunk: list[dict[str, Any]], external: Mapping[str, np.ndarray] | None, files: QueryFiles
) -> np.ndarray:
    """(n, d) vectors of a chunk of image queries: stored (already adapted) or from the query
    descriptors (adapted here, as the index was built)."""
    if external is None:
        return np.stack([index.vector_of(q["key"]) for q in chunk]).astype(np.float32)
    return adapt_queries(index, np.stack([external[q["key"]] for q in chunk]), files)


def _mean(values: list[float]) -> float:
    return 100.0 * float(np.mean(values)) if values else float("nan")


def evaluate(
    index_dir: Path,
    queries: list[dict[str, Any]] | GroundTruth,
    conf: EvalConfig,
    ignore: Collection[str] = (),
    index: Index | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Search every query and compute AP@k per query, mAP@k x 100, recall@k, ILIAS's oracle and
    the attribute breakdowns.

    ``queries``: a query list or a GroundTruth; queries with a "text" are text queries.
    ``ignore``: keys removed from every ranking (they count neither as hits nor as misses).
    ``index``: an already loaded index of ``index_dir`` (distractor-scaling runs reuse one).
    ``device``: where the re-ranking runs (``--device``; rerank.device.resolve_device)."""
    truth = queries if isinstance(queries, GroundTruth) else GroundTruth(list(queries))
    ignore = set(ignore)
    index = index or load_index(index_dir)
    usable = [q for q in truth.queries if q["positives"]]
    if not usable:
        raise NeedleInputError("no query with positives to evaluate")
    image_queries = [q for q in usable if "text" not in q]
    text_queries = [q for q in usable if "text" in q]
    # +1: the query finds itself; ignored keys may take places in the shortlist too.
    depth = min(index.ntotal, conf.k + 1 + len(ignore))
    query_conf = QueryConfig(k=depth, nprobe=conf.nprobe, rerank=conf.rerank, qe_top=conf.qe_top)
    reranker = make_reranker(conf.rerank, index, token_kind(index), device) if conf.rerank else None
    keys = [q["key"] for q in image_queries]
    external = read_query_vectors(conf.query_descriptors, keys) if conf.query_descriptors and keys else None
    query_tokens = read_query_tokens(conf.query_locals, keys) if conf.rerank and conf.query_locals and keys else None
    results: list[tuple[dict[str, Any], list[str], list[float]]] = []
    search_s = 0.0
    chunks = [(image_queries[s : s + conf.batch], None) for s in range(0, len(image_queries), conf.batch)]
    if text_queries:
        xt = embed_texts(index, [q["text"] for q in text_queries], conf.files)
        chunks += [
            (text_queries[s : s + conf.batch], xt[s : s + conf.batch]) for s in range(0, len(text_queries), conf.batch)
        ]
    for chunk, text_vectors in chunks:
        xq = text_vectors if text_vectors is not None else _query_vectors(index, chunk, external, conf.files)
        tokens = None
        if conf.rerank:
            if text_vectors is not None:
                tokens = [None] * len(chunk)  # a text has no local tokens: global order
            else:
                tokens = (
                    [query_tokens[q["key"]] for q in chunk]
                    if query_tokens
                    else stored_tokens(index, [q["key"] for q in chunk])
                )
        start = time.perf_counter()
        D, I, _ = search(index, xq, query_conf, tokens, reranker)
        search_s += time.perf_counter() - start
        for q, row_keys, scores in zip(chunk, index.keys_of(I), D):
            kept = [
                (k, float(s)) for k, s in zip(row_keys, scores) if k is not None and k != q["key"] and k not in ignore
            ][: conf.k]
            results.append((q, [k for k, _ in kept], [s for _, s in kept]))
    report = _scores(results, truth, conf.k)
    if conf.ilias_pickle:
        write_results_pickle(
            conf.ilias_pickle, [q["key"] for q, _, _ in results], [r for _, r, _ in results], [s for _, _, s in results]
        )
    if conf.ilias_json:
        write_results_json(
            conf.ilias_json, [q["key"] for q, _, _ in results], [r for _, r, _ in results], [s for _, _, s in results]
        )
    report.update(
        {
            "skipped_without_positives": len(truth.queries) - len(usable),
            "database_size": index.ntotal,
            "search_ms_per_query": round(1000.0 * search_s / len(results), 3),
            "index": str(Path(index.path).resolve()),
            "index_kind": index.infos.get("kind"),
            "ground_truth": truth.source,
            "config": asdict(conf),
        }
    )
    report["per_query"] = report.pop("per_query")  # last: the long part
    return report


def _scores(results: list[tuple[dict[str, Any], list[str], list[float]]], truth: GroundTruth, k: int) -> dict[str, Any]:
    per_query = []
    bins: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for q, ranking, _ in results:
        entry = {
            "key": q["key"],
            "kind": "text" if "text" in q else "image",
            "ap": average_precision_at_k(ranking, q["positives"], k),
            "recall": recall_at_k(ranking, q["positives"], k),
            "oracle": ilias_oracle(ranking, q["positives"], k),
        }
        for name, (edges, values) in truth.attributes.items():
            for label, ap in binned_ap(ranking, q["positives"], values, edges, k).items():
                bins[name][label].append(ap)
        per_query.append(entry)
    report = {
        f"map_at_{k}": _mean([p["ap"] for p in per_query]),
        f"recall_at_{k}": _mean([p["recall"] for p in per_query]),
        # The AP@k of a perfect re-ranking of the top k (eval.metrics.ilias_oracle), in [0, 100].
        f"oracle_at_{k}": _mean([p["oracle"] for p in per_query]),
        "k": k,
        "n_queries": len(per_query),
    }
    kinds = {p["kind"] for p in per_query}
    if len(kinds) > 1:  # ILIAS reports image-to-image and text-to-image retrieval apart
        for kind in sorted(kinds):
            report[f"map_at_{k}_{kind}"] = _mean([p["ap"] for p in per_query if p["kind"] == kind])
            report[f"n_{kind}_queries"] = sum(p["kind"] == kind for p in per_query)
    if bins:
        report["breakdowns"] = {
            name: {label: _mean(aps) for label, aps in by_bin.items()} for name, by_bin in bins.items()
        }
    report["per_query"] = per_query
    return report


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
        raise NeedleInputError(
            f"query descriptors {directory} lack local tokens of {len(missing)} queries, e.g. {missing[:3]}"
        )
    return found


def main(conf: EvalConfig, index_dir: Path, ground_truth: Path, output: Path, device: str = "cpu") -> Path:
    """Evaluate ``index_dir`` on ``ground_truth`` (re-ranking on ``device``); write the JSON report
    to ``output``."""
    report = evaluate(index_dir, load_truth(ground_truth, conf.text_queries), conf, device=device)
    write_json_atomic(report, Path(output))
    log.info("mAP@%d = %.2f over %d queries", conf.k, report[f"map_at_{conf.k}"], report["n_queries"])
    return Path(output)
