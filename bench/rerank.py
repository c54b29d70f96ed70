"""Re-ranking on real photos: ``../shared/data/realbench`` through ingestion (globals + local tokens),
the exact index and the local store, then re-ranking of each query's global top-1000.

The database holds every image (the 132 grouped ones and the 1,518 distractors) with the default
database tokens (``lite0-s16``: Lite0's stride-16 stage at 512 px, 128-bit ITQ codes) kept up to
``--db-tokens`` per image; the queries (every grouped image with another image of its group) are
ingested again with the query-side preset (``lite0-s16-query``: 100 tokens at each of 384/512/768
px). Ensemble weights (and SP's Hamming threshold) are chosen by grid search on validation
queries, never on the queries they are tested on: 2-fold cross-validation over the instance
groups, so every query is scored with settings chosen on the other half of the groups. AMES is
trained here on pairs made from the distractors only (random homographies, photometric changes)
and re-ranks the global top ``--ames-shortlist``.

Prints one JSON line last: ``map_at_1k`` for global-only, +SP, +Chamfer, +AMES and the best,
``gain``, ``rerank_ms_per_query`` (1,000 candidates x 100 binary tokens, timed in the same run as
the global search), ``local_bytes_per_image`` and a curve of mAP against tokens per database image.

    python bench/rerank.py [--workdir DIR] [--ames-epochs N] [--skip-ames]
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
SP_LO_ITERATIONS = (0, 3)  # ... affine refinements tried; chosen per fold on the other fold's queries
LAMBDAS = tuple(np.round(np.linspace(0.0, 1.0, 21), 3))

log = logging.getLogger("bench.rerank")


def ingest_all(work: Path, db_tokens: int, itq_from_distractors: bool) -> str | None:
    """Ingest the database and the queries; returns the ITQ file used (None: the shipped one).

    With ``itq_from_distractors`` the ITQ projection is first learned from the distractors' local
    descriptors (a sample of the database, never the queries), as a user learns it on a sample of
    their own collection."""
    import ray

    from cluster.ingest_job import IngestConfig
    from cluster.ingest_job import main as ingest
    from embed.train_itq import TrainITQConfig
    from embed.train_itq import main as train_itq

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    itq = None
    try:
        if itq_from_distractors:
            sample = IngestConfig(locals="lite0-s16", local_itq="none", keep_local_desc=True, overwrite=True)
            distractor_shards = sorted(str(p) for p in (work / "shards").glob("*.tar") if p.stem != GROUPED_SHARD)
            ingest(sample, distractor_shards, work / "desc_itq")
            itq = str(train_itq(TrainITQConfig(), work / "desc_itq", work / "itq_distractors.npz"))
        ingest(
            IngestConfig(locals="lite0-s16", local_top_k=db_tokens, local_itq=itq, overwrite=True),
            str(work / "shards" / "*.tar"),
            work / "desc",
        )
        ingest(
            IngestConfig(locals="lite0-s16-query", local_itq=itq, overwrite=True),
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
) -> tuple[list[np.ndarray], float]:
    """Raw local scores of every query's shortlist, and the mean time per query (ms) of gathering
    the candidates' tokens and scoring them."""
    raws, seconds = [], 0.0
    for entry in lists:
        start = time.perf_counter()
        candidates = index.local_store.batch(index.positions_of_rows(entry["rows"][:shortlist]), db_tokens)
        raws.append(reranker.local_scores(query_tokens[entry["key"]], candidates).raw)
        seconds += time.perf_counter() - start
    return raws, 1000.0 * seconds / len(lists)


def validation_queries(lists: list[dict], raws: list[np.ndarray], shortlist: int):
    from rerank.ensemble import ValidationQuery

    out = []
    for entry, raw in zip(lists, raws):
        n = len(raw)
        # Past the shortlist the global order stays: those candidates get no local score and
        # are placed below every shortlisted one (a score below any ensemble score).
        has = np.zeros(len(entry["rows"]), bool)
        has[:n] = True
        s_global = np.where(has, entry["s_global"], entry["s_global"] - 10.0)
        full_raw = np.zeros(len(entry["rows"]))
        full_raw[:n] = raw
        out.append(ValidationQuery(entry["rows"], s_global, full_raw, has, entry["positive"], entry["n_positives"]))
    return out


def cross_validated_map(vq: list, folds: list[np.ndarray], method: str, gammas=(1.0,)) -> tuple[float, list[dict]]:
    """mAP@K over all queries, each fold scored with the (λ, γ) chosen on the other folds."""
    from rerank.ensemble import grid_search, mean_ap

    total, chosen = 0.0, []
    for f, fold in enumerate(folds):
        train = [vq[i] for i in np.concatenate([g for j, g in enumerate(folds) if j != f])]
        conf, val_map = grid_search(train, method, K, LAMBDAS, gammas)
        total += mean_ap([vq[i] for i in fold], method, conf, K) * len(fold)
        chosen.append({"lam": conf.lam, "gamma": conf.gamma, "validation_map": round(val_map, 2)})
    return total / sum(len(f) for f in folds), chosen


def group_folds(lists: list[dict], groups: dict[str, str], n: int = 2) -> list[np.ndarray]:
    """Queries split into ``n`` folds by instance group (every query of a group in one fold)."""
    names = sorted({groups[e["key"]] for e in lists})
    fold_of = {g: i % n for i, g in enumerate(names)}
    return [np.array([i for i, e in enumerate(lists) if fold_of[groups[e["key"]]] == f]) for f in range(n)]


def train_ames(work: Path, epochs: int, itq: str | None) -> Path:
    from cluster.ingest_job import IngestConfig, make_local_extractor
    from rerank.ames_train import TrainConfig
    from rerank.ames_train import main as train

    extractor = make_local_extractor(IngestConfig(locals="lite0-s16", local_itq=itq))
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
    parser.add_argument("--db-tokens", type=int, default=max(TOKEN_CURVE), help="tokens stored per database image")
    parser.add_argument("--ames-epochs", type=int, default=10)
    parser.add_argument(
        "--ames-shortlist", type=int, default=100, help="AMES re-ranks this many (its CPU cost is per pair)"
    )
    parser.add_argument("--skip-ames", action="store_true")
    parser.add_argument("--reuse", action="store_true", help="reuse descriptors/index/AMES already in --workdir")
    parser.add_argument(
        "--shipped-itq",
        action="store_true",
        help="binarise with the shipped ITQ projection instead of one learned from the distractors",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from eval.evaluate import read_query_tokens
    from index.build import IndexConfig
    from index.build import main as build_index
    from index.search import load_index
    from rerank.matching import MatchConfig
    from rerank.rerank import RerankConfig, Reranker
    from rerank.spatial import SpatialConfig

    torch.set_num_threads(os.cpu_count() or 1)
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="needle-rerank-")
    work = Path(args.workdir or tmp.name)
    rows, _ = pack_realbench(REALBENCH, work / "shards")
    itq = None if args.shipped_itq else str(work / "itq_distractors.npz")
    if not (args.reuse and (work / "index" / "index_infos.json").is_file()):
        itq = ingest_all(work, args.db_tokens, not args.shipped_itq)
        build_index(IndexConfig(kind="flat"), work / "desc", work / "index")
    index = load_index(work / "index")
    queries = [q for q in row_queries(rows) if q["positives"]]
    groups = {r["key"]: r["group"] for r in rows}
    lists, global_ms = shortlists(index, queries)
    folds = group_folds(lists, groups)
    query_tokens = read_query_tokens(work / "desc_q", [q["key"] for q in queries])
    from rerank.ensemble import ap_of_order

    global_map = 100.0 * float(np.mean([ap_of_order(e["positive"], e["n_positives"], K) for e in lists]))
    oracle = 100.0 * float(np.mean([min(K, int(e["positive"].sum())) / min(K, e["n_positives"]) for e in lists]))
    log.info(
        "global mAP@1k %.2f (oracle of the top-%d: %.2f), global search %.2f ms/query", global_map, K, oracle, global_ms
    )

    result: dict = {
        "map_at_1k": {"global": round(global_map, 2)},
        "n_queries": len(lists),
        "oracle_top1k": round(oracle, 2),
    }
    settings: dict = {}

    # SP: the Hamming threshold and LO refinement chosen on validation queries too (per fold).
    sp_runs = {}
    for max_hamming in SP_MAX_HAMMING:
        for lo in SP_LO_ITERATIONS:
            conf = RerankConfig(
                method="sp", match=MatchConfig(max_distance=max_hamming), spatial=SpatialConfig(lo_iterations=lo)
            )
            raws, ms = local_scores(index, Reranker(conf), lists, query_tokens, TIMED_TOKENS)
            sp_runs[f"max_hamming={max_hamming},lo_iterations={lo}"] = (validation_queries(lists, raws, SHORTLIST), ms)
    sp_map, sp_chosen = _cv_over_settings(sp_runs, folds, "sp")
    result["map_at_1k"]["sp"] = round(sp_map, 2)
    settings["sp"] = sp_chosen
    result["sp_ms_per_query"] = {name: round(ms, 1) for name, (_, ms) in sp_runs.items()}
    # The default settings' run, timed in the same run as the global search.
    rerank_ms = sp_runs[f"max_hamming={MatchConfig().max_distance},lo_iterations={SpatialConfig().lo_iterations}"][1]

    chamfer = Reranker(RerankConfig(method="chamfer"))
    raws, chamfer_ms = local_scores(index, chamfer, lists, query_tokens, TIMED_TOKENS)
    chamfer_map, settings["chamfer"] = cross_validated_map(validation_queries(lists, raws, SHORTLIST), folds, "chamfer")
    result["map_at_1k"]["chamfer"] = round(chamfer_map, 2)

    curve = []
    best_sp = Reranker(RerankConfig(method="sp"))  # the default threshold: no choice made on the test queries
    for n in TOKEN_CURVE:
        if n > args.db_tokens:
            continue
        raws, ms = local_scores(index, best_sp, lists, query_tokens, n)
        value, _ = cross_validated_map(validation_queries(lists, raws, SHORTLIST), folds, "sp")
        curve.append(
            {
                "tokens": n,
                "bytes_per_image": n * 23 + 8,
                "map_at_1k_sp": round(value, 2),
                "rerank_ms_per_query": round(ms, 1),
            }
        )

    if not args.skip_ames:
        ckpt = work / "ames.pt"
        if not (args.reuse and ckpt.is_file()):
            ckpt = train_ames(work, args.ames_epochs, itq)
        ames = Reranker(RerankConfig(method="ames", ames=str(ckpt), shortlist=args.ames_shortlist))
        # AMES was trained on single-scale database tokens: the query uses its stored ones too.
        stored = {e["key"]: index.local_store.tokens(index.position_of(e["key"])) for e in lists}
        raws, ames_ms = local_scores(index, ames, lists, stored, TIMED_TOKENS, args.ames_shortlist)
        ames_map, settings["ames"] = cross_validated_map(
            validation_queries(lists, raws, args.ames_shortlist), folds, "ames", gammas=(0.1, 0.25, 0.5, 1.0, 2.0)
        )
        result["map_at_1k"]["ames"] = round(ames_map, 2)
        result["ames_ms_per_query"] = round(ames_ms, 1)
        result["ames_shortlist"] = args.ames_shortlist
        result["ames_training"] = json.loads(ckpt.with_suffix(".json").read_text()).get("val")

    best = max((m for m in result["map_at_1k"] if m != "global"), key=lambda m: result["map_at_1k"][m])
    result["map_at_1k"]["best"] = result["map_at_1k"][best]
    result.update(
        {
            "best_method": best,
            "gain": round(result["map_at_1k"][best] - global_map, 2),
            "rerank_ms_per_query": round(rerank_ms, 1),
            "rerank_setting": (
                f"SP on {SHORTLIST} candidates x {TIMED_TOKENS} binary tokens, "
                f"query {len(next(iter(query_tokens.values())))} tokens"
            ),
            "global_search_ms_per_query": round(global_ms, 2),
            "chamfer_ms_per_query": round(chamfer_ms, 1),
            "local_bytes_per_image": TIMED_TOKENS * 23 + 8,
            "itq": "learned on the distractors' tokens" if itq else "shipped (demo photos)",
            "store_bytes_per_image": index.infos["locals"]["bytes_per_image"],
            "chosen_on_validation": settings,
            "curve": curve,
            "targets": {"gain": 10.0, "rerank_ms_per_query": 100.0, "local_bytes_per_image": 2500},
        }
    )
    if tmp is not None:
        tmp.cleanup()
    print(json.dumps(result))


def _cv_over_settings(runs: dict, folds: list[np.ndarray], method: str) -> tuple[float, list[dict]]:
    """Cross-validated mAP choosing both a run (e.g. the Hamming threshold) and λ on the other folds."""
    from rerank.ensemble import grid_search, mean_ap

    total, chosen = 0.0, []
    for f, fold in enumerate(folds):
        others = np.concatenate([g for j, g in enumerate(folds) if j != f])
        best = None
        for setting, (vq, _) in runs.items():
            conf, value = grid_search([vq[i] for i in others], method, K, LAMBDAS)
            if best is None or value > best[2]:
                best = (setting, conf, value)
        setting, conf, value = best
        total += mean_ap([runs[setting][0][i] for i in fold], method, conf, K) * len(fold)
        chosen.append({"setting": setting, "lam": conf.lam, "validation_map": round(value, 2)})
    return total / sum(len(f) for f in folds), chosen


if __name__ == "__main__":
    main()
