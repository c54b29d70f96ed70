"""Training the adaptors on unlabelled images, from cached outputs of the frozen stem: the
pseudo-labels (k-means of the frozen descriptors, one clustering per granularity), one adaptor set
per granularity with its cosine classifier, then the fusion layers with the neighbour attention
loss; and the whole training from an image folder to an adaptors file."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from core.atomic import write_json_atomic
from similarity.adaptors.clusters import nearest_neighbours, pseudo_labels
from similarity.adaptors.config import FROZEN, FUSED, AdaptorsConfig, AdaptorsError, check_config
from similarity.adaptors.files import save_adaptors
from similarity.adaptors.images import load_square, normalised_batch, training_images
from similarity.adaptors.net import build_adapted

log = logging.getLogger(__name__)


def stem_features(
    net: nn.Module, paths: Sequence[Path], side: int, mean: Sequence[float], std: Sequence[float], batch_size: int = 32
) -> torch.Tensor:
    """The frozen stem's output of each image's square training crop, stacked, float16."""
    if net.parts.fixed_size is not None and side != net.parts.fixed_size:
        raise AdaptorsError(f"this backbone needs {net.parts.fixed_size}-pixel inputs, got resolution {side}")
    out = []
    with torch.no_grad():
        for s in tqdm(range(0, len(paths), batch_size), desc="adaptors: frozen stem", unit="batch"):
            batch = np.stack([load_square(p, side) for p in paths[s : s + batch_size]])
            out.append(net.stem(normalised_batch(batch, mean, std)).half())
    return torch.cat(out)


def descriptors(net: nn.Module, cache: torch.Tensor, mode: str | int, batch_size: int = 128) -> np.ndarray:
    """(n, D) float32 descriptors from cached stem outputs, in eval mode."""
    net.eval()
    with torch.no_grad():
        parts = [
            net.forward_cached(cache[s : s + batch_size].float(), mode)[0] for s in range(0, len(cache), batch_size)
        ]
    return torch.cat(parts).numpy().astype(np.float32)


def _augment(h: torch.Tensor, gen: torch.Generator, tokens: bool) -> torch.Tensor:
    """Random horizontal flip and random crop of cached CNN maps (tokens pass unchanged)."""
    if tokens:
        return h
    flip = torch.rand(len(h), generator=gen) < 0.5
    h = torch.where(flip.view(-1, 1, 1, 1), h.flip(-1), h)
    margin = h.shape[-1] // 7  # 14x14 maps (224 pixels, stride 16) lose up to 2 cells per side
    if margin == 0 or h.shape[-2] <= margin:
        return h
    height, width = h.shape[-2] - margin, h.shape[-1] - margin
    ys = torch.randint(0, margin + 1, (len(h),), generator=gen).tolist()
    xs = torch.randint(0, margin + 1, (len(h),), generator=gen).tolist()
    return torch.stack([m[:, y : y + height, x : x + width] for m, y, x in zip(h, ys, xs)])


def _only_trainable(net: nn.Module, params: Sequence[nn.Parameter]) -> None:
    """Gradients for ``params`` only, the rest of ``net`` frozen (each stage trains its own part)."""
    keep = {id(p) for p in params}
    net.zero_grad(set_to_none=True)  # no stale gradient of an earlier stage survives
    for p in net.parameters():
        p.requires_grad_(id(p) in keep)


def _batches(n: int, batch_size: int, gen: torch.Generator) -> list[torch.Tensor]:
    """One epoch's shuffled batches of row indices, drawn from ``gen`` (seeded training)."""
    order = torch.randperm(n, generator=gen)
    return [order[s : s + batch_size] for s in range(0, n, batch_size)]


def train_adaptor(
    net: nn.Module,
    cache: torch.Tensor,
    labels: np.ndarray,
    centroids: np.ndarray,
    i: int,
    conf: AdaptorsConfig,
    gen: torch.Generator,
) -> list[float]:
    """Train adaptor set ``i`` and its classifier on pseudo-labels; returns the mean loss per epoch."""
    head = net.heads[i]
    with torch.no_grad():
        head.weight.copy_(F.normalize(torch.from_numpy(centroids).float(), dim=-1))
    params = net.adaptor_parameters(i) + list(head.parameters())
    _only_trainable(net, params)
    opt = torch.optim.AdamW(params, lr=conf.lr, weight_decay=conf.weight_decay)
    target = torch.from_numpy(labels)
    losses = []
    net.train()
    for epoch in range(conf.epochs):
        total = 0.0
        steps = _batches(len(cache), conf.batch_size, gen)
        for idx in tqdm(
            steps, desc=f"adaptor k={net.granularities[i]} epoch {epoch + 1}/{conf.epochs}", unit="batch", leave=False
        ):
            desc, _ = net.forward_cached(_augment(cache[idx].float(), gen, net.parts.tokens), i)
            loss = F.cross_entropy(head(desc), target[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        losses.append(total / len(cache))
        log.info("adaptor k=%d epoch %d: loss %.4f", net.granularities[i], epoch + 1, losses[-1])
    net.eval()
    return losses


def attention_propagation_loss(weights: torch.Tensor, bank: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """Mean over images and slots of KL(target || weights), target = the mean of the neighbours'
    banked fusion weights. weights (B, S, N); bank (n, S, N); neighbours (B, K) rows of the bank."""
    target = bank[neighbours].mean(1)
    return (target * (target.clamp_min(1e-12).log() - weights.clamp_min(1e-12).log())).sum(-1).mean()


def train_fusion(
    net: nn.Module,
    cache: torch.Tensor,
    labels: Sequence[np.ndarray],
    knn: np.ndarray,
    conf: AdaptorsConfig,
    gen: torch.Generator,
) -> list[dict[str, float]]:
    """Train the fusion layers (adaptors and classifiers frozen); returns per-epoch mean losses."""
    params = net.fusion_parameters()
    _only_trainable(net, params)
    opt = torch.optim.AdamW(params, lr=conf.fusion_lr, weight_decay=conf.weight_decay)
    targets = [torch.from_numpy(y) for y in labels]
    n_slots, n_adaptors = len(net.slots), len(net.granularities)
    bank = torch.full((len(cache), n_slots, n_adaptors), 1.0 / n_adaptors)
    knn_t = torch.from_numpy(knn)
    history = []
    net.train()
    for epoch in range(conf.fusion_epochs):
        sums = {"classification": 0.0, "attention": 0.0}
        steps = _batches(len(cache), conf.batch_size, gen)
        for idx in tqdm(steps, desc=f"fusion epoch {epoch + 1}/{conf.fusion_epochs}", unit="batch", leave=False):
            desc, weights = net.forward_cached(_augment(cache[idx].float(), gen, net.parts.tokens), FUSED)
            w = torch.stack(weights, 1)  # (B, S, N)
            cls = torch.stack([F.cross_entropy(h(desc), t[idx]) for h, t in zip(net.heads, targets)]).mean()
            att = attention_propagation_loss(w, bank, knn_t[idx])
            loss = cls + conf.attention_weight * att
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            bank[idx] = w.detach()
            sums["classification"] += cls.item() * len(idx)
            sums["attention"] += att.item() * len(idx)
        history.append({k: v / len(cache) for k, v in sums.items()})
        log.info("fusion epoch %d: %s", epoch + 1, history[-1])
    net.eval()
    return history


def train_adaptors(net: nn.Module, cache: torch.Tensor, conf: AdaptorsConfig) -> dict[str, Any]:
    """Pseudo-labels, the adaptor sets and the fusion, from cached stem outputs of unlabelled
    images. Returns a JSON-friendly record of the training."""
    if len(cache) < max(conf.granularities):
        raise AdaptorsError(
            f"{len(cache)} training images for {max(conf.granularities)} clusters: need at least as many images"
        )
    gen = torch.Generator().manual_seed(conf.seed)
    frozen = descriptors(net, cache, FROZEN)
    labels, record = [], {"granularities": []}
    for i, k in enumerate(net.granularities):
        centroids, y = pseudo_labels(frozen, k, conf.kmeans_iterations, conf.seed + i)
        labels.append(y)
        losses = train_adaptor(net, cache, y, centroids, i, conf, gen)
        sizes = np.bincount(y, minlength=k)
        record["granularities"].append(
            {
                "k": k,
                "loss_per_epoch": losses,
                "cluster_size_min": int(sizes.min()),
                "cluster_size_max": int(sizes.max()),
            }
        )
    knn = nearest_neighbours(frozen, conf.neighbours)
    record["fusion_loss_per_epoch"] = train_fusion(net, cache, labels, knn, conf, gen)
    record["fusion_mean_weights"] = mean_fusion_weights(net, cache)
    for p in net.parameters():
        p.requires_grad_(False)
    return record


def mean_fusion_weights(net: nn.Module, cache: torch.Tensor, batch_size: int = 128) -> dict[str, list[float]]:
    """Per adapted stage, the fusion weights of each adaptor averaged over the images."""
    net.eval()
    with torch.no_grad():
        w = torch.cat(
            [
                torch.stack(net.forward_cached(cache[s : s + batch_size].float(), FUSED)[1], 1)
                for s in range(0, len(cache), batch_size)
            ]
        )
    return {f"stage_{s}": [round(float(v), 4) for v in w[:, j].mean(0)] for j, s in enumerate(net.stage_ids)}


def train_main(conf: AdaptorsConfig, images: Path | str, output: Path | str) -> Path:
    """Train adaptors and fusion on the unlabelled images of ``images`` (a directory, or a
    realbench directory: its distractors); write ``output`` and ``output`` + ``.json``."""
    start = time.perf_counter()
    check_config(conf)
    paths = training_images(images)
    if conf.max_images is not None and len(paths) > conf.max_images:
        keep = np.sort(np.random.default_rng(conf.seed).choice(len(paths), conf.max_images, replace=False))
        paths = [paths[i] for i in keep]
    net, backbone = build_adapted(conf)
    cache = stem_features(net, paths, conf.resolution, backbone["mean"], backbone["std"])
    record = train_adaptors(net, cache, conf)
    output = save_adaptors(net, dataclasses.replace(conf, stages=net.stage_ids), backbone, Path(output))
    write_json_atomic(
        {
            "config": asdict(conf),
            "stages": list(net.stage_ids),
            "backbone": backbone,
            "images": str(images),
            "trained_on": len(paths),
            "trainable_parameters": sum(p.numel() for p in net.slots.parameters()),
            **record,
            "seconds": round(time.perf_counter() - start, 3),
        },
        output.with_name(output.name + ".json"),
    )
    log.info("adaptors %s trained on %d images in %.0f s", output, len(paths), time.perf_counter() - start)
    return output
