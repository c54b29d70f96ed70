"""Foreground feature averaging (FFA): describe an image by its foreground only.

After Kotar, Tian et al., "Are These the Same Apple? Comparing Images Based on Object Intrinsics"
(the CUTE benchmark): frozen patch features averaged over the foreground are a strong
instance-similarity baseline; background, pose and lighting weigh less than in a whole-image
descriptor. The paper uses DINOv2 patch tokens and a salient-object segmenter; here the tokens are
the cells of a frozen CNN feature map (EfficientNet-Lite0 with the shipped ImageNet weights: its last
feature map, 1280 channels at stride 32, the one the GeM global descriptor pools; or a block's
output, e.g. ``feature_stage=4``, the stride-16 stage of embed/locals.py) and the foreground mask
comes from a signal that needs no extra weights:

- ``pca``: the first principal component of the image's own tokens, thresholded (above the mean by
  default); its sign is chosen so that the component correlates positively with closeness to the
  image centre (objects tend to be framed), since a principal direction has no sign of its own.
- ``norm``: the ``norm_fraction`` of tokens with the largest L2 norm (the "detector weight" the
  local tokens of embed/locals.py are ranked by).
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
the definitions above, where crop-img re-extracts a crop.) A mask with fewer than ``min_tokens`` cells falls back to every
token (counted as ``fallbacks``), as the reference code does for an empty mask.

``needle similarity ffa eval --groups SRC --mask pca|norm|none --mode crop-feat|crop-img --out
report.json`` reports the grouped measures of eval/groups.py (top-1, mAP, K=2 k-means ARI,
odd-one-out); ``needle similarity ffa embed`` writes the descriptors.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from core.errors import NeedleInputError
from embed.registry import DEFAULT_MODEL

if TYPE_CHECKING:  # heavy imports stay out of CLI start-up
    from eval.groups import GroupEvalConfig

log = logging.getLogger(__name__)

MASKS = ("none", "pca", "norm")
MODES = ("crop-feat", "crop-img")
POOLINGS = ("avg", "gem")


class FFAError(NeedleInputError):
    """A bad FFA setting or input (mask, mode, image, mask shape)."""


@dataclass(frozen=True)
class FFAConfig:
    model: str = "tf_efficientnet_lite0.gem"  # registry preset (embed/models.py): backbone, weights, normalisation
    resolution: int = 384  # longer side the images are resized to (and crops re-resized to)
    feature_stage: int | None = None  # None: the model's last feature map; k: the output of block k (Lite0: 4 = stride 16)
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
        for name, value, allowed in (("mask", self.mask, MASKS), ("mode", self.mode, MODES), ("pooling", self.pooling, POOLINGS)):
            if value not in allowed:
                raise FFAError(f"unknown {name} {value!r}; choose from {allowed}")
        if not 0.0 < self.norm_fraction <= 1.0:
            raise FFAError(f"norm_fraction must be in (0, 1], got {self.norm_fraction}")
        if self.resolution < 32 or self.min_tokens < 1 or self.crop_margin < 0 or self.batch_size < 1 or self.gem_p <= 0:
            raise FFAError(f"resolution >= 32, min_tokens >= 1, crop_margin >= 0, batch_size >= 1 and gem_p > 0 needed: {self}")


# --- masks -------------------------------------------------------------------------------------


class MaskFn(Protocol):
    """A foreground mask on the token grid; anything with this call plugs into FFA."""

    name: str  # recorded in reports

    def __call__(self, tokens: np.ndarray, image: np.ndarray) -> np.ndarray:
        """tokens (h, w, d) float32 and the image they come from (H, W, 3) uint8 -> (h, w) bool."""
        ...


def centredness(h: int, w: int) -> np.ndarray:
    """(h, w): 1 at the grid centre, 0 on the outermost ring (normalised Chebyshev distance)."""
    ys = np.abs(np.arange(h) - (h - 1) / 2) / max((h - 1) / 2, 1e-9) if h > 1 else np.zeros(1)
    xs = np.abs(np.arange(w) - (w - 1) / 2) / max((w - 1) / 2, 1e-9) if w > 1 else np.zeros(1)
    return 1.0 - np.maximum(ys[:, None], xs[None, :])


def first_component_projection(tokens: np.ndarray) -> np.ndarray:
    """(h, w) projections of the centred tokens on their first principal direction, the sign
    chosen so that the projection correlates non-negatively with :func:`centredness`."""
    h, w, d = tokens.shape
    x = tokens.reshape(h * w, d).astype(np.float64)
    x -= x.mean(axis=0)
    if h * w < 2 or not np.any(x):
        return np.zeros((h, w))
    # Thin SVD of the (n, d) tokens: the top right singular vector is the covariance's top eigenvector.
    _, _, vt = np.linalg.svd(x, full_matrices=False)
    proj = x @ vt[0]
    centre = centredness(h, w).ravel()
    if float(proj @ (centre - centre.mean())) < 0:
        proj = -proj
    return proj.reshape(h, w)


@dataclass(frozen=True)
class PCAMask:
    threshold: float = 0.0  # in standard deviations of the projection above its mean (0)
    name: str = "pca"

    def __call__(self, tokens: np.ndarray, image: np.ndarray) -> np.ndarray:
        proj = first_component_projection(tokens)
        return proj > self.threshold * proj.std()


@dataclass(frozen=True)
class NormMask:
    fraction: float = 0.5  # share of cells kept (at least one), those of largest token norm
    name: str = "norm"

    def __call__(self, tokens: np.ndarray, image: np.ndarray) -> np.ndarray:
        h, w, _ = tokens.shape
        norms = np.linalg.norm(tokens.reshape(h * w, -1).astype(np.float64), axis=1)
        keep = max(1, math.ceil(self.fraction * h * w))
        # Stable sort on the negated norms: equal norms keep the lower cell index.
        top = np.argsort(-norms, kind="stable")[:keep]
        mask = np.zeros(h * w, dtype=bool)
        mask[top] = True
        return mask.reshape(h, w)


@dataclass(frozen=True)
class FullMask:
    name: str = "none"

    def __call__(self, tokens: np.ndarray, image: np.ndarray) -> np.ndarray:
        return np.ones(tokens.shape[:2], dtype=bool)


def grid_mask_from_pixels(mask: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """A pixel mask (H, W) on a token grid (h, w): a cell is foreground when more than half of the
    pixels under it are (area average, each cell covering H/h x W/w pixels)."""
    from PIL import Image

    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise FFAError(f"a pixel mask must be (H, W), got shape {mask.shape}")
    h, w = grid
    # Area (box) resampling averages exactly the pixels under each cell, fractional edges weighted.
    coverage = Image.fromarray(mask.astype(np.float32)).resize((w, h), Image.Resampling.BOX)
    return np.asarray(coverage) > 0.5


@dataclass(frozen=True)
class PixelMaskFn:
    """Adapts a segmenter ``image (H, W, 3) uint8 -> foreground (H, W)`` (bool or probabilities in
    [0, 1], thresholded at 0.5) to a :class:`MaskFn`."""

    segment: Callable[[np.ndarray], np.ndarray]
    name: str = "segmentation"

    def __call__(self, tokens: np.ndarray, image: np.ndarray) -> np.ndarray:
        pixels = np.asarray(self.segment(image))
        if pixels.shape != image.shape[:2]:
            raise FFAError(f"segmenter {self.name!r} gave a mask of shape {pixels.shape} for an image of {image.shape[:2]}")
        return grid_mask_from_pixels(pixels > 0.5 if pixels.dtype != bool else pixels, tokens.shape[:2])


def get_mask_fn(conf: FFAConfig) -> MaskFn:
    if conf.mask == "pca":
        return PCAMask(conf.pca_threshold)
    if conf.mask == "norm":
        return NormMask(conf.norm_fraction)
    return FullMask()


# --- pooling and cropping -----------------------------------------------------------------------


def pool_tokens(tokens: np.ndarray, mask: np.ndarray | None, pooling: str = "avg", p: float = 3.0, eps: float = 1e-6) -> np.ndarray:
    """(d,) float32 L2-normalised pool of the masked tokens of (h, w, d): their mean, or GeM
    ((mean of clamp(x, eps)^p)^(1/p), as embed.pooling.gem)."""
    h, w, d = tokens.shape
    x = tokens.reshape(h * w, d).astype(np.float64)
    if mask is not None:
        x = x[np.asarray(mask, dtype=bool).reshape(h * w)]
    if len(x) == 0:
        raise FFAError("cannot pool an empty set of tokens")
    if pooling == "gem":
        pooled = np.power(np.power(np.maximum(x, eps), p).mean(axis=0), 1.0 / p)
    elif pooling == "avg":
        pooled = x.mean(axis=0)
    else:
        raise FFAError(f"unknown pooling {pooling!r}; choose from {POOLINGS}")
    return (pooled / max(float(np.linalg.norm(pooled)), 1e-12)).astype(np.float32)


def foreground_box(mask: np.ndarray, image_shape: tuple[int, ...], margin: int = 0) -> tuple[int, int, int, int]:
    """Pixel box (top, bottom, left, right; bottom/right exclusive) of the foreground cells of an
    (h, w) mask, grown by ``margin`` cells, on an image of ``image_shape`` (H, W, ...). Cell (i, j)
    covers rows [i H / h, (i + 1) H / h) and columns alike."""
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    if len(rows) == 0:
        raise FFAError("an empty mask has no box")
    h, w = mask.shape
    big_h, big_w = image_shape[:2]
    r0, r1 = max(0, rows[0] - margin), min(h, rows[-1] + 1 + margin)
    c0, c1 = max(0, cols[0] - margin), min(w, cols[-1] + 1 + margin)
    return (math.floor(r0 * big_h / h), math.ceil(r1 * big_h / h), math.floor(c0 * big_w / w), math.ceil(c1 * big_w / w))


def crop_resized(image: np.ndarray, box: tuple[int, int, int, int], longer_side: int) -> np.ndarray:
    """The box of ``image``, resized isotropically so its longer side is ``longer_side``."""
    from PIL import Image

    from ingest.images import RESAMPLE, resized_size

    top, bottom, left, right = box
    crop = Image.fromarray(np.ascontiguousarray(image[top:bottom, left:right]))
    return np.asarray(crop.resize(resized_size(crop.width, crop.height, longer_side), RESAMPLE))


# --- token maps ---------------------------------------------------------------------------------


class TokenMaps:
    """A frozen CNN's feature map cells as tokens: images (H, W, 3) uint8 -> (h, w, d) float32."""

    def __init__(self, model: str = DEFAULT_MODEL, feature_stage: int | None = None,
                 weights: str | Path | None = None, batch_size: int = 16):
        from ingest.torchvision_compat import ensure_torchvision_importable

        ensure_torchvision_importable()
        import torch

        from embed.locals import CNNStageTokens
        from embed.models import build_global_model
        from embed.registry import get_model_config

        self.model_name, self.feature_stage, self.batch_size = model, feature_stage, batch_size
        conf = get_model_config(model)
        if conf.library != "timm":
            raise FFAError(f"FFA needs a timm CNN feature map; {model} is an {conf.library} model")
        net, self.weights_path = build_global_model(model, weights)
        backbone = net.backbone
        if feature_stage is None:
            if not hasattr(backbone, "forward_features"):
                raise FFAError(f"{model} has no forward_features")
            self._forward = backbone.forward_features
        else:
            stage = CNNStageTokens(backbone, feature_stage).eval()
            self._forward = stage.forward_map
        self._net = backbone
        self._mean = torch.tensor(conf.mean).view(1, 3, 1, 1)
        self._std = torch.tensor(conf.std).view(1, 3, 1, 1)

    def __call__(self, images: Sequence[np.ndarray]) -> list[np.ndarray]:
        import torch

        from embed.extract import batches_by_shape

        out: list[np.ndarray | None] = [None] * len(images)
        for i, image in enumerate(images):
            if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
                raise FFAError(f"image {i}: expected (H, W, 3) uint8, got {image.shape} {image.dtype}")
        with torch.inference_mode():
            for idx in batches_by_shape(list(images), self.batch_size):
                x = torch.from_numpy(np.stack([images[i] for i in idx])).permute(0, 3, 1, 2).float().div_(255.0)
                maps = self._forward((x - self._mean) / self._std).float().permute(0, 2, 3, 1).numpy()
                for j, i in enumerate(idx):
                    out[i] = np.ascontiguousarray(maps[j])
        return out  # type: ignore[return-value]

    def info(self) -> dict[str, Any]:
        from embed.extract import file_sha256
        from embed.registry import describe

        return {
            "model": describe(self.model_name),
            "feature_stage": self.feature_stage,
            "weights": str(self.weights_path) if self.weights_path else None,
            "weights_sha256": file_sha256(self.weights_path) if self.weights_path else None,
        }


# --- descriptors --------------------------------------------------------------------------------


def ffa_descriptors(conf: FFAConfig, images: Sequence[np.ndarray], extract: Callable[[Sequence[np.ndarray]], list[np.ndarray]],
                    maps: Sequence[np.ndarray] | None = None, mask_fn: MaskFn | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """(n, d) L2-normalised FFA descriptors of ``images`` and mask statistics.

    ``extract`` turns images into token maps (a :class:`TokenMaps`); ``maps`` are the whole
    images' maps when already computed (every mode starts from them); ``mask_fn`` overrides the
    configured mask (a segmentation model, say).
    """
    mask_fn = mask_fn or get_mask_fn(conf)
    maps = list(maps) if maps is not None else extract(images)
    if len(maps) != len(images):
        raise FFAError(f"{len(maps)} token maps for {len(images)} images")
    masks, fallbacks = [], 0
    for i, (tokens, image) in enumerate(zip(maps, images)):
        mask = np.asarray(mask_fn(tokens, image), dtype=bool)
        if mask.shape != tokens.shape[:2]:
            raise FFAError(f"mask {mask_fn.name!r} gave shape {mask.shape} for image {i}'s token grid {tokens.shape[:2]}")
        if mask.sum() < conf.min_tokens:
            mask, fallbacks = np.ones_like(mask), fallbacks + 1
        masks.append(mask)
    stats: dict[str, Any] = {
        "mask": mask_fn.name,
        "foreground_fraction": float(np.mean([m.mean() for m in masks])) if masks else None,
        "fallbacks": fallbacks,
    }
    if conf.mode == "crop-feat":
        desc = [pool_tokens(t, m, conf.pooling, conf.gem_p) for t, m in zip(maps, masks)]
    else:
        boxes = [foreground_box(m, img.shape, conf.crop_margin) for m, img in zip(masks, images)]
        whole = [b == (0, img.shape[0], 0, img.shape[1]) for b, img in zip(boxes, images)]
        todo = [i for i, full in enumerate(whole) if not full]
        # A box covering the whole image is the image itself: its map is already there.
        crops = extract([crop_resized(images[i], boxes[i], conf.resolution) for i in todo]) if todo else []
        crop_maps = dict(zip(todo, crops))
        desc = [pool_tokens(crop_maps.get(i, maps[i]), None, conf.pooling, conf.gem_p) for i in range(len(images))]
        stats["crop_area_fraction"] = float(np.mean([(b[1] - b[0]) * (b[3] - b[2]) / (img.shape[0] * img.shape[1])
                                                     for b, img in zip(boxes, images)])) if images else None
        stats["cropped_images"] = len(todo)
    return (np.stack(desc) if desc else np.zeros((0, maps[0].shape[-1] if maps else 0), np.float32)), stats


# --- data and stages ----------------------------------------------------------------------------


def load_items(source: Path | str, distractors: int = 0, seed: int = 0, min_size: int = 1) -> tuple[list[Path], list[str]]:
    """(image paths, group labels) of a realbench-style directory or class folders, plus
    ``distractors`` seeded realbench distractors, each a group of its own."""
    from similarity.data import SimilarityDataError, load_groups, realbench_distractors

    groups = load_groups(source, min_size)
    paths = [p for g in groups for p in groups[g]]
    labels = [g for g in groups for _ in groups[g]]
    if distractors:
        pool = realbench_distractors(source)
        if distractors > len(pool):
            raise SimilarityDataError(f"{source} has {len(pool)} distractors, {distractors} asked for")
        pick = np.sort(np.random.default_rng(seed).choice(len(pool), size=distractors, replace=False))
        paths += [pool[i] for i in pick]
        labels += [f"distractor:{pool[i].name}" for i in pick]
    return paths, labels


def load_images(paths: Sequence[Path], resolution: int) -> list[np.ndarray]:
    from tqdm import tqdm

    from similarity.data import load_rgb

    return [load_rgb(p, resolution) for p in tqdm(paths, desc="decode", disable=len(paths) < 50)]


def evaluate(conf: FFAConfig, eval_conf: GroupEvalConfig, source: Path | str, distractors: int = 0,
             weights: str | Path | None = None) -> dict[str, Any]:
    """The grouped measures (eval/groups.py) of FFA descriptors of the images of ``source``."""
    from eval.groups import evaluate_groups

    start = time.perf_counter()
    paths, labels = load_items(source, distractors, eval_conf.seed)
    images = load_images(paths, conf.resolution)
    tokens = TokenMaps(conf.model, conf.feature_stage, weights, conf.batch_size)
    desc, stats = ffa_descriptors(conf, images, tokens)
    report = evaluate_groups(desc, labels, eval_conf)
    return {"method": "ffa", "source": str(source), "distractors": distractors, "ffa": asdict(conf), **report,
            "masks": stats, "extractor": tokens.info(), "seconds": round(time.perf_counter() - start, 3)}


def main(conf: FFAConfig, eval_conf: GroupEvalConfig, source: Path | str, output: Path | str, distractors: int = 0,
         weights: str | Path | None = None) -> Path:
    """Evaluate FFA descriptors of ``source`` by groups; write the JSON report to ``output``."""
    from core.atomic import write_json_atomic

    report = evaluate(conf, eval_conf, source, distractors, weights)
    write_json_atomic(report, Path(output))
    log.info("ffa %s/%s: top-1 %.1f, mAP %.1f, ARI %s, odd-one-out %s", conf.mask, conf.mode, report["top1"], report["map"],
             report["ari"], report["odd_one_out"])
    return Path(output)


def embed_main(conf: FFAConfig, source: Path | str, output: Path | str, distractors: int = 0, seed: int = 0,
               weights: str | Path | None = None) -> Path:
    """Write FFA descriptors of ``source`` to ``output`` (.npz: descriptors, paths, labels) and
    ``output``.json (how they were made)."""
    from core.atomic import write_atomic, write_json_atomic

    start = time.perf_counter()
    paths, labels = load_items(source, distractors, seed)
    images = load_images(paths, conf.resolution)
    tokens = TokenMaps(conf.model, conf.feature_stage, weights, conf.batch_size)
    desc, stats = ffa_descriptors(conf, images, tokens)
    output = Path(output)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object, so numpy does not append .npz to the temp name
            np.savez(f, descriptors=desc, paths=np.asarray([str(p) for p in paths]), labels=np.asarray(labels))

    write_atomic(output, write)
    write_json_atomic({"method": "ffa", "source": str(source), "distractors": distractors, "seed": seed, "ffa": asdict(conf),
                       "images": len(paths), "dim": int(desc.shape[1]), "masks": stats, "extractor": tokens.info(),
                       "seconds": round(time.perf_counter() - start, 3)}, output.with_name(output.name + ".json"))
    return output


# --- CLI ----------------------------------------------------------------------------------------


def _ffa_config(args: argparse.Namespace) -> FFAConfig:
    return FFAConfig(model=args.model, resolution=args.resolution, feature_stage=args.stage, mask=args.mask, mode=args.mode,
                     pooling=args.pooling, gem_p=args.gem_p, norm_fraction=args.norm_fraction, pca_threshold=args.pca_threshold,
                     min_tokens=args.min_tokens, crop_margin=args.crop_margin)


def _eval(args: argparse.Namespace) -> int:
    from eval.groups import GroupEvalConfig

    eval_conf = GroupEvalConfig(seed=args.seed, max_pairs=args.max_pairs, odd_trials=args.odd_trials)
    main(_ffa_config(args), eval_conf, args.groups, args.out, args.distractors, args.weights)
    return 0


def _embed(args: argparse.Namespace) -> int:
    embed_main(_ffa_config(args), args.groups, args.out, args.distractors, args.seed, args.weights)
    return 0


def _add_common(p: argparse.ArgumentParser) -> None:
    d = FFAConfig()
    p.add_argument("--groups", required=True, help="realbench-style directory (groups.csv) or a folder of class folders")
    p.add_argument("--out", required=True, help="output file")
    p.add_argument("--mask", choices=MASKS, default=d.mask, help="foreground signal (none: the whole-image baseline)")
    p.add_argument("--mode", choices=MODES, default=d.mode, help="pool foreground tokens, or crop to the foreground and re-extract")
    p.add_argument("--pooling", choices=POOLINGS, default=d.pooling)
    p.add_argument("--gem-p", type=float, default=d.gem_p)
    p.add_argument("--model", default=d.model, help="registry model (a timm CNN)")
    p.add_argument("--weights", help="local weights file (default: the preset's)")
    p.add_argument("--resolution", type=int, default=d.resolution, help="longer side of images and crops")
    p.add_argument("--stage", type=int, default=None, help="tokens from this block's output (default: the last feature map)")
    p.add_argument("--norm-fraction", type=float, default=d.norm_fraction, help="mask norm: share of tokens kept")
    p.add_argument("--pca-threshold", type=float, default=d.pca_threshold, help="mask pca: threshold in std above the mean")
    p.add_argument("--min-tokens", type=int, default=d.min_tokens, help="smaller masks fall back to every token")
    p.add_argument("--crop-margin", type=int, default=d.crop_margin, help="crop-img: cells added around the box")
    p.add_argument("--distractors", type=int, default=0, help="add this many realbench distractors (seeded), each its own group")
    p.add_argument("--seed", type=int, default=0)


def add_cli(methods: argparse._SubParsersAction) -> None:
    p = methods.add_parser("ffa", help="foreground feature averaging: pool only foreground tokens of a frozen feature map")
    sub = p.add_subparsers(dest="ffa_command", required=True)
    e = sub.add_parser("eval", help="top-1 / mAP within groups, K=2 k-means ARI, odd-one-out of FFA descriptors")
    _add_common(e)
    e.add_argument("--max-pairs", type=int, default=2000, help="group pairs clustered for the ARI (seeded sample beyond)")
    e.add_argument("--odd-trials", type=int, default=1000, help="odd-one-out trials")
    e.set_defaults(func=_eval)
    m = sub.add_parser("embed", help="write FFA descriptors (.npz with descriptors, paths, labels)")
    _add_common(m)
    m.set_defaults(func=_embed)
