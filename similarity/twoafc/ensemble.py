"""The context-sensitive ensemble of 2AFC similarity models: its torch module, its training, its file.

The ensemble follows Liao & Chen, "Image Similarity using An Ensemble of Context-Sensitive Models"
(KDD 2024), its MLP variant: for each of K similarity models a small regressor predicts, from a
PCA embedding of R alone (the *context*), the probability that the model answers R's triplets
right; it is trained on a validation split. For a new triplet the K predictions ``p_k(R)`` are
normalised to sum to one, ``w_k = p_k / sum_j p_j`` (as the paper's code does), and the ensemble
answers ``sign(sum_k w_k(R) * (s_k(R, A) - s_k(R, B)) / c_k)``. The paper sums raw cosine distances
of models that all give cosines; ours mix cosines, Chamfer similarities and histogram
intersections, whose margins differ in scale, so each model's margin is divided by ``c_k``, its
median absolute margin on the validation triplets. (The normalisation of the weights changes no
decision, since the weights are positive; it makes them readable as shares.) Majority vote, the
baseline, is the sign of the sum of the K models' votes.

Differences from the paper, on purpose: the regressors are trained with binary cross-entropy on
whether the model was right on each validation triplet (a tie or a soft label gives a soft target)
rather than regressing each reference's accuracy with a squared loss (the minimiser is the same
per-reference mean); the context descriptor is EfficientNet-Lite0's GeM descriptor (the paper: a
ViT's), reduced by a PCA fitted on every image of the validation triplets; and the K models are
frozen off-the-shelf ones with shipped weights, not models fine-tuned per context. Besides the
paper's weights, ``weighting="log_odds"`` gives ``max(0, log(p / (1 - p)))`` (normalised): with
shares, a model predicted right half of the time keeps a full share of the say; with log-odds it
gets none (the optimal weights of a vote among independent voters).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from core.atomic import write_atomic, write_json_atomic
from core.checkpoint import load_torch_file
from embed.pca import fit_pca
from eval.twoafc import credit, decisions_from_scores, weighted_decision
from similarity.data import SimilarityDataError
from similarity.twoafc.config import WEIGHTINGS, EnsembleConfig
from similarity.twoafc.features import FeatureStore, context_descriptors, triplet_scores
from similarity.twoafc.registry import get_model
from similarity.twoafc.triplets import SPLITS, read_triplets, resolve_split

log = logging.getLogger(__name__)

ENSEMBLE_FORMAT = "needle-2afc-ensemble-1"


class ContextEnsemble(nn.Module):
    """PCA of the context descriptor, then one regressor per model: P(model k is right | R)."""

    def __init__(self, names: Sequence[str], context_model: str, dim: int, pca_dim: int, hidden: int):
        super().__init__()
        self.names, self.context_model, self.hidden = list(names), context_model, hidden
        self.register_buffer("pca_mean", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("pca_components", torch.zeros(pca_dim, dim, dtype=torch.float64))
        self.register_buffer("pca_scale", torch.ones((), dtype=torch.float64))
        self.register_buffer("margin_scale", torch.ones(len(names), dtype=torch.float64))
        self.regressors = nn.ModuleList(
            nn.Sequential(nn.Linear(pca_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1)) for _ in names
        )

    def project(self, context: np.ndarray) -> torch.Tensor:
        x = torch.as_tensor(np.asarray(context, np.float64))
        if x.ndim != 2 or x.shape[1] != self.pca_mean.shape[0]:
            raise SimilarityDataError(
                f"context descriptors of shape {tuple(x.shape)} do not fit an ensemble "
                f"for d={self.pca_mean.shape[0]} ({self.context_model})"
            )
        return ((x - self.pca_mean) @ self.pca_components.T / self.pca_scale).float()

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        return torch.cat([reg(z) for reg in self.regressors], dim=1)

    @torch.no_grad()
    def probabilities(self, context: np.ndarray) -> np.ndarray:
        """(n, K) predicted probability that each model answers R's triplet right."""
        return torch.sigmoid(self.logits(self.project(context))).double().numpy()

    def weights(self, context: np.ndarray, weighting: str = "share") -> np.ndarray:
        """(n, K) per-triplet weights from the predicted probabilities p: "share", p / sum(p) (the
        paper's); "log_odds", max(0, log(p / (1 - p))), the optimal weights of a vote of independent
        voters right with probability p (Nitzan & Paroush), normalised to sum to one too."""
        p = self.probabilities(context)
        if weighting == "log_odds":
            p = np.clip(p, 1e-6, 1 - 1e-6)
            p = np.maximum(np.log(p / (1 - p)), 0.0)
        elif weighting != "share":
            raise SimilarityDataError(f"unknown weighting {weighting!r}; choose from {WEIGHTINGS}")
        total = p.sum(axis=1, keepdims=True)
        return np.divide(p, total, out=np.full_like(p, 1.0 / p.shape[1]), where=total > 0)

    def decide(self, margins: np.ndarray, context: np.ndarray, weighting: str = "share") -> np.ndarray:
        """(n,) int8: sign of sum_k w_k(R) * margin_k / c_k."""
        return weighted_decision(np.asarray(margins) / self.margin_scale.numpy(), self.weights(context, weighting))


def margin_scales(margins: np.ndarray) -> np.ndarray:
    """(K,) each model's median absolute margin over the triplets where it is not 0 (1 if none)."""
    out = np.ones(margins.shape[1])
    for k in range(margins.shape[1]):
        m = np.abs(margins[:, k])
        m = m[m > 0]
        if len(m) and np.median(m) > 0:
            out[k] = float(np.median(m))
    return out


def context_pca(x: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(mean, (d, D) components, scale) of the context descriptors ``x``: their PCA (embed/pca.py,
    the SVD's signs) to d = min(dim, n - 1, D) leading components; scale = the standard deviation
    along the first, so that the regressors' inputs are of order one."""
    pca = fit_pca(x, dim, fix_signs=False, what="context descriptors", error=SimilarityDataError)
    first = pca.singular_values[0]
    scale = float(first / math.sqrt(len(x) - 1)) if first > 0 else 1.0
    return pca.mean, pca.components, scale


def fit_ensemble(
    conf: EnsembleConfig, margins: np.ndarray, credits: np.ndarray, context_ref: np.ndarray, context_fit: np.ndarray
) -> tuple[ContextEnsemble, list[float]]:
    """Train the ensemble: ``margins`` and ``credits`` (n, K) of the training triplets, ``context_ref``
    (n, D) R's context descriptor, ``context_fit`` (m, D) the descriptors the PCA is fitted on.
    Returns (ensemble, final training loss per regressor)."""
    margins, credits = np.asarray(margins, np.float64), np.asarray(credits, np.float64)
    if margins.shape != credits.shape or margins.shape[1] != len(conf.models) or len(context_ref) != len(margins):
        raise SimilarityDataError(
            f"margins {margins.shape}, credits {credits.shape} and context {np.shape(context_ref)} "
            f"do not fit {len(conf.models)} models"
        )
    mean, components, scale = context_pca(context_fit, conf.pca_dim)
    torch.manual_seed(conf.seed)
    ensemble = ContextEnsemble(conf.models, conf.context_model, len(mean), len(components), conf.hidden)
    ensemble.pca_mean.copy_(torch.from_numpy(mean))
    ensemble.pca_components.copy_(torch.from_numpy(components))
    ensemble.pca_scale.fill_(scale)
    ensemble.margin_scale.copy_(torch.from_numpy(margin_scales(margins)))
    z = ensemble.project(context_ref)
    target = torch.from_numpy(credits).float()
    losses = []
    for k, regressor in enumerate(ensemble.regressors):
        optimizer = torch.optim.Adam(regressor.parameters(), lr=conf.lr, weight_decay=conf.weight_decay)
        for _ in range(conf.epochs):
            loss = F.binary_cross_entropy_with_logits(regressor(z)[:, 0], target[:, k])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        losses.append(float(loss.detach()))
        log.info(
            "regressor %s: final BCE %.4f, mean right on training %.3f",
            conf.models[k],
            losses[-1],
            credits[:, k].mean(),
        )
    return ensemble.eval(), losses


def save_ensemble(ensemble: ContextEnsemble, path: Path | str) -> Path:
    """The ensemble's buffers and regressors with what rebuilds it (models, context model, width)."""
    state = {
        "format": ENSEMBLE_FORMAT,
        "models": list(ensemble.names),
        "context_model": ensemble.context_model,
        "hidden": int(ensemble.hidden),
        "state": {k: v.detach().clone() for k, v in ensemble.state_dict().items()},
    }
    return write_atomic(Path(path), lambda tmp: torch.save(state, tmp))


def load_ensemble(path: Path | str) -> ContextEnsemble:
    """An ensemble written by :func:`save_ensemble`, in eval mode; typed errors naming the file."""
    path = Path(path)
    state = load_torch_file(path, SimilarityDataError, "ensemble")
    if not isinstance(state, dict) or state.get("format") != ENSEMBLE_FORMAT:
        raise SimilarityDataError(f"{path} is not a 2AFC ensemble (format {ENSEMBLE_FORMAT})")
    try:
        tensors = state["state"]
        pca_dim, dim = tensors["pca_components"].shape
        ensemble = ContextEnsemble(state["models"], state["context_model"], dim, pca_dim, int(state["hidden"]))
        ensemble.load_state_dict(tensors)
    except (KeyError, RuntimeError, ValueError, AttributeError) as exc:
        raise SimilarityDataError(f"ensemble {path} is malformed: {type(exc).__name__}: {exc}") from exc
    return ensemble.eval()


def _credits_of(sa: np.ndarray, sb: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(n, K) each model's 2AFC credit on each triplet: the regressors' targets."""
    return np.stack([credit(decisions_from_scores(sa[:, k], sb[:, k]), labels) for k in range(sa.shape[1])], axis=1)


def train_ensemble(
    conf: EnsembleConfig,
    triplets: Path | str,
    output: Path | str,
    cache: Path | str | None = None,
    store: FeatureStore | None = None,
) -> Path:
    """Train the ensemble on the triplets of ``conf.split``; write ``output`` (.pt) and ``output``.json."""
    start = time.perf_counter()
    split = resolve_split(triplets, conf.split, SPLITS[0])
    data = read_triplets(triplets, split, conf.min_votes)
    store = store or FeatureStore(cache)
    sa, sb = triplet_scores([get_model(n) for n in conf.models], data, store)
    credits = _credits_of(sa, sb, data.label)
    context_ref, context_fit = context_descriptors(conf.context_model, data, store)
    ensemble, losses = fit_ensemble(conf, sa - sb, credits, context_ref, context_fit)
    path = save_ensemble(ensemble, Path(output))
    probs = ensemble.probabilities(context_ref)
    write_json_atomic(
        {
            "config": asdict(conf),
            "triplets": str(triplets),
            "split": split,
            "n": len(data),
            "images": len(context_fit),
            "pca_dim": int(ensemble.pca_components.shape[0]),
            "margin_scale": dict(zip(conf.models, ensemble.margin_scale.tolist())),
            "train_accuracy_pct": dict(zip(conf.models, np.round(100 * credits.mean(0), 2).tolist())),
            "mean_predicted_pct": dict(zip(conf.models, np.round(100 * probs.mean(0), 2).tolist())),
            "final_bce": dict(zip(conf.models, losses)),
            "seconds": round(time.perf_counter() - start, 3),
        },
        path.with_name(path.name + ".json"),
    )
    log.info("ensemble of %s -> %s (%d triplets of split %s)", ", ".join(conf.models), path, len(data), split or "all")
    return path
