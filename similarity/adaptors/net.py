"""The adaptors' networks: the frozen backbone cut around its adapted stages, the residual bottleneck
adaptors after each adapted stage, their attention fusion, and the pseudo-label classifiers.

ViT (timm ``VisionTransformer``): an adaptor after each chosen transformer block, on the block's
output tokens: x + up(GELU(down(x))) (linear layers). EfficientNet-style CNN (the shipped Lite0): an
adaptor after each chosen stage (a timm ``blocks[i]``), on its feature map: x + up(ReLU(down(x)))
(1x1 convolutions); the stem and the stages before the first adapted one are cut off as one module
(embed/stages.py) so that their output can be cached, and the descriptor is the backbone's own: GeM
(p of the registry preset) of the head's map, L2-normalised. The up-projections start at zero: an
untrained adaptor is the identity, so "frozen" is exactly the backbone's own descriptor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from embed.pooling import gem
from embed.stages import head_map, is_staged_cnn, stem_modules
from similarity.adaptors.config import DEFAULT_CNN_STAGES, FROZEN, FUSED, AdaptorsConfig, AdaptorsError


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
    """The EfficientNet head's map (conv_head, bn2: embed/stages.py) GeM-pooled, L2-normalised."""

    def __init__(self, backbone: nn.Module, p: float):
        super().__init__()
        self.backbone, self.p = backbone, p

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.normalize(gem(head_map(self.backbone, h), self.p), dim=-1)


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
        return F.normalize(x[:, getattr(self.vit, "num_prefix_tokens", 0) :].mean(1), dim=-1)


@dataclass
class BackboneParts:
    """The frozen backbone cut around its adapted stages (plain attributes: not registered
    again as submodules; the backbone itself is)."""

    stem: Callable  # images -> input of the first adapted stage (cacheable)
    stages: list  # the stages from the first adapted one on, in order
    adapted: list  # backbone block index of each of those stages
    head: Callable  # last stage output -> L2-normalised descriptor (B, D)
    tokens: bool  # ViT tokens (B, T, C) rather than CNN maps (B, C, H, W)
    fixed_size: int | None  # the square input size the backbone needs, None when any size works


def split_backbone(
    backbone: nn.Module, stages: Sequence[int] | None, pooling: str, gem_p: float
) -> tuple[BackboneParts, tuple[int, ...]]:
    """The backbone cut before its first adapted stage (a cacheable stem), its stages from there on,
    and its descriptor head; with the adapted stages (default: ViT every block, CNN the last
    ``DEFAULT_CNN_STAGES``). Typed errors for other backbones, stages or poolings."""
    blocks = getattr(backbone, "blocks", None)
    is_vit = blocks is not None and hasattr(backbone, "patch_embed") and hasattr(backbone, "_pos_embed")
    is_cnn = blocks is not None and is_staged_cnn(backbone)
    if not (is_vit or is_cnn):
        raise AdaptorsError(
            f"adaptors support timm ViTs and EfficientNet-style CNNs; {type(backbone).__name__} is neither"
        )
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
        parts = BackboneParts(
            ViTStem(backbone, first), list(blocks[first:]), list(range(first, n)), ViTHead(backbone), True, fixed
        )
    else:
        if pooling != "gem":
            raise AdaptorsError(f"CNN adaptors use the GeM descriptor; the preset's pooling is {pooling!r}")
        stem = stem_modules(backbone, first)
        parts = BackboneParts(stem, list(blocks[first:]), list(range(first, n)), GeMHead(backbone, gem_p), False, None)
    return parts, stages


class AdaptedNet(nn.Module):
    """A frozen backbone with N adaptors after each adapted stage, their fusion layers and the
    N pseudo-label classifiers. Input: normalised images (B, 3, H, W); output: L2-normalised
    descriptors (B, D) for a mode: FROZEN, an adaptor index i, or FUSED."""

    def __init__(
        self,
        backbone: nn.Module,
        *,
        granularities: Sequence[int],
        stages: Sequence[int] | None = None,
        pooling: str = "gem",
        gem_p: float = 3.0,
        reduction: int = 4,
        fusion_dim: int = 64,
        temperature: float = 0.05,
    ):
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
        self.slots = nn.ModuleDict(
            {
                str(s): AdaptorSlot(channels[s], n, max(1, channels[s] // reduction), fusion_dim, parts.tokens)
                for s in self.stage_ids
            }
        )
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
            raise AdaptorsError(
                f"mode must be {FROZEN!r}, {FUSED!r} or an adaptor index < {len(self.granularities)}, got {mode!r}"
            )
        weights = []
        for index, stage in zip(self.parts.adapted, self.parts.stages):
            h = stage(h)
            if str(index) in self.slots:
                h, w = self.slots[str(index)](h, mode)
                if w is not None:
                    weights.append(w)
        return self.parts.head(h), weights

    def forward(self, x: torch.Tensor, mode: str | int = FROZEN) -> torch.Tensor:
        return self.forward_cached(self.stem(x), mode)[0]

    def adaptor_parameters(self, i: int) -> list[nn.Parameter]:
        return [p for slot in self.slots.values() for p in slot.adaptors[i].parameters()]

    def fusion_parameters(self) -> list[nn.Parameter]:
        return [p for slot in self.slots.values() for p in (*slot.query.parameters(), *slot.key.parameters())]


def make_adapted_net(backbone: nn.Module, **kwargs: Any) -> AdaptedNet:
    """The adapted network around ``backbone`` (frozen here): keyword arguments granularities,
    stages, pooling ("gem" for CNNs, "cls" for ViTs), gem_p, reduction, fusion_dim, temperature."""
    return AdaptedNet(backbone, **kwargs)


def build_adapted(conf: AdaptorsConfig) -> tuple[AdaptedNet, dict[str, Any]]:
    """The registry backbone ``conf.backbone`` (with its weights) wrapped for adaptors; returns
    (net, backbone record: name, weights file and sha256, mean, std)."""
    from embed.extract import file_sha256
    from embed.models import build_global_model

    torch.manual_seed(conf.seed)  # the fusion keys and classifiers start from a seeded draw
    model, path = build_global_model(conf.backbone, conf.weights)
    mc = model.conf
    net = make_adapted_net(
        model.backbone,
        granularities=conf.granularities,
        stages=conf.stages,
        pooling=mc.pooling,
        gem_p=mc.gem_p,
        reduction=conf.reduction,
        fusion_dim=conf.fusion_dim,
        temperature=conf.temperature,
    )
    record = {
        "name": conf.backbone,
        "weights": str(path) if path else None,
        "weights_sha256": file_sha256(path) if path else None,
        "mean": list(mc.mean),
        "std": list(mc.std),
        "pooling": mc.pooling,
        "gem_p": mc.gem_p,
    }
    return net, record
