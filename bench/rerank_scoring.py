"""The scoring of bench/rerank.py: its grids of settings, the folds over instance groups, each fold
scored with what the other folds chose (SP and its floor, Chamfer term and α-QE; per image source),
and the held-out-by-source and LightGlue reports over its scoring passes."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

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
# defaults are embed.locals.presets.RERANK_BY_KIND (Lite0 100 at each of 0.75/1/1.5, ALIKED 300 at 1).
QUERY_TOKEN_VARIANTS = {
    "cnn": (("query_5_scales", (0.5, 0.75, 1.0, 1.5, 2.0), 100), ("query_150_per_scale", (0.75, 1.0, 1.5), 150)),
    "aliked": (("query_200", (1.0,), 200), ("query_500", (1.0,), 500)),
}
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
