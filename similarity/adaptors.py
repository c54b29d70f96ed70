"""``needle similarity adaptors``: granularity-aware adaptors on a frozen backbone (after GrAPPA:
Almazán, Ko, Gu, Larlus, Kalantidis, "Granularity-aware Adaptation for Image Retrieval over
Multiple Tasks", ECCV 2022).

The backbone stays frozen (parameters, BatchNorm statistics and dropout: it always runs in eval
mode). Small residual bottleneck adaptors are added after some of its stages:

- ViT (timm ``VisionTransformer``): one adaptor after every transformer block by default, on the
  block's output tokens: x + up(GELU(down(x))) (linear layers, one per block);
- EfficientNet-style CNN (the shipped Lite0): one adaptor after each chosen stage (a timm
  ``blocks[i]``), on its feature map: x + up(ReLU(down(x))) (1x1 convolutions). By default the last
  two stages (stride 32), so that the frozen part before them can be computed once and cached; the
  descriptor is the backbone's own: GeM (p of the registry preset) of the head's map, L2-normalised.

The up-projections start at zero: an untrained adaptor is the identity, so "frozen" is exactly the
backbone's own descriptor.

Training, on unlabelled images only (for realbench, its distractors; never the evaluation groups):

1. Pseudo-granularities. The frozen descriptors of the training images are clustered with k-means
   for each granularity k (e.g. 8, 32, 128 clusters): each clustering is one set of pseudo-labels,
   coarse to fine.
2. Adaptors. One adaptor set (one adaptor per adapted stage) per granularity, trained independently
   with its own cosine classifier over the k clusters (normalised softmax: cross-entropy of
   cos(descriptor, class weight) / temperature; class weights start at the k-means centroids).
3. Fusion. With adaptors and classifiers frozen, one fusion layer per adapted stage combines the N
   adaptors of that stage by attention, per image: the query is a projection of the pooled stage
   output h, the keys projections of the pooled adaptor outputs h + f_i(h), a softmax over the N
   adaptors weighs them, and the output is h + sum_i w_i f_i(h) (residual; the query projection
   starts at zero, so the fused model starts as the plain average of the adaptors). The fused
   descriptor is trained to serve every granularity at once (mean of the N classifiers' losses),
   plus GrAPPA's propagation of pseudo-granularity attentions across neighbours: each image's
   attentions are pulled (KL divergence) towards the mean attentions of its nearest neighbours in
   the frozen feature space (kept in a memory bank updated every step), so that images of one
   domain agree on which granularities suit them.

Sources and choices. What we could confirm of the paper (its abstract and related work): a
strong pretrained model kept frozen, several independently trained adaptor sets, one per
pseudo-label set of a different size (pseudo-granularity), obtained from unlabelled images only,
then fusion layers learned in a second stage (adaptors fixed), guided by propagating
pseudo-granularity attentions across neighbours in the feature space. The rest is our choice and
should be read as such: adaptors on block outputs (as AdapterFusion places them after the
feed-forward part; here after the whole block), the bottleneck width (channels // ``reduction``),
the normalised-softmax loss and its temperature, classifier initialisation at the centroids, the
form of the attention propagation (memory bank + KL), the pooled-query/pooled-key attention, and,
for the CNN, the adapted stages. The paper works with a self-supervised ViT, far more unlabelled
images and far more clusters; here the cluster counts follow the size of the unlabelled set. For
speed on CPU the training images are square crops at a low resolution whose frozen part is cached;
the cached CNN maps are augmented by random horizontal flips and random crops of the map (a cheap
approximation of flipping and cropping the images).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.checkpoint import load_torch_file
from core.errors import NeedleInputError
from embed.registry import DEFAULT_MODEL
from similarity.data import IMAGE_SUFFIXES, SimilarityDataError, load_groups, load_rgb, realbench_distractors

if TYPE_CHECKING:  # heavy imports stay inside functions: the CLI imports this module to build its parser
    import torch
    from torch import nn

log = logging.getLogger(__name__)

FROZEN = "frozen"  # mode: the backbone alone
FUSED = "fused"  # mode: all adaptors, combined by the fusion layers
FORMAT = "needle-adaptors-v1"
DEFAULT_BACKBONE = DEFAULT_MODEL
DEFAULT_CNN_STAGES = 2  # CNN default: adaptors after the last this-many stages


class AdaptorsError(NeedleInputError):
    """An adaptors file, backbone or training input that is missing or does not fit."""


@dataclass(frozen=True)
class AdaptorsConfig:
    backbone: str = DEFAULT_BACKBONE  # registry model (embed.models) whose backbone stays frozen
    weights: str | None = None  # local weights file for the backbone; None: the preset's own
    stages: tuple[int, ...] | None = None  # indices of the backbone's blocks followed by an adaptor; None: ViT all, CNN the last two
    granularities: tuple[int, ...] = (8, 32, 128)  # k-means cluster counts: one pseudo-label set and one adaptor set each
    reduction: int = 4  # adaptor bottleneck width = channels // reduction (our choice)
    fusion_dim: int = 64  # width of the fusion attention's query and key projections
    resolution: int = 224  # side of the square training crops
    epochs: int = 4  # passes over the training images for each adaptor set
    fusion_epochs: int = 4  # passes over the training images for the fusion layers
    batch_size: int = 64  # images per step
    lr: float = 1e-3  # AdamW learning rate of adaptors and classifiers
    fusion_lr: float = 1e-3  # AdamW learning rate of the fusion layers
    weight_decay: float = 1e-4  # AdamW weight decay
    temperature: float = 0.05  # cosine-classifier temperature of the pseudo-label loss
    neighbours: int = 10  # neighbours whose attentions each image's attentions are pulled towards
    attention_weight: float = 1.0  # weight of the neighbour attention loss against the classification losses
    kmeans_iterations: int = 50  # at most this many Lloyd iterations per clustering
    max_images: int | None = None  # train on a seeded sample of at most this many images; None: all
    seed: int = 0  # initialisation, sampling, clustering and batch order


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


def _modules():
    """The torch module classes, defined on first use so that importing this file stays light."""
    global _MODULES
    if _MODULES is None:
        _MODULES = _define_modules()
    return _MODULES


_MODULES = None


def _define_modules():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class ConvAdaptor(nn.Module):
        """Residual branch of a CNN adaptor: (B, C, H, W) -> up(ReLU(down(x))), 1x1 convolutions."""

        def __init__(self, channels: int, bottleneck: int):
            super().__init__()
            self.down = nn.Conv2d(channels, bottleneck, 1)
            self.up = nn.Conv2d(bottleneck, channels, 1)
            nn.init.zeros_(self.up.weight)  # an untrained adaptor is the identity
            nn.init.zeros_(self.up.bias)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.up(F.relu(self.down(x)))

    class TokenAdaptor(nn.Module):
        """Residual branch of a ViT adaptor: (B, T, C) -> up(GELU(down(x)))."""

        def __init__(self, channels: int, bottleneck: int):
            super().__init__()
            self.down = nn.Linear(channels, bottleneck)
            self.up = nn.Linear(bottleneck, channels)
            nn.init.zeros_(self.up.weight)
            nn.init.zeros_(self.up.bias)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.up(F.gelu(self.down(x)))

    class AdaptorSlot(nn.Module):
        """The N adaptors after one stage and their fusion layer."""

        def __init__(self, channels: int, n: int, bottleneck: int, fusion_dim: int, tokens: bool):
            super().__init__()
            make = TokenAdaptor if tokens else ConvAdaptor
            self.tokens = tokens
            self.adaptors = nn.ModuleList(make(channels, bottleneck) for _ in range(n))
            self.query = nn.Linear(channels, fusion_dim, bias=False)
            self.key = nn.Linear(channels, fusion_dim, bias=False)
            nn.init.zeros_(self.query.weight)  # uniform attention at the start: the mean of the adaptors

        def pool(self, h: torch.Tensor) -> torch.Tensor:
            return h.mean(1) if self.tokens else h.mean((2, 3))

        def fusion_weights(self, h: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
            """(B, N) softmax over adaptors; deltas (B, N, ...) are the adaptors' residual branches."""
            pooled = self.pool(h)  # (B, C)
            pooled_out = pooled[:, None] + (deltas.mean(2) if self.tokens else deltas.mean((3, 4)))  # pool(h + f_i(h))
            q = self.query(pooled)  # (B, a)
            k = self.key(pooled_out)  # (B, N, a)
            return torch.softmax((k @ q[:, :, None]).squeeze(-1) / math.sqrt(q.shape[-1]), dim=1)

        def forward(self, h: torch.Tensor, mode: str | int) -> tuple[torch.Tensor, torch.Tensor | None]:
            if mode == FROZEN:
                return h, None
            if isinstance(mode, int):
                return h + self.adaptors[mode](h), None
            deltas = torch.stack([a(h) for a in self.adaptors], 1)  # (B, N, ...)
            weights = self.fusion_weights(h, deltas)
            mixed = (weights.view(*weights.shape, *([1] * (h.ndim - 1))) * deltas).sum(1)
            return h + mixed, weights

    class CosineHead(nn.Module):
        """Pseudo-label classifier: cos(descriptor, class weight) / temperature."""

        def __init__(self, classes: int, dim: int, temperature: float):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(classes, dim) / math.sqrt(dim))
            self.temperature = temperature

        def forward(self, desc: torch.Tensor) -> torch.Tensor:
            return F.normalize(desc, dim=-1) @ F.normalize(self.weight, dim=-1).T / self.temperature

    class GeMHead(nn.Module):
        """The EfficientNet head (conv_head, bn2) and GeM pooling, L2-normalised."""

        def __init__(self, backbone: nn.Module, p: float):
            super().__init__()
            self.conv_head, self.bn2, self.p = backbone.conv_head, backbone.bn2, p

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            from embed.pooling import gem

            return F.normalize(gem(self.bn2(self.conv_head(h)), self.p), dim=-1)

    class ViTStem(nn.Module):
        """Patch embedding, position embedding and the blocks before the first adapted one."""

        def __init__(self, vit: nn.Module, first: int):
            super().__init__()
            self.vit, self.first = vit, first

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            v = self.vit
            x = v.norm_pre(v.patch_drop(v._pos_embed(v.patch_embed(x))))
            for block in v.blocks[: self.first]:
                x = block(x)
            return x

    class ViTHead(nn.Module):
        """Final norm, then the class token ("cls" pooling, as GlobalModel) or the mean of the
        patch tokens when the model has no class token, L2-normalised."""

        def __init__(self, vit: nn.Module):
            super().__init__()
            self.vit = vit

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.vit.norm(x)
            if getattr(self.vit, "cls_token", None) is not None:
                return F.normalize(x[:, 0], dim=-1)
            return F.normalize(x[:, getattr(self.vit, "num_prefix_tokens", 0):].mean(1), dim=-1)

    @dataclass
    class Parts:
        """The frozen backbone cut around its adapted stages (plain attributes: not registered
        again as submodules; the backbone itself is)."""

        stem: Callable  # images -> input of the first adapted stage (cacheable)
        stages: list  # the stages from the first adapted one on, in order
        adapted: list  # backbone block index of each of those stages
        head: Callable  # last stage output -> L2-normalised descriptor (B, D)
        tokens: bool  # ViT tokens (B, T, C) rather than CNN maps (B, C, H, W)
        fixed_size: int | None  # the square input size the backbone needs, None when any size works

    def split_backbone(backbone: nn.Module, stages: Sequence[int] | None, pooling: str, gem_p: float) -> tuple[Parts, tuple[int, ...]]:
        blocks = getattr(backbone, "blocks", None)
        is_vit = blocks is not None and hasattr(backbone, "patch_embed") and hasattr(backbone, "_pos_embed")
        is_cnn = blocks is not None and all(hasattr(backbone, a) for a in ("conv_stem", "bn1", "conv_head", "bn2"))
        if not (is_vit or is_cnn):
            raise AdaptorsError(f"adaptors support timm ViTs and EfficientNet-style CNNs; {type(backbone).__name__} is neither")
        n = len(blocks)
        if stages is None:
            stages = tuple(range(n)) if is_vit else tuple(range(max(0, n - DEFAULT_CNN_STAGES), n))
        stages = tuple(int(s) for s in stages)
        if not stages or sorted(set(stages)) != list(stages) or not all(0 <= s < n for s in stages):
            raise AdaptorsError(f"stages must be increasing block indices in [0, {n}), got {list(stages)}")
        first = stages[0]
        if is_vit:
            if pooling not in ("cls", "gem"):  # a ViT preset says "cls"; tests pass "cls"
                raise AdaptorsError(f"pooling {pooling!r} is not supported for ViT adaptors")
            dynamic = bool(getattr(backbone, "dynamic_img_size", False))
            size = getattr(backbone.patch_embed, "img_size", None)
            fixed = None if dynamic or size is None else int(size[0] if isinstance(size, (tuple, list)) else size)
            parts = Parts(ViTStem(backbone, first), list(blocks[first:]), list(range(first, n)), ViTHead(backbone), True, fixed)
        else:
            if pooling != "gem":
                raise AdaptorsError(f"CNN adaptors use the GeM descriptor; the preset's pooling is {pooling!r}")
            stem = nn.Sequential(backbone.conv_stem, backbone.bn1, *blocks[:first])
            parts = Parts(stem, list(blocks[first:]), list(range(first, n)), GeMHead(backbone, gem_p), False, None)
        return parts, stages

    class AdaptedNet(nn.Module):
        """A frozen backbone with N adaptors after each adapted stage, their fusion layers and the
        N pseudo-label classifiers. Input: normalised images (B, 3, H, W); output: L2-normalised
        descriptors (B, D) for a mode: FROZEN, an adaptor index i, or FUSED."""

        def __init__(self, backbone: nn.Module, *, granularities: Sequence[int], stages: Sequence[int] | None = None,
                     pooling: str = "gem", gem_p: float = 3.0, reduction: int = 4, fusion_dim: int = 64,
                     temperature: float = 0.05):
            super().__init__()
            if reduction < 1 or fusion_dim < 1:
                raise AdaptorsError(f"reduction and fusion_dim must be >= 1, got {reduction}, {fusion_dim}")
            self.backbone = backbone
            for p in backbone.parameters():
                p.requires_grad_(False)
            parts, self.stage_ids = split_backbone(backbone, stages, pooling, gem_p)
            object.__setattr__(self, "parts", parts)  # plain attribute: the backbone is registered once
            self.granularities = tuple(int(g) for g in granularities)
            backbone.eval()
            channels, dim = self._probe()
            n = len(self.granularities)
            self.slots = nn.ModuleDict({
                str(s): AdaptorSlot(channels[s], n, max(1, channels[s] // reduction), fusion_dim, parts.tokens)
                for s in self.stage_ids
            })
            self.heads = nn.ModuleList(CosineHead(g, dim, temperature) for g in self.granularities)
            self.dim = dim

        def _probe(self) -> tuple[dict[int, int], int]:
            side = self.parts.fixed_size or 64
            with torch.no_grad():
                h = self.parts.stem(torch.zeros(1, 3, side, side))
                channels = {}
                for index, stage in zip(self.parts.adapted, self.parts.stages):
                    h = stage(h)
                    channels[index] = int(h.shape[-1] if self.parts.tokens else h.shape[1])
                return channels, int(self.parts.head(h).shape[1])

        def train(self, mode: bool = True):
            super().train(mode)
            self.backbone.eval()  # frozen: BatchNorm statistics and dropout never change
            return self

        def stem(self, x: torch.Tensor) -> torch.Tensor:
            return self.parts.stem(x)

        def forward_cached(self, h: torch.Tensor, mode: str | int = FROZEN) -> tuple[torch.Tensor, list[torch.Tensor]]:
            """From the stem's output: (descriptors (B, D), fusion weights (B, N) per slot, FUSED only)."""
            if not (mode in (FROZEN, FUSED) or (isinstance(mode, int) and 0 <= mode < len(self.granularities))):
                raise AdaptorsError(f"mode must be {FROZEN!r}, {FUSED!r} or an adaptor index < {len(self.granularities)}, got {mode!r}")
            weights = []
            for index, stage in zip(self.parts.adapted, self.parts.stages):
                h = stage(h)
                slot = self.slots[str(index)] if str(index) in self.slots else None
                if slot is not None:
                    h, w = slot(h, mode)
                    if w is not None:
                        weights.append(w)
            return self.parts.head(h), weights

        def forward(self, x: torch.Tensor, mode: str | int = FROZEN) -> torch.Tensor:
            return self.forward_cached(self.stem(x), mode)[0]

        def adaptor_parameters(self, i: int) -> list[nn.Parameter]:
            return [p for slot in self.slots.values() for p in slot.adaptors[i].parameters()]

        def fusion_parameters(self) -> list[nn.Parameter]:
            return [p for slot in self.slots.values() for p in (*slot.query.parameters(), *slot.key.parameters())]

    return dict(ConvAdaptor=ConvAdaptor, TokenAdaptor=TokenAdaptor, AdaptorSlot=AdaptorSlot, CosineHead=CosineHead,
                AdaptedNet=AdaptedNet, split_backbone=split_backbone)


def make_adapted_net(backbone: nn.Module, **kwargs: Any) -> nn.Module:
    """The adapted network around ``backbone`` (frozen here): keyword arguments granularities,
    stages, pooling ("gem" for CNNs, "cls" for ViTs), gem_p, reduction, fusion_dim, temperature."""
    return _modules()["AdaptedNet"](backbone, **kwargs)


def build_adapted(conf: AdaptorsConfig) -> tuple[nn.Module, dict[str, Any]]:
    """The registry backbone ``conf.backbone`` (with its weights) wrapped for adaptors; returns
    (net, backbone record: name, weights file and sha256, mean, std)."""
    import torch

    from embed.extract import file_sha256
    from embed.models import build_global_model

    torch.manual_seed(conf.seed)  # the fusion keys and classifiers start from a seeded draw
    model, path = build_global_model(conf.backbone, conf.weights)
    mc = model.conf
    net = make_adapted_net(model.backbone, granularities=conf.granularities, stages=conf.stages, pooling=mc.pooling,
                     gem_p=mc.gem_p, reduction=conf.reduction, fusion_dim=conf.fusion_dim, temperature=conf.temperature)
    record = {"name": conf.backbone, "weights": str(path) if path else None,
              "weights_sha256": file_sha256(path) if path else None, "mean": list(mc.mean), "std": list(mc.std),
              "pooling": mc.pooling, "gem_p": mc.gem_p}
    return net, record


# --------------------------------------------------------------------------------------------
# Clustering and neighbours
# --------------------------------------------------------------------------------------------


def _sq_distances(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    return np.maximum((x * x).sum(1)[:, None] - 2.0 * x @ c.T + (c * c).sum(1)[None, :], 0.0)


def kmeans(x: np.ndarray, k: int, iterations: int = 50, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's k-means with k-means++ seeding: (centroids (k, d) float32, labels (n,) int64).

    On convergence every label is the nearest centroid (ties to the lower index) and every centroid
    the mean of its points; an emptied cluster is re-seeded with the point farthest from its centroid.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or not np.isfinite(x).all():
        raise AdaptorsError(f"k-means needs a finite (n, d) array, got shape {x.shape}")
    n = len(x)
    if not 2 <= k <= n:
        raise AdaptorsError(f"cannot make {k} clusters of {n} images (need 2 <= k <= images)")
    rng = np.random.default_rng(seed)
    centroids = [x[rng.integers(n)]]
    closest = _sq_distances(x, centroids[0][None])[:, 0]
    for _ in range(1, k):
        total = closest.sum()
        pick = rng.choice(n, p=closest / total) if total > 0 else rng.integers(n)
        centroids.append(x[pick])
        closest = np.minimum(closest, _sq_distances(x, x[pick][None])[:, 0])
    c = np.stack(centroids)
    labels = np.full(n, -1)
    for _ in range(iterations):
        d = _sq_distances(x, c)
        new = d.argmin(1)
        if np.array_equal(new, labels):
            break
        labels = new
        counts = np.bincount(labels, minlength=k)
        served = d[np.arange(n), labels]
        for empty in np.flatnonzero(counts == 0):
            # Re-seed with the point worst served by its centroid, taken from a cluster that keeps
            # at least one point (k <= n, so there is always one).
            far = int(np.where(counts[labels] > 1, served, -np.inf).argmax())
            counts[labels[far]] -= 1
            counts[empty] += 1
            labels[far] = empty
        c = np.zeros_like(c)
        np.add.at(c, labels, x)
        c /= np.bincount(labels, minlength=k)[:, None]
    return c.astype(np.float32), labels.astype(np.int64)


def nearest_neighbours(x: np.ndarray, k: int) -> np.ndarray:
    """(n, min(k, n - 1)) indices of each row's most similar other rows by inner product, most
    similar first, ties to the lower index."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    k = min(k, n - 1)
    if k < 1:
        raise AdaptorsError(f"nearest neighbours need at least two images, got {n}")
    order = np.argsort(-(x @ x.T), axis=1, kind="stable")
    others = order[order != np.arange(n)[:, None]].reshape(n, n - 1)
    return others[:, :k]


# --------------------------------------------------------------------------------------------
# Images and cached features
# --------------------------------------------------------------------------------------------


def training_images(source: Path | str) -> list[Path]:
    """Unlabelled training images: a realbench directory's distractors (never its groups), or
    every image file under a directory (sorted)."""
    source = Path(source)
    if (source / "distractors.csv").is_file():
        return realbench_distractors(source)
    if not source.is_dir():
        raise SimilarityDataError(f"training image directory {source} does not exist")
    paths = sorted(p for p in source.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not paths:
        raise SimilarityDataError(f"{source} holds no image file ({', '.join(IMAGE_SUFFIXES)})")
    return paths


def load_square(path: Path, side: int) -> np.ndarray:
    """(side, side, 3) uint8: the image's central square, resized (the training crop)."""
    from PIL import Image, ImageOps

    from ingest.images import RESAMPLE

    image = Image.fromarray(load_rgb(path, 2 * side))
    return np.asarray(ImageOps.fit(image, (side, side), RESAMPLE), dtype=np.uint8)


def _normalise(batch: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    import torch

    x = torch.from_numpy(np.array(batch, dtype=np.uint8)).permute(0, 3, 1, 2).float().div_(255.0)  # a writable copy
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)


def stem_features(net: nn.Module, paths: Sequence[Path], side: int, mean: Sequence[float], std: Sequence[float],
                  batch_size: int = 32) -> torch.Tensor:
    """The frozen stem's output of each image's square training crop, stacked, float16."""
    import torch
    from tqdm import tqdm

    if net.parts.fixed_size is not None and side != net.parts.fixed_size:
        raise AdaptorsError(f"this backbone needs {net.parts.fixed_size}-pixel inputs, got resolution {side}")
    out = []
    with torch.no_grad():
        for s in tqdm(range(0, len(paths), batch_size), desc="adaptors: frozen stem", unit="batch"):
            batch = np.stack([load_square(p, side) for p in paths[s : s + batch_size]])
            out.append(net.stem(_normalise(batch, mean, std)).half())
    return torch.cat(out)


def descriptors(net: nn.Module, cache: torch.Tensor, mode: str | int, batch_size: int = 128) -> np.ndarray:
    """(n, D) float32 descriptors from cached stem outputs, in eval mode."""
    import torch

    net.eval()
    with torch.no_grad():
        parts = [net.forward_cached(cache[s : s + batch_size].float(), mode)[0] for s in range(0, len(cache), batch_size)]
    return torch.cat(parts).numpy().astype(np.float32)


def _augment(h: torch.Tensor, gen: torch.Generator, tokens: bool) -> torch.Tensor:
    """Random horizontal flip and random crop of cached CNN maps (tokens pass unchanged)."""
    import torch

    if tokens:
        return h
    flip = torch.rand(len(h), generator=gen) < 0.5
    h = torch.where(flip.view(-1, 1, 1, 1), h.flip(-1), h)
    margin = h.shape[-1] // 7  # 14x14 maps (224 pixels, stride 16) lose up to 2 cells per side
    if margin == 0 or h.shape[-2] <= margin:
        return h
    height, width = h.shape[-2] - margin, h.shape[-1] - margin
    ys = torch.randint(0, margin + 1, (len(h),), generator=gen).tolist()
    xs = torch.randint(0, margin + 1, (len(h),), generator=gen).tolist()
    return torch.stack([m[:, y : y + height, x : x + width] for m, y, x in zip(h, ys, xs)])


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def _only_trainable(net: nn.Module, params: Sequence[nn.Parameter]) -> None:
    keep = {id(p) for p in params}
    net.zero_grad(set_to_none=True)  # no stale gradient of an earlier stage survives
    for p in net.parameters():
        p.requires_grad_(id(p) in keep)


def _batches(n: int, batch_size: int, gen: torch.Generator) -> list[torch.Tensor]:
    import torch

    order = torch.randperm(n, generator=gen)
    return [order[s : s + batch_size] for s in range(0, n, batch_size)]


def train_adaptor(net: nn.Module, cache: torch.Tensor, labels: np.ndarray, centroids: np.ndarray, i: int,
                  conf: AdaptorsConfig, gen: torch.Generator) -> list[float]:
    """Train adaptor set ``i`` and its classifier on pseudo-labels; returns the mean loss per epoch."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    head = net.heads[i]
    with torch.no_grad():
        head.weight.copy_(F.normalize(torch.from_numpy(centroids).float(), dim=-1))
    params = net.adaptor_parameters(i) + list(head.parameters())
    _only_trainable(net, params)
    opt = torch.optim.AdamW(params, lr=conf.lr, weight_decay=conf.weight_decay)
    target = torch.from_numpy(labels)
    losses = []
    net.train()
    for epoch in range(conf.epochs):
        total = 0.0
        steps = _batches(len(cache), conf.batch_size, gen)
        for idx in tqdm(steps, desc=f"adaptor k={net.granularities[i]} epoch {epoch + 1}/{conf.epochs}", unit="batch", leave=False):
            desc, _ = net.forward_cached(_augment(cache[idx].float(), gen, net.parts.tokens), i)
            loss = F.cross_entropy(head(desc), target[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        losses.append(total / len(cache))
        log.info("adaptor k=%d epoch %d: loss %.4f", net.granularities[i], epoch + 1, losses[-1])
    net.eval()
    return losses


def attention_propagation_loss(weights: torch.Tensor, bank: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """Mean over images and slots of KL(target || weights), target = the mean of the neighbours'
    banked fusion weights. weights (B, S, N); bank (n, S, N); neighbours (B, K) rows of the bank."""
    target = bank[neighbours].mean(1)
    return (target * (target.clamp_min(1e-12).log() - weights.clamp_min(1e-12).log())).sum(-1).mean()


def train_fusion(net: nn.Module, cache: torch.Tensor, labels: Sequence[np.ndarray], knn: np.ndarray,
                 conf: AdaptorsConfig, gen: torch.Generator) -> list[dict[str, float]]:
    """Train the fusion layers (adaptors and classifiers frozen); returns per-epoch mean losses."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    params = net.fusion_parameters()
    _only_trainable(net, params)
    opt = torch.optim.AdamW(params, lr=conf.fusion_lr, weight_decay=conf.weight_decay)
    targets = [torch.from_numpy(y) for y in labels]
    n_slots, n_adaptors = len(net.slots), len(net.granularities)
    bank = torch.full((len(cache), n_slots, n_adaptors), 1.0 / n_adaptors)
    knn_t = torch.from_numpy(knn)
    history = []
    net.train()
    for epoch in range(conf.fusion_epochs):
        sums = {"classification": 0.0, "attention": 0.0}
        steps = _batches(len(cache), conf.batch_size, gen)
        for idx in tqdm(steps, desc=f"fusion epoch {epoch + 1}/{conf.fusion_epochs}", unit="batch", leave=False):
            desc, weights = net.forward_cached(_augment(cache[idx].float(), gen, net.parts.tokens), FUSED)
            w = torch.stack(weights, 1)  # (B, S, N)
            cls = torch.stack([F.cross_entropy(h(desc), t[idx]) for h, t in zip(net.heads, targets)]).mean()
            att = attention_propagation_loss(w, bank, knn_t[idx])
            loss = cls + conf.attention_weight * att
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            bank[idx] = w.detach()
            sums["classification"] += cls.item() * len(idx)
            sums["attention"] += att.item() * len(idx)
        history.append({k: v / len(cache) for k, v in sums.items()})
        log.info("fusion epoch %d: %s", epoch + 1, history[-1])
    net.eval()
    return history


def train_adaptors(net: nn.Module, cache: torch.Tensor, conf: AdaptorsConfig) -> dict[str, Any]:
    """Pseudo-labels, the adaptor sets and the fusion, from cached stem outputs of unlabelled
    images. Returns a JSON-friendly record of the training."""
    import torch

    if len(cache) < max(conf.granularities):
        raise AdaptorsError(f"{len(cache)} training images for {max(conf.granularities)} clusters: need at least as many images")
    gen = torch.Generator().manual_seed(conf.seed)
    frozen = descriptors(net, cache, FROZEN)
    labels, record = [], {"granularities": []}
    for i, k in enumerate(net.granularities):
        centroids, y = kmeans(frozen, k, conf.kmeans_iterations, conf.seed + i)
        labels.append(y)
        losses = train_adaptor(net, cache, y, centroids, i, conf, gen)
        sizes = np.bincount(y, minlength=k)
        record["granularities"].append({"k": k, "loss_per_epoch": losses, "cluster_size_min": int(sizes.min()),
                                        "cluster_size_max": int(sizes.max())})
    knn = nearest_neighbours(frozen, conf.neighbours)
    record["fusion_loss_per_epoch"] = train_fusion(net, cache, labels, knn, conf, gen)
    record["fusion_mean_weights"] = mean_fusion_weights(net, cache)
    for p in net.parameters():
        p.requires_grad_(False)
    return record


def mean_fusion_weights(net: nn.Module, cache: torch.Tensor, batch_size: int = 128) -> dict[str, list[float]]:
    """Per adapted stage, the fusion weights of each adaptor averaged over the images."""
    import torch

    net.eval()
    with torch.no_grad():
        w = torch.cat([torch.stack(net.forward_cached(cache[s : s + batch_size].float(), FUSED)[1], 1)
                       for s in range(0, len(cache), batch_size)])
    return {f"stage_{s}": [round(float(v), 4) for v in w[:, j].mean(0)] for j, s in enumerate(net.stage_ids)}


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def save_adaptors(net: nn.Module, conf: AdaptorsConfig, backbone: dict[str, Any], output: Path) -> Path:
    """Adaptors, fusion layers and classifiers (never the backbone) with what rebuilds them."""
    import torch

    from core.atomic import write_atomic

    state = {
        "format": FORMAT,
        "config": json.dumps(asdict(conf)),
        "backbone": json.dumps(backbone),
        "stages": list(net.stage_ids),
        "slots": net.slots.state_dict(),
        "heads": net.heads.state_dict(),
    }
    return write_atomic(Path(output), lambda tmp: torch.save(state, tmp))


def load_adaptors(path: Path | str, backbone: nn.Module | None = None) -> tuple[nn.Module, AdaptorsConfig, dict[str, Any]]:
    """(net, config, backbone record) from an adaptors file. The backbone is rebuilt from the
    registry (its weights file must be the one trained with) unless a module is given."""

    from embed.extract import file_sha256
    from embed.models import build_global_model

    path = Path(path)
    state = load_torch_file(path, AdaptorsError, "adaptors file")
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise AdaptorsError(f"{path} is not a needle adaptors file (format {FORMAT})")
    raw = json.loads(state["config"])
    raw["granularities"] = tuple(raw["granularities"])
    raw["stages"] = tuple(state["stages"])
    conf = AdaptorsConfig(**raw)
    record = json.loads(state["backbone"])
    pooling, gem_p = record.get("pooling", "gem"), record.get("gem_p", 3.0)
    if backbone is None:
        model, weights = build_global_model(record["name"], conf.weights)  # None: the preset's own file, wherever installed
        if record["weights_sha256"] and (weights is None or file_sha256(weights) != record["weights_sha256"]):
            raise AdaptorsError(f"{path}: backbone weights {weights} differ from those the adaptors were trained with")
        backbone, pooling, gem_p = model.backbone, model.conf.pooling, model.conf.gem_p
    net = make_adapted_net(backbone, granularities=conf.granularities, stages=conf.stages, pooling=pooling, gem_p=gem_p,
                     reduction=conf.reduction, fusion_dim=conf.fusion_dim, temperature=conf.temperature)
    try:
        net.slots.load_state_dict(state["slots"])
        net.heads.load_state_dict(state["heads"])
    except RuntimeError as exc:
        raise AdaptorsError(f"{path} does not fit backbone {record.get('name')}: {exc}") from exc
    for p in net.parameters():
        p.requires_grad_(False)
    return net.eval(), conf, record


def check_config(conf: AdaptorsConfig) -> None:
    """Typed errors for settings no training can use."""
    if len(conf.granularities) < 1 or min(conf.granularities) < 2:
        raise AdaptorsError(f"granularities must be cluster counts >= 2, got {list(conf.granularities)}")
    for name in ("resolution", "batch_size", "reduction", "fusion_dim", "neighbours"):
        if getattr(conf, name) < 1:
            raise AdaptorsError(f"{name} must be >= 1, got {getattr(conf, name)}")
    if conf.epochs < 0 or conf.fusion_epochs < 0:
        raise AdaptorsError(f"epochs must be >= 0, got {conf.epochs} and {conf.fusion_epochs}")
    if conf.max_images is not None and conf.max_images < max(conf.granularities):
        raise AdaptorsError(f"max_images {conf.max_images} is below the largest granularity {max(conf.granularities)}")


def main(conf: AdaptorsConfig, images: Path | str, output: Path | str) -> Path:
    """Train adaptors and fusion on the unlabelled images of ``images`` (a directory, or a
    realbench directory: its distractors); write ``output`` and ``output`` + ``.json``."""
    from core.atomic import write_json_atomic

    start = time.perf_counter()
    check_config(conf)
    paths = training_images(images)
    if conf.max_images is not None and len(paths) > conf.max_images:
        keep = np.sort(np.random.default_rng(conf.seed).choice(len(paths), conf.max_images, replace=False))
        paths = [paths[i] for i in keep]
    net, backbone = build_adapted(conf)
    cache = stem_features(net, paths, conf.resolution, backbone["mean"], backbone["std"])
    record = train_adaptors(net, cache, conf)
    output = save_adaptors(net, dataclasses.replace(conf, stages=net.stage_ids), backbone, Path(output))
    write_json_atomic({
        "config": asdict(conf),
        "stages": list(net.stage_ids),
        "backbone": backbone,
        "images": str(images),
        "trained_on": len(paths),
        "trainable_parameters": sum(p.numel() for p in net.slots.parameters()),
        **record,
        "seconds": round(time.perf_counter() - start, 3),
    }, output.with_name(output.name + ".json"))
    log.info("adaptors %s trained on %d images in %.0f s", output, len(paths), time.perf_counter() - start)
    return output


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


def mode_names(granularities: Sequence[int]) -> dict[str, str | int]:
    """Result name -> mode: frozen, one adaptor per granularity, fused."""
    return {FROZEN: FROZEN, **{f"single_k{k}": i for i, k in enumerate(granularities)}, FUSED: FUSED}


def class_images(paths: Sequence[Path], net: nn.Module, resolution: int, mean: Sequence[float],
                 std: Sequence[float]) -> list[torch.Tensor]:
    """Stem outputs of evaluation images, one (1, ...) tensor each: the whole image, longer side
    ``resolution`` (the ingestion convention), or its central square when the backbone needs one."""
    import torch
    from tqdm import tqdm

    out = []
    with torch.no_grad():
        for p in tqdm(paths, desc="adaptors: evaluation images", unit="image", leave=False):
            fixed = net.parts.fixed_size
            image = load_square(p, fixed) if fixed else load_rgb(p, resolution)
            out.append(net.stem(_normalise(image[None], mean, std)))
    return out


def evaluate_net(net: nn.Module, stems: Sequence[torch.Tensor], labels: Sequence[str],
                 modes: dict[str, str | int]) -> dict[str, dict[str, float]]:
    """MAP@R and R-Precision (x 100) of each mode on the evaluation images' cached stem outputs."""

    from eval.class_retrieval import class_retrieval_from_embeddings

    results = {}
    for name, mode in modes.items():
        metrics = class_retrieval_from_embeddings(eval_descriptors(net, stems, mode), labels)
        results[name] = {"map_at_r": round(metrics["map_at_r"], 3), "r_precision": round(metrics["r_precision"], 3)}
    return results


def eval_descriptors(net: nn.Module, stems: Sequence[torch.Tensor], mode: str | int) -> np.ndarray:
    """(n, D) float32 descriptors of evaluation images (one stem output each) for ``mode``."""
    import torch

    net.eval()
    with torch.no_grad():
        return torch.cat([net.forward_cached(h, mode)[0] for h in stems]).numpy().astype(np.float32)


def evaluate(classes: Path | str, model: Path | str | None = None, backbone: str = DEFAULT_BACKBONE,
             weights: str | None = None, resolution: int = 224, min_size: int = 2) -> dict[str, Any]:
    """MAP@R and R-Precision on labelled classes (realbench groups or class folders; classes of at
    least ``min_size`` images, each image querying all the others): the frozen backbone, and with
    an adaptors file also each single adaptor and the fused adaptors."""
    groups = load_groups(classes, min_size)
    if not groups:
        raise SimilarityDataError(f"{classes} holds no class with at least {min_size} images")
    paths = [p for g in groups for p in groups[g]]
    labels = [g for g in groups for _ in groups[g]]
    if model is not None:
        net, conf, record = load_adaptors(model)
        modes = mode_names(conf.granularities)
    else:
        net, record = build_adapted(AdaptorsConfig(backbone=backbone, weights=weights, granularities=(2,)))
        modes = {FROZEN: FROZEN}
    stems = class_images(paths, net, resolution, record["mean"], record["std"])
    return {
        "classes": str(classes), "model": str(model) if model else None, "backbone": record["name"],
        "images": len(paths), "groups": len(groups), "resolution": resolution,
        "results": evaluate_net(net, stems, labels, modes),
    }


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    """``8,32,128`` -> (8, 32, 128); a typed error naming ``what`` otherwise."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise AdaptorsError(f"{what} must be comma-separated integers like 8,32,128, got {text!r}") from None
    return values


def _train(args: argparse.Namespace) -> int:
    conf = AdaptorsConfig(
        backbone=args.backbone, weights=args.weights,
        stages=parse_ints(args.stages, "--stages") if args.stages else None,
        granularities=parse_ints(args.granularities, "--granularities"), reduction=args.reduction,
        resolution=args.resolution, epochs=args.epochs, fusion_epochs=args.fusion_epochs,
        batch_size=args.batch_size, max_images=args.max_images, seed=args.seed,
    )
    main(conf, Path(args.images), Path(args.out))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from core.atomic import write_json_atomic

    result = evaluate(Path(args.classes), Path(args.model) if args.model else None, args.backbone, args.weights,
                      args.resolution, args.min_size)
    if args.out:
        write_json_atomic(result, Path(args.out))
    print(json.dumps(result, indent=2))
    return 0


def add_cli(methods: argparse._SubParsersAction) -> None:
    p = methods.add_parser("adaptors", help="granularity-aware adaptors with attention fusion on a frozen backbone (GrAPPA)")
    sub = p.add_subparsers(dest="adaptors_command", required=True)
    t = sub.add_parser("train", help="train one adaptor set per pseudo-granularity (k-means of frozen features), then their fusion")
    t.add_argument("--images", required=True, help="unlabelled images: a directory, or a realbench directory (its distractors only)")
    t.add_argument("--out", required=True, help="adaptors file to write (.pt), with a .json beside it")
    t.add_argument("--granularities", default="8,32,128", help="k-means cluster counts, one adaptor set each")
    t.add_argument("--backbone", default=DEFAULT_BACKBONE, help="registry model kept frozen (needle models)")
    t.add_argument("--weights", help="local weights file for the backbone (default: the preset's)")
    t.add_argument("--stages", help="backbone block indices followed by adaptors, e.g. 5,6 (default: ViT all, CNN the last two)")
    t.add_argument("--reduction", type=int, default=4, help="adaptor bottleneck = channels // reduction")
    t.add_argument("--resolution", type=int, default=224, help="side of the square training crops")
    t.add_argument("--epochs", type=int, default=4, help="epochs per adaptor set")
    t.add_argument("--fusion-epochs", type=int, default=4, help="epochs of fusion training")
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--max-images", type=int, help="train on a seeded sample of this many images")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_train)
    e = sub.add_parser("eval", help="MAP@R and R-Precision on labelled classes: frozen, each single adaptor, fused")
    e.add_argument("--classes", required=True, help="realbench directory (groups.csv) or a folder of class folders")
    e.add_argument("--model", help="adaptors file from 'train' (default: the frozen backbone only)")
    e.add_argument("--backbone", default=DEFAULT_BACKBONE, help="without --model: the registry model to evaluate")
    e.add_argument("--weights", help="without --model: local weights file for the backbone")
    e.add_argument("--resolution", type=int, default=224, help="longer side of the evaluation images")
    e.add_argument("--min-size", type=int, default=2, help="classes with fewer images are left out")
    e.add_argument("--out", help="also write the metrics JSON here")
    e.set_defaults(func=_eval)
