"""The similarity models 2AFC evaluates and ensembles, each a similarity between two images computed
from per-image features.

A model follows the :class:`SimilarityModel` protocol (``name``, ``extract(paths)`` -> per-image
feature arrays, ``score(features, ref, cand)`` -> similarities, ``info()``); the registry
(similarity/twoafc/registry.py) names them, the feature store (similarity/twoafc/features.py) caches
their features. Importing this module stays light: the models build their torch networks on first use.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from similarity.data import load_rgb

LITE0 = "tf_efficientnet_lite0.gem"  # embed.models' default preset (named here: importing it imports torch)


class SimilarityModel(Protocol):
    """A similarity between two images, computed from per-image features (cached by FeatureStore)."""

    name: str  # registry name; also names the feature cache file

    def extract(self, paths: Sequence[Path]) -> dict[str, np.ndarray]:
        """Features of the images: arrays whose first axis is the image (same shapes for every call).
        A model with one vector per image that can serve as the ensemble's context stores it as "global"."""
        ...

    def score(self, features: Mapping[str, np.ndarray], ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
        """(n,) similarity of image ``ref[i]`` with image ``cand[i]`` (rows of ``features``); higher = closer."""
        ...

    def info(self) -> dict[str, Any]:
        """How the features are made (JSON); a change invalidates the cache."""
        ...


def _load_images(paths: Sequence[Path], longer_side: int) -> list[np.ndarray]:
    return [load_rgb(p, longer_side) for p in paths]


def _torch_ready() -> None:
    """Before the first torch model: no weights fetched at run time, and an importable torchvision
    (timm imports it)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ingest.torchvision_compat import ensure_torchvision_importable

    ensure_torchvision_importable()


def _weights_record(model: str) -> dict[str, Any]:
    from embed.extract import file_sha256
    from embed.registry import get_model_config, resolve_weights

    path = resolve_weights(get_model_config(model), None)
    return {"model": model, "weights_sha256": file_sha256(path) if path else None}


def dot_rows(x: np.ndarray, ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """(n,) float64 ``x[ref[i]] . x[cand[i]]``."""
    return np.einsum("nd,nd->n", x[ref].astype(np.float64), x[cand].astype(np.float64))


class GlobalCosine:
    """Cosine of a registry model's L2-normalised global descriptors (Lite0 GeM by default)."""

    def __init__(self, name: str, resolution: int, model: str = LITE0, batch_size: int = 16):
        self.name, self.resolution, self.model, self.batch_size = name, resolution, model, batch_size
        self._extractor = None
        self._info: dict[str, Any] | None = None

    def _build(self):
        if self._extractor is None:
            _torch_ready()
            from embed.extract import GlobalExtractor

            self._extractor = GlobalExtractor(self.model, resolution=self.resolution, batch_size=self.batch_size)
        return self._extractor

    def _vectors(self, images: list[np.ndarray]) -> np.ndarray:
        from embed.extract import batches_by_shape

        ex = self._build()
        out = np.zeros((len(images), ex.dim), np.float32)
        for idx in batches_by_shape(images, self.batch_size):
            out[idx] = ex.forward_uint8(np.stack([images[i] for i in idx]))
        return out

    def extract(self, paths: Sequence[Path]) -> dict[str, np.ndarray]:
        return {"global": self._vectors(_load_images(paths, self.resolution))}

    def score(self, features: Mapping[str, np.ndarray], ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
        return dot_rows(features["global"], ref, cand)

    def info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = {"class": type(self).__name__, "resolution": self.resolution, **_weights_record(self.model)}
        return self._info


class MultiStageCosine(GlobalCosine):
    """The mean over several Lite0 stages of the cosine between stage descriptors: blocks ``stages``
    (their outputs are signed, linear bottlenecks: average-pooled) and the last feature map (after
    ReLU6: GeM p=3, the global descriptor's pooling). Each stage vector is L2-normalised and scaled
    by 1/sqrt(S), so the dot product of the concatenations is the mean of the S cosines."""

    def __init__(self, name: str, resolution: int, stages: tuple[int, ...] = (4, 5), batch_size: int = 16):
        super().__init__(name, resolution, batch_size=batch_size)
        self.stages = stages

    def _build(self):
        if self._extractor is None:
            _torch_ready()
            import torch

            from embed.models import build_global_model
            from embed.registry import get_model_config

            net, _ = build_global_model(self.model)
            conf = get_model_config(self.model)
            self._extractor = (
                net.backbone,
                torch.tensor(conf.mean).view(1, 3, 1, 1),
                torch.tensor(conf.std).view(1, 3, 1, 1),
            )
        return self._extractor

    def _vectors(self, images: list[np.ndarray]) -> np.ndarray:
        import torch
        import torch.nn.functional as F

        from embed.extract import batches_by_shape
        from embed.pooling import gem
        from embed.stages import stage_maps

        backbone, mean, std = self._build()
        rows: list[np.ndarray | None] = [None] * len(images)
        for idx in batches_by_shape(images, self.batch_size):
            x = torch.from_numpy(np.stack([images[i] for i in idx])).permute(0, 3, 1, 2).float().div_(255.0)
            with torch.inference_mode():
                maps, head = stage_maps(backbone, (x - mean) / std, self.stages, head=True)
                parts = [F.normalize(h.mean(dim=(2, 3)), dim=1) for h in maps.values()]  # in block order
                parts.append(F.normalize(gem(head, 3.0), dim=1))
                out = torch.cat(parts, dim=1) / math.sqrt(len(parts))
            for j, i in enumerate(idx):
                rows[i] = out[j].numpy()
        return np.stack(rows).astype(np.float32)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "stages": list(self.stages), "head": "gem3"}


class ChamferTokens:
    """Chamfer similarity (rerank/chamfer.py) of R's local tokens with the candidate's: Lite0's
    stride-16 tokens binarised to 128 ITQ bits (embed/locals/extract.py, preset ``lite0-s16``)."""

    def __init__(self, name: str, preset: str = "lite0-s16", resolution: int | None = None):
        self.name, self.preset, self.resolution = name, preset, resolution
        self._extractor = None

    def _build(self):
        if self._extractor is None:
            _torch_ready()
            from embed.locals.extract import build_local_extractor

            self._extractor = build_local_extractor(self.preset, resolution=self.resolution)
        return self._extractor

    def extract(self, paths: Sequence[Path]) -> dict[str, np.ndarray]:
        from core.tokens import CODE_BYTES

        ex = self._build()
        tokens = ex.tokens_of_any_size(_load_images(paths, ex.resolution))
        T = ex.conf.max_tokens
        codes = np.zeros((len(paths), T, CODE_BYTES), np.uint8)
        count = np.zeros(len(paths), np.int32)
        for i, t in enumerate(tokens):
            count[i] = min(len(t), T)
            codes[i, : count[i]] = t.codes[:T]
        return {"codes": codes, "count": count}

    def score(self, features: Mapping[str, np.ndarray], ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
        from core.tokens import TokenBatch
        from rerank.chamfer import chamfer_similarity

        out = np.zeros(len(ref))
        for r in np.unique(ref):
            rows = np.flatnonzero(ref == r)
            batch = TokenBatch.stack([_tokens(features, c) for c in cand[rows]])
            out[rows] = chamfer_similarity(_tokens(features, r), batch)
        return out

    def info(self) -> dict[str, Any]:
        return {
            "class": type(self).__name__,
            "preset": self.preset,
            "resolution": self.resolution,
            **_weights_record(LITE0),
        }


def _tokens(features: Mapping[str, np.ndarray], i: int):
    from core.tokens import LocalTokens

    n = int(features["count"][i])
    # Chamfer reads the codes only; positions, scales and weights are placeholders.
    return LocalTokens(
        features["codes"][i, :n], np.zeros((n, 2), np.float32), np.ones(n, np.float32), np.ones(n, np.float32)
    )


class ColourHistogram:
    """Histogram intersection of joint RGB histograms (``bins`` per channel, normalised to sum 1),
    after Swain & Ballard; the image is read at longer side ``side``."""

    def __init__(self, name: str, bins: int = 8, side: int = 128):
        self.name, self.bins, self.side = name, bins, side

    def extract(self, paths: Sequence[Path]) -> dict[str, np.ndarray]:
        out = np.zeros((len(paths), self.bins**3), np.float32)
        for i, image in enumerate(_load_images(paths, self.side)):
            q = (image.reshape(-1, 3).astype(np.int64) * self.bins) // 256
            cells = (q[:, 0] * self.bins + q[:, 1]) * self.bins + q[:, 2]
            out[i] = np.bincount(cells, minlength=self.bins**3) / len(cells)
        return {"global": out}

    def score(self, features: Mapping[str, np.ndarray], ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
        h = features["global"]
        return np.minimum(h[ref], h[cand]).astype(np.float64).sum(axis=1)

    def info(self) -> dict[str, Any]:
        return {"class": type(self).__name__, "bins": self.bins, "side": self.side}


class TinyImage:
    """Tiny images (Torralba et al.): the image squashed to ``side`` x ``side`` RGB, minus its mean,
    L2-normalised; cosine. Cheap and unlike every learned model: the default miner of hard B's."""

    def __init__(self, name: str, side: int = 32):
        self.name, self.side = name, side

    def extract(self, paths: Sequence[Path]) -> dict[str, np.ndarray]:
        from PIL import Image

        from ingest.images import RESAMPLE

        out = np.zeros((len(paths), self.side * self.side * 3), np.float32)
        for i, image in enumerate(_load_images(paths, 2 * self.side)):
            x = np.asarray(Image.fromarray(image).resize((self.side, self.side), RESAMPLE), np.float32).reshape(-1)
            x -= x.mean()
            out[i] = x / max(float(np.linalg.norm(x)), 1e-12)
        return {"global": out}

    def score(self, features: Mapping[str, np.ndarray], ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
        return dot_rows(features["global"], ref, cand)

    def info(self) -> dict[str, Any]:
        return {"class": type(self).__name__, "side": self.side}
