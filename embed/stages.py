"""The stage walk of an EfficientNet-style timm CNN (the shipped Lite0 and its kin): the stem
(``conv_stem``, ``bn1``), the stages (``blocks[0]``, ``blocks[1]``, ...) and the head
(``conv_head``, ``bn2``), run in that order, with the intermediate feature maps taken where asked.

The one copy for every caller that needs more than the backbone's final map: local tokens of one
stage (:class:`CNNStageTokens`, embed/locals/extract.py and FFA), the adaptation function's multi-stage
features, the 2AFC multi-stage model, and the adaptors, which cache the stem and the stages before
the first adapted one (:func:`stem_modules`) and add the head after the last (:func:`head_map`).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from core.errors import NeedleInputError

STAGE_PARTS = ("conv_stem", "bn1", "blocks", "conv_head", "bn2")  # the attributes the walk uses


def is_staged_cnn(backbone: nn.Module) -> bool:
    """Whether ``backbone`` has the parts of the walk (an EfficientNet-style timm model)."""
    return all(hasattr(backbone, part) for part in STAGE_PARTS)


def stem_modules(backbone: nn.Module, blocks: int = 0) -> nn.Sequential:
    """The stem and the first ``blocks`` stages as one module (the backbone's own submodules)."""
    return nn.Sequential(backbone.conv_stem, backbone.bn1, *backbone.blocks[:blocks])


def head_map(backbone: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The head's map (``bn2(conv_head(h))``, GeM's input) of the last stage's output ``h``."""
    return backbone.bn2(backbone.conv_head(h))


def stage_maps(
    backbone: nn.Module, x: torch.Tensor, stages: Collection[int], head: bool = False
) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
    """One pass over normalised images ``x`` (B, 3, H, W): ({block index: its output map} for the
    blocks of ``stages``, in block order; the head's map when ``head``, else None). The blocks run
    only as deep as needed."""
    wanted = set(stages)
    depth = len(backbone.blocks) if head else (max(wanted) + 1 if wanted else 0)
    h = backbone.bn1(backbone.conv_stem(x))
    maps = {}
    for i in range(depth):
        h = backbone.blocks[i](h)
        if i in wanted:
            maps[i] = h
    return maps, head_map(backbone, h) if head else None


class CNNStageTokens(nn.Module):
    """A timm CNN up to one block: its feature map's cells are the tokens, weighted by their L2 norm."""

    def __init__(self, backbone: nn.Module, stage: int):
        super().__init__()
        if not hasattr(backbone, "blocks") or not 0 <= stage < len(backbone.blocks):
            raise NeedleInputError(f"feature_stage {stage} is not a block of {type(backbone).__name__}")
        self.stem = stem_modules(backbone)
        self.blocks = backbone.blocks[: stage + 1]
        self.dim = int(self.forward_map(torch.zeros(1, 3, 32, 32)).shape[1])

    def forward_map(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.stem(x))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.forward_map(x).float()
        weight = features.norm(dim=1)
        return torch.nn.functional.normalize(features, dim=1), weight
