"""Evaluating adaptors: MAP@R and R-Precision (eval/class_retrieval.py) on labelled classes of the
frozen backbone, and with an adaptors file of each single adaptor set and of the fused adaptors."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from eval.class_retrieval import class_retrieval_from_embeddings
from similarity.adaptors.config import DEFAULT_BACKBONE, FROZEN, AdaptorsConfig, mode_names
from similarity.adaptors.files import load_adaptors
from similarity.adaptors.images import load_square, normalised_batch
from similarity.adaptors.net import build_adapted
from similarity.data import SimilarityDataError, load_groups, load_rgb


def class_images(
    paths: Sequence[Path], net: nn.Module, resolution: int, mean: Sequence[float], std: Sequence[float]
) -> list[torch.Tensor]:
    """Stem outputs of evaluation images, one (1, ...) tensor each: the whole image, longer side
    ``resolution`` (the ingestion convention), or its central square when the backbone needs one."""
    out = []
    with torch.no_grad():
        for p in tqdm(paths, desc="adaptors: evaluation images", unit="image", leave=False):
            fixed = net.parts.fixed_size
            image = load_square(p, fixed) if fixed else load_rgb(p, resolution)
            out.append(net.stem(normalised_batch(image[None], mean, std)))
    return out


def evaluate_net(
    net: nn.Module, stems: Sequence[torch.Tensor], labels: Sequence[str], modes: dict[str, str | int]
) -> dict[str, dict[str, float]]:
    """MAP@R and R-Precision (x 100) of each mode on the evaluation images' cached stem outputs."""

    results = {}
    for name, mode in modes.items():
        metrics = class_retrieval_from_embeddings(eval_descriptors(net, stems, mode), labels)
        results[name] = {"map_at_r": round(metrics["map_at_r"], 3), "r_precision": round(metrics["r_precision"], 3)}
    return results


def eval_descriptors(net: nn.Module, stems: Sequence[torch.Tensor], mode: str | int) -> np.ndarray:
    """(n, D) float32 descriptors of evaluation images (one stem output each) for ``mode``."""
    net.eval()
    with torch.no_grad():
        return torch.cat([net.forward_cached(h, mode)[0] for h in stems]).numpy().astype(np.float32)


def evaluate(
    classes: Path | str,
    model: Path | str | None = None,
    backbone: str = DEFAULT_BACKBONE,
    weights: str | None = None,
    resolution: int = 224,
    min_size: int = 2,
) -> dict[str, Any]:
    """MAP@R and R-Precision on labelled classes (realbench groups or class folders; classes of at
    least ``min_size`` images, each image querying all the others): the frozen backbone, and with
    an adaptors file also each single adaptor and the fused adaptors."""
    groups = load_groups(classes, min_size)
    if not groups:
        raise SimilarityDataError(f"{classes} holds no class with at least {min_size} images")
    paths = [p for g in groups for p in groups[g]]
    labels = [g for g in groups for _ in groups[g]]
    if model is not None:
        net, conf, record = load_adaptors(model)
        modes = mode_names(conf.granularities)
    else:
        net, record = build_adapted(AdaptorsConfig(backbone=backbone, weights=weights, granularities=(2,)))
        modes = {FROZEN: FROZEN}
    stems = class_images(paths, net, resolution, record["mean"], record["std"])
    return {
        "classes": str(classes),
        "model": str(model) if model else None,
        "backbone": record["name"],
        "images": len(paths),
        "groups": len(groups),
        "resolution": resolution,
        "results": evaluate_net(net, stems, labels, modes),
    }
