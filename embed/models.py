"""Building a global-descriptor model from a registry preset (embed/registry.py): the backbone,
its weights (a local file, a packaged file, the published ones, or a seeded random init) and the
pooling that turns its output into one L2-normalised vector.

Aspect ratio: timm ViTs are built with ``dynamic_img_size=True`` (position embeddings interpolated)
and the input is padded right/bottom to a multiple of the patch size, as ILIAS does. open_clip's
ViTs, EVA and ModifiedResNet towers have fixed position embeddings: their input is padded to a
square and resized to the train resolution (``square_input``), so their test resolution is the
train one. open_clip ConvNeXt towers take any size.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from core.errors import NeedleInputError
from embed.pooling import gem, l2_normalize
from embed.registry import (
    LIBRARIES,
    POOLINGS,
    PRETRAINED,
    RANDOM,
    RANDOM_SEED,
    ModelConfig,
    WeightsError,
    check_published_weights,
    check_weights,
    get_model_config,
    resolve_weights,
    weights_help,
)
from ingest.torchvision_compat import ensure_torchvision_importable

log = logging.getLogger(__name__)


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file; name the file in one
        raise WeightsError(f"cannot load weights file {path}: {type(exc).__name__}: {exc}") from exc
    for wrapper in ("state_dict", "model", "module"):
        if isinstance(state, dict) and wrapper in state and isinstance(state[wrapper], dict):
            state = state[wrapper]
    if not isinstance(state, dict):
        raise WeightsError(f"weights file {path} holds a {type(state).__name__}, not a state dict")
    return {k.removeprefix("module."): v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _map_in_order(
    source: dict[str, torch.Tensor], target: dict[str, torch.Tensor], path: Path
) -> dict[str, torch.Tensor]:
    if len(source) != len(target):
        raise WeightsError(
            f"weights file {path} has {len(source)} tensors, the model {len(target)}: cannot map in order"
        )
    mapped = {}
    for (src_name, tensor), (dst_name, expected) in zip(source.items(), target.items()):
        if tensor.shape != expected.shape:
            raise WeightsError(
                f"weights file {path}: tensor {src_name} {tuple(tensor.shape)} does not fit "
                f"{dst_name} {tuple(expected.shape)} when mapped in order"
            )
        mapped[dst_name] = tensor
    return mapped


def load_weights(module: nn.Module, path: Path, mapping: str = "by_name") -> None:
    """Load a local state dict into ``module``: "by_name" (strict), "in_order" (by position, shapes
    checked) or "auto" (by name when the names match, else in order)."""
    state = _read_state_dict(path)
    if "mask_token" in state and hasattr(module, "patch_embed"):
        # The original DINOv2 release's layout (mask token, registers apart, 1370 positions):
        # timm's own filter turns it into timm's names and shapes.
        from timm.models.vision_transformer import checkpoint_filter_fn

        state = checkpoint_filter_fn(state, module)
    if mapping == "auto":
        # A file in the model's own naming loads by name; a foreign one (another codebase's
        # names, same layers) is mapped by position, every shape checked.
        mapping = "by_name" if set(state) == set(module.state_dict()) else "in_order"
        log.info("loading %s %s", path, "by name" if mapping == "by_name" else "by position (foreign names)")
    if mapping == "in_order":
        state = _map_in_order(state, module.state_dict(), path)
    elif mapping != "by_name":
        raise WeightsError(f"unknown weights mapping {mapping!r}")
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise WeightsError(
            f"weights file {path} does not match the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )


class GlobalModel(nn.Module):
    """Normalised image batch (B, 3, H, W) -> L2-normalised float32 global descriptors (B, D)."""

    def __init__(self, conf: ModelConfig, backbone: nn.Module):
        super().__init__()
        if conf.pooling not in POOLINGS:
            raise NeedleInputError(f"unknown pooling {conf.pooling!r}; choose from {POOLINGS}")
        if conf.library == "open_clip" and conf.pooling != "head":
            raise NeedleInputError(f"open_clip models support pooling 'head' only, got {conf.pooling!r}")
        self.conf = conf
        self.backbone = backbone

    def _fit_input(self, x: torch.Tensor) -> torch.Tensor:
        """Pad ViT inputs to a multiple of the patch size; pad+resize fixed-size open_clip towers to their square."""
        h, w = x.shape[-2:]
        if self.conf.square_input:
            side = max(h, w)
            if (h, w) != (side, side):
                x = torch.nn.functional.pad(x, (0, side - w, 0, side - h))
            size = self.conf.train_resolution
            if side != size:
                x = torch.nn.functional.interpolate(
                    x, size=(size, size), mode="bilinear", align_corners=False, antialias=True
                )
            return x
        patch = self._patch_size()
        if patch is not None:
            pad_h, pad_w = (-h) % patch[0], (-w) % patch[1]
            if pad_h or pad_w:
                x = torch.nn.functional.pad(x, (0, pad_w, 0, pad_h))
        return x

    def _patch_size(self) -> tuple[int, int] | None:
        patch_embed = getattr(self.backbone, "patch_embed", None)
        patch = getattr(patch_embed, "patch_size", None) if patch_embed is not None else None
        return None if patch is None else (int(patch[0]), int(patch[1]))

    def input_shape(self, height: int, width: int) -> tuple[int, int]:
        """The (H, W) an image of that size is zero-padded to before the backbone (``_fit_input``'s
        padding, before any resize). Images with equal input shapes can share a batch, each
        zero-padded to it, with exactly the descriptors they get alone."""
        if self.conf.square_input:
            side = max(height, width)
            return side, side
        patch = self._patch_size()
        if patch is not None:
            return height + (-height) % patch[0], width + (-width) % patch[1]
        return height, width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._fit_input(x)
        if self.conf.library == "open_clip":
            return l2_normalize(self.backbone.encode_image(x))
        if self.conf.pooling == "head":
            return l2_normalize(self.backbone.forward_head(self.backbone.forward_features(x), pre_logits=True))
        features = self.backbone.forward_features(x)
        if self.conf.pooling == "gem":
            if features.ndim != 4:
                raise NeedleInputError(
                    f"GeM needs a CNN feature map; {self.conf.architecture} gives shape {tuple(features.shape)}"
                )
            return l2_normalize(gem(features, self.conf.gem_p))
        if features.ndim != 3:
            raise NeedleInputError(
                f"'cls' pooling needs tokens; {self.conf.architecture} gives shape {tuple(features.shape)}"
            )
        return l2_normalize(features[:, 0])


def _create_backbone(conf: ModelConfig, pretrained: bool = False, name: str = "") -> nn.Module:
    ensure_torchvision_importable()
    kwargs = dict(conf.factory_kwargs)
    name = name or conf.architecture
    if pretrained:
        check_published_weights(conf, name)
    try:
        if conf.library == "timm":
            import timm

            return timm.create_model(
                conf.pretrained or conf.architecture if pretrained else conf.architecture,
                pretrained=pretrained,
                **kwargs,
            )
        if conf.library == "open_clip":
            import open_clip

            return open_clip.create_model(
                conf.architecture, pretrained=conf.pretrained if pretrained else None, **kwargs
            )
    except Exception as exc:
        if not pretrained:
            raise
        raise WeightsError(
            f"cannot fetch the published weights of model {name!r} ({conf.pretrained or conf.architecture}): "
            f"{type(exc).__name__}: {exc}; {weights_help(name)}"
        ) from exc
    raise NeedleInputError(f"unknown model library {conf.library!r}; choose from {LIBRARIES}")


def build_global_model(
    name: str, weights: str | Path | None = None, pretrained: bool = False
) -> tuple[GlobalModel, Path | None]:
    """Build the model ``name`` (preset or generic spec) in eval mode with its weights; returns (model, weights path).

    ``weights``: a local file, None for the preset's packaged file, ``PRETRAINED`` (or
    ``pretrained=True``) to fetch the published weights through timm / open_clip (offline or on a
    failed fetch: WeightsError), or ``RANDOM`` for a seeded random initialisation (the same network
    in every process: meaningless for retrieval, useful for tests and timing). A model with none of
    these is a WeightsError: it is never randomly initialised unless asked.
    """
    conf = get_model_config(name)
    if weights is not None and str(weights) == PRETRAINED:
        weights, pretrained = None, True
    if pretrained and weights is not None:
        raise WeightsError(f"model {name!r}: give either a local weights file or pretrained, not both")
    check_weights(name, PRETRAINED if pretrained else weights)  # the one-line errors a job also checks first
    if weights is not None and str(weights) == RANDOM:
        log.warning("model %s: seeded random initialisation, as asked (meaningless for retrieval)", name)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_SEED)
            return GlobalModel(conf, _create_backbone(conf, False, name)).eval(), None
    backbone = _create_backbone(conf, pretrained, name)
    if pretrained:
        return GlobalModel(conf, backbone).eval(), None
    path = resolve_weights(conf, weights)
    load_weights(backbone, path, conf.weights_mapping if weights is None else "auto")
    return GlobalModel(conf, backbone).eval(), path
