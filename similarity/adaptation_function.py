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

Pairs (``load_pairs``) come from: a realbench-style directory or a folder of class folders (the
first two images of every group with at least two, one pair per group, so that no split shares an
instance between train and test and the identity target has no second positive in a batch); the
TLL layout (``left/`` and ``right/`` with matching file names); a CSV with columns ``left,right``
(paths relative to the CSV's folder unless absolute); or a ``.npz`` of features written by
``needle similarity afn features``. Distractors (optional: a realbench directory's
``distractors/``, or a folder of images) are added to both directions' galleries.

CLI::

    needle similarity afn features --pairs SRC --out feats.npz [--distractors SRC]
    needle similarity afn train --pairs SRC --out model.pt [--sigma 15] [--epochs 150]
    needle similarity afn eval --pairs SRC [--model model.pt] [--splits 20] [--sigma 1 1.5 15]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.checkpoint import load_torch_file
from core.errors import NeedleInputError
from similarity.data import IMAGE_SUFFIXES, SimilarityDataError, load_groups, realbench_distractors

if TYPE_CHECKING:  # heavy imports stay inside functions: the CLI imports this module to build its parser
    import torch

log = logging.getLogger(__name__)

HEAD = "head"  # layer name of the backbone's conv head (after its BN + activation)
MODEL_FORMAT = "needle-afn-1"  # recorded in every model file
KS = (1, 5, 20)  # the paper's aR@k


class AdaptationFunctionError(NeedleInputError):
    """An adaptation-function model, feature file or setting that is missing, malformed or does not fit."""


# --- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FeatureConfig:
    backbone: str = "tf_efficientnet_lite0.gem"  # registry preset of the frozen backbone (its shipped weights)
    layers: tuple[str, ...] = ("blocks.3", "blocks.4", "blocks.5", "blocks.6", HEAD)  # stage outputs, each averaged + L2-normalised
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


# --- pairs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairSet:
    left: tuple[Path, ...]  # left image of pair i
    right: tuple[Path, ...]  # right image of pair i
    names: tuple[str, ...]  # a name per pair (group, file name or CSV row)

    def __len__(self) -> int:
        return len(self.left)


def pairs_from_groups(groups: dict[str, list[Path]]) -> PairSet:
    """One pair per group of at least two images: its first two (groups keep their file order)."""
    chosen = [(name, paths) for name, paths in groups.items() if len(paths) >= 2]
    skipped = len(groups) - len(chosen)
    if skipped:
        log.info("%d group(s) with a single image give no pair", skipped)
    return PairSet(tuple(p[0] for _, p in chosen), tuple(p[1] for _, p in chosen), tuple(n for n, _ in chosen))


def tll_pairs(root: Path) -> PairSet:
    """Totally-Looks-Like layout: ``root/left/<name>`` pairs with ``root/right/<name>``."""
    sides = {}
    for side in ("left", "right"):
        folder = root / side
        sides[side] = {p.name: p for p in sorted(folder.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES}
    only_left = sorted(set(sides["left"]) - set(sides["right"]))
    only_right = sorted(set(sides["right"]) - set(sides["left"]))
    if only_left or only_right:
        raise SimilarityDataError(f"{root}: left/ and right/ must hold the same file names; only in left/: {only_left[:3]}, "
                                  f"only in right/: {only_right[:3]}")
    names = sorted(sides["left"])
    return PairSet(tuple(sides["left"][n] for n in names), tuple(sides["right"][n] for n in names), tuple(names))


def csv_pairs(path: Path) -> PairSet:
    """A CSV with a header holding ``left,right`` (optionally ``name``); relative paths are taken
    from the CSV's folder."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or not {"left", "right"} <= set(reader.fieldnames):
            raise SimilarityDataError(f"{path}: needs a header with columns left,right, got {reader.fieldnames}")
        rows = list(reader)
    left, right, names = [], [], []
    for i, row in enumerate(rows, start=2):  # line numbers as an editor shows them (header = 1)
        pair = []
        for side in ("left", "right"):
            value = (row.get(side) or "").strip()
            image = Path(value) if Path(value).is_absolute() else path.parent / value
            if not value or not image.is_file():
                raise SimilarityDataError(f"{path}: line {i} column {side} names {value!r}, which is not a file")
            pair.append(image)
        left.append(pair[0])
        right.append(pair[1])
        names.append(row.get("name") or f"row{i}")
    return PairSet(tuple(left), tuple(right), tuple(names))


def load_pairs(source: Path | str) -> PairSet:
    """Pairs of a pairs CSV, a TLL-layout folder, a realbench-style directory or class folders."""
    source = Path(source)
    if source.is_file() and source.suffix.lower() == ".csv":
        pairs = csv_pairs(source)
    elif (source / "left").is_dir() and (source / "right").is_dir():
        pairs = tll_pairs(source)
    elif source.is_dir():
        pairs = pairs_from_groups(load_groups(source, min_size=1))
    else:
        raise SimilarityDataError(f"pairs source {source} is neither a .csv, a folder with left/ and right/, "
                                  "a realbench-style directory nor a folder of class folders")
    if len(pairs) < 2:
        raise SimilarityDataError(f"{source} gives {len(pairs)} pair(s); at least 2 are needed")
    return pairs


def load_distractor_paths(source: Path | str) -> list[Path]:
    """Distractor images: a realbench directory's ``distractors.csv`` or every image in a folder."""
    source = Path(source)
    if (source / "distractors.csv").is_file():
        return realbench_distractors(source)
    if source.is_dir():
        paths = sorted(p for p in source.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if paths:
            return paths
    raise SimilarityDataError(f"distractor source {source} is neither a realbench directory nor a folder of images")


# --- features -------------------------------------------------------------------------------------


def layer_names(depth: int) -> tuple[str, ...]:
    """The layer names a backbone with ``depth`` timm blocks offers."""
    return tuple(f"blocks.{i}" for i in range(depth)) + (HEAD,)


def build_layer_model(conf: FeatureConfig):
    """The frozen backbone as a module: normalised images (B, 3, H, W) -> (B, D) concatenated,
    per-layer L2-normalised spatial averages. Returns (module, mean, std, weights path)."""
    import torch
    from torch import nn

    from embed.models import build_global_model
    from embed.registry import get_model_config

    class LayerFeatures(nn.Module):
        def __init__(self, backbone: nn.Module, layers: tuple[str, ...]):
            super().__init__()
            if not all(hasattr(backbone, a) for a in ("conv_stem", "bn1", "blocks", "conv_head", "bn2")):
                raise AdaptationFunctionError(f"backbone {conf.backbone} is not an EfficientNet-style timm model "
                                              "(conv_stem, bn1, blocks, conv_head, bn2)")
            known = layer_names(len(backbone.blocks))
            unknown = [name for name in layers if name not in known]
            if unknown:
                raise AdaptationFunctionError(f"unknown layer(s) {unknown} of {conf.backbone}; choose from {known}")
            self.layers = layers
            self.backbone = backbone
            # Run the blocks only as deep as the deepest requested layer.
            self.depth = len(backbone.blocks) if HEAD in layers else 1 + max(int(n.split(".")[1]) for n in layers)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b = self.backbone
            h = b.bn1(b.conv_stem(x))
            maps = {}
            for i in range(self.depth):
                h = b.blocks[i](h)
                maps[f"blocks.{i}"] = h
            if HEAD in self.layers:
                maps[HEAD] = b.bn2(b.conv_head(h))
            pooled = [nn.functional.normalize(maps[name].float().mean(dim=(2, 3)), dim=1) for name in self.layers]
            return torch.cat(pooled, dim=1)

    net, weights = build_global_model(conf.backbone)
    mc = get_model_config(conf.backbone)
    return LayerFeatures(net.backbone, conf.layers).eval(), mc.mean, mc.std, weights


def extract_features(paths: list[Path] | tuple[Path, ...], conf: FeatureConfig, device: str = "cpu",
                     model: Any = None, desc: str = "afn features") -> np.ndarray:
    """(n, D) float32 features of image files (``model``: a prebuilt :func:`build_layer_model`)."""
    import torch
    from tqdm import tqdm

    from embed.extract import batches_by_shape
    from similarity.data import load_rgb

    net, mean, std, _ = model if model is not None else build_layer_model(conf)
    dev = torch.device(device)
    net.to(dev)
    mean_t = torch.tensor(mean, device=dev).view(1, 3, 1, 1)
    std_t = torch.tensor(std, device=dev).view(1, 3, 1, 1)
    rows: list[np.ndarray] = []
    chunk = 8 * conf.batch_size  # images decoded at a time: memory stays bounded on large sets
    with tqdm(total=len(paths), desc=desc, unit="img", leave=False) as bar:
        for start in range(0, len(paths), chunk):
            images = [load_rgb(p, conf.resolution) for p in paths[start : start + chunk]]
            parts: dict[int, np.ndarray] = {}
            for idx in batches_by_shape(images, conf.batch_size):
                x = torch.from_numpy(np.stack([images[i] for i in idx])).to(dev).permute(0, 3, 1, 2).float().div_(255.0)
                with torch.inference_mode():
                    feats = net((x - mean_t) / std_t).float().cpu().numpy()
                parts.update(zip(idx, feats))
                bar.update(len(idx))
            rows.append(np.stack([parts[i] for i in range(len(images))]).astype(np.float32))
    if not rows:
        raise SimilarityDataError("no images to extract features from")
    return np.concatenate(rows)


@dataclass
class PairFeatures:
    left: np.ndarray  # (n, D) float32 features of the left images
    right: np.ndarray  # (n, D) float32 features of the right images
    names: list[str]  # pair names
    feature_config: dict[str, Any]  # FeatureConfig.record() of the extraction
    distractors: np.ndarray | None = None  # (m, D) float32 or None
    sources: dict[str, Any] = field(default_factory=dict)  # where the images came from

    def __post_init__(self) -> None:
        if self.left.ndim != 2 or self.left.shape != self.right.shape or len(self.names) != len(self.left):
            raise AdaptationFunctionError(f"pair features must be two (n, D) arrays and n names, got {self.left.shape}, "
                                          f"{self.right.shape} and {len(self.names)} names")
        if self.distractors is not None and (self.distractors.ndim != 2 or self.distractors.shape[1] != self.left.shape[1]):
            raise AdaptationFunctionError(f"distractor features must be (m, {self.left.shape[1]}), got {self.distractors.shape}")

    def __len__(self) -> int:
        return len(self.left)


def compute_pair_features(pairs: PairSet, conf: FeatureConfig, distractors: list[Path] | None = None,
                          device: str = "cpu") -> PairFeatures:
    model = build_layer_model(conf)
    left = extract_features(pairs.left, conf, device, model, "afn left")
    right = extract_features(pairs.right, conf, device, model, "afn right")
    dis = extract_features(distractors, conf, device, model, "afn distractors") if distractors else None
    return PairFeatures(left, right, list(pairs.names), conf.record(), dis)


def save_pair_features(feats: PairFeatures, path: Path) -> Path:
    from core.atomic import write_atomic

    arrays = {"left": feats.left.astype(np.float32), "right": feats.right.astype(np.float32),
              "names": np.asarray(feats.names, dtype=str), "feature_config": np.asarray(json.dumps(feats.feature_config))}
    if feats.distractors is not None:
        arrays["distractors"] = feats.distractors.astype(np.float32)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to a path
            np.savez(f, **arrays)

    return write_atomic(Path(path), write)


def load_pair_features(path: Path) -> PairFeatures:
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = {"left", "right", "names", "feature_config"} - set(data.files)
            if missing:
                raise AdaptationFunctionError(f"feature file {path} lacks {sorted(missing)}; write it with `needle similarity afn features`")
            return PairFeatures(data["left"].astype(np.float32), data["right"].astype(np.float32), [str(n) for n in data["names"]],
                                json.loads(str(data["feature_config"])),
                                data["distractors"].astype(np.float32) if "distractors" in data.files else None,
                                {"features": str(path)})
    except (OSError, ValueError) as exc:
        raise AdaptationFunctionError(f"cannot read feature file {path}: {exc}") from exc


def pair_features_for(source: Path | str, conf: FeatureConfig | None, distractors: Path | str | None = None,
                      device: str = "cpu") -> PairFeatures:
    """Features of a pairs source: read from a ``.npz`` (whose recorded extraction must match
    ``conf`` when one is given), else extracted with ``conf`` (default FeatureConfig)."""
    source = Path(source)
    if source.suffix == ".npz":
        if distractors is not None:
            raise AdaptationFunctionError(f"{source} holds extracted features: extract distractors with it (`afn features --distractors`)")
        feats = load_pair_features(source)
        if conf is not None and conf.record() != feats.feature_config:
            raise AdaptationFunctionError(f"{source} was extracted with {feats.feature_config}, but {conf.record()} is asked")
        return feats
    conf = conf or FeatureConfig()
    pairs = load_pairs(source)
    dis_paths = load_distractor_paths(distractors) if distractors is not None else None
    feats = compute_pair_features(pairs, conf, dis_paths, device)
    feats.sources = {"pairs": str(source), **({"distractors": str(distractors)} if distractors is not None else {})}
    return feats


# --- PCA, adaptation, loss ------------------------------------------------------------------------


@dataclass(frozen=True)
class PCA:
    mean: np.ndarray  # (D,) float64 mean of the fitted rows
    components: np.ndarray  # (k, D) float64 orthonormal rows, by decreasing variance

    def apply(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.mean.shape[0]:
            raise AdaptationFunctionError(f"features of shape {x.shape} do not fit a PCA of D={self.mean.shape[0]}")
        return ((x - self.mean) @ self.components.T).astype(np.float32)

    @property
    def dim(self) -> int:
        return int(self.components.shape[0])


def fit_pca(x: np.ndarray, dim: int, warn: bool = True) -> PCA:
    """Centred PCA of the rows of ``x`` to min(dim, n - 1, D) components (sign fixed so that each
    component's largest-magnitude entry is positive: deterministic)."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or len(x) < 2:
        raise AdaptationFunctionError(f"PCA needs (n >= 2, D) features, got shape {x.shape}")
    k = min(dim, len(x) - 1, x.shape[1])
    if k < dim:
        (log.warning if warn else log.debug)("PCA to %d dimensions instead of %d: %d training images of dimension %d", k, dim, len(x), x.shape[1])
    mean = x.mean(axis=0)
    _, _, vt = np.linalg.svd(x - mean, full_matrices=False)
    components = vt[:k]
    signs = np.sign(components[np.arange(k), np.abs(components).argmax(axis=1)])
    return PCA(mean, components * np.where(signs == 0, 1.0, signs)[:, None])


def _adaptation_module(in_dim: int, hidden_dim: int):
    from torch import nn

    class Adaptation(nn.Module):
        """x -> ReLU(W x), W without bias (the authors' adaptation module)."""

        def __init__(self) -> None:
            super().__init__()
            self.weight_matrix = nn.Linear(in_dim, hidden_dim, bias=False)

        def forward(self, x):
            return self.weight_matrix(x).relu()

    return Adaptation()


def symmetric_loss(left: torch.Tensor, right: torch.Tensor, sigma: float) -> torch.Tensor:
    """Mean of the cross-entropies of sigma * cos(left_i, right_j) against the identity, row-wise
    (left -> right) and column-wise (right -> left)."""
    import torch
    import torch.nn.functional as F

    sim = F.normalize(left, dim=1, eps=1e-8) @ F.normalize(right, dim=1, eps=1e-8).T
    target = torch.arange(len(sim), device=sim.device)
    return 0.5 * F.cross_entropy(sigma * sim, target) + 0.5 * F.cross_entropy(sigma * sim.T, target)


def train_adaptation(left: np.ndarray, right: np.ndarray, conf: AfnConfig) -> tuple[Any, list[float]]:
    """Train ReLU(W x) on (n, k) PCA features of n pairs; returns (module in eval mode, mean loss per epoch)."""
    import torch
    from tqdm import tqdm

    left = np.asarray(left, dtype=np.float32)
    right = np.asarray(right, dtype=np.float32)
    if left.ndim != 2 or left.shape != right.shape or len(left) < 2:
        raise AdaptationFunctionError(f"training needs two (n >= 2, k) arrays of pair features, got {left.shape} and {right.shape}")
    torch.manual_seed(conf.seed)
    module = _adaptation_module(left.shape[1], conf.hidden_dim)
    optimizer = torch.optim.Adam(module.parameters(), lr=conf.lr, weight_decay=conf.weight_decay)
    L, R = torch.from_numpy(left), torch.from_numpy(right)
    generator = torch.Generator().manual_seed(conf.seed)
    n = len(left)
    history = []
    module.train()
    for _ in tqdm(range(conf.epochs), desc="afn train", unit="epoch", leave=False, disable=conf.epochs * n < 10**6):
        if conf.batch_size == 0 or conf.batch_size >= n:
            steps = [torch.arange(n)]
        else:
            order = torch.randperm(n, generator=generator)
            # A last batch of one pair has no negative (loss 0): it joins the previous batch.
            cuts = list(range(0, n, conf.batch_size))
            if n - cuts[-1] < 2:
                cuts.pop()
            steps = [order[a:b] for a, b in zip(cuts, cuts[1:] + [n])]
        losses = []
        for idx in steps:
            loss = symmetric_loss(module(L[idx]), module(R[idx]), conf.sigma)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        history.append(float(np.mean(losses)))
    return module.eval(), history


@dataclass
class AfnModel:
    pca: PCA  # the projection fitted on the training images
    weight: np.ndarray  # (hidden, k) float32: W
    sigma: float  # the sigma it was trained with (a record; not needed to embed)
    feature_config: dict[str, Any]  # FeatureConfig.record() of the features it expects

    def embed(self, x: np.ndarray) -> np.ndarray:
        """(n, D) frozen features -> (n, hidden) adapted representations ReLU(W PCA(x))."""
        return np.maximum(self.pca.apply(x) @ self.weight.T, 0.0)

    @classmethod
    def from_module(cls, pca: PCA, module: Any, sigma: float, feature_config: dict[str, Any]) -> AfnModel:
        return cls(pca, module.weight_matrix.weight.detach().cpu().numpy().astype(np.float32), sigma, feature_config)


def fit_afn(feats: PairFeatures, conf: AfnConfig, index: np.ndarray | None = None) -> tuple[AfnModel, list[float]]:
    """PCA on the images of the pairs ``index`` (default: all), then the adaptation on their pairs."""
    idx = np.arange(len(feats)) if index is None else np.asarray(index)
    pca = fit_pca(np.concatenate([feats.left[idx], feats.right[idx]]), conf.pca_dim)
    module, history = train_adaptation(pca.apply(feats.left[idx]), pca.apply(feats.right[idx]), conf)
    return AfnModel.from_module(pca, module, conf.sigma, feats.feature_config), history


def save_model(model: AfnModel, path: Path) -> Path:
    import torch

    from core.atomic import write_atomic

    state = {"format": MODEL_FORMAT, "pca_mean": torch.from_numpy(model.pca.mean), "pca_components": torch.from_numpy(model.pca.components),
             "weight": torch.from_numpy(model.weight), "sigma": float(model.sigma), "features": model.feature_config}
    return write_atomic(Path(path), lambda tmp: torch.save(state, tmp))


def load_model(path: Path | str) -> AfnModel:
    import torch

    path = Path(path)
    state = load_torch_file(path, AdaptationFunctionError, "model")
    if not isinstance(state, dict) or state.get("format") != MODEL_FORMAT:
        raise AdaptationFunctionError(f"{path} is not an adaptation-function model ({MODEL_FORMAT})")
    mean, comps, weight = (state.get(k) for k in ("pca_mean", "pca_components", "weight"))
    if not all(isinstance(t, torch.Tensor) for t in (mean, comps, weight)) or mean.ndim != 1 or comps.ndim != 2 \
            or weight.ndim != 2 or comps.shape[1] != mean.shape[0] or weight.shape[1] != comps.shape[0]:
        raise AdaptationFunctionError(f"model {path}: inconsistent shapes "
                                      f"{ {k: tuple(getattr(state.get(k), 'shape', ())) for k in ('pca_mean', 'pca_components', 'weight')} }")
    return AfnModel(PCA(mean.double().numpy(), comps.double().numpy()), weight.float().numpy(), float(state.get("sigma", 0.0)),
                    dict(state.get("features") or {}))


# --- evaluation -----------------------------------------------------------------------------------


def split_indices(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) pair indices of one random split: floor(test_fraction * n) test pairs."""
    n_test = int(np.floor(test_fraction * n))
    if n_test < 1 or n - n_test < 2:
        raise AdaptationFunctionError(f"{n} pairs cannot be split {1 - test_fraction:g}/{test_fraction:g} "
                                      f"into >= 2 training and >= 1 test pairs")
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[n_test:]), np.sort(order[:n_test])


def summarise(values: list[float]) -> dict[str, Any]:
    """Mean and 2 x (population) std of per-split values, and the values."""
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": round(float(arr.mean()), 3), "two_std": round(float(2 * arr.std()), 3), "values": [round(v, 3) for v in values]}


def _galleries(feats: PairFeatures) -> list[tuple[str, np.ndarray | None]]:
    out: list[tuple[str, np.ndarray | None]] = [("pairs", None)]
    if feats.distractors is not None and len(feats.distractors):
        out.append(("with_distractors", feats.distractors))
    return out


def sigma_key(sigma: float) -> str:
    return f"sigma={sigma:g}"


def evaluate_splits(feats: PairFeatures, conf: AfnConfig, eval_conf: EvalConfig, sigmas: tuple[float, ...] | None = None) -> dict[str, Any]:
    """The paper's protocol: per random split, PCA + adaptation trained on the training pairs, aR@k
    of the test pairs before (raw concatenation; PCA) and after adaptation, for each sigma. Returns
    per gallery ("pairs"; "with_distractors" when the features hold distractors) and row, each k's
    mean, 2 std and per-split values."""
    from tqdm import tqdm

    from eval.pairs import asymmetric_recall

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
            module, history = train_adaptation(pca.apply(feats.left[train]), pca.apply(feats.right[train]),
                                               dataclasses.replace(conf, sigma=sigma, seed=conf.seed + s))
            weight = module.weight_matrix.weight.detach().numpy().astype(np.float32)
            reps[sigma_key(sigma)] = [None if x is None else np.maximum(x @ weight.T, 0.0) for x in projected]
            final_losses[sigma_key(sigma)].append(history[-1])
        for gallery, _ in galleries:
            for row in rows:
                left, right, distractors = reps[row]
                scores = asymmetric_recall(left, right, eval_conf.ks, distractors if gallery == "with_distractors" else None)
                for k in eval_conf.ks:
                    values[gallery][row][k].append(scores[k])
    n_test = int(np.floor(eval_conf.test_fraction * n))
    result: dict[str, Any] = {
        "protocol": {"pairs": n, "train_pairs": n - n_test, "test_pairs": n_test, "splits": eval_conf.splits,
                     "test_fraction": eval_conf.test_fraction, "distractors": 0 if feats.distractors is None else len(feats.distractors),
                     "pca_dim": sorted(set(pca_dims)), "sigmas": list(sigmas), "afn": dataclasses.asdict(conf),
                     "features": feats.feature_config, "seconds": round(time.perf_counter() - start, 2)},
        "final_train_loss": {key: summarise(v) for key, v in final_losses.items()},
    }
    for gallery, _ in galleries:
        result[gallery] = {row: {f"aR@{k}": summarise(values[gallery][row][k]) for k in eval_conf.ks} for row in rows}
    return result


def evaluate_model(model: AfnModel, feats: PairFeatures, ks: tuple[int, ...] = KS) -> dict[str, Any]:
    """aR@k of all pairs of ``feats`` (plus its distractors) before (raw; the model's PCA) and after the model."""
    from eval.pairs import asymmetric_recall

    if model.feature_config and model.feature_config != feats.feature_config:
        raise AdaptationFunctionError(f"the model expects features {model.feature_config}, the pairs have {feats.feature_config}")
    rows = {"before_raw": lambda x: x, "before_pca": model.pca.apply, "after": model.embed}
    result: dict[str, Any] = {"protocol": {"pairs": len(feats), "distractors": 0 if feats.distractors is None else len(feats.distractors),
                                           "pca_dim": model.pca.dim, "sigma": model.sigma, "features": feats.feature_config}}
    for gallery, distractors in _galleries(feats):
        result[gallery] = {}
        for row, f in rows.items():
            scores = asymmetric_recall(f(feats.left), f(feats.right), ks, None if distractors is None else f(distractors))
            result[gallery][row] = {f"aR@{k}": round(v, 3) for k, v in scores.items()}
    return result


# --- stages ---------------------------------------------------------------------------------------


def features_main(conf: FeatureConfig, pairs: Path, output: Path, distractors: Path | None = None, device: str = "cpu") -> Path:
    """Extract the frozen features of a pairs source (and distractors) to ``output`` (.npz) + .json."""
    from core.atomic import write_json_atomic

    start = time.perf_counter()
    if Path(pairs).suffix == ".npz":
        raise AdaptationFunctionError(f"{pairs} already holds features; give the images' pairs source")
    feats = pair_features_for(pairs, conf, distractors, device)
    path = save_pair_features(feats, Path(output))
    write_json_atomic({"stage": "afn features", "features": conf.record(), **feats.sources, "pairs_count": len(feats),
                       "distractors_count": 0 if feats.distractors is None else len(feats.distractors),
                       "dim": int(feats.left.shape[1]), "seconds": round(time.perf_counter() - start, 2)},
                      path.with_name(path.name + ".json"))
    log.info("afn features of %d pairs (D=%d) -> %s", len(feats), feats.left.shape[1], path)
    return path


def train_main(conf: AfnConfig, pairs: Path, output: Path, feature_conf: FeatureConfig | None = None, device: str = "cpu") -> Path:
    """Fit PCA + adaptation on every pair of ``pairs``; write the model ``output`` (.pt) + .json."""
    from core.atomic import write_json_atomic

    start = time.perf_counter()
    feats = pair_features_for(pairs, feature_conf, None, device)
    model, history = fit_afn(feats, conf)
    path = save_model(model, Path(output))
    write_json_atomic({"stage": "afn train", "config": dataclasses.asdict(conf), "features": feats.feature_config,
                       "pairs": str(pairs), "pairs_count": len(feats), "pca_dim": model.pca.dim, "hidden_dim": int(model.weight.shape[0]),
                       "loss_history": [round(v, 5) for v in history], "seconds": round(time.perf_counter() - start, 2)},
                      path.with_name(path.name + ".json"))
    log.info("afn model (PCA %d -> %d, sigma %g) from %d pairs -> %s", model.pca.dim, model.weight.shape[0], conf.sigma, len(feats), path)
    return path


def eval_main(pairs: Path, output: Path | None = None, model_path: Path | None = None, conf: AfnConfig = AfnConfig(),
              eval_conf: EvalConfig = EvalConfig(), sigmas: tuple[float, ...] | None = None,
              feature_conf: FeatureConfig | None = None, distractors: Path | None = None, device: str = "cpu") -> dict[str, Any]:
    """With ``model_path``: aR@k of that model on every pair. Without: the split protocol. The
    result is returned and, with ``output``, written as JSON."""
    from core.atomic import write_json_atomic

    model = load_model(model_path) if model_path is not None else None
    if model is not None and feature_conf is None and model.feature_config:
        rec = model.feature_config
        feature_conf = FeatureConfig(backbone=rec["backbone"], layers=tuple(rec["layers"]), resolution=int(rec["resolution"]))
    feats = pair_features_for(pairs, feature_conf, distractors, device)
    if model is not None:
        result = evaluate_model(model, feats, eval_conf.ks)
        result["protocol"]["model"] = str(model_path)
    else:
        result = evaluate_splits(feats, conf, eval_conf, sigmas)
    result["protocol"]["pairs_source"] = str(pairs)
    if output is not None:
        write_json_atomic(result, Path(output))
    return result


# --- CLI ------------------------------------------------------------------------------------------


def _add_feature_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backbone", help=f"registry preset of the frozen backbone (default {FeatureConfig.backbone})")
    p.add_argument("--layers", nargs="+", help=f"stage outputs to pool (default {' '.join(FeatureConfig.layers)})")
    p.add_argument("--resolution", type=int, help=f"longer side of the images (default {FeatureConfig.resolution})")
    p.add_argument("--extract-batch-size", type=int, help=f"images per forward pass (default {FeatureConfig.batch_size})")
    p.add_argument("--device", default="cpu", help="torch device of the backbone")


def _add_train_args(p: argparse.ArgumentParser, sigma_many: bool = False) -> None:
    if sigma_many:
        p.add_argument("--sigma", type=float, nargs="+", default=[AfnConfig.sigma], help="one or more sigmas: logits = sigma * cosine")
    else:
        p.add_argument("--sigma", type=float, default=AfnConfig.sigma, help="logits = sigma * cosine")
    p.add_argument("--epochs", type=int, default=AfnConfig.epochs)
    p.add_argument("--lr", type=float, default=AfnConfig.lr)
    p.add_argument("--weight-decay", type=float, default=AfnConfig.weight_decay)
    p.add_argument("--pca-dim", type=int, default=AfnConfig.pca_dim)
    p.add_argument("--hidden-dim", type=int, default=AfnConfig.hidden_dim)
    p.add_argument("--batch-size", type=int, default=AfnConfig.batch_size, help="pairs per step; 0: full batch")
    p.add_argument("--seed", type=int, default=AfnConfig.seed)


def _feature_conf(args: argparse.Namespace) -> FeatureConfig | None:
    """The FeatureConfig the flags ask for, or None when no feature flag was given (then a feature
    file's or a model's own extraction settings apply, else the defaults)."""
    overrides = {"backbone": args.backbone, "layers": tuple(args.layers) if args.layers else None,
                 "resolution": args.resolution, "batch_size": args.extract_batch_size}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return FeatureConfig(**overrides) if overrides else None


def _afn_conf(args: argparse.Namespace, sigma: float) -> AfnConfig:
    return AfnConfig(pca_dim=args.pca_dim, hidden_dim=args.hidden_dim, sigma=sigma, epochs=args.epochs, lr=args.lr,
                     weight_decay=args.weight_decay, batch_size=args.batch_size, seed=args.seed)


def _features(args: argparse.Namespace) -> int:
    features_main(_feature_conf(args) or FeatureConfig(), Path(args.pairs), Path(args.out),
                  Path(args.distractors) if args.distractors else None, args.device)
    return 0


def _train(args: argparse.Namespace) -> int:
    train_main(_afn_conf(args, args.sigma), Path(args.pairs), Path(args.out), _feature_conf(args), args.device)
    return 0


def _strip_values(obj: Any) -> Any:
    """The result without per-split value lists (for the terminal)."""
    if isinstance(obj, dict):
        return {k: _strip_values(v) for k, v in obj.items() if k != "values"}
    return obj


def _eval(args: argparse.Namespace) -> int:
    sigmas = tuple(args.sigma)
    result = eval_main(Path(args.pairs), Path(args.out) if args.out else None, Path(args.model) if args.model else None,
                       _afn_conf(args, sigmas[0]), EvalConfig(splits=args.splits, test_fraction=args.test_fraction, ks=tuple(args.k),
                                                              seed=args.seed),
                       sigmas, _feature_conf(args), Path(args.distractors) if args.distractors else None, args.device)
    print(json.dumps(_strip_values(result), indent=2))
    return 0


def add_cli(methods: argparse._SubParsersAction) -> None:
    p = methods.add_parser("afn", help="adaptation function ReLU(W PCA(x)) on frozen multi-layer features (TLL pairs)")
    sub = p.add_subparsers(dest="afn_command", required=True)

    f = sub.add_parser("features", help="extract the frozen features of a pairs source to a .npz")
    f.add_argument("--pairs", required=True, help="pairs CSV (left,right), TLL folder (left/, right/), realbench dir or class folders")
    f.add_argument("--out", required=True, help="output .npz")
    f.add_argument("--distractors", help="realbench dir or folder of images added to both galleries at evaluation")
    _add_feature_args(f)
    f.set_defaults(func=_features)

    t = sub.add_parser("train", help="fit PCA + adaptation on every pair of a source")
    t.add_argument("--pairs", required=True, help="pairs source or a .npz from `afn features`")
    t.add_argument("--out", required=True, help="output model .pt")
    _add_train_args(t)
    _add_feature_args(t)
    t.set_defaults(func=_train)

    e = sub.add_parser("eval", help="aR@k: a trained model on every pair (--model), or the split protocol")
    e.add_argument("--pairs", required=True, help="pairs source or a .npz from `afn features`")
    e.add_argument("--model", help="a model from `afn train` (else: train and test on random splits)")
    e.add_argument("--splits", type=int, default=EvalConfig.splits, help="random splits (without --model)")
    e.add_argument("--test-fraction", type=float, default=EvalConfig.test_fraction)
    e.add_argument("--k", type=int, nargs="+", default=list(KS), help="aR@k cut-offs")
    e.add_argument("--distractors", help="realbench dir or folder of images added to both galleries")
    e.add_argument("--out", help="write the full result (with per-split values) to this JSON")
    _add_train_args(e, sigma_many=True)
    _add_feature_args(e)
    e.set_defaults(func=_eval)
