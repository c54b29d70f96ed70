"""Pooling a backbone's output into one global vector."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gem(feature_map: torch.Tensor, p: float = 3.0, eps: float = 1e-6) -> torch.Tensor:
    """Generalised-mean pooling of a (B, C, H, W) map: (mean x^p)^(1/p) per channel -> (B, C).

    p=1 is average pooling, p->inf max pooling; p=3 is the usual choice for retrieval.
    """
    if feature_map.ndim != 4:
        raise ValueError(f"GeM expects a (B, C, H, W) feature map, got shape {tuple(feature_map.shape)}")
    pooled = F.avg_pool2d(feature_map.float().clamp(min=eps).pow(p), feature_map.shape[-2:])
    return pooled.pow(1.0 / p).flatten(1)


def l2_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    return F.normalize(x.float(), p=2, dim=-1, eps=eps)
