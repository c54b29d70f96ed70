"""ViT patch tokens through the AMES detector head: the ``vit_ames`` local tokens.

AMES (Suma et al., "AMES: Asymmetric and Memory-Efficient Similarity Estimation for Instance-level
Retrieval", ECCV 2024) takes DINOv2 ViT-B/14-with-registers patch tokens (``x_norm_patchtokens``:
the final LayerNorm's output without the class and register tokens) and passes them through a
small detector, ``SpatialAttention2d``: a 1x1 conv + BatchNorm whose output, L2-normalised, is the
local descriptor, and a ReLU + 1x1 conv + Softplus branch giving each token a non-negative weight
(the tokens kept per image are the ``top_k`` of highest weight). The module here has the parameter
names and shapes of AMES's, so the published detector checkpoint loads unchanged.

Input sizes: AMES's extraction (``extract/image_dataset.py``, ``quantization_factor``) does not pad
but resizes each side to the nearest multiple of the patch size (``max(round(side / 14), 1)``
patches). We do the same, on the already-resized input, so that (a) descriptors match the AMES
setting the detector was trained for, without zero-padded patches at the border, and (b) the
``h x w`` token grid evenly covers the input image, which is what ``embed.locals.extract._grid_tokens``
assumes when it places each token at the centre of its cell. The price is an anisotropic rescale
by at most half a patch per side (<= 1.4 % at 518 px), which is below what the ViT can tell apart.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from core.checkpoint import load_torch_file
from core.errors import NeedleInputError
from embed.models import build_global_model
from embed.registry import RANDOM, RANDOM_SEED, WeightsError, get_model_config

if TYPE_CHECKING:  # embed.locals.extract imports this module lazily; no import cycle at run time either way
    from embed.locals.presets import LocalConfig

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
# Wrappers around a bare state dict in the checkpoints we accept (AMES saves {"state": ...}).
_STATE_WRAPPERS = ("state", "state_dict", "model")


class SpatialAttention2d(nn.Module):
    """AMES's detector head: 1x1 conv + BN -> L2-normalised descriptors; ReLU, 1x1 conv, Softplus
    -> one non-negative weight per position. Parameter names match AMES's checkpoint."""

    def __init__(self, in_c: int, bn_eps: float = 1e-5, bn_mom: float = 0.1):
        super().__init__()
        if in_c < 1:
            raise NeedleInputError(f"SpatialAttention2d needs a positive channel count, got {in_c}")
        self.conv1 = nn.Conv2d(in_c, in_c, 1, 1)
        self.bn = nn.BatchNorm2d(in_c, eps=bn_eps, momentum=bn_mom)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(in_c, 1, 1, 1)
        self.softplus = nn.Softplus(beta=1, threshold=20)
        # AMES's ResNet-style init (std sqrt(2 / fan_out), fan_out = out channels for a 1x1 conv);
        # only used when no checkpoint is given, but it keeps random-init weights in a sane range.
        for conv in (self.conv1, self.conv2):
            nn.init.normal_(conv.weight, 0.0, (2.0 / conv.out_channels) ** 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, c, h, w) -> (descriptors (B, c, h, w) L2-normalised over c, weights (B, 1, h, w) >= 0)."""
        x = self.bn(self.conv1(x))
        desc = F.normalize(x, p=2, dim=1, eps=1e-15)
        return desc, self.softplus(self.conv2(self.act1(x)))


def read_detector_state(path: Path | str) -> dict[str, torch.Tensor]:
    """A detector state dict from ``path``: bare, or wrapped in "state"/"state_dict"/"model";
    a leading "module." (DataParallel) is stripped."""
    path = Path(path)
    state: Any = load_torch_file(path, WeightsError, "detector weights file")
    for wrapper in _STATE_WRAPPERS:
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
            break
    if not isinstance(state, dict):
        raise WeightsError(f"detector weights file {path} holds a {type(state).__name__}, not a state dict")
    return {str(k).removeprefix("module."): v for k, v in state.items() if isinstance(v, torch.Tensor)}


def load_detector_weights(detector: SpatialAttention2d, path: Path | str) -> None:
    """Load an AMES detector checkpoint into ``detector``, every name and shape checked."""
    state = read_detector_state(path)
    expected = detector.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise WeightsError(
            f"detector weights file {path} does not fit SpatialAttention2d({detector.conv1.in_channels}): "
            f"missing keys {missing}, unexpected keys {unexpected}"
        )
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise WeightsError(
                f"detector weights file {path}: key {key!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(expected[key].shape)}"
            )
    detector.load_state_dict(state, strict=True)


def grid_size(height: int, width: int, patch_size: int) -> tuple[int, int]:
    """AMES's token grid for an input of ``height x width``: each side rounded to the nearest
    number of patches (at least one)."""
    return max(round(height / patch_size), 1), max(round(width / patch_size), 1)


class ViTAmesTokens(nn.Module):
    """A timm ViT's patch tokens through the AMES detector: the DenseLocalModel of ``vit_ames``.

    forward: normalised images (B, 3, H, W) -> (descriptors (B, d, h, w) float32 L2-normalised
    over d, weights (B, h, w) float32 >= 0), with ``(h, w) = grid_size(H, W, patch_size)``: the
    grid evenly covers the input (cell i spans rows ``i * H / h`` to ``(i + 1) * H / h``).

    ``precision``: "fp32", "bf16" or "fp16" autocast of the backbone, or "auto" (fp16 on CUDA,
    the preset's ``bf16_on_cpu`` on CPU, as the global extractor does). The detector head always
    runs in float32 (it is cheap, and BN statistics in bf16 would cost accuracy).
    """

    def __init__(
        self, backbone: nn.Module, detector: SpatialAttention2d, precision: str = "fp32", bf16_on_cpu: bool = False
    ):
        super().__init__()
        prefix = getattr(backbone, "num_prefix_tokens", None)
        patch_embed = getattr(backbone, "patch_embed", None)
        if prefix is None or patch_embed is None or not hasattr(backbone, "forward_features"):
            raise NeedleInputError(f"{type(backbone).__name__} is not a timm ViT (no num_prefix_tokens / patch_embed)")
        if precision not in PRECISIONS:
            raise NeedleInputError(f"unknown precision {precision!r}; choose from {PRECISIONS}")
        patch = patch_embed.patch_size
        patch = tuple(patch) if isinstance(patch, (tuple, list)) else (patch, patch)
        if patch[0] != patch[1]:
            raise NeedleInputError(f"non-square patches {patch} are not supported")
        dim = int(getattr(backbone, "num_features", 0) or getattr(backbone, "embed_dim", 0))
        if dim != detector.conv1.in_channels:
            raise NeedleInputError(f"detector for {detector.conv1.in_channels} channels on a backbone of width {dim}")
        self.backbone = backbone
        self.detector = detector
        self.num_prefix_tokens = int(prefix)
        self.patch_size = int(patch[0])
        self.dim = dim
        self.precision = precision
        self.bf16_on_cpu = bf16_on_cpu

    def _autocast(self, device: torch.device):
        precision = self.precision
        if precision == "auto":
            precision = "fp16" if device.type == "cuda" else ("bf16" if self.bf16_on_cpu else "fp32")
        if precision == "fp32":
            return nullcontext()
        return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)

    def patch_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised images (B, 3, H, W) -> the final-norm patch tokens as a float32 (B, d, h, w) map."""
        if x.ndim != 4 or x.shape[1] != 3:
            raise NeedleInputError(f"expected a (B, 3, H, W) batch, got shape {tuple(x.shape)}")
        b, _, height, width = x.shape
        h, w = grid_size(height, width, self.patch_size)
        size = (h * self.patch_size, w * self.patch_size)
        if size != (height, width):
            # AMES's quantisation: resize to whole patches (see the module docstring for why not pad).
            x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
        with self._autocast(x.device):
            tokens = self.backbone.forward_features(x)
        patches = tokens[:, self.num_prefix_tokens :].float()
        if patches.shape[1] != h * w:
            raise NeedleInputError(
                f"backbone gave {patches.shape[1]} patch tokens for a {h}x{w} grid "
                "(was it built with dynamic_img_size=True?)"
            )
        return patches.transpose(1, 2).reshape(b, self.dim, h, w)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        desc, weight = self.detector(self.patch_tokens(x))
        return desc, weight[:, 0]


def build_vit_ames(
    conf: LocalConfig, weights: str | Path | None = None, precision: str = "auto"
) -> tuple[ViTAmesTokens, tuple, tuple, Path | None]:
    """(ViTAmesTokens in eval mode, mean, std, backbone weights path) for a ``vit_ames`` LocalConfig.

    Backbone weights: ``weights`` (a local file, ``PRETRAINED`` or ``RANDOM``, see build_global_model).
    Detector weights: ``conf.detector_weights`` (a local file); a seeded random initialisation only when
    asked for (``detector_weights="random"``, or ``weights=RANDOM`` for the whole model).
    """
    mc = get_model_config(conf.model)
    if mc.library != "timm":
        raise NeedleInputError(f"vit_ames needs a timm ViT preset, {conf.model!r} is a {mc.library} model")
    random_detector = conf.detector_weights == RANDOM or (not conf.detector_weights and str(weights) == RANDOM)
    if not conf.detector_weights and not random_detector:  # before loading the backbone: fail fast
        raise WeightsError(
            f"vit_ames local tokens of {conf.model!r} need the AMES detector's weights "
            "(LocalConfig.detector_weights, --detector-weights), or a random initialisation asked for"
        )
    net, path = build_global_model(conf.model, weights)
    backbone = net.backbone
    width = int(getattr(backbone, "num_features", 0) or getattr(backbone, "embed_dim", 0))
    if width < 1:
        raise NeedleInputError(f"model {conf.model!r} ({type(backbone).__name__}) has no token width: not a ViT")
    detector = SpatialAttention2d(width)
    if not random_detector:
        load_detector_weights(detector, conf.detector_weights)
    else:
        log.warning(
            "vit_ames: the AMES detector head is randomly initialised, as asked "
            "(token weights and descriptors are meaningless for retrieval)"
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_SEED)
            detector = SpatialAttention2d(width)
    model = ViTAmesTokens(backbone, detector, precision=precision, bf16_on_cpu=mc.bf16_on_cpu)
    return model.eval(), mc.mean, mc.std, path
