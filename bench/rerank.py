"""Re-ranking on real photos: ``../shared/data/realbench`` through ingestion (globals + local tokens),
the exact index and the local store, then re-ranking of each query's global top-1000.

The database holds every image (the 132 grouped ones and the 1,518 distractors) with the database
tokens of ``--locals`` (default ``aliked-n16``: ALIKED-N16 keypoints at 512 px; ``lite0-s16``:
Lite0's stride-16 stage at 512 px), 128-bit ITQ codes learned on a sample of the distractors
(``ITQ_SAMPLE``: per token kind, which distractor shards and how many tokens per image), kept up to
``--db-tokens`` per image, of which the first 100 (2,308 B) are used; the queries (every grouped
image with another image of its group) get the preset's query-side tokens (``<locals>-query``:
ALIKED 300 keypoints at 512 px; Lite0 100 tokens at each of 384/512/768 px), ingested (plain codes)
and extracted as ``needle query --image`` does (keeping the float ITQ projections that asymmetric
matching scores). One token kind per run (and per ``--workdir``): run it once per kind to compare
them.

Cross-validation over instance groups: the queries are split into ``--folds`` folds by group (every
query of a group in one fold); each fold is scored with the settings and λ chosen on the other
folds' queries, never on its own. Every variant is a row of ``variants`` (mAP@1k, ms/query,
bytes/image, what each fold chose):

* SP as before issue 21 (plain Hamming, single-match hypotheses; threshold and LO per fold);
* + two-match (rotation-aware) hypotheses; asymmetric matching; both (threshold 28/32 per fold);
* the defaults (``RerankConfig()``: asymmetric, the kind's threshold, pair hypotheses, the
  ensemble's floor and Chamfer term), λ per fold; and every SP setting of this issue chosen per
  fold, floor or none included, SP alone (``sp, all settings per fold``);
* the defaults followed by α-QE over the verified top and a second scoring of the shortlist;
* the defaults with other query-side tokens (no storage cost; ``QUERY_TOKEN_VARIANTS`` of the kind);
* Chamfer plain and asymmetric; AMES trained here on distractor pairs (``--skip-ames`` to leave out).

Held out by source (issue 37, bench/rerank_sources.py; the headline): every setting of
``HELD_OUT_GRID`` x the kind's query-token sets (λ, threshold, pair hypotheses, floor, Chamfer
term, α-QE) is
chosen on the other image sources' queries and scored on the held-out source's:
``gain_source_held_out`` (pooled per query), ``by_source_held_out`` (per source: queries,
global-only, the defaults in-sample, held out, the setting chosen), ``defaults_in_sample`` and
``consensus_setting`` (the setting most folds chose: what the defaults should be).

Prints the table and one JSON line last (also written to ``--out``): ``map_at_1k`` (global, SP as
before, the defaults, ...), ``gain`` (the defaults over global-only, λ per group fold), ``gain_nested``,
``rerank_ms_per_query`` (the defaults: 1,000 candidates x 100 binary tokens, gathering included,
timed in the same run; torch threads from OMP_NUM_THREADS), ``local_bytes_per_image``, ``variants``,
a curve of mAP against tokens per database image, and ``by_source``: global-only and the defaults'
mAP@1k per image source of realbench (where re-ranking pays and where it does not).

    OMP_NUM_THREADS=2 python bench/rerank.py [--locals lite0-s16|aliked-n16] [--workdir DIR] [--reuse]
        [--skip-ames] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# This file is named like the `rerank` package: keep its own directory off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from embed.local_presets import DEFAULT_LOCALS  # noqa: E402  (torch-free: the registry of presets)


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

K = 1000
SHORTLIST = 1000
TIMED_TOKENS = 100  # the timed setting: 100 binary tokens per database image
TOKEN_CURVE = (25, 50, 100, 200)
SP_MAX_HAMMING = (32, 40)  # Hamming thresholds and ...
SP_LO_ITERATIONS = (0, 3)  # ... affine refinements tried for SP as before issue 21
LAMBDAS = tuple(np.round(np.linspace(0.0, 1.0, 21), 3))
PAIR_SEEDS = 8  # two-match (rotation-aware) hypotheses among each candidate's 8 closest matches
ASYMMETRIC_MAX_DISTANCE = (28, 32)  # weighted-Hamming thresholds tried with asymmetric matching
FLOORS = (0.0, 99.5)  # the shortlist's chance floor of inliers: none, or its 99.5th percentile
# SP's Chamfer term (EnsembleConfig.chamfer_weight): the weight of the candidates' Chamfer similarity
# added to the ensemble (free: SP's matching computes the distances), none or one of these
CHAMFER_WEIGHTS = (0.0, 0.15, 0.3, 0.5)
# Query expansion after verification: (results looked at, inliers needed, alpha) tried per fold
QE_GRID = tuple((top, inliers, alpha) for top in (1, 2, 3, 5) for inliers in (5, 10, 20) for alpha in (0.0, 3.0))
# Query-side token variants (no storage cost) by token kind: (name, scales, tokens per scale); the
# defaults are embed.local_presets.RERANK_BY_KIND (Lite0 100 at each of 0.75/1/1.5, ALIKED 300 at 1).
QUERY_TOKEN_VARIANTS = {
    "cnn": (("query_5_scales", (0.5, 0.75, 1.0, 1.5, 2.0), 100), ("query_150_per_scale", (0.75, 1.0, 1.5), 150)),
    "aliked": (("query_200", (1.0,), 200), ("query_500", (1.0,), 500)),
}
# The distractor sample each token kind's ITQ projection is learned from: (every how many-th
# distractor shard of the 7 of ~217 images, tokens per image). ALIKED's keypoints: shards 0, 3 and
# 6 at 300 per image (~150k descriptors; on 2 shards x 100 its re-ranking read 2-3 mAP lower).
# Lite0's tokens: their stored 100 per image of every shard (from the top 300 of every third its
# defaults read 53.6 instead of 56.4: weak tokens are not what it stores).
ITQ_SAMPLE = {"aliked": (3, 300), "cnn": (1, 100)}
# Leave-one-source-out validation (issue 37): every setting of this grid (x the kind's query-token
# sets) is chosen on the other sources' queries and scored on the held-out source's.
HELD_OUT_GRID = {
    "max_hamming": ASYMMETRIC_MAX_DISTANCE,
    "pair_seeds": (0, PAIR_SEEDS),
    "floors": FLOORS,
    "chamfers": CHAMFER_WEIGHTS,
    "qe": (None, *QE_GRID),
    "lambdas": LAMBDAS,
}
BYTES_PER_TOKEN = 23  # the local store's record (index/locals.py); + 8 B of offset per image

log = logging.getLogger("bench.rerank")


def ingest_all(
    work: Path, db_tokens: int, itq_from_distractors: bool, locals_preset: str, cpus_per_worker: int = 2
) -> str | None:
    """Ingest the database and the queries; returns the ITQ file used (None: the shipped one).

    With ``itq_from_distractors`` the ITQ projection is first learned from the distractors' local
    descriptors (a sample of the database, never the queries), as a user learns it on a sample of
    their own collection (here the token kind's ``ITQ_SAMPLE`` of the distractor shards)."""
    import ray

    from cluster.ingest_job import main as ingest
    from embed.local_presets import get_local_preset
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

    from embed.locals import build_local_extractor
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


def map_by_source(
    lists: list[dict],
    vq: list,
    folds: list[np.ndarray],
    chosen: list[dict],
    source: dict,
    vectors: list | None = None,
    expansion=None,
    chamfer_weight: float = 0.0,
) -> dict:
    """Global-only and re-ranked mAP@K per image source of realbench (each query re-ranked with the
    λ its fold was scored with, then expanded with ``expansion`` where given): where re-ranking pays
    and where it does not."""
    from rerank.ensemble import EnsembleConfig, ap_of_order

    rows: dict[str, list[tuple[float, float]]] = {}
    for f, fold in enumerate(folds):
        conf = EnsembleConfig(lam=chosen[f]["lam"], chamfer_weight=chamfer_weight)
        for i in fold:
            q = vq[i]
            order = sp_order(q, conf, expansion, None if vectors is None else vectors[i])
            aps = (ap_of_order(q.positive, q.n_positives, K), ap_of_order(q.positive[order], q.n_positives, K))
            rows.setdefault(source[lists[i]["key"]], []).append(aps)
    return {
        name: {
            "queries": len(aps),
            "global": round(100 * float(np.mean([a[0] for a in aps])), 2),
            "sp_default": round(100 * float(np.mean([a[1] for a in aps])), 2),
        }
        for name, aps in sorted(rows.items())
    }


def sp_order(q, conf, expansion=None, vectors: tuple | None = None) -> np.ndarray:
    """Validation query ``q``'s shortlist order by SP and its global score mixed with ensemble
    ``conf``; with ``expansion``, α-QE over the verified top (``vectors``: the query's and the
    shortlist's global vectors) and the order again by the expanded query's scores."""
    from rerank.ensemble import combine, rerank_order
    from rerank.expand import expanded_scores

    order = rerank_order(combine("sp", q.s_global, q.raw_local, q.has_locals, conf, q.chamfer), q.rows)
    if expansion is None:
        return order
    s_qe = expanded_scores(vectors[0], vectors[1], order, q.raw_local, expansion)
    if s_qe is None:
        return order
    return rerank_order(combine("sp", s_qe, q.raw_local, q.has_locals, conf, q.chamfer), q.rows)


def qe_cross_validated(
    lists: list[dict],
    vq: list,
    vectors: list,
    folds: list[np.ndarray],
    settings: list | None = None,
    chamfer_weight: float = 0.0,
) -> tuple[float, list[dict]]:
    """mAP@K of the default SP followed by α-QE over the verified top and a second global scoring of
    the shortlist, every (λ, QE setting of ``settings`` (ExpansionConfig or None: none); default
    none and every one of QE_GRID) chosen on the other folds."""
    from rerank.ensemble import EnsembleConfig, ap_of_order
    from rerank.expand import ExpansionConfig

    def fold_map(idx, lam, qe):
        conf = EnsembleConfig(lam=lam, chamfer_weight=chamfer_weight)
        aps = [ap_of_order(vq[i].positive[sp_order(vq[i], conf, qe, vectors[i])], vq[i].n_positives, K) for i in idx]
        return 100.0 * float(np.mean(aps))

    if settings is None:
        settings = [None] + [ExpansionConfig(top=t, min_inliers=m, alpha=a) for t, m, a in QE_GRID]
    total, chosen = 0.0, []
    for f, fold in enumerate(folds):
        others = np.concatenate([g for j, g in enumerate(folds) if j != f])
        best = None
        for qe in settings:
            for lam in LAMBDAS:
                value = fold_map(others, float(lam), qe)
                if best is None or value > best[2] + 1e-12:
                    best = (float(lam), qe, value)
        total += fold_map(fold, best[0], best[1]) * len(fold)
        qe = best[1]
        chosen.append(
            {
                "lam": best[0],
                "qe": None if qe is None else [qe.top, qe.min_inliers, qe.alpha],
                "validation_map": round(best[2], 2),
            }
        )
    return total / sum(len(f) for f in folds), chosen


def expansion_ms(index, lists: list[dict], vq: list, conf, ensemble) -> float:
    """Mean time per query (ms) of the query path's α-QE after SP (query.retrieve's
    ``expanded_global_scores``: the verified results' vectors and the shortlist's second scoring,
    read from the index as a query does), on the first order of ``ensemble`` (the kind's defaults)."""
    from query.retrieve import expanded_global_scores
    from rerank.ensemble import combine, rerank_order

    seconds = 0.0
    for e, q in zip(lists, vq):
        rows = np.asarray(e["rows"][:SHORTLIST], np.int64)
        n = len(rows)
        s_first = np.asarray(q.s_global[:n], np.float64)
        chamfer = None if q.chamfer is None else q.chamfer[:n]
        order = rerank_order(combine("sp", s_first, q.raw_local[:n], q.has_locals[:n], ensemble, chamfer), rows)
        xq = np.asarray(index.vector_of(e["key"]), np.float32)[None]
        start = time.perf_counter()
        expanded_global_scores(
            index, xq, {0: rows}, {0: s_first}, {0: q.raw_local[:n].astype(np.int64)}, {0: order}, conf
        )
        seconds += time.perf_counter() - start
    return 1000.0 * seconds / len(lists)


def validation_queries(lists: list[dict], scores: list, shortlist: int):
    """Each query's ValidationQuery from its shortlist and its local scores (``local_scores``)."""
    from rerank.ensemble import ValidationQuery

    out = []
    for entry, local in zip(lists, scores):
        raw = local.raw
        n = len(raw)
        # Past the shortlist the global order stays: those candidates get no local score and
        # are placed below every shortlisted one (a score below any ensemble score).
        has = np.zeros(len(entry["rows"]), bool)
        has[:n] = True
        s_global = np.where(has, entry["s_global"], entry["s_global"] - 10.0)
        full_raw = np.zeros(len(entry["rows"]))
        full_raw[:n] = raw
        chamfer = None
        if local.chamfer is not None:
            chamfer = np.zeros(len(entry["rows"]))
            chamfer[:n] = local.chamfer
        out.append(
            ValidationQuery(entry["rows"], s_global, full_raw, has, entry["positive"], entry["n_positives"], chamfer)
        )
    return out


def cross_validated_map(
    vq: list, folds: list[np.ndarray], method: str, gammas=(1.0,), chamfer_weight: float = 0.0
) -> tuple[float, list[dict]]:
    """mAP@K over all queries, each fold scored with the (λ, γ) chosen on the other folds (SP with
    ``chamfer_weight``'s Chamfer term)."""
    from rerank.ensemble import grid_search, mean_ap

    total, chosen = 0.0, []
    for f, fold in enumerate(folds):
        train = [vq[i] for i in np.concatenate([g for j, g in enumerate(folds) if j != f])]
        conf, val_map = grid_search(train, method, K, LAMBDAS, gammas, chamfer_weight=chamfer_weight)
        total += mean_ap([vq[i] for i in fold], method, conf, K) * len(fold)
        chosen.append({"lam": conf.lam, "gamma": conf.gamma, "validation_map": round(val_map, 2)})
    return total / sum(len(f) for f in folds), chosen


def group_folds(lists: list[dict], groups: dict[str, str], n: int = 2) -> list[np.ndarray]:
    """Queries split into ``n`` folds by instance group (every query of a group in one fold)."""
    names = sorted({groups[e["key"]] for e in lists})
    fold_of = {g: i % n for i, g in enumerate(names)}
    return [np.array([i for i, e in enumerate(lists) if fold_of[groups[e["key"]]] == f]) for f in range(n)]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", help="keep tars, descriptors, index and AMES here (default: a temp dir)")
    parser.add_argument(
        "--locals", default=DEFAULT_LOCALS, choices=("lite0-s16", "aliked-n16"), help="database token preset"
    )
    parser.add_argument("--db-tokens", type=int, default=max(TOKEN_CURVE), help="tokens stored per database image")
    parser.add_argument("--folds", type=int, default=5, help="cross-validation folds over the instance groups")
    parser.add_argument("--ames-epochs", type=int, default=10)
    parser.add_argument(
        "--ames-shortlist", type=int, default=100, help="AMES re-ranks this many (its CPU cost is per pair)"
    )
    parser.add_argument("--skip-ames", action="store_true")
    parser.add_argument(
        "--cpus-per-worker",
        type=int,
        default=2,
        help="ingestion: CPUs (torch threads) per Ray worker; 1 on a busy shared machine (no thread barrier "
        "stalls), the tokens are the same",
    )
    parser.add_argument(
        "--glue",
        default="",
        help="also verify the top with LightGlue, candidates' descriptors from these sources (codes,images; "
        "bench/rerank_glue.py)",
    )
    parser.add_argument("--glue-tops", default="5,10,20", help="the second stage's N: its curve's points")
    parser.add_argument(
        "--glue-keypoints",
        type=int,
        help="--glue images: re-extract this many keypoints per candidate, and as many for the query "
        "(default: the database preset's 100 and the query's 300)",
    )
    parser.add_argument("--reuse", action="store_true", help="reuse descriptors/index/AMES already in --workdir")
    parser.add_argument(
        "--shipped-itq",
        action="store_true",
        help="binarise with the shipped ITQ projection instead of one learned from the distractors",
    )
    parser.add_argument("--out", help="also write the JSON result here (e.g. bench/results/rerank_realbench.json)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from embed.local_presets import get_local_preset
    from eval.evaluate import read_query_tokens
    from index.build import IndexConfig
    from index.build import main as build_index
    from index.search import load_index
    from rerank.ensemble import ap_of_order
    from rerank.expand import ExpansionConfig
    from rerank.matching import MatchConfig
    from rerank.rerank import RerankConfig, Reranker, with_kind_defaults

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="needle-rerank-")
    work = Path(args.workdir or tmp.name)
    rows, _ = pack_realbench(REALBENCH, work / "shards")
    itq = None if args.shipped_itq else str(work / "itq_distractors.npz")
    if not (args.reuse and (work / "index" / "index_infos.json").is_file()):
        itq = ingest_all(work, args.db_tokens, not args.shipped_itq, args.locals, args.cpus_per_worker)
        build_index(IndexConfig(kind="flat"), work / "desc", work / "index")
    index = load_index(work / "index")
    queries = [q for q in row_queries(rows) if q["positives"]]
    groups = {r["key"]: r["group"] for r in rows}
    lists, global_ms = shortlists(index, queries)
    folds = group_folds(lists, groups, args.folds)
    query_tokens = read_query_tokens(work / "desc_q", [q["key"] for q in queries])
    images = {r["key"]: r["image"] for r in rows}
    proj_tokens = query_tokens_with_projections(work, lists, images, itq, args.locals)
    token_sets = {"ingested": query_tokens, "image": proj_tokens}

    global_map = 100.0 * float(np.mean([ap_of_order(e["positive"], e["n_positives"], K) for e in lists]))
    oracle = 100.0 * float(np.mean([min(K, int(e["positive"].sum())) / min(K, e["n_positives"]) for e in lists]))
    log.info(
        "global mAP@1k %.2f (oracle of the top-%d: %.2f), global search %.2f ms/query", global_map, K, oracle, global_ms
    )
    bytes_per_image = TIMED_TOKENS * BYTES_PER_TOKEN + 8
    result: dict = {
        "map_at_1k": {"global": round(global_map, 2)},
        "n_queries": len(lists),
        "oracle_top1k": round(oracle, 2),
    }

    cache: dict[tuple[str, str], tuple[list, float]] = {}  # one scoring pass per (query tokens, setting)

    kind = get_local_preset(args.locals).kind
    ensemble = with_kind_defaults(RerankConfig(), kind).ensemble  # the kind's defaults: λ, floor, Chamfer term

    def scored(tokens_name: str, conf) -> tuple[list, float]:
        conf = with_kind_defaults(conf, kind)  # what the defaults leave open: the token kind's own
        key = (tokens_name, _describe(conf))
        if key not in cache:
            reranker = Reranker(conf)
            first = lists[0]  # warm-up (tables, allocations), untimed
            reranker.local_scores(
                token_sets[tokens_name][first["key"]],
                index.local_store.batch(index.positions_of_rows(first["rows"][:SHORTLIST]), TIMED_TOKENS),
            )
            raws, ms = local_scores(index, reranker, lists, token_sets[tokens_name], TIMED_TOKENS)
            cache[key] = (validation_queries(lists, raws, SHORTLIST), ms)
            log.info("%s on %s query tokens: %.1f ms/query", key[1], tokens_name, ms)
        return cache[key]

    def sp_row(name: str, tokens_name: str, options: list[dict], floors=(0.0,), timed: dict | None = None) -> dict:
        """A variant: SP settings (``options``) x floors, one chosen per fold with λ."""
        runs = {}
        for option in options:
            vq, ms = scored(tokens_name, _sp_config(option))
            for floor in floors:
                runs[f"{_describe(with_kind_defaults(_sp_config(option), kind))},floor={floor}"] = (vq, ms, floor)
        value, chosen = _cv_over_settings(runs, folds, ensemble)
        timed_conf = _sp_config(timed if timed is not None else options[-1])
        row = {
            "name": name,
            "map_at_1k": round(value, 2),
            "ms_per_query": round(scored(tokens_name, timed_conf)[1], 1),
            "bytes_per_image": bytes_per_image,
            "chosen_on_validation": chosen,
        }
        log.info("%s: mAP@1k %.2f", name, value)
        return row

    # SP as before this issue: plain Hamming distances, single-match hypotheses, no floor.
    plain = {"match": {"asymmetric": False}, "spatial": {"pair_seeds": 0}}
    before = [
        {"match": {"asymmetric": False, "max_distance": d}, "spatial": {"pair_seeds": 0, "lo_iterations": lo}}
        for d in SP_MAX_HAMMING
        for lo in SP_LO_ITERATIONS
    ]
    asym = [{"match": {"max_distance": d}} for d in ASYMMETRIC_MAX_DISTANCE]
    variants = [
        sp_row("SP as before (plain Hamming, single-match hypotheses; threshold 32/40, LO 0/3)", "ingested", before),
        sp_row(
            "+ two-match (rotation-aware) hypotheses",
            "ingested",
            [{"match": plain["match"], "spatial": {"pair_seeds": PAIR_SEEDS}}],
        ),
        sp_row(
            "asymmetric matching (float query vs 128-bit codes; threshold 28/32)",
            "image",
            [dict(o, spatial={"pair_seeds": 0}) for o in asym],
            timed={"spatial": {"pair_seeds": 0}},
        ),
        sp_row("asymmetric + two-match hypotheses (threshold 28/32)", "image", asym, timed={}),
        sp_row(
            "defaults (RerankConfig()): asymmetric + two-match, the ensemble's (λ per fold; its floor and Chamfer "
            "term)" + (", before α-QE" if with_kind_defaults(RerankConfig(), kind).expansion.top else ""),
            "image",
            [{}],
            floors=(None,),
        ),
        sp_row(
            "SP, all settings of this issue per fold (asymmetric, threshold 28/32, pairs 0/8, floor none/99.5)",
            "image",
            [dict(o, spatial={"pair_seeds": p}) for o in asym for p in (0, PAIR_SEEDS)],
            floors=FLOORS,
            timed={},
        ),
    ]
    result["map_at_1k"]["sp"] = variants[0]["map_at_1k"]
    default_map = variants[4]["map_at_1k"]  # the defaults' SP; with α-QE below where that is a default
    result["map_at_1k"]["sp_nested"] = nested_map = variants[5]["map_at_1k"]
    default_vq, rerank_ms = scored("image", RerankConfig(method="sp"))

    vectors = [
        (
            np.asarray(index.vector_of(e["key"]), np.float64),
            np.asarray(index.vectors[index.positions_of_rows(e["rows"])], np.float64),
        )
        for e in lists
    ]
    # α-QE is part of the defaults where the token kind's is on (embed.local_presets.RERANK_BY_KIND)
    kind_qe = with_kind_defaults(RerankConfig(), kind).expansion
    top, min_inliers = kind_qe.top, kind_qe.min_inliers
    qe_ms = expansion_ms(index, lists, default_vq, kind_qe if top else ExpansionConfig(top=5), ensemble)
    if top:
        result["map_at_1k"]["sp_default_no_qe"] = default_map
        default_map, chosen = qe_cross_validated(
            lists, default_vq, vectors, folds, [kind_qe], chamfer_weight=ensemble.chamfer_weight
        )
        rerank_ms += qe_ms
        variants.append(
            {
                "name": f"defaults (RerankConfig()): the above + α-QE, mean of the top {top} with >= {min_inliers} "
                "inliers, second scoring of the shortlist",
                "map_at_1k": round(default_map, 2),
                "ms_per_query": round(rerank_ms, 1),
                "bytes_per_image": bytes_per_image,
                "chosen_on_validation": chosen,
            }
        )
    result["map_at_1k"]["sp_default"] = round(default_map, 2)
    result["by_source"] = map_by_source(
        lists,
        default_vq,
        folds,
        (variants[-1] if top else variants[4])["chosen_on_validation"],
        realbench_sources(rows),
        vectors,
        kind_qe if top else None,
        ensemble.chamfer_weight,
    )
    qe_map, qe_chosen = qe_cross_validated(lists, default_vq, vectors, folds, chamfer_weight=ensemble.chamfer_weight)
    variants.append(
        {
            "name": "the defaults' SP + α-QE chosen per fold (none, or top 1-5, >= 5-20 inliers, alpha 0/3)",
            "map_at_1k": round(qe_map, 2),
            "ms_per_query": round(variants[4]["ms_per_query"] + qe_ms, 1),
            "bytes_per_image": bytes_per_image,
            "chosen_on_validation": qe_chosen,
        }
    )
    result["map_at_1k"]["sp_qe_per_fold"] = round(qe_map, 2)
    if top:  # the expansion is a default: the nested number chooses it (or none) per fold too
        nested_map = qe_map

    for name, scales, top_k in QUERY_TOKEN_VARIANTS[kind]:
        token_sets[name] = query_tokens_with_projections(work, lists, images, itq, args.locals, scales, top_k)
    result.update(held_out_by_source(scored, lists, vectors, realbench_sources(rows), kind))
    if args.glue:
        glue_queries = token_sets["image"]
        if args.glue_keypoints:  # the query's keypoints as many as the re-extracted candidates'
            glue_queries = query_tokens_with_projections(
                work, lists, images, itq, args.locals, (1.0,), args.glue_keypoints
            )
        result["glue"] = glue_by_source(
            scored, lists, vectors, realbench_sources(rows), result, index, glue_queries, itq, work, args
        )

    # Query-side tokens cost no storage: more scales or more tokens per scale, the defaults otherwise.
    for name, scales, top_k in QUERY_TOKEN_VARIANTS[get_local_preset(args.locals).kind]:
        token_sets[name] = query_tokens_with_projections(work, lists, images, itq, args.locals, scales, top_k)
        vq, ms = scored(name, RerankConfig(method="sp"))
        value, chosen = cross_validated_map(vq, folds, "sp", chamfer_weight=ensemble.chamfer_weight)
        variants.append(
            {
                "name": f"defaults, query tokens {top_k} at each of {len(scales)} scales {scales}",
                "map_at_1k": round(value, 2),
                "ms_per_query": round(ms, 1),
                "bytes_per_image": bytes_per_image,
                "chosen_on_validation": chosen,
            }
        )

    for name, tokens_name, conf in (
        ("Chamfer (plain Hamming)", "ingested", RerankConfig(method="chamfer", match=MatchConfig(asymmetric=False))),
        ("Chamfer, asymmetric", "image", RerankConfig(method="chamfer")),
    ):
        vq, ms = scored(tokens_name, conf)
        value, chosen = cross_validated_map(vq, folds, "chamfer")
        variants.append(
            {
                "name": name,
                "map_at_1k": round(value, 2),
                "ms_per_query": round(ms, 1),
                "bytes_per_image": bytes_per_image,
                "chosen_on_validation": chosen,
            }
        )
    result["map_at_1k"]["chamfer"] = variants[-2]["map_at_1k"]
    result["map_at_1k"]["chamfer_asymmetric"] = variants[-1]["map_at_1k"]

    curve = []
    default_reranker = Reranker(RerankConfig(method="sp"), kind)
    for n in TOKEN_CURVE:
        if n > args.db_tokens:
            continue
        if n == TIMED_TOKENS:
            vq, ms = default_vq, rerank_ms
        else:
            raws, ms = local_scores(index, default_reranker, lists, proj_tokens, n)
            vq = validation_queries(lists, raws, SHORTLIST)
        value, _ = cross_validated_map(vq, folds, "sp", chamfer_weight=ensemble.chamfer_weight)
        curve.append(
            {
                "tokens": n,
                "bytes_per_image": n * BYTES_PER_TOKEN + 8,
                "map_at_1k_sp_default": round(value, 2),
                "rerank_ms_per_query": round(ms, 1),
            }
        )

    if not args.skip_ames:
        ckpt = work / "ames.pt"
        if not (args.reuse and ckpt.is_file()):
            ckpt = train_ames(work, args.ames_epochs, itq, args.locals)
        ames = Reranker(RerankConfig(method="ames", ames=str(ckpt), shortlist=args.ames_shortlist), kind)
        # AMES was trained on single-scale database tokens: the query uses its stored ones too.
        stored = {e["key"]: index.local_store.tokens(index.position_of(e["key"])) for e in lists}
        raws, ames_ms = local_scores(index, ames, lists, stored, TIMED_TOKENS, args.ames_shortlist)
        ames_map, chosen = cross_validated_map(
            validation_queries(lists, raws, args.ames_shortlist), folds, "ames", gammas=(0.1, 0.25, 0.5, 1.0, 2.0)
        )
        result["map_at_1k"]["ames"] = round(ames_map, 2)
        variants.append(
            {
                "name": f"AMES trained here (distractor pairs), top {args.ames_shortlist}",
                "map_at_1k": round(ames_map, 2),
                "ms_per_query": round(ames_ms, 1),
                "bytes_per_image": bytes_per_image,
                "chosen_on_validation": chosen,
            }
        )
        result["ames_shortlist"] = args.ames_shortlist

    result.update(
        {
            # the defaults' gain (λ per fold): the number the target is about; not the best row,
            # which would be a choice made on the test folds
            "gain": round(default_map - global_map, 2),
            "gain_nested": round(nested_map - global_map, 2),
            "expansion_ms_per_query": round(qe_ms, 2),
            "rerank_ms_per_query": round(rerank_ms, 1),
            "rerank_setting": f"defaults ({_describe(with_kind_defaults(RerankConfig(method='sp'), kind))}, "
            f"expansion top {top}) on "
            f"{SHORTLIST} candidates x "
            f"{TIMED_TOKENS} binary tokens, query {len(next(iter(proj_tokens.values())))} float tokens, "
            f"{torch.get_num_threads()} threads, gathering the tokens included",
            "local_bytes_per_image": bytes_per_image,
            "global_search_ms_per_query": round(global_ms, 2),
            "folds": args.folds,
            "locals": args.locals,
            "itq": "learned on the distractors' tokens" if itq else "shipped (demo photos)",
            "store_bytes_per_image": index.infos["locals"]["bytes_per_image"],
            "variants": variants,
            "curve": curve,
            "targets": {"gain": 10.0, "rerank_ms_per_query": 100.0, "local_bytes_per_image": 2500},
        }
    )
    if tmp is not None:
        tmp.cleanup()
    print_table(result)
    line = json.dumps(result)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)


def held_out_by_source(scored, lists: list[dict], vectors: list, source: dict, kind: str) -> dict:
    """Leave-one-source-out validation (bench/rerank_sources.py) over HELD_OUT_GRID x the kind's
    query-token sets, each pass scored by ``scored`` (main's cache of scoring passes)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_rerank_sources", ROOT / "bench" / "rerank_sources.py")
    sources_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sources_module)

    def one_pass(tokens: str, max_hamming: int, pair_seeds: int) -> tuple[list, float]:
        return scored(
            tokens, _sp_config({"match": {"max_distance": max_hamming}, "spatial": {"pair_seeds": pair_seeds}})
        )

    grid = dict(HELD_OUT_GRID, tokens=("image", *(v[0] for v in QUERY_TOKEN_VARIANTS[kind])))
    return sources_module.bench_report(one_pass, lists, vectors, source, kind, grid, K)


def glue_by_source(scored, lists, vectors, source, held_out, index, query_tokens, itq, work, args) -> dict:
    """The LightGlue second stage over the held-out first stages (bench/rerank_glue.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_rerank_glue", ROOT / "bench" / "rerank_glue.py")
    glue = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(glue)

    def vq_of(setting: dict) -> list:
        option = {"match": {"max_distance": setting["max_hamming"]}, "spatial": {"pair_seeds": setting["pair_seeds"]}}
        return scored(setting["tokens"], _sp_config(option))[0]

    return glue.glue_report(
        vq_of,
        vectors,
        lists,
        source,
        held_out,
        index,
        query_tokens,
        itq,
        work,
        args.locals,
        args.glue.split(","),
        tuple(int(n) for n in args.glue_tops.split(",")),
        args.glue_keypoints,
    )


def print_table(result: dict) -> None:
    """The variants as a Markdown table (docs/results.md's)."""
    g = result["map_at_1k"]["global"]
    print("| variant | mAP@1k | gain | ms/query | bytes/image |")
    print("|---|---|---|---|---|")
    print(f"| global only | {g:.2f} | | {result['global_search_ms_per_query']:.2f} (search) | |")
    for v in result["variants"]:
        print(
            f"| {v['name']} | {v['map_at_1k']:.2f} | {v['map_at_1k'] - g:+.2f} | {v['ms_per_query']:.0f} "
            f"| {v['bytes_per_image']:,} |"
        )


def _sp_config(option: dict):
    """A RerankConfig for SP from the defaults with ``option``'s match/spatial fields replaced."""
    from rerank.matching import MatchConfig
    from rerank.rerank import RerankConfig
    from rerank.spatial import SpatialConfig

    return RerankConfig(
        method="sp", match=MatchConfig(**option.get("match", {})), spatial=SpatialConfig(**option.get("spatial", {}))
    )


def _describe(conf) -> str:
    m, s = conf.match, conf.spatial
    if conf.method != "sp":
        return f"{conf.method},max_hamming={m.threshold},asymmetric={m.asymmetric}"
    return (
        f"max_hamming={m.threshold},asymmetric={m.asymmetric},pair_seeds={s.pair_seeds},lo_iterations={s.lo_iterations}"
    )


def _cv_over_settings(runs: dict, folds: list[np.ndarray], defaults) -> tuple[float, list[dict]]:
    """Cross-validated SP mAP choosing both a run (a scoring setting and a floor: None the
    ensemble's ``defaults``, the kind's Chamfer term included; a floor: SP alone) and λ on the other
    folds' queries, never on the fold scored."""
    from rerank.ensemble import grid_search, mean_ap

    total, chosen = 0.0, []
    for f, fold in enumerate(folds):
        others = np.concatenate([g for j, g in enumerate(folds) if j != f])
        best = None
        for setting, (vq, _, floor) in runs.items():
            # floor None: the ensemble's defaults (its floor and Chamfer term); else that floor, SP alone
            chamfer_weight = defaults.chamfer_weight if floor is None else 0.0
            floor = defaults.inlier_floor if floor is None else floor
            conf, value = grid_search(
                [vq[i] for i in others], "sp", K, LAMBDAS, inlier_floor=floor, chamfer_weight=chamfer_weight
            )
            if best is None or value > best[2] + 1e-12:
                best = (setting, conf, value)
        setting, conf, value = best
        total += mean_ap([runs[setting][0][i] for i in fold], "sp", conf, K) * len(fold)
        chosen.append({"setting": setting, "lam": conf.lam, "validation_map": round(value, 2)})
    return total / sum(len(f) for f in folds), chosen


if __name__ == "__main__":
    main()
