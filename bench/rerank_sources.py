"""Leave-one-source-out validation of re-ranking settings (issue 37), for bench/rerank.py.

realbench's grouped images come from a few public sources (``groups.csv``'s ``source``: WxBS, EVD,
Phototourism, ...), each with its own kind of change (viewpoint, day/night, season). Settings chosen
on queries of the same sources as the test queries flatter the gain: the defaults were explored on
all 131 queries. Here every setting is chosen without the source it is scored on:

* an AP table: one row per setting (query tokens, Hamming threshold, pair hypotheses, inlier floor,
  Chamfer weight, α-QE, λ), one column per query, AP@1k of that query re-ranked with that setting;
* for each source s, the row of best mAP@1k over the queries of every *other* source (pooled per
  query; ties to the first row in grid order) is scored on s's queries;
* ``gain_source_held_out``: the mean over all queries (pooled per query, not a mean of the
  sources' means) of each query's AP under the setting chosen without its source, minus global-only;
* the defaults: the setting the most folds chose (ties: the better pooled mAP over all queries).

Only numpy and rerank.ensemble / rerank.expand are needed: the tests build tiny tables by hand.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

QE_NONE = None


def setting_name(s: dict) -> str:
    """A setting as one readable string (the JSON's ``chosen``)."""
    qe = "none" if s["qe"] is None else "/".join(str(v) for v in s["qe"])
    return (
        f"tokens={s['tokens']},max_hamming={s['max_hamming']},pair_seeds={s['pair_seeds']},"
        f"floor={s['floor']},chamfer={s['chamfer']},qe={qe},lam={s['lam']}"
    )


def query_aps(
    vq: list,
    vectors: list | None,
    floor: float,
    lam: float,
    qe_grid: Sequence,
    cache: list[dict] | None = None,
    chamfer: float = 0.0,
) -> np.ndarray:
    """(len(qe_grid), Q) AP@1k of every query re-ranked by SP at (floor, λ, Chamfer weight), then
    expanded with each α-QE setting of ``qe_grid`` ((top, min_inliers, alpha) or None: no
    expansion). An expansion averaging in the same results as another of the same alpha is scored
    once; ``cache`` (one dict per query, kept across calls) holds the expanded queries' global
    scores, which depend on neither λ, the floor nor the Chamfer weight."""
    from rerank.ensemble import EnsembleConfig, ap_of_order, chamfer_term, local_to_unit, rerank_order
    from rerank.expand import ExpansionConfig, expand, verified_top

    conf = EnsembleConfig(lam=float(lam), inlier_floor=float(floor), chamfer_weight=float(chamfer))
    cache = cache if cache is not None else [{} for _ in vq]
    out = np.zeros((len(qe_grid), len(vq)))
    for i, q in enumerate(vq):
        if ("unit", floor) not in cache[i]:  # f(inliers) with the shortlist's floor: the same for every λ
            cache[i][("unit", floor)] = local_to_unit("sp", q.raw_local, conf, q.has_locals)
        # rerank.ensemble.local_term with f(local) computed once
        unit = cache[i][("unit", floor)]
        local = (1.0 - conf.lam) * unit + chamfer_term("sp", conf, q.chamfer, len(unit))

        def combine(s_global, q=q, local=local):  # rerank.ensemble.combine
            return np.where(q.has_locals, conf.lam * np.asarray(s_global, np.float64) + local, s_global)

        order = rerank_order(combine(q.s_global), q.rows)
        plain = ap_of_order(q.positive[order], q.n_positives, 1000)
        seen: dict[tuple, float] = {}
        for j, qe in enumerate(qe_grid):
            if qe is None:
                out[j, i] = plain
                continue
            expansion = ExpansionConfig(*qe)
            key = (tuple(verified_top(order, q.raw_local, expansion).tolist()), expansion.alpha)
            if key not in seen:
                if key not in cache[i]:
                    query, shortlist = vectors[i]
                    expanded = expand(query, shortlist[list(key[0])], expansion) if key[0] else None
                    cache[i][key] = None if expanded is None else shortlist @ expanded
                s_qe = cache[i][key]
                if s_qe is None:
                    seen[key] = plain
                else:
                    seen[key] = ap_of_order(q.positive[rerank_order(combine(s_qe), q.rows)], q.n_positives, 1000)
            out[j, i] = seen[key]
    return out


def final_scores(q, vector: tuple | None, setting: dict) -> np.ndarray:
    """One query's final scores over its ``q.rows`` under one ``setting`` of the grid (SP at its
    floor and λ, then its α-QE), as ``query_aps`` ranks them: the first stage that a second
    verification starts from."""
    from rerank.ensemble import EnsembleConfig
    from rerank.ensemble import combine as ensemble
    from rerank.expand import ExpansionConfig, expand, verified_top

    conf = EnsembleConfig(
        lam=float(setting["lam"]), inlier_floor=float(setting["floor"]), chamfer_weight=float(setting["chamfer"])
    )

    def combine(s_global: np.ndarray) -> np.ndarray:
        return ensemble("sp", s_global, q.raw_local, q.has_locals, conf, q.chamfer)

    scores = combine(q.s_global)
    if setting["qe"] is None:
        return scores
    from rerank.ensemble import rerank_order

    expansion = ExpansionConfig(*setting["qe"])
    top = verified_top(rerank_order(scores, q.rows), q.raw_local, expansion)
    if not len(top):
        return scores
    query, shortlist = vector
    return combine(shortlist @ expand(query, shortlist[top], expansion))


def ap_table(
    passes: dict[tuple, list],
    vectors: list,
    floors: Sequence[float],
    qe_grid: Sequence,
    lambdas: Sequence[float],
    chamfers: Sequence[float] = (0.0,),
) -> tuple[list[dict], np.ndarray]:
    """Every setting's per-query AP: ``passes`` maps (tokens, max_hamming, pair_seeds) to that
    scoring's validation queries; rows in grid order (pass, floor, Chamfer weight, λ, α-QE)."""
    settings, rows = [], []
    for (tokens, max_hamming, pair_seeds), vq in passes.items():
        cache: list[dict] = [{} for _ in vq]
        for floor in floors:
            for chamfer in chamfers:
                for lam in lambdas:
                    rows.append(query_aps(vq, vectors, floor, lam, qe_grid, cache, chamfer))
                    for qe in qe_grid:
                        settings.append(
                            {
                                "tokens": tokens,
                                "max_hamming": int(max_hamming),
                                "pair_seeds": int(pair_seeds),
                                "floor": float(floor),
                                "chamfer": float(chamfer),
                                "qe": None if qe is None else [int(qe[0]), int(qe[1]), float(qe[2])],
                                "lam": float(lam),
                            }
                        )
    return settings, np.concatenate(rows)


def best_row(table: np.ndarray, columns: np.ndarray) -> int:
    """The row of best mean over ``columns``; ties to the first row (means within 1e-12)."""
    means = table[:, columns].mean(axis=1)
    return int(np.flatnonzero(means >= means.max() - 1e-12)[0])


def held_out(table: np.ndarray, sources: Sequence[str]) -> tuple[dict[str, int], np.ndarray]:
    """Leave-one-source-out: each source's row chosen on the other sources' queries, and every
    query's AP under the row chosen without its source (Q,)."""
    sources = np.asarray(sources)
    chosen: dict[str, int] = {}
    per_query = np.zeros(table.shape[1])
    for s in sorted(set(sources.tolist())):
        inside = sources == s
        if inside.all():
            raise ValueError("leave-one-source-out needs at least two sources")
        chosen[s] = best_row(table, np.flatnonzero(~inside))
        per_query[inside] = table[chosen[s], inside]
    return chosen, per_query


def consensus(chosen: dict[str, int], table: np.ndarray) -> int:
    """The row the most folds chose; among equally frequent rows, the best pooled mean over every
    query (then the first in grid order)."""
    counts = Counter(chosen.values())
    top = max(counts.values())
    candidates = sorted(r for r, c in counts.items() if c == top)
    means = table[candidates].mean(axis=1)
    return candidates[int(np.flatnonzero(means >= means.max() - 1e-12)[0])]


def _pct(values: np.ndarray) -> float:
    return round(100.0 * float(np.mean(values)), 2)


def source_report(
    settings: list[dict], table: np.ndarray, global_aps: np.ndarray, sources: Sequence[str], default_row: int
) -> dict:
    """The JSON fields of the leave-one-source-out validation (see the module's docstring); figures
    are mAP@1k x 100, pooled per query."""
    sources = np.asarray(sources)
    chosen, per_query = held_out(table, sources)
    by_source = {}
    for s, row in chosen.items():
        inside = sources == s
        by_source[s] = {
            "queries": int(inside.sum()),
            "global": _pct(global_aps[inside]),
            "held_out": _pct(per_query[inside]),
            "gain": round(_pct(per_query[inside]) - _pct(global_aps[inside]), 2),
            "defaults_in_sample": _pct(table[default_row, inside]),
            "chosen": setting_name(settings[row]),
            "chosen_fields": settings[row],
            "validation_map": _pct(table[row, ~inside]),
        }
    pick = consensus(chosen, table)
    worst = min(by_source, key=lambda s: by_source[s]["gain"])
    return {
        "map_at_1k_source_held_out": _pct(per_query),
        "gain_source_held_out": round(_pct(per_query) - _pct(global_aps), 2),
        "gain_source_held_out_mean_of_sources": round(
            float(np.mean([v["held_out"] - v["global"] for v in by_source.values()])), 2
        ),
        "worst_source_held_out": {"source": worst, "gain": by_source[worst]["gain"]},
        "by_source_held_out": by_source,
        "defaults_in_sample": {
            "setting": setting_name(settings[default_row]),
            "map_at_1k": _pct(table[default_row]),
            "gain": round(_pct(table[default_row]) - _pct(global_aps), 2),
        },
        "consensus_setting": {
            "setting": setting_name(settings[pick]),
            "setting_fields": settings[pick],
            "folds_choosing_it": sum(1 for r in chosen.values() if r == pick),
            "folds": len(chosen),
            "map_at_1k_in_sample": _pct(table[pick]),
        },
        "best_in_sample": setting_name(settings[best_row(table, np.arange(table.shape[1]))]),
        "held_out_settings": len(settings),
    }


def find_row(settings: list[dict], want: dict) -> int:
    """The index of the setting equal to ``want`` (same keys)."""
    for i, s in enumerate(settings):
        if all(s[k] == want[k] for k in want):
            return i
    raise KeyError(f"setting not in the grid: {want}")


def source_held_out(
    scored: Callable[[str, int, int], tuple[list, float]],
    vectors: list,
    global_aps: np.ndarray,
    sources: Sequence[str],
    grid: dict,
    defaults: dict,
) -> dict:
    """Score every pass of ``grid`` (``tokens`` x ``max_hamming`` x ``pair_seeds``; ``scored``
    returns a pass's validation queries and its ms per query), build the AP table over ``floors`` x ``lambdas`` x ``qe``
    and report it with ``defaults`` (a setting) as the in-sample comparison."""
    runs = {(t, d, p): scored(t, d, p) for t in grid["tokens"] for d in grid["max_hamming"] for p in grid["pair_seeds"]}
    passes = {key: vq for key, (vq, _) in runs.items()}
    settings, table = ap_table(
        passes, vectors, grid["floors"], grid["qe"], grid["lambdas"], grid.get("chamfers", (0.0,))
    )
    report = source_report(settings, table, np.asarray(global_aps), sources, find_row(settings, defaults))
    pick = find_row(settings, report["consensus_setting"]["setting_fields"])
    report["consensus_setting"]["scoring_ms_per_query"] = round(runs[_pass_of(settings[pick])][1], 1)
    report["held_out_by_floor"] = held_out_by(settings, table, np.asarray(global_aps), sources, "floor")
    report["held_out_by_chamfer"] = held_out_by(settings, table, np.asarray(global_aps), sources, "chamfer")
    return report


def held_out_by(
    settings: list[dict], table: np.ndarray, global_aps: np.ndarray, sources: Sequence[str], field: str
) -> dict:
    """The held-out figures with one ``field`` of the settings fixed at each of its values (every
    other field still chosen on the other sources): what a value costs or gains, e.g. keeping a
    chance floor where a use outside this benchmark needs one, or SP without its Chamfer term."""
    out = {}
    for value in sorted({s[field] for s in settings}):
        rows = [i for i, s in enumerate(settings) if s[field] == value]
        sub = source_report([settings[i] for i in rows], table[rows], global_aps, sources, 0)
        out[str(value)] = {
            "map_at_1k_source_held_out": sub["map_at_1k_source_held_out"],
            "gain_source_held_out": sub["gain_source_held_out"],
            "worst_source_held_out": sub["worst_source_held_out"],
            "consensus_setting": sub["consensus_setting"]["setting"],
        }
    return out


def _pass_of(s: dict) -> tuple:
    return (s["tokens"], s["max_hamming"], s["pair_seeds"])


def bench_report(
    one_pass: Callable[[str, int, int], tuple[list, float]],
    lists: list[dict],
    vectors: list,
    source: dict,
    kind: str,
    grid: dict,
    k: int = 1000,
) -> dict:
    """bench/rerank.py's held-out validation: the defaults (RerankConfig() with the token kind's
    settings; λ and floor its EnsembleConfig's; the kind's own query tokens, token set "image") as
    the in-sample comparison, every query's global-only AP@k from its shortlist (``lists``), the
    report logged and printed."""
    import logging
    import time

    from rerank.ensemble import ap_of_order
    from rerank.rerank import RerankConfig, with_kind_defaults

    conf = with_kind_defaults(RerankConfig(method="sp"), kind)
    qe = conf.expansion
    defaults = {
        "tokens": "image",
        "max_hamming": conf.match.threshold,
        "pair_seeds": conf.spatial.pair_seeds,
        "floor": conf.ensemble.inlier_floor,
        "chamfer": conf.ensemble.chamfer_weight,
        "qe": [qe.top, qe.min_inliers, float(qe.alpha)] if qe.top else None,
        "lam": conf.ensemble.lam,
    }
    global_aps = np.array([ap_of_order(e["positive"], e["n_positives"], k) for e in lists])
    start = time.perf_counter()
    report = source_held_out(one_pass, vectors, global_aps, [source[e["key"]] for e in lists], grid, defaults)
    logging.getLogger("bench.rerank").info(
        "source-held-out validation: %d settings in %.0f s", report["held_out_settings"], time.perf_counter() - start
    )
    print_sources(report)
    return report


def print_sources(report: dict) -> None:
    """The per-source table (docs/results.md's) of the held-out validation."""
    print("| source | queries | global | defaults (in-sample) | held out | gain | chosen on the other sources |")
    print("|---|---|---|---|---|---|---|")
    for s, v in report["by_source_held_out"].items():
        print(
            f"| {s} | {v['queries']} | {v['global']:.2f} | {v['defaults_in_sample']:.2f} | {v['held_out']:.2f} "
            f"| {v['gain']:+.2f} | {v['chosen']} |"
        )
