"""2AFC evaluation: each similarity model's decisions on triplets, their majority vote and, with a
trained ensemble, its decisions; accuracy per method and per kind of B, and the ensemble against the
best single model on the same triplets."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.atomic import write_json_atomic
from eval.twoafc import decisions_from_scores, majority_vote, paired, summary, weighted_decision
from similarity.data import SimilarityDataError
from similarity.twoafc.config import EvalConfig
from similarity.twoafc.features import FeatureStore, context_descriptors, triplet_scores
from similarity.twoafc.registry import DEFAULT_MODELS, get_model
from similarity.twoafc.triplets import SPLITS, Triplets, read_triplets, resolve_split

if TYPE_CHECKING:  # the ensemble's module imports torch
    from similarity.twoafc.ensemble import ContextEnsemble


@dataclass(frozen=True, eq=False)
class Evaluation:
    """Per-triplet decisions of every method on one set of triplets."""

    labels: np.ndarray  # (n,)
    kinds: tuple[str, ...]  # (n,) how B was chosen
    decisions: dict[str, np.ndarray]  # method -> (n,) int8: each model, majority_vote, and with an ensemble
    # mean_margin (uniform weights), ensemble (the paper's weights) and ensemble_log_odds
    models: tuple[str, ...]
    mean_weights: dict[str, float] | None = None  # the ensemble's mean weight per model

    @staticmethod
    def concatenate(parts: Sequence[Evaluation]) -> Evaluation:
        """The evaluations of several sets of triplets (the same methods) as one."""
        names = list(parts[0].decisions)
        if any(list(p.decisions) != names for p in parts):
            raise SimilarityDataError("evaluations of different methods cannot be pooled")
        return Evaluation(
            np.concatenate([p.labels for p in parts]),
            tuple(k for p in parts for k in p.kinds),
            {m: np.concatenate([p.decisions[m] for p in parts]) for m in names},
            parts[0].models,
        )


def evaluate_triplets(
    triplets: Triplets,
    models: Sequence[str],
    ensemble: ContextEnsemble | None = None,
    store: FeatureStore | None = None,
) -> Evaluation:
    """Each model's decisions, majority vote, and with an ensemble its decisions and the uniform
    average of the scaled margins (``mean_margin``: the ensemble without its context weights)."""
    store = store or FeatureStore()
    sa, sb = triplet_scores([get_model(n) for n in models], triplets, store)
    margins = sa - sb
    decisions = {n: decisions_from_scores(sa[:, k], sb[:, k]) for k, n in enumerate(models)}
    if len(models) >= 2:
        decisions["majority_vote"] = majority_vote(margins)
    mean_weights = None
    if ensemble is not None:
        scaled = margins / ensemble.margin_scale.numpy()
        decisions["mean_margin"] = weighted_decision(scaled, np.ones_like(scaled))
        context_ref, _ = context_descriptors(ensemble.context_model, triplets, store)
        decisions["ensemble"] = ensemble.decide(margins, context_ref)
        decisions["ensemble_log_odds"] = ensemble.decide(margins, context_ref, "log_odds")
        mean_weights = dict(zip(models, np.round(ensemble.weights(context_ref).mean(0), 4).tolist()))
    return Evaluation(triplets.label, triplets.kind, decisions, tuple(models), mean_weights)


def report(evaluation: Evaluation) -> dict[str, Any]:
    """Accuracy per method (overall and per kind of B), and the ensemble against the best single model."""
    ev = evaluation
    out: dict[str, Any] = {"n": len(ev.labels), "methods": {m: summary(d, ev.labels) for m, d in ev.decisions.items()}}
    kinds = sorted(set(ev.kinds) - {""})
    if kinds:
        keep = {k: np.asarray([x == k for x in ev.kinds]) for k in kinds}
        out["by_kind"] = {
            k: {
                "n": int(keep[k].sum()),
                **{m: summary(d[keep[k]], ev.labels[keep[k]])["accuracy_pct"] for m, d in ev.decisions.items()},
            }
            for k in kinds
        }
    best = max(ev.models, key=lambda m: out["methods"][m]["accuracy_pct"])
    out["best_single"] = best
    for method in ("majority_vote", "ensemble", "ensemble_log_odds"):
        if method in ev.decisions:
            out[f"{method}_vs_best_single"] = paired(ev.decisions[method], ev.decisions[best], ev.labels)
    if ev.mean_weights is not None:
        out["ensemble_mean_weights"] = ev.mean_weights
    return out


def evaluate(
    conf: EvalConfig,
    triplets: Path | str,
    ensemble: Path | str | None = None,
    output: Path | str | None = None,
    cache: Path | str | None = None,
) -> dict[str, Any]:
    """The 2AFC report of ``triplets`` (the split of ``conf.split``); written to ``output`` when given."""
    from similarity.twoafc.ensemble import load_ensemble  # torch: only with an ensemble to read

    start = time.perf_counter()
    model = load_ensemble(ensemble) if ensemble is not None else None
    if model is not None and conf.models is not None and tuple(conf.models) != tuple(model.names):
        raise SimilarityDataError(f"ensemble {ensemble} combines {model.names}; --models {list(conf.models)} differs")
    models = tuple(model.names) if model is not None else (conf.models or DEFAULT_MODELS)
    split = resolve_split(triplets, conf.split, SPLITS[1])
    data = read_triplets(triplets, split, conf.min_votes)
    out = {
        "triplets": str(triplets),
        "split": split,
        "ensemble": str(ensemble) if ensemble else None,
        **report(evaluate_triplets(data, models, model, FeatureStore(cache))),
    }
    out["seconds"] = round(time.perf_counter() - start, 3)
    if output is not None:
        write_json_atomic(out, Path(output))
    return out
