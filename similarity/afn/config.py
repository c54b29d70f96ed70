"""``needle similarity afn``: an adaptation function for visual similarity on frozen features.

After Risser-Maroix, Kurtz and Loménie, "Learning an adaptation function to assess image visual
similarities" (ICIP 2021; extended as arXiv:2206.01417), evaluated there on Totally-Looks-Like
(TLL) pairs. The method, as implemented here:

- **Representation** (frozen, ``FeatureConfig``): the shipped EfficientNet-Lite0 ImageNet backbone;
  the outputs of several of its stages (default: timm ``blocks.3``..``blocks.6``, strides 16-32,
  80/112/192/320 channels, and ``head``, the 1280-channel conv head GeM pools elsewhere in
  needle) are each averaged over space, L2-normalised and concatenated (1,984 dimensions). Images
  keep their aspect ratio at longer side 224 (Lite0's training resolution).
- **PCA** to 256 dimensions (centred, not whitened, as sklearn's ``PCA``), fitted on the images of
  the training pairs only (left and right). The authors fit it on the whole dataset before
  splitting; we do not let test images shape the projection. A PCA of n training images has at
  most n - 1 informative components, so the dimension is capped at n - 1 (logged; on realbench's
  42 training pairs it is 83).
- **Adaptation** ``f(x) = ReLU(W x)``, W: 256 -> 1024 without bias (the authors' ``Adaptation``
  module), PyTorch's default Linear initialisation.
- **Loss**: S = cosine similarity matrix between the adapted left and right images of a batch of
  pairs; logits = **sigma * S** (sigma *multiplies* the cosine, i.e. it is an inverse temperature:
  the authors' code computes ``F.cross_entropy(sim * temp, arange(n))``); cross-entropy against the
  identity row-wise (left -> right) and column-wise (right -> left), averaged 0.5/0.5.
- **Optimiser**: Adam, lr 1e-3, weight decay 1e-5 (the first setting of the authors' ``train.py``).
  One "epoch" is one full-batch step over all training pairs (their loader yields the whole split
  as one batch); 150 epochs, their published command for the paper's numbers (``-e 150 -t 15``;
  their default config says 500). ``AfnConfig.batch_size`` > 0 switches to shuffled mini-batches
  for large pair sets.
- **Evaluation**: asymmetric recall aR@{1,5,20} (``eval/pairs.py``): a test pair counts if its right
  image is in the top k of its left image's ranking of the test rights, or the other way round.
  Protocol: random 75/25 splits of the pairs, repeated (default 20), reported as mean +- 2 std
  (population std, numpy's default, as the authors' ``calc_stds``), "before" (cosine on the PCA
  features, and on the raw concatenation) and "after" adaptation, for each sigma asked. We report
  the last epoch; the authors picked the epoch of best mean *test* top-1, which we do not do. They
  also trained on augmented copies of the training images; we do not augment.

Pairs come from a realbench-style directory or class folders (one pair per group), the TLL layout,
a ``left,right`` CSV (similarity/afn/pairs.py), or a ``.npz`` of features written by ``needle
similarity afn features`` (similarity/afn/pair_features.py); optional distractors are added to
both directions' galleries.

The method's modules: its settings and typed error (this module), pair sources
(similarity/afn/pairs.py), the frozen multi-stage features (similarity/afn/features.py) and their
files (similarity/afn/pair_features.py), the adaptation's training (similarity/afn/training.py), the
fitted model (similarity/afn/model.py), the evaluation protocol (similarity/afn/evaluation.py) and
the command line (similarity/afn/cli.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.errors import NeedleInputError

HEAD = "head"  # layer name of the backbone's conv head (after its BN + activation)
MODEL_FORMAT = "needle-afn-1"  # recorded in every model file
KS = (1, 5, 20)  # the paper's aR@k


class AdaptationFunctionError(NeedleInputError):
    """An adaptation-function model, feature file or setting that is missing, malformed or does not fit."""


@dataclass(frozen=True)
class FeatureConfig:
    backbone: str = "tf_efficientnet_lite0.gem"  # registry preset of the frozen backbone (its shipped weights)
    layers: tuple[str, ...] = (
        "blocks.3",
        "blocks.4",
        "blocks.5",
        "blocks.6",
        HEAD,
    )  # stage outputs, each averaged + L2-normalised
    resolution: int = 224  # longer side of the input images (aspect kept)
    batch_size: int = 16  # images per forward pass (same-size images only)

    def __post_init__(self) -> None:
        if not self.layers:
            raise AdaptationFunctionError("at least one layer is needed")
        if len(set(self.layers)) != len(self.layers):
            raise AdaptationFunctionError(f"layers repeat: {self.layers}")
        if self.resolution < 32:
            raise AdaptationFunctionError(f"resolution must be >= 32, got {self.resolution}")
        if self.batch_size < 1:
            raise AdaptationFunctionError(f"batch_size must be >= 1, got {self.batch_size}")

    def record(self) -> dict[str, Any]:
        """What decides the feature values (batch size does not)."""
        return {"backbone": self.backbone, "layers": list(self.layers), "resolution": self.resolution}


@dataclass(frozen=True)
class AfnConfig:
    pca_dim: int = 256  # PCA output dimension (capped at n_train_images - 1)
    hidden_dim: int = 1024  # output dimension of W (the adapted representation)
    sigma: float = 15.0  # logits = sigma * cosine (an inverse temperature)
    epochs: int = 150  # passes over the training pairs (full batch: one step each)
    lr: float = 1e-3  # Adam learning rate
    weight_decay: float = 1e-5  # Adam weight decay
    batch_size: int = 0  # pairs per step; 0: all training pairs in one batch (the paper)
    seed: int = 0  # initialisation and mini-batch order

    def __post_init__(self) -> None:
        for name in ("pca_dim", "hidden_dim", "epochs"):
            if getattr(self, name) < 1:
                raise AdaptationFunctionError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.sigma > 0:
            raise AdaptationFunctionError(f"sigma must be > 0, got {self.sigma}")
        if self.lr <= 0 or self.weight_decay < 0:
            raise AdaptationFunctionError(f"need lr > 0 and weight_decay >= 0, got {self.lr}, {self.weight_decay}")
        if self.batch_size < 0 or self.batch_size == 1:
            raise AdaptationFunctionError(f"batch_size must be 0 (full batch) or >= 2, got {self.batch_size}")


@dataclass(frozen=True)
class EvalConfig:
    splits: int = 20  # random train/test splits of the pairs
    test_fraction: float = 0.25  # share of pairs in each test split (floor)
    ks: tuple[int, ...] = KS  # aR@k cut-offs
    seed: int = 0  # split s uses seed + s (and the adaptation seed + s)

    def __post_init__(self) -> None:
        if self.splits < 1:
            raise AdaptationFunctionError(f"splits must be >= 1, got {self.splits}")
        if not 0 < self.test_fraction < 1:
            raise AdaptationFunctionError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        if not self.ks or any(k < 1 for k in self.ks):
            raise AdaptationFunctionError(f"k values must be >= 1, got {self.ks}")
