"""Evaluating the adaptation function by asymmetric recall aR@k (eval/pairs.py): the paper's protocol
of random train/test splits of the pairs (before and after adaptation, for each sigma), or a
trained model on every pair. Importing this module stays light."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from eval.pairs import asymmetric_recall
from similarity.afn.config import KS, AdaptationFunctionError, AfnConfig, EvalConfig
from similarity.afn.model import AfnModel, fit_pca
from similarity.afn.pair_features import PairFeatures


def split_indices(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) pair indices of one random split: floor(test_fraction * n) test pairs."""
    n_test = int(np.floor(test_fraction * n))
    if n_test < 1 or n - n_test < 2:
        raise AdaptationFunctionError(
            f"{n} pairs cannot be split {1 - test_fraction:g}/{test_fraction:g} into >= 2 training and >= 1 test pairs"
        )
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[n_test:]), np.sort(order[:n_test])


def summarise(values: list[float]) -> dict[str, Any]:
    """Mean and 2 x (population) std of per-split values, and the values."""
    arr = np.asarray(values, dtype=np.float64)
    return {
        "mean": round(float(arr.mean()), 3),
        "two_std": round(float(2 * arr.std()), 3),
        "values": [round(v, 3) for v in values],
    }


def _galleries(feats: PairFeatures) -> list[tuple[str, np.ndarray | None]]:
    """The galleries scored: the pairs alone, and with the distractors when the features hold some."""
    out: list[tuple[str, np.ndarray | None]] = [("pairs", None)]
    if feats.distractors is not None and len(feats.distractors):
        out.append(("with_distractors", feats.distractors))
    return out


def sigma_key(sigma: float) -> str:
    """The result row of the adaptation trained with ``sigma``."""
    return f"sigma={sigma:g}"


def evaluate_splits(
    feats: PairFeatures, conf: AfnConfig, eval_conf: EvalConfig, sigmas: tuple[float, ...] | None = None
) -> dict[str, Any]:
    """The paper's protocol: per random split, PCA + adaptation trained on the training pairs, aR@k
    of the test pairs before (raw concatenation; PCA) and after adaptation, for each sigma. Returns
    per gallery ("pairs"; "with_distractors" when the features hold distractors) and row, each k's
    mean, 2 std and per-split values."""
    from similarity.afn.training import train_adaptation  # torch: only when training

    sigmas = tuple(sigmas or (conf.sigma,))
    n = len(feats)
    galleries = _galleries(feats)
    rows = ["before_raw", "before_pca"] + [sigma_key(s) for s in sigmas]
    values = {g: {r: {k: [] for k in eval_conf.ks} for r in rows} for g, _ in galleries}
    pca_dims, final_losses = [], {sigma_key(s): [] for s in sigmas}
    start = time.perf_counter()
    for s in tqdm(range(eval_conf.splits), desc="afn splits", unit="split", leave=False):
        train, test = split_indices(n, eval_conf.test_fraction, eval_conf.seed + s)
        pca = fit_pca(np.concatenate([feats.left[train], feats.right[train]]), conf.pca_dim, warn=s == 0)
        pca_dims.append(pca.dim)
        # Each row's (left, right, distractors) representations of the test split, projected once
        # per split (the distractors dominate the cost).
        dis = feats.distractors if len(galleries) > 1 else None
        projected = [pca.apply(feats.left[test]), pca.apply(feats.right[test]), None if dis is None else pca.apply(dis)]
        reps = {"before_raw": [feats.left[test], feats.right[test], dis], "before_pca": projected}
        for sigma in sigmas:
            module, history = train_adaptation(
                pca.apply(feats.left[train]),
                pca.apply(feats.right[train]),
                dataclasses.replace(conf, sigma=sigma, seed=conf.seed + s),
            )
            weight = module.weight_matrix.weight.detach().numpy().astype(np.float32)
            reps[sigma_key(sigma)] = [None if x is None else np.maximum(x @ weight.T, 0.0) for x in projected]
            final_losses[sigma_key(sigma)].append(history[-1])
        for gallery, _ in galleries:
            for row in rows:
                left, right, distractors = reps[row]
                scores = asymmetric_recall(
                    left, right, eval_conf.ks, distractors if gallery == "with_distractors" else None
                )
                for k in eval_conf.ks:
                    values[gallery][row][k].append(scores[k])
    n_test = int(np.floor(eval_conf.test_fraction * n))
    result: dict[str, Any] = {
        "protocol": {
            "pairs": n,
            "train_pairs": n - n_test,
            "test_pairs": n_test,
            "splits": eval_conf.splits,
            "test_fraction": eval_conf.test_fraction,
            "distractors": 0 if feats.distractors is None else len(feats.distractors),
            "pca_dim": sorted(set(pca_dims)),
            "sigmas": list(sigmas),
            "afn": dataclasses.asdict(conf),
            "features": feats.feature_config,
            "seconds": round(time.perf_counter() - start, 2),
        },
        "final_train_loss": {key: summarise(v) for key, v in final_losses.items()},
    }
    for gallery, _ in galleries:
        result[gallery] = {row: {f"aR@{k}": summarise(values[gallery][row][k]) for k in eval_conf.ks} for row in rows}
    return result


def evaluate_model(model: AfnModel, feats: PairFeatures, ks: tuple[int, ...] = KS) -> dict[str, Any]:
    """aR@k of all pairs of ``feats`` (plus its distractors) before (raw; the model's PCA) and after the model."""
    if model.feature_config and model.feature_config != feats.feature_config:
        raise AdaptationFunctionError(
            f"the model expects features {model.feature_config}, the pairs have {feats.feature_config}"
        )
    rows = {"before_raw": lambda x: x, "before_pca": model.pca.apply, "after": model.embed}
    result: dict[str, Any] = {
        "protocol": {
            "pairs": len(feats),
            "distractors": 0 if feats.distractors is None else len(feats.distractors),
            "pca_dim": model.pca.dim,
            "sigma": model.sigma,
            "features": feats.feature_config,
        }
    }
    for gallery, distractors in _galleries(feats):
        result[gallery] = {}
        for row, f in rows.items():
            scores = asymmetric_recall(
                f(feats.left), f(feats.right), ks, None if distractors is None else f(distractors)
            )
            result[gallery][row] = {f"aR@{k}": round(v, 3) for k, v in scores.items()}
    return result
