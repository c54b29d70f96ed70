"""The registry of local-token extractors, torch-free: named presets (``needle locals presets``),
the token kinds, the shipped ITQ projections, and the re-ranking settings each kind brings
(RERANK_BY_KIND). Building an extractor is embed/locals/extract.py's job; the global-model presets are
embed/registry.py's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from core.errors import NeedleInputError
from embed.registry import DEFAULT_MODEL

LOCAL_KINDS = ("cnn", "vit_ames", "sift", "aliked")
KEYPOINT_KINDS = ("sift", "aliked")  # kinds whose tokens are detected keypoints, not a dense grid


class UnknownLocalPresetError(NeedleInputError):
    """A local-descriptor preset name that is not in the registry."""


@dataclass(frozen=True)
class LocalConfig:
    kind: str = "cnn"  # token source: cnn | vit_ames | sift | aliked
    model: str = DEFAULT_MODEL  # registry preset of the backbone (cnn: its weights and normalisation)
    feature_stage: int = (
        4  # cnn: index of the timm block whose output are the tokens (Lite0: 4 = stride 16, 112 channels)
    )
    resolution: int = 512  # base longer side; token x, y are pixels of the image resized to it
    scales: tuple[float, ...] = (1.0,)  # resize factors of the base image that tokens are taken from
    top_k: int = 100  # tokens kept per image (per scale with per_scale), by weight
    per_scale: bool = False  # top_k at each scale (queries) instead of over all scales (database)
    itq: str | None = None  # ITQ projection .npz (key proj, d x 128); "package:<module>/<file>" for a shipped one
    keep_desc: bool = False  # also store float16 descriptors (quality-first setting, ITQ training)
    detector_weights: str | None = None  # vit_ames: the AMES detector's state dict (conv1, bn, conv2)

    def __post_init__(self) -> None:
        if self.kind not in LOCAL_KINDS:
            raise NeedleInputError(f"unknown local kind {self.kind!r}; choose from {LOCAL_KINDS}")
        if not self.scales or any(not 0.1 <= s <= 4.0 for s in self.scales):
            raise NeedleInputError(f"local scales must be factors in [0.1, 4], got {self.scales}")
        if len(self.scales) > 255:
            raise NeedleInputError("at most 255 local scales (stored as uint8 indices)")
        if self.top_k < 1:
            raise NeedleInputError(f"top_k must be >= 1, got {self.top_k}")

    @property
    def max_tokens(self) -> int:
        return self.top_k * (len(self.scales) if self.per_scale else 1)


# The ITQ projection shipped for the default CNN tokens: learned by `needle locals train-itq` on
# the demo collection's photos (scikit-image, public domain), never on evaluation data.
LITE0_ITQ = "package:embed/data/itq_lite0_s16.npz"
ALIKED_ITQ = "package:embed/data/itq_aliked_n16.npz"  # likewise, for the ALIKED-N16 keypoint tokens

LOCAL_PRESETS: dict[str, LocalConfig] = {
    # Database side: 100 tokens of one scale (2.3 KB per image in the local store).
    "lite0-s16": LocalConfig(itq=LITE0_ITQ),
    # Query side: 100 tokens at each of three scales (384, 512, 768 px longer side).
    "lite0-s16-query": LocalConfig(itq=LITE0_ITQ, scales=(0.75, 1.0, 1.5), per_scale=True),
    # AMES's DINOv2 setting: ViT-B/14 with registers, detector head; needs an ITQ file (--local-itq).
    "dinov2-ames": LocalConfig(kind="vit_ames", model="vit_base_patch14_reg4_dinov2.ames", resolution=518),
    "dinov2-ames-query": LocalConfig(
        kind="vit_ames",
        model="vit_base_patch14_reg4_dinov2.ames",
        resolution=518,
        scales=(0.707, 1.0, 1.414),
        per_scale=True,
    ),
    # Classical: RootSIFT keypoints; needs an ITQ file (--local-itq) for its 128-d descriptors.
    "sift": LocalConfig(kind="sift", resolution=512, top_k=300),
    # Learned keypoints (embed/locals/aliked.py), the default: 100 ALIKED-N16 keypoints at 512 px
    # (2.3 KB per image, as lite0-s16). realbench (bench/rerank.py): +13.4 mAP@1k with the default
    # re-ranking where lite0-s16 gives +9.4; ahead on extreme viewpoints and Phototourism, behind
    # on day/night; a forward pass of its own (~0.3 s per 512 px image on one CPU thread).
    "aliked-n16": LocalConfig(kind="aliked", itq=ALIKED_ITQ),
    # Query side: 300 keypoints at the base scale (ALIKED's keypoints are found at every scale of
    # one image; more scales cost a forward pass each).
    "aliked-n16-query": LocalConfig(kind="aliked", itq=ALIKED_ITQ, top_k=300),
}

# The database tokens of `needle demo` and bench/rerank.py unless told otherwise (realbench:
# ALIKED's re-ranking gains +13.4 mAP@1k, Lite0's +9.4).
DEFAULT_LOCALS = "aliked-n16"


@dataclass(frozen=True)
class KindRerank:
    """A token kind's re-ranking settings, where RerankConfig leaves them open (None)."""

    # Query-side extraction factors of the base resolution and tokens kept at each (the asymmetric
    # setting: queries carry more tokens than database images, at no storage cost).
    query_scales: tuple[float, ...]
    query_top_k: int
    max_hamming: int  # tentative matches within this many (weighted) differing bits of 128
    # α-QE after SP (rerank.expand.ExpansionConfig): results at the top of the re-ranked list looked
    # at (0: none), inliers each needs to be averaged in, alpha
    expansion: tuple[int, int, float] = (0, 10, 0.0)
    # SP's Chamfer term (rerank.ensemble.EnsembleConfig.chamfer_weight): the weight of the candidate's
    # Chamfer similarity in the ensemble (0: none)
    chamfer_weight: float = 0.0


RERANK_BY_KIND: dict[str, KindRerank] = {
    "cnn": KindRerank((0.75, 1.0, 1.5), 100, max_hamming=32),  # α-QE lost 0.7 on realbench
    "vit_ames": KindRerank((0.707, 1.0, 1.414), 100, max_hamming=32),
    "sift": KindRerank((1.0,), 300, max_hamming=32),
    # realbench (bench/rerank.py): every validation fold chose 28 over 32 for ALIKED's codes, and
    # α-QE over the verified top (4 folds of 5: the mean of the top 5 with >= 10 inliers); held out
    # by source, every fold chose the Chamfer term at 0.3 (62.28 mAP@1k against 60.60 without it)
    "aliked": KindRerank((1.0,), 300, max_hamming=28, expansion=(5, 10, 0.0), chamfer_weight=0.3),
}


def get_local_preset(name: str, **overrides: Any) -> LocalConfig:
    try:
        conf = LOCAL_PRESETS[name]
    except KeyError:
        raise UnknownLocalPresetError(
            f"unknown local preset {name!r}; known presets: {sorted(LOCAL_PRESETS)}"
        ) from None
    return dataclasses.replace(conf, **{k: v for k, v in overrides.items() if v is not None})
