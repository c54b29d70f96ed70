"""The fitted adaptation function: its PCA (embed/pca.py) and its W, fitted on pairs, applied to
frozen features, written to and read from a model file. Importing this module stays light."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.atomic import write_atomic
from core.checkpoint import load_torch_file
from embed import pca as pca_lib
from embed.pca import PCA
from similarity.afn.config import MODEL_FORMAT, AdaptationFunctionError, AfnConfig
from similarity.afn.pair_features import PairFeatures

log = logging.getLogger(__name__)


def fit_pca(x: np.ndarray, dim: int, warn: bool = True) -> PCA:
    """The adaptation function's PCA (embed/pca.py): centred, to min(dim, n - 1, D) components, each
    oriented so that its largest-magnitude entry is positive (deterministic). A cap below ``dim`` is
    logged, as a warning when ``warn``."""
    pca = pca_lib.fit_pca(x, dim, fix_signs=True, error=AdaptationFunctionError)
    if pca.dim < dim:
        n, d = np.shape(x)
        (log.warning if warn else log.debug)(
            "PCA to %d dimensions instead of %d: %d training images of dimension %d", pca.dim, dim, n, d
        )
    return pca


@dataclass
class AfnModel:
    """A fitted adaptation function: ``x -> ReLU(W PCA(x))``."""

    pca: PCA  # the projection fitted on the training images
    weight: np.ndarray  # (hidden, k) float32: W
    sigma: float  # the sigma it was trained with (a record; not needed to embed)
    feature_config: dict[str, Any]  # FeatureConfig.record() of the features it expects

    def embed(self, x: np.ndarray) -> np.ndarray:
        """(n, D) frozen features -> (n, hidden) adapted representations ReLU(W PCA(x))."""
        return np.maximum(self.pca.apply(x) @ self.weight.T, 0.0)

    @classmethod
    def from_module(cls, pca: PCA, module: Any, sigma: float, feature_config: dict[str, Any]) -> AfnModel:
        """The model of a trained :class:`similarity.afn.training.Adaptation` module."""
        return cls(pca, module.weight_matrix.weight.detach().cpu().numpy().astype(np.float32), sigma, feature_config)


def fit_afn(feats: PairFeatures, conf: AfnConfig, index: np.ndarray | None = None) -> tuple[AfnModel, list[float]]:
    """PCA on the images of the pairs ``index`` (default: all), then the adaptation on their pairs."""
    from similarity.afn.training import train_adaptation  # torch: only when training

    idx = np.arange(len(feats)) if index is None else np.asarray(index)
    pca = fit_pca(np.concatenate([feats.left[idx], feats.right[idx]]), conf.pca_dim)
    module, history = train_adaptation(pca.apply(feats.left[idx]), pca.apply(feats.right[idx]), conf)
    return AfnModel.from_module(pca, module, conf.sigma, feats.feature_config), history


def save_model(model: AfnModel, path: Path) -> Path:
    """The model's PCA, W, sigma and feature settings as a torch file, written atomically."""
    import torch

    state = {
        "format": MODEL_FORMAT,
        "pca_mean": torch.from_numpy(model.pca.mean),
        "pca_components": torch.from_numpy(model.pca.components),
        "weight": torch.from_numpy(model.weight),
        "sigma": float(model.sigma),
        "features": model.feature_config,
    }
    return write_atomic(Path(path), lambda tmp: torch.save(state, tmp))


def load_model(path: Path | str) -> AfnModel:
    """A model written by :func:`save_model`; typed errors naming the file."""
    import torch

    path = Path(path)
    state = load_torch_file(path, AdaptationFunctionError, "model")
    if not isinstance(state, dict) or state.get("format") != MODEL_FORMAT:
        raise AdaptationFunctionError(f"{path} is not an adaptation-function model ({MODEL_FORMAT})")
    mean, comps, weight = (state.get(k) for k in ("pca_mean", "pca_components", "weight"))
    if (
        not all(isinstance(t, torch.Tensor) for t in (mean, comps, weight))
        or mean.ndim != 1
        or comps.ndim != 2
        or weight.ndim != 2
        or comps.shape[1] != mean.shape[0]
        or weight.shape[1] != comps.shape[0]
    ):
        raise AdaptationFunctionError(
            f"model {path}: inconsistent shapes "
            f"{ {k: tuple(getattr(state.get(k), 'shape', ())) for k in ('pca_mean', 'pca_components', 'weight')} }"
        )
    return AfnModel(
        PCA(mean.double().numpy(), comps.double().numpy()),
        weight.float().numpy(),
        float(state.get("sigma", 0.0)),
        dict(state.get("features") or {}),
    )
