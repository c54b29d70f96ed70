"""The adaptation function's frozen representation: the outputs of several stages of an
EfficientNet-style backbone (embed/stages.py), each averaged over space, L2-normalised and
concatenated; extracted from image files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from embed.extract import batches_by_shape
from embed.stages import is_staged_cnn, stage_maps
from similarity.afn.config import HEAD, AdaptationFunctionError, FeatureConfig
from similarity.data import SimilarityDataError, load_rgb


def layer_names(depth: int) -> tuple[str, ...]:
    """The layer names a backbone with ``depth`` timm blocks offers."""
    return (*(f"blocks.{i}" for i in range(depth)), HEAD)


class LayerFeatures(nn.Module):
    """The frozen backbone as a module: normalised images (B, 3, H, W) -> (B, D) concatenated,
    per-layer L2-normalised spatial averages of the ``layers`` (``blocks.i`` or ``head``)."""

    def __init__(self, backbone: nn.Module, layers: tuple[str, ...], name: str):
        super().__init__()
        if not is_staged_cnn(backbone):
            raise AdaptationFunctionError(
                f"backbone {name} is not an EfficientNet-style timm model (conv_stem, bn1, blocks, conv_head, bn2)"
            )
        known = layer_names(len(backbone.blocks))
        unknown = [layer for layer in layers if layer not in known]
        if unknown:
            raise AdaptationFunctionError(f"unknown layer(s) {unknown} of {name}; choose from {known}")
        self.layers = layers
        self.backbone = backbone
        # The walk runs the blocks only as deep as the deepest requested layer.
        self.block_indices = [int(layer.split(".")[1]) for layer in layers if layer != HEAD]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        maps, head = stage_maps(self.backbone, x, self.block_indices, head=HEAD in self.layers)
        named = {HEAD: head, **{f"blocks.{i}": h for i, h in maps.items()}}
        pooled = [nn.functional.normalize(named[layer].float().mean(dim=(2, 3)), dim=1) for layer in self.layers]
        return torch.cat(pooled, dim=1)


def build_layer_model(conf: FeatureConfig) -> tuple[LayerFeatures, tuple, tuple, Path | None]:
    """The frozen backbone of ``conf`` as a :class:`LayerFeatures` in eval mode. Returns (module,
    mean, std, weights path)."""
    from embed.models import build_global_model
    from embed.registry import get_model_config

    net, weights = build_global_model(conf.backbone)
    mc = get_model_config(conf.backbone)
    return LayerFeatures(net.backbone, conf.layers, conf.backbone).eval(), mc.mean, mc.std, weights


def extract_features(
    paths: list[Path] | tuple[Path, ...],
    conf: FeatureConfig,
    device: str = "cpu",
    model: Any = None,
    desc: str = "afn features",
) -> np.ndarray:
    """(n, D) float32 features of image files (``model``: a prebuilt :func:`build_layer_model`)."""
    net, mean, std, _ = model if model is not None else build_layer_model(conf)
    dev = torch.device(device)
    net.to(dev)
    mean_t = torch.tensor(mean, device=dev).view(1, 3, 1, 1)
    std_t = torch.tensor(std, device=dev).view(1, 3, 1, 1)
    rows: list[np.ndarray] = []
    chunk = 8 * conf.batch_size  # images decoded at a time: memory stays bounded on large sets
    with tqdm(total=len(paths), desc=desc, unit="img", leave=False) as bar:
        for start in range(0, len(paths), chunk):
            images = [load_rgb(p, conf.resolution) for p in paths[start : start + chunk]]
            parts: dict[int, np.ndarray] = {}
            for idx in batches_by_shape(images, conf.batch_size):
                x = torch.from_numpy(np.stack([images[i] for i in idx])).to(dev).permute(0, 3, 1, 2).float().div_(255.0)
                with torch.inference_mode():
                    feats = net((x - mean_t) / std_t).float().cpu().numpy()
                parts.update(zip(idx, feats))
                bar.update(len(idx))
            rows.append(np.stack([parts[i] for i in range(len(images))]).astype(np.float32))
    if not rows:
        raise SimilarityDataError("no images to extract features from")
    return np.concatenate(rows)
