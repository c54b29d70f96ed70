"""The frozen features of a pairs source (left and right images, optional distractors): extracted,
written to and read from a ``.npz`` (``needle similarity afn features``), checked against the
extraction settings they were made with. Importing this module stays light."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.atomic import write_atomic
from similarity.afn.config import AdaptationFunctionError, FeatureConfig
from similarity.afn.pairs import PairSet, load_distractor_paths, load_pairs


@dataclass
class PairFeatures:
    """The frozen features of n pairs (and of distractors), with how they were extracted."""

    left: np.ndarray  # (n, D) float32 features of the left images
    right: np.ndarray  # (n, D) float32 features of the right images
    names: list[str]  # pair names
    feature_config: dict[str, Any]  # FeatureConfig.record() of the extraction
    distractors: np.ndarray | None = None  # (m, D) float32 or None
    sources: dict[str, Any] = field(default_factory=dict)  # where the images came from

    def __post_init__(self) -> None:
        if self.left.ndim != 2 or self.left.shape != self.right.shape or len(self.names) != len(self.left):
            raise AdaptationFunctionError(
                f"pair features must be two (n, D) arrays and n names, got {self.left.shape}, "
                f"{self.right.shape} and {len(self.names)} names"
            )
        if self.distractors is not None and (
            self.distractors.ndim != 2 or self.distractors.shape[1] != self.left.shape[1]
        ):
            raise AdaptationFunctionError(
                f"distractor features must be (m, {self.left.shape[1]}), got {self.distractors.shape}"
            )

    def __len__(self) -> int:
        return len(self.left)


def compute_pair_features(
    pairs: PairSet, conf: FeatureConfig, distractors: list[Path] | None = None, device: str = "cpu"
) -> PairFeatures:
    """The frozen features (``conf``) of every pair's left and right image, and of ``distractors``."""
    from similarity.afn.features import build_layer_model, extract_features  # torch: only when extracting

    model = build_layer_model(conf)
    left = extract_features(pairs.left, conf, device, model, "afn left")
    right = extract_features(pairs.right, conf, device, model, "afn right")
    dis = extract_features(distractors, conf, device, model, "afn distractors") if distractors else None
    return PairFeatures(left, right, list(pairs.names), conf.record(), dis)


def save_pair_features(feats: PairFeatures, path: Path) -> Path:
    """``feats`` as a ``.npz`` (left, right, names, feature_config, distractors), written atomically."""
    arrays = {
        "left": feats.left.astype(np.float32),
        "right": feats.right.astype(np.float32),
        "names": np.asarray(feats.names, dtype=str),
        "feature_config": np.asarray(json.dumps(feats.feature_config)),
    }
    if feats.distractors is not None:
        arrays["distractors"] = feats.distractors.astype(np.float32)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to a path
            np.savez(f, **arrays)

    return write_atomic(Path(path), write)


def load_pair_features(path: Path) -> PairFeatures:
    """Features written by :func:`save_pair_features`; typed errors naming the file."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = {"left", "right", "names", "feature_config"} - set(data.files)
            if missing:
                raise AdaptationFunctionError(
                    f"feature file {path} lacks {sorted(missing)}; write it with `needle similarity afn features`"
                )
            return PairFeatures(
                data["left"].astype(np.float32),
                data["right"].astype(np.float32),
                [str(n) for n in data["names"]],
                json.loads(str(data["feature_config"])),
                data["distractors"].astype(np.float32) if "distractors" in data.files else None,
                {"features": str(path)},
            )
    except (OSError, ValueError) as exc:
        raise AdaptationFunctionError(f"cannot read feature file {path}: {exc}") from exc


def pair_features_for(
    source: Path | str, conf: FeatureConfig | None, distractors: Path | str | None = None, device: str = "cpu"
) -> PairFeatures:
    """Features of a pairs source: read from a ``.npz`` (whose recorded extraction must match
    ``conf`` when one is given), else extracted with ``conf`` (default FeatureConfig)."""
    source = Path(source)
    if source.suffix == ".npz":
        if distractors is not None:
            raise AdaptationFunctionError(
                f"{source} holds extracted features: extract distractors with it (`afn features --distractors`)"
            )
        feats = load_pair_features(source)
        if conf is not None and conf.record() != feats.feature_config:
            raise AdaptationFunctionError(
                f"{source} was extracted with {feats.feature_config}, but {conf.record()} is asked"
            )
        return feats
    conf = conf or FeatureConfig()
    pairs = load_pairs(source)
    dis_paths = load_distractor_paths(distractors) if distractors is not None else None
    feats = compute_pair_features(pairs, conf, dis_paths, device)
    feats.sources = {"pairs": str(source), **({"distractors": str(distractors)} if distractors is not None else {})}
    return feats
