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

The method's modules: its settings and typed error (this module), the networks
(similarity/adaptors/net.py), the pseudo-labels and neighbours (similarity/adaptors/clusters.py),
training images and crops (similarity/adaptors/images.py), training (similarity/adaptors/training.py),
adaptors files (similarity/adaptors/files.py), evaluation (similarity/adaptors/evaluation.py) and
the command line (similarity/adaptors/cli.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from core.errors import NeedleInputError
from embed.registry import DEFAULT_MODEL

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
    stages: tuple[int, ...] | None = (
        None  # indices of the backbone's blocks followed by an adaptor; None: ViT all, CNN the last two
    )
    granularities: tuple[int, ...] = (
        8,
        32,
        128,
    )  # k-means cluster counts: one pseudo-label set and one adaptor set each
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


def check_config(conf: AdaptorsConfig) -> None:
    """Typed errors for settings no training can use."""
    if len(conf.granularities) < 1 or min(conf.granularities) < 2:
        raise AdaptorsError(f"granularities must be cluster counts >= 2, got {list(conf.granularities)}")
    for name in ("resolution", "batch_size", "reduction", "fusion_dim", "neighbours", "kmeans_iterations"):
        if getattr(conf, name) < 1:
            raise AdaptorsError(f"{name} must be >= 1, got {getattr(conf, name)}")
    if conf.epochs < 0 or conf.fusion_epochs < 0:
        raise AdaptorsError(f"epochs must be >= 0, got {conf.epochs} and {conf.fusion_epochs}")
    if conf.max_images is not None and conf.max_images < max(conf.granularities):
        raise AdaptorsError(f"max_images {conf.max_images} is below the largest granularity {max(conf.granularities)}")


def mode_names(granularities: Sequence[int]) -> dict[str, str | int]:
    """Result name -> mode: frozen, one adaptor per granularity, fused."""
    return {FROZEN: FROZEN, **{f"single_k{k}": i for i, k in enumerate(granularities)}, FUSED: FUSED}


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    """``8,32,128`` -> (8, 32, 128); a typed error naming ``what`` otherwise."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise AdaptorsError(f"{what} must be comma-separated integers like 8,32,128, got {text!r}") from None
    return values
