"""The settings of rerank's commands, torch-free so that ``needle <cmd> --help`` imports no stage:
the re-ranking methods and devices the flags offer (rerank/ensemble.py, rerank/device.py check
them) and ``needle ames train``'s TrainConfig and its WarpConfig (rerank/ames_train.py). The flags
of TrainConfig are its fields (cli/flags.py), their help declared with each (core.settings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from core.settings import setting

METHODS = ("sp", "chamfer", "ames")  # re-ranking methods (--rerank choices; rerank/ensemble.py)
DEVICES = ("auto", "cpu", "cuda")  # where re-ranking runs (--device choices; rerank/device.py)


@dataclass(frozen=True)
class WarpConfig:
    """The random view of an image that forms a positive pair with it."""

    rotation_deg: float = 15.0  # rotation drawn uniformly in ±rotation_deg
    scale: tuple[float, float] = (0.6, 1.4)  # zoom, log-uniform; > 1 crops, < 1 leaves black borders
    translate: float = 0.15  # shift of the centre, uniform in ± this fraction of width / height
    perspective: float = 0.08  # each corner moved by up to this fraction of the shorter side
    brightness: float = 0.3  # brightness factor uniform in 1 ± this
    contrast: float = 0.3  # contrast factor uniform in 1 ± this
    saturation: float = 0.3  # colour saturation factor uniform in 1 ± this
    gain: float = 0.1  # independent per-channel gain uniform in 1 ± this (colour cast)
    blur_prob: float = 0.3  # probability of a Gaussian blur ...
    blur_radius: tuple[float, float] = (0.3, 1.5)  # ... with a radius (pixels) uniform in this range


@dataclass(frozen=True)
class TrainConfig:
    """How an AMES model is trained; recorded in the JSON beside the checkpoint."""

    pairs: int = setting(2000, "pairs in the pool, described once and reused every epoch")
    positive_fraction: float = setting(0.5, "share of positive pairs in the pool")
    val_fraction: float = setting(0.1, "share of pairs held out to report accuracy on unseen pairs")
    epochs: int = setting(20, "passes over the training pairs")
    batch_size: int = setting(32, "pairs per optimisation step")
    lr: float = setting(2e-4, "Adam learning rate")
    weight_decay: float = setting(1e-5, "Adam (L2) weight decay")
    seed: int = setting(0, "seeds pair sampling, warps, model initialisation and shuffling")
    binarized: bool = setting(True, "train on 128-bit codes (True) or on float descriptors (False)")
    model_dim: int = setting(128, "transformer width (= bits of the codes when binarised)")
    heads: int = setting(2, "attention heads")
    layers: int = setting(5, "decoder layers")
    ff_dim: int = setting(1024, "MLP hidden width")
    max_tokens: int | None = setting(None, "keep each image's top tokens by weight (None: all it has)")
    describe_batch: int = setting(32, "images handed to describe per call (bounds memory)")
    init: str | None = setting(None, "checkpoint to fine-tune from instead of a fresh model")
    warp: WarpConfig = field(default_factory=WarpConfig)
