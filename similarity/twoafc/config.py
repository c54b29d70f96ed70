"""The settings of the 2AFC context-sensitive ensemble and of the evaluation, kept apart from the
ensemble's torch module so that the command line builds them without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

from similarity.data import SimilarityDataError
from similarity.twoafc.registry import DEFAULT_CONTEXT, DEFAULT_MODELS

WEIGHTINGS = ("share", "log_odds")  # how predicted probabilities become weights (ContextEnsemble.weights)


@dataclass(frozen=True)
class EnsembleConfig:
    models: tuple[str, ...] = DEFAULT_MODELS  # the K similarity models combined
    context_model: str = DEFAULT_CONTEXT  # its "global" descriptor of R, reduced by PCA, is the regressors' input
    pca_dim: int = 64  # PCA components of the context (fewer when the training images are fewer)
    hidden: int = 32  # hidden units of each regressor: pca_dim -> hidden -> 1
    epochs: int = 300  # full-batch Adam steps per regressor
    lr: float = 1e-2  # Adam learning rate
    weight_decay: float = 1e-3  # L2 on the regressors: a few hundred triplets for ~2k parameters each
    seed: int = 0  # the regressors' initialisation
    split: str = "auto"  # triplets trained on: "auto" (split "val" when the CSV has splits, else all), "all", or a name
    min_votes: int = 0  # NIGHTS: keep triplets with at least this many votes

    def __post_init__(self) -> None:
        if len(self.models) < 2:
            raise SimilarityDataError(f"an ensemble needs at least two models, got {self.models}")
        if self.pca_dim < 1 or self.hidden < 1 or self.epochs < 1 or self.lr <= 0 or self.weight_decay < 0:
            raise SimilarityDataError(f"pca_dim, hidden, epochs >= 1, lr > 0 and weight_decay >= 0 needed, got {self}")


@dataclass(frozen=True)
class EvalConfig:
    models: tuple[str, ...] | None = None  # None: the ensemble's models, or DEFAULT_MODELS without one
    split: str = "auto"  # "auto" (split "test" when the CSV has splits, else all), "all", or a split name
    min_votes: int = 0  # NIGHTS: keep triplets with at least this many votes
