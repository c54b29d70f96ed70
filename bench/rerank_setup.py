"""realbench for bench/rerank.py: the photos packed, ingested (database and query-side tokens, the ITQ
projection learned on the distractors) and indexed; each query's global shortlist, the query-side tokens
(cached), the image sources and AMES trained on distractors; and ``Bench``, the state main's phases
share, with its cache of scoring passes by local tokens."""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rerank_scoring import (  # bench/: on sys.path after the root (see bench/rerank.py)
    ROOT,
    SHORTLIST,
    TIMED_TOKENS,
    K,
    _describe,
    group_folds,
    validation_queries,
)

log = logging.getLogger("bench.rerank")


def _load_realbench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_realbench", ROOT / "bench" / "realbench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_realbench = _load_realbench()
GROUPED_SHARD, REALBENCH, pack_realbench, row_queries = (
    _realbench.GROUPED_SHARD,
    _realbench.REALBENCH,
    _realbench.pack_realbench,
    _realbench.row_queries,
)

# The distractor sample each token kind's ITQ projection is learned from: (every how many-th
# distractor shard of the 7 of ~217 images, tokens per image). ALIKED's keypoints: shards 0, 3 and
# 6 at 300 per image (~150k descriptors; on 2 shards x 100 its re-ranking read 2-3 mAP lower).
# Lite0's tokens: their stored 100 per image of every shard (from the top 300 of every third its
# defaults read 53.6 instead of 56.4: weak tokens are not what it stores).
ITQ_SAMPLE = {"aliked": (3, 300), "cnn": (1, 100)}


def ingest_all(
    work: Path, db_tokens: int, itq_from_distractors: bool, locals_preset: str, cpus_per_worker: int = 2
) -> str | None:
    """Ingest the database and the queries; returns the ITQ file used (None: the shipped one).

    With ``itq_from_distractors`` the ITQ projection is first learned from the distractors' local
    descriptors (a sample of the database, never the queries), as a user learns it on a sample of
    their own collection (here the token kind's ``ITQ_SAMPLE`` of the distractor shards)."""
    import ray

    from cluster.ingest_job import main as ingest
    from embed.locals.presets import get_local_preset
    from embed.train_itq import TrainITQConfig
    from embed.train_itq import main as train_itq
    from ingest.config import IngestConfig

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    itq = None
    try:
        if itq_from_distractors:
            stride, tokens = ITQ_SAMPLE[get_local_preset(locals_preset).kind]
            sample = IngestConfig(
                locals=locals_preset,
                local_top_k=tokens,
                local_itq="none",
                keep_local_desc=True,
                overwrite=True,
                cpus_per_worker=cpus_per_worker,
            )
            distractor_shards = sorted(str(p) for p in (work / "shards").glob("*.tar") if p.stem != GROUPED_SHARD)
            ingest(sample, distractor_shards[::stride], work / "desc_itq")
            itq = str(train_itq(TrainITQConfig(), work / "desc_itq", work / "itq_distractors.npz"))
        ingest(
            IngestConfig(
                locals=locals_preset,
                local_top_k=db_tokens,
                local_itq=itq,
                overwrite=True,
                cpus_per_worker=cpus_per_worker,
            ),
            str(work / "shards" / "*.tar"),
            work / "desc",
        )
        ingest(
            IngestConfig(
                locals=f"{locals_preset}-query", local_itq=itq, overwrite=True, cpus_per_worker=cpus_per_worker
            ),
            str(work / "shards" / f"{GROUPED_SHARD}.tar"),
            work / "desc_q",
        )
    finally:
        ray.shutdown()
    return itq


def shortlists(index, queries: list[dict]) -> tuple[list[dict], float]:
    """Each query's global top-K (itself removed) and the mean global search time per query (ms)."""
    out, seconds = [], 0.0
    key_position = {k: i for i, k in enumerate(index.ids["key"].to_pylist())}
    for q in queries:
        xq = index.vector_of(q["key"])[None]
        start = time.perf_counter()
        D, I = index.search(xq, K + 1)
        seconds += time.perf_counter() - start
        keep = I[0] != index.rows[key_position[q["key"]]]
        rows, scores = I[0][keep][:K], D[0][keep][:K]
        keys = index.keys_of(rows[None])[0]
        positives = set(q["positives"])
        out.append(
            {
                "key": q["key"],
                "rows": rows,
                "s_global": scores.astype(np.float64),
                "positive": np.array([k in positives for k in keys]),
                "n_positives": len(positives),
            }
        )
    return out, 1000.0 * seconds / len(queries)


def local_scores(
    index, reranker, lists: list[dict], query_tokens: dict, db_tokens: int, shortlist: int = SHORTLIST
) -> tuple[list, float]:
    """Local scores (rerank.rerank.LocalScores) of every query's shortlist, and the mean time per
    query (ms) of gathering the candidates' tokens and scoring them."""
    scores, seconds = [], 0.0
    for entry in lists:
        start = time.perf_counter()
        candidates = index.local_store.batch(index.positions_of_rows(entry["rows"][:shortlist]), db_tokens)
        scores.append(reranker.local_scores(query_tokens[entry["key"]], candidates))
        seconds += time.perf_counter() - start
    return scores, 1000.0 * seconds / len(lists)


def query_tokens_with_projections(
    work: Path,
    lists: list[dict],
    images: dict[str, str],
    itq: str | None,
    locals_preset: str,
    scales: tuple[float, ...] | None = None,
    top_k: int | None = None,
) -> dict:
    """Query-side tokens extracted as ``needle query --image`` does (the index's local extractor at
    the query-side scales; ``scales``/``top_k`` replace the preset's), keeping the float ITQ
    projections that asymmetric matching scores; cached in the work directory."""
    import pickle

    from embed.locals.extract import build_local_extractor
    from ingest.images import decode_resized

    setting = "" if scales is None and top_k is None else f"_{'-'.join(map(str, scales or ()))}_{top_k}"
    cache = work / f"query_tokens_proj{setting}.pkl"
    if cache.is_file():
        return pickle.loads(cache.read_bytes())
    extractor = build_local_extractor(f"{locals_preset}-query", itq=itq, scales=scales, top_k=top_k)
    out = {}
    keys = [e["key"] for e in lists]
    for start in range(0, len(keys), 8):
        chunk = keys[start : start + 8]
        decoded = [
            decode_resized((REALBENCH / "images" / f"{images[k]}.jpg").read_bytes(), extractor.resolution, k)[0]
            for k in chunk
        ]
        out.update(zip(chunk, extractor.tokens(decoded)))
    cache.write_bytes(pickle.dumps(out))
    return out


def realbench_sources(rows: list[dict]) -> dict[str, str]:
    """Each grouped row's key -> the source its image came from (groups.csv's ``source``)."""
    import csv

    with open(REALBENCH / "groups.csv") as f:
        source = {r["key"]: r["source"] for r in csv.DictReader(f)}
    return {r["key"]: source[r["image"]] for r in rows}


def train_ames(work: Path, epochs: int, itq: str | None, locals_preset: str) -> Path:
    from cluster.ingest_job import make_local_extractor
    from ingest.config import IngestConfig
    from rerank.ames_train import TrainConfig
    from rerank.ames_train import main as train

    extractor = make_local_extractor(IngestConfig(locals=locals_preset, local_itq=itq))
    conf = TrainConfig(pairs=1500, epochs=epochs, batch_size=32)
    return train(
        conf,
        REALBENCH / "distractors",
        work / "ames.pt",
        describe=extractor.tokens_of_any_size,
        projection=extractor.itq.proj,
    )


@dataclass
class Bench:
    """What main's phases share: the arguments, the ingested photos and their index, the shortlists and
    folds, the query-side token sets and the cache of scoring passes (one per query tokens and setting)."""

    args: argparse.Namespace
    work: Path
    rows: list[dict]
    itq: str | None
    index: Any
    lists: list[dict]
    global_ms: float
    global_map: float
    folds: list[np.ndarray]
    images: dict[str, str]
    proj_tokens: dict
    token_sets: dict
    kind: str
    ensemble: Any  # the kind's defaults: λ, floor, Chamfer term
    vectors: list = field(default_factory=list)  # each query's and its shortlist's global vectors
    cache: dict[tuple[str, str], tuple[list, float]] = field(default_factory=dict)

    def scored(self, tokens_name: str, conf) -> tuple[list, float]:
        """The scoring pass of query tokens ``tokens_name`` with ``conf`` (what it leaves open: the token
        kind's defaults): its validation queries and ms/query, scored once."""
        from rerank.rerank import Reranker, with_kind_defaults

        conf = with_kind_defaults(conf, self.kind)  # what the defaults leave open: the token kind's own
        key = (tokens_name, _describe(conf))
        if key not in self.cache:
            index, lists = self.index, self.lists
            reranker = Reranker(conf)
            first = lists[0]  # warm-up (tables, allocations), untimed
            reranker.local_scores(
                self.token_sets[tokens_name][first["key"]],
                index.local_store.batch(index.positions_of_rows(first["rows"][:SHORTLIST]), TIMED_TOKENS),
            )
            raws, ms = local_scores(index, reranker, lists, self.token_sets[tokens_name], TIMED_TOKENS)
            self.cache[key] = (validation_queries(lists, raws, SHORTLIST), ms)
            log.info("%s on %s query tokens: %.1f ms/query", key[1], tokens_name, ms)
        return self.cache[key]


def ingest_and_index(args: argparse.Namespace, work: Path) -> tuple[list[dict], str | None, Any]:
    """realbench packed into ``work``, ingested and indexed (unless ``--reuse`` finds the index):
    its rows, the ITQ file and the loaded index."""
    from index.build.stage import IndexConfig
    from index.build.stage import main as build_index
    from index.search import load_index

    rows, _ = pack_realbench(REALBENCH, work / "shards")
    itq = None if args.shipped_itq else str(work / "itq_distractors.npz")
    if not (args.reuse and (work / "index" / "index_infos.json").is_file()):
        itq = ingest_all(work, args.db_tokens, not args.shipped_itq, args.locals, args.cpus_per_worker)
        build_index(IndexConfig(kind="flat"), work / "desc", work / "index")
    return rows, itq, load_index(work / "index")


def prepare(args: argparse.Namespace, work: Path) -> Bench:
    """Ingestion and the index, each query's shortlist, the group folds and the query-side tokens."""
    from embed.locals.presets import get_local_preset
    from eval.evaluate import read_query_tokens
    from rerank.ensemble import ap_of_order
    from rerank.rerank import RerankConfig, with_kind_defaults

    rows, itq, index = ingest_and_index(args, work)
    queries = [q for q in row_queries(rows) if q["positives"]]
    groups = {r["key"]: r["group"] for r in rows}
    lists, global_ms = shortlists(index, queries)
    folds = group_folds(lists, groups, args.folds)
    query_tokens = read_query_tokens(work / "desc_q", [q["key"] for q in queries])
    images = {r["key"]: r["image"] for r in rows}
    proj_tokens = query_tokens_with_projections(work, lists, images, itq, args.locals)
    global_map = 100.0 * float(np.mean([ap_of_order(e["positive"], e["n_positives"], K) for e in lists]))
    kind = get_local_preset(args.locals).kind
    ensemble = with_kind_defaults(RerankConfig(), kind).ensemble
    return Bench(
        args=args,
        work=work,
        rows=rows,
        itq=itq,
        index=index,
        lists=lists,
        global_ms=global_ms,
        global_map=global_map,
        folds=folds,
        images=images,
        proj_tokens=proj_tokens,
        token_sets={"ingested": query_tokens, "image": proj_tokens},
        kind=kind,
        ensemble=ensemble,
    )
