"""Local descriptors: up to K tokens per image, each with ``x, y``, ``scale``, ``weight`` and a
descriptor binarised to 128 ITQ bits, written by the same ingestion pass as the global descriptor.

Token sources (``LocalConfig.kind``):

- ``cnn``: a CNN stage's feature map (default: EfficientNet-Lite0's stride-16 stage, 112 channels,
  with the shipped ImageNet weights; :class:`embed.stages.CNNStageTokens`); weight = the token's L2
  norm; descriptor = the token L2-normalised.
- ``vit_ames``: ViT patch tokens through the AMES detector head (embed/locals/vit.py).
- ``sift``: kornia's SIFT / RootSIFT keypoints (embed/locals/sift.py), weight-free.
- ``aliked``: ALIKED-N16's learned keypoints and descriptors (embed/locals/aliked.py); weight = the
  keypoint's score (presets ``aliked-n16``, ``aliked-n16-query``).

Multi-scale: the image is resized by each factor of ``scales`` (relative to ``resolution``, the base
longer side), every token's position is mapped back to base pixels, and the ``top_k`` tokens of
highest weight are kept (over all scales, or per scale with ``per_scale``). Queries use more
scales and tokens than database images (the asymmetric setting): see the presets.

Parquet columns (schema v2, docs/schema.md), one list per row:
``local_codes`` (16-byte codes), ``local_x``, ``local_y`` (int16 base pixels), ``local_scale``
(uint8 index into the recorded ``scales``), ``local_weight`` (float16), and with ``keep_desc`` the
float16 descriptors ``local_desc``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import torch
from PIL import Image
from torch import nn

from core.errors import NeedleInputError
from core.hashing import file_sha256
from core.tokens import CODE_BYTES, LocalTokens
from embed.extract import batches_by_shape
from embed.itq import ITQ, load_itq
from embed.locals.presets import KEYPOINT_KINDS, LocalConfig, get_local_preset
from embed.models import build_global_model
from embed.registry import RANDOM, get_model_config, resolve_package_file
from embed.stages import CNNStageTokens
from ingest.descriptors import local_fields
from ingest.images import RESAMPLE, resized_size

log = logging.getLogger(__name__)

LOCAL_COLUMNS = ("local_codes", "local_x", "local_y", "local_scale", "local_weight")


class KeypointModel(Protocol):
    """A keypoint detector and descriptor (ALIKED, SIFT): images in, each image's tokens out."""

    dim: int  # descriptor dimension

    def batch(self, images: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """uint8 images -> per image (xy (n, 2) pixels, pixel (i, j) covering [j, j + 1) x [i, i + 1);
        weight (n,); desc (n, d) unit), in input order."""
        ...


class DenseLocalModel(Protocol):
    """A network giving a dense grid of local descriptors and their weights."""

    dim: int  # descriptor dimension

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised images (B, 3, H, W) -> (descriptors (B, d, h, w) L2-normalised over d, weights (B, h, w))."""
        ...


def resolve_itq(reference: str | None) -> tuple[ITQ | None, Path | None]:
    if reference is None:
        return None, None
    path = resolve_package_file(reference) if reference.startswith("package:") else Path(reference)
    return load_itq(path), path


def build_local_model(
    conf: LocalConfig, weights: str | Path | None = None
) -> tuple[nn.Module, tuple, tuple, Path | None]:
    """(dense model or SIFT, mean, std, weights path) for ``conf``, in eval mode."""
    if conf.kind == "cnn":
        net, path = build_global_model(conf.model, weights)
        mc = get_model_config(conf.model)
        return CNNStageTokens(net.backbone, conf.feature_stage).eval(), mc.mean, mc.std, path
    if conf.kind == "vit_ames":
        from embed.locals.vit import build_vit_ames

        return build_vit_ames(conf, weights)
    # Keypoint detectors propose at most num_features keypoints; keep enough for every scale's top-K.
    proposals = max(1000, 2 * conf.top_k)
    if conf.kind == "aliked":
        from embed.locals.aliked import AlikedTokens

        if weights is not None and str(weights) == RANDOM:
            raise NeedleInputError("ALIKED tokens have no random initialisation: they need the published weights")
        net = AlikedTokens(num_features=proposals, weights=weights)
        return net, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), net.weights_path
    from embed.locals.sift import SiftTokens

    return SiftTokens(num_features=proposals), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), None


@dataclass
class _ScaleTokens:
    desc: np.ndarray  # (n, d) float32
    xy: np.ndarray  # (n, 2) float32, base pixels
    weight: np.ndarray  # (n,)
    scale_index: np.ndarray  # (n,) uint8


class LocalExtractor:
    """Local tokens of images, as Parquet list columns (ingestion) or LocalTokens (queries)."""

    def __init__(
        self,
        conf: LocalConfig,
        weights: str | Path | None = None,
        device: str = "cpu",
        batch_size: int = 16,
        itq: ITQ | None = None,
    ):
        if batch_size < 1:
            raise NeedleInputError(f"batch_size must be >= 1, got {batch_size}")
        self.conf = conf
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.net, mean, std, self.weights_path = build_local_model(conf, weights)
        self.random_init = weights is not None and str(weights) == RANDOM  # asked for: recorded as such
        self.net.to(self.device)
        self.itq, self.itq_path = (itq, None) if itq is not None else resolve_itq(conf.itq)
        if self.itq is None and not conf.keep_desc:
            raise NeedleInputError(
                f"local tokens of kind {conf.kind!r} need an ITQ projection to be binarised: learn one with "
                "`needle locals train-itq` from descriptors kept with --keep-local-desc, and pass --local-itq"
            )
        self.dim = int(self.net.dim)
        if self.itq is not None and self.itq.dim != self.dim:
            raise NeedleInputError(
                f"ITQ projection {self.itq_path} is for d={self.itq.dim}, the local descriptors have d={self.dim}"
            )
        self._mean = torch.tensor(mean, device=self.device).view(1, 3, 1, 1)
        self._std = torch.tensor(std, device=self.device).view(1, 3, 1, 1)
        # Images arrive at the largest scale; smaller scales are resized from them.
        self.resolution = round(conf.resolution * max(conf.scales))

    # --- extraction ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _dense(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = torch.from_numpy(batch).to(self.device).permute(0, 3, 1, 2).float().div_(255.0)
        desc, weight = self.net((x - self._mean) / self._std)
        return desc.float().cpu().numpy(), weight.float().cpu().numpy()

    def _at_scale(self, images: list[np.ndarray], scale_index: int) -> list[_ScaleTokens]:
        factor = self.conf.scales[scale_index]
        longer = max(1, round(self.conf.resolution * factor))
        scaled = [_resize(image, longer) for image in images]
        if self.conf.kind in KEYPOINT_KINDS:
            return self._keypoint_tokens(scaled, images, scale_index)
        out: list[_ScaleTokens | None] = [None] * len(images)
        for idx in batches_by_shape(scaled, self.batch_size):
            desc, weight = self._dense(np.stack([scaled[i] for i in idx]))
            for j, i in enumerate(idx):
                out[i] = _grid_tokens(
                    desc[j], weight[j], images[i].shape[:2], self.resolution / self.conf.resolution, scale_index
                )
        return out  # type: ignore[return-value]

    def _keypoint_tokens(
        self, scaled: list[np.ndarray], originals: list[np.ndarray], scale_index: int
    ) -> list[_ScaleTokens]:
        """All images at once: the model batches them as it can (ALIKED by padded shape on a GPU)."""
        model: KeypointModel = self.net  # type: ignore[assignment]  # build_local_model's, for a keypoint kind
        out = []
        for (xy, weight, desc), image, original in zip(model.batch(scaled), scaled, originals, strict=True):
            to_base = original.shape[1] / image.shape[1] / (self.resolution / self.conf.resolution)
            out.append(_ScaleTokens(desc, xy * to_base, weight, np.full(len(xy), scale_index, np.uint8)))
        return out

    def _select(self, per_scale: list[_ScaleTokens]) -> _ScaleTokens:
        if self.conf.per_scale:
            per_scale = [_top(t, self.conf.top_k) for t in per_scale]
        merged = _ScaleTokens(
            *(np.concatenate([getattr(t, f.name) for t in per_scale]) for f in dataclasses.fields(_ScaleTokens))
        )
        return _top(merged, self.conf.max_tokens)

    def describe(self, images: list[np.ndarray]) -> list[_ScaleTokens]:
        """Each image's selected tokens (float descriptors, base-pixel positions), images given
        at ``self.resolution`` (longer side)."""
        by_scale = [self._at_scale(images, s) for s in range(len(self.conf.scales))]
        return [self._select([scale[i] for scale in by_scale]) for i in range(len(images))]

    def tokens(self, images: list[np.ndarray]) -> list[LocalTokens]:
        """LocalTokens of images (the query side and AMES training)."""
        if self.itq is None:
            raise NeedleInputError("binary tokens need an ITQ projection (LocalConfig.itq)")
        scales = np.asarray(self.conf.scales, np.float32)
        return [
            LocalTokens(
                np.packbits(proj >= 0, axis=1),
                t.xy.astype(np.float32),
                scales[t.scale_index],
                t.weight.astype(np.float32),
                t.desc,
                proj,
            )
            for t in self.describe(images)
            for proj in (self.itq.project(t.desc),)
        ]

    def tokens_of_any_size(self, images: list[np.ndarray]) -> list[LocalTokens]:
        """LocalTokens of RGB images of any size (resized to the extractor's resolution first)."""
        return self.tokens([_resize(image, self.resolution) for image in images])

    # --- the Extractor protocol of ingestion ------------------------------------------------------
    def extra_fields(self) -> list[pa.Field]:
        return local_fields(self.itq is not None, self.dim if self.conf.keep_desc else None)

    def __call__(self, images: list[np.ndarray]) -> dict[str, list[np.ndarray]]:
        described = self.describe(images)
        columns: dict[str, list[np.ndarray]] = {
            "local_x": [np.round(t.xy[:, 0]).clip(-32768, 32767).astype(np.int16) for t in described],
            "local_y": [np.round(t.xy[:, 1]).clip(-32768, 32767).astype(np.int16) for t in described],
            "local_scale": [t.scale_index for t in described],
            "local_weight": [t.weight.astype(np.float16) for t in described],
        }
        if self.itq is not None:
            columns["local_codes"] = [self.itq.binarize(t.desc) for t in described]
        if self.conf.keep_desc:
            columns["local_desc"] = [t.desc.astype(np.float16) for t in described]
        return columns

    def info(self) -> dict[str, Any]:
        return {
            "extractor": "local",
            "config": dataclasses.asdict(self.conf),
            "scales": list(self.conf.scales),
            "dim": self.dim,
            "code_bytes": CODE_BYTES if self.itq is not None else None,
            "weights": RANDOM if self.random_init else (str(self.weights_path) if self.weights_path else None),
            "weights_sha256": file_sha256(self.weights_path) if self.weights_path else None,
            "itq": str(self.itq_path) if self.itq_path else None,
            "itq_sha256": file_sha256(self.itq_path) if self.itq_path else None,
            "detector_weights_sha256": (
                file_sha256(Path(self.conf.detector_weights))
                if self.conf.detector_weights and self.conf.detector_weights != RANDOM
                else None
            ),
            "resolution": self.conf.resolution,
        }


NO_ITQ = "none"  # the ``itq`` override that asks for float descriptors only, no codes (e.g. to learn an ITQ)


def build_local_extractor(
    preset: str | LocalConfig, weights: str | Path | None = None, device: str = "cpu", **overrides: Any
) -> LocalExtractor:
    """The one way every caller builds a local-token extractor: a preset name (embed/registry.py) or
    a config, with ``overrides`` replacing its fields (a None override keeps the preset's value;
    ``itq=NO_ITQ`` removes the ITQ projection). ``weights``: the backbone's file, ``RANDOM`` for a
    seeded random initialisation, None for the preset's packaged weights."""
    kept = {name: value for name, value in overrides.items() if value is not None}
    conf = get_local_preset(preset, **kept) if isinstance(preset, str) else dataclasses.replace(preset, **kept)
    if conf.itq == NO_ITQ:
        conf = dataclasses.replace(conf, itq=None)
    return LocalExtractor(conf, weights, device=device)


def _resize(image: np.ndarray, longer_side: int) -> np.ndarray:
    h, w = image.shape[:2]
    size = resized_size(w, h, longer_side)
    if size == (w, h):
        return image
    return np.asarray(Image.fromarray(image).resize(size, RESAMPLE))


def _grid_tokens(
    desc: np.ndarray, weight: np.ndarray, input_hw: tuple[int, int], input_over_base: float, scale_index: int
) -> _ScaleTokens:
    """Every cell of a (d, h, w) map as a token at the centre of its cell, in base pixels (the map
    covers the scaled image evenly, so a cell's centre in input pixels is (j + 0.5) * W / w)."""
    d, h, w = desc.shape
    ys, xs = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    x = (xs.reshape(-1) + 0.5) * input_hw[1] / w / input_over_base
    y = (ys.reshape(-1) + 0.5) * input_hw[0] / h / input_over_base
    return _ScaleTokens(
        desc.reshape(d, -1).T,
        np.stack([x, y], 1).astype(np.float32),
        weight.reshape(-1),
        np.full(h * w, scale_index, np.uint8),
    )


def _top(tokens: _ScaleTokens, k: int) -> _ScaleTokens:
    order = np.argsort(-tokens.weight, kind="stable")[:k]
    return _ScaleTokens(tokens.desc[order], tokens.xy[order], tokens.weight[order], tokens.scale_index[order])
