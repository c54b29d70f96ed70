"""Foreground feature averaging (FFA): describe an image by its foreground only.

After Kotar, Tian et al., "Are These the Same Apple? Comparing Images Based on Object Intrinsics"
(the CUTE benchmark): frozen patch features averaged over the foreground are a strong
instance-similarity baseline; background, pose and lighting weigh less than in a whole-image
descriptor. The paper uses DINOv2 patch tokens and a salient-object segmenter; here the tokens are
the cells of a frozen CNN feature map (EfficientNet-Lite0 with the shipped ImageNet weights: its last
feature map, 1280 channels at stride 32, the one the GeM global descriptor pools; or a block's
output, e.g. ``feature_stage=4``, the stride-16 stage of embed/locals/extract.py) and the foreground mask
comes from a signal that needs no extra weights:

- ``pca``: the first principal component of the image's own tokens, thresholded (above the mean by
  default); its sign is chosen so that the component correlates positively with closeness to the
  image centre (objects tend to be framed), since a principal direction has no sign of its own.
- ``norm``: the ``norm_fraction`` of tokens with the largest L2 norm (the "detector weight" the
  local tokens of embed/locals/extract.py are ranked by).
- ``none``: every token (the baseline: plain average, or GeM, over the whole map).

Any :class:`MaskFn` plugs in; :class:`PixelMaskFn` adapts a segmentation model that gives a pixel
mask (a cell is foreground when more than half of its pixels are, as the paper's code resizes).

Two modes (the paper's two variants, as named in the issue):

- ``crop-feat``: one pass over the whole image; pool only the foreground tokens.
- ``crop-img``: the bounding box of the foreground cells (in pixels, plus ``crop_margin`` cells),
  cropped from the image and resized so its longer side is ``resolution`` again; a second pass;
  pool every token of the crop (the crop is the foreground). A mask covering the whole grid gives
  the whole image, so ``crop-img`` with ``none`` is the baseline, without a second pass.

(The reference implementation's "Crop-Feat" runs the backbone on the image with its background
blacked out, its "Crop-Img" on the original image, both averaging the foreground patches; we follow
the definitions above, where crop-img re-extracts a crop.) A mask with fewer than ``min_tokens``
cells falls back to every token (counted as ``fallbacks``), as the reference code does for an empty
mask.

``needle similarity ffa eval --groups SRC --mask pca|norm|none --mode crop-feat|crop-img --out
report.json`` reports the grouped measures of eval/groups.py (top-1, mAP, K=2 k-means ARI,
odd-one-out); ``needle similarity ffa embed`` writes the descriptors.

The method's modules: its settings and typed error (this module), the foreground masks
(similarity/ffa/masks.py), the descriptors (similarity/ffa/descriptors.py), the frozen token maps
(similarity/ffa/tokens.py), evaluation and embedding of a source (similarity/ffa/stages.py) and
the command line (similarity/ffa/cli.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import NeedleInputError

MASKS = ("none", "pca", "norm")
MODES = ("crop-feat", "crop-img")
POOLINGS = ("avg", "gem")


class FFAError(NeedleInputError):
    """A bad FFA setting or input (mask, mode, image, mask shape)."""


@dataclass(frozen=True)
class FFAConfig:
    model: str = "tf_efficientnet_lite0.gem"  # registry preset (embed/models.py): backbone, weights, normalisation
    resolution: int = 384  # longer side the images are resized to (and crops re-resized to)
    feature_stage: int | None = (
        None  # None: the model's last feature map; k: the output of block k (Lite0: 4 = stride 16)
    )
    mask: str = "pca"  # foreground signal: none | pca | norm
    mode: str = "crop-feat"  # crop-feat: pool foreground tokens; crop-img: crop to the foreground box, re-extract
    pooling: str = "avg"  # avg (the paper's mean) | gem (GeM, the global descriptor's pooling)
    gem_p: float = 3.0  # GeM exponent (pooling gem only)
    norm_fraction: float = 0.5  # mask norm: share of tokens kept, those of largest L2 norm
    pca_threshold: float = 0.0  # mask pca: foreground = projection above mean + this many standard deviations
    min_tokens: int = 1  # a mask with fewer foreground cells falls back to every cell
    crop_margin: int = 0  # crop-img: token cells added around the foreground box on each side
    batch_size: int = 16  # images of one size per forward pass

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("mask", self.mask, MASKS),
            ("mode", self.mode, MODES),
            ("pooling", self.pooling, POOLINGS),
        ):
            if value not in allowed:
                raise FFAError(f"unknown {name} {value!r}; choose from {allowed}")
        if not 0.0 < self.norm_fraction <= 1.0:
            raise FFAError(f"norm_fraction must be in (0, 1], got {self.norm_fraction}")
        if (
            self.resolution < 32
            or self.min_tokens < 1
            or self.crop_margin < 0
            or self.batch_size < 1
            or self.gem_p <= 0
        ):
            raise FFAError(
                f"resolution >= 32, min_tokens >= 1, crop_margin >= 0, batch_size >= 1 and gem_p > 0 needed: {self}"
            )
