"""Adaptors files: the adaptors, fusion layers and classifiers (never the backbone) with what
rebuilds them around the registry backbone they were trained on (checked by its weights' hash)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.atomic import write_atomic
from core.checkpoint import load_torch_file
from similarity.adaptors.config import FORMAT, AdaptorsConfig, AdaptorsError
from similarity.adaptors.net import AdaptedNet, make_adapted_net


def save_adaptors(net: nn.Module, conf: AdaptorsConfig, backbone: dict[str, Any], output: Path) -> Path:
    """Adaptors, fusion layers and classifiers (never the backbone) with what rebuilds them."""
    state = {
        "format": FORMAT,
        "config": json.dumps(asdict(conf)),
        "backbone": json.dumps(backbone),
        "stages": list(net.stage_ids),
        "slots": net.slots.state_dict(),
        "heads": net.heads.state_dict(),
    }
    return write_atomic(Path(output), lambda tmp: torch.save(state, tmp))


def load_adaptors(
    path: Path | str, backbone: nn.Module | None = None
) -> tuple[AdaptedNet, AdaptorsConfig, dict[str, Any]]:
    """(net, config, backbone record) from an adaptors file. The backbone is rebuilt from the
    registry (its weights file must be the one trained with) unless a module is given."""
    from embed.extract import file_sha256
    from embed.models import build_global_model

    path = Path(path)
    state = load_torch_file(path, AdaptorsError, "adaptors file")
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise AdaptorsError(f"{path} is not a needle adaptors file (format {FORMAT})")
    raw = json.loads(state["config"])
    raw["granularities"] = tuple(raw["granularities"])
    raw["stages"] = tuple(state["stages"])
    conf = AdaptorsConfig(**raw)
    record = json.loads(state["backbone"])
    pooling, gem_p = record.get("pooling", "gem"), record.get("gem_p", 3.0)
    if backbone is None:
        model, weights = build_global_model(
            record["name"], conf.weights
        )  # None: the preset's own file, wherever installed
        if record["weights_sha256"] and (weights is None or file_sha256(weights) != record["weights_sha256"]):
            raise AdaptorsError(f"{path}: backbone weights {weights} differ from those the adaptors were trained with")
        backbone, pooling, gem_p = model.backbone, model.conf.pooling, model.conf.gem_p
    net = make_adapted_net(
        backbone,
        granularities=conf.granularities,
        stages=conf.stages,
        pooling=pooling,
        gem_p=gem_p,
        reduction=conf.reduction,
        fusion_dim=conf.fusion_dim,
        temperature=conf.temperature,
    )
    try:
        net.slots.load_state_dict(state["slots"])
        net.heads.load_state_dict(state["heads"])
    except RuntimeError as exc:
        raise AdaptorsError(f"{path} does not fit backbone {record.get('name')}: {exc}") from exc
    for p in net.parameters():
        p.requires_grad_(False)
    return net.eval(), conf, record
