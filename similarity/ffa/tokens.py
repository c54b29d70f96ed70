"""FFA's tokens: the cells of a frozen timm CNN's feature map (its last one, or a block's output
through the stage walk of embed/stages.py), from images."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embed.registry import DEFAULT_MODEL
from embed.stages import CNNStageTokens
from similarity.ffa.config import FFAError


class TokenMaps:
    """A frozen CNN's feature map cells as tokens: images (H, W, 3) uint8 -> (h, w, d) float32."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        feature_stage: int | None = None,
        weights: str | Path | None = None,
        batch_size: int = 16,
    ):
        from ingest.torchvision_compat import ensure_torchvision_importable

        ensure_torchvision_importable()  # before timm, which embed.models imports to build the backbone
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
        """Each image's (h, w, d) float32 token map (images of one size batched)."""
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
        """The model, stage and weights (with their SHA-256) the tokens come from."""
        from embed.extract import file_sha256
        from embed.registry import describe

        return {
            "model": describe(self.model_name),
            "feature_stage": self.feature_stage,
            "weights": str(self.weights_path) if self.weights_path else None,
            "weights_sha256": file_sha256(self.weights_path) if self.weights_path else None,
        }
