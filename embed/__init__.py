"""Images to descriptors: the model registry, pooling, and extractors (plain library, no Ray).

Here too, torch-free so that ``needle <cmd> --help`` imports no stage, the settings of embed's
commands, their flags (cli/flags.py) with their help declared (core.settings): ``needle locals
train-itq`` (TrainITQConfig, embed/train_itq.py), ``needle adapt train`` (AdaptConfig,
embed/adapt.py), ``needle adapt whiten`` (WhitenConfig, embed/whiten.py) and ``needle adapt
make-classes`` (AugmentConfig, embed/augment.py). They live in the package's own module because
its folder holds as many modules as a folder may (tests/test_layers.py)."""

from __future__ import annotations

from dataclasses import dataclass

from core.settings import setting

WHITEN_METHODS = ("pca", "learned")  # WhitenConfig.method (embed.whiten.METHODS)
DEFAULT_EPS = 1e-3  # WhitenConfig.eps


@dataclass(frozen=True)
class TrainITQConfig:
    sample: int = setting(200_000, "descriptors drawn (uniformly over all tokens) to learn from")
    iterations: int = setting(50, "ITQ rotation updates")
    seed: int = setting(0, "sampling and rotation initialisation")


@dataclass(frozen=True)
class AdaptConfig:
    out_dim: int = setting(512, "adapted descriptor dimension (128-1024; smaller shrinks index and refine memory)")
    epochs: int = setting(2, "passes over the labelled descriptors")
    batch_size: int = setting(128, "descriptors per step (the last incomplete batch is dropped, as ILIAS does)")
    lr: float = setting(1e-3, "Adam learning rate")
    weight_decay: float = setting(1e-6, "Adam weight decay")
    scale: float = setting(16.0, "normalised-softmax scale")
    margin: float = setting(0.0, "CosFace margin subtracted from the target cosine")
    seed: int = setting(0, "initialisation and batch order")


@dataclass(frozen=True)
class WhitenConfig:
    method: str = setting(
        "pca",
        '"pca": unsupervised PCA whitening; "learned": whitening learned from same-label pairs',
    )
    out_dim: int = setting(512, "kept dimensions (at most the descriptor dimension and the number of descriptors - 1)")
    eps: float = setting(DEFAULT_EPS, "regulariser added to the eigenvalues, as a fraction of their mean")
    max_pairs: int | None = setting(
        None,
        "learned: at most this many positive pairs, a seeded uniform sample; None: all, in closed form",
    )
    seed: int = setting(0, "learned: which pairs the sample holds when max_pairs caps them")


@dataclass(frozen=True)
class AugmentConfig:
    views: int = setting(5, "views per image (one class); the first is the original when keep_original")
    seed: int = setting(0, "every view is reproducible from this and the image's position in the sorted list")
    max_side: int = setting(500, "longer side of the written JPEGs at most (images are never upscaled)")
    keep_original: bool = setting(
        True,
        "the first view is the whole image, only resized (written at the top JPEG quality)",
    )
    crop_scale: tuple[float, float] = setting(
        (0.35, 1.0),
        "random resized crop: range of the crop's share of the image area",
    )
    crop_ratio: tuple[float, float] = setting(
        (3 / 4, 4 / 3),
        "random resized crop: range of its aspect ratio w/h (log-uniform)",
    )
    flip_prob: float = setting(0.5, "probability of a horizontal flip")
    rotation_prob: float = setting(0.5, "probability of a rotation")
    max_rotation: float = setting(15.0, "rotation angle uniform in +-this many degrees, then cropped to no border")
    brightness: float = setting(0.3, "brightness factor uniform in [1 - b, 1 + b]")
    contrast: float = setting(0.3, "contrast factor uniform in [1 - c, 1 + c]")
    saturation: float = setting(0.3, "saturation factor uniform in [1 - s, 1 + s]")
    grayscale_prob: float = setting(0.1, "probability of turning the view grey (kept as 3-channel RGB)")
    jpeg_quality: tuple[int, int] = setting(
        (70, 95),
        "JPEG quality of an augmented view, uniform in this range (inclusive)",
    )
    samples_per_tar: int = setting(1000, "views per tar shard")
