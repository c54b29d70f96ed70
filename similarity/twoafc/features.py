"""Each 2AFC similarity model's features per image file, computed once and cached
(:class:`FeatureStore`), and what the methods read from them: the models' scores of triplets and
the context model's global descriptors."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from similarity.data import SimilarityDataError
from similarity.twoafc.models import SimilarityModel
from similarity.twoafc.registry import get_model
from similarity.twoafc.triplets import Triplets

log = logging.getLogger(__name__)


def _file_key(path: Path) -> str:
    """A cache key that changes when the file does: resolved path, size, modification time."""
    try:
        st = Path(path).stat()
    except OSError as exc:
        raise SimilarityDataError(f"cannot read image {path}: {exc}") from exc
    return f"{Path(path).resolve()}|{st.st_size}|{st.st_mtime_ns}"


def _safe_name(name: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return f"{keep}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


@dataclass
class _Cached:
    info: str  # the model's info as JSON
    keys: list[str] = field(default_factory=list)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    row: dict[str, int] = field(default_factory=dict)


class FeatureStore:
    """Each model's features per image file, computed once: in memory, and on disk under
    ``directory`` (``<model>.npz`` with the rows' file keys, ``<model>.json`` with the model's info;
    a model whose info changed is recomputed)."""

    def __init__(self, directory: Path | str | None = None, chunk: int = 32):
        self.directory = Path(directory) if directory is not None else None
        self.chunk = chunk
        self._memory: dict[str, _Cached] = {}

    def _file(self, model: SimilarityModel) -> Path:
        return self.directory / f"{_safe_name(model.name)}.npz"

    def _load(self, model: SimilarityModel) -> _Cached:
        info = json.dumps(model.info(), sort_keys=True)
        cached = self._memory.get(model.name)
        if cached is not None and cached.info == info:
            return cached
        cached = _Cached(info)
        path = self._file(model) if self.directory is not None else None
        if path is not None and path.is_file() and path.with_suffix(".json").is_file():
            if json.loads(path.with_suffix(".json").read_text()).get("info") == json.loads(info):
                with np.load(path, allow_pickle=False) as data:
                    cached.keys = [str(k) for k in data["__keys__"]]
                    cached.arrays = {k: data[k] for k in data.files if k != "__keys__"}
                cached.row = {k: i for i, k in enumerate(cached.keys)}
            else:
                log.info("feature cache %s was made by another %s: recomputing", path, model.name)
        self._memory[model.name] = cached
        return cached

    def _save(self, model: SimilarityModel, cached: _Cached) -> None:
        if self.directory is None:
            return
        from core.atomic import write_atomic, write_json_atomic

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, __keys__=np.asarray(cached.keys), **cached.arrays)

        path = write_atomic(self._file(model), write)
        write_json_atomic(
            {"model": model.name, "info": json.loads(cached.info), "images": len(cached.keys)},
            path.with_suffix(".json"),
        )

    def features(self, model: SimilarityModel, paths: Sequence[Path]) -> dict[str, np.ndarray]:
        """``model``'s features of ``paths``, rows in that order."""
        from tqdm import tqdm

        cached = self._load(model)
        keys = [_file_key(p) for p in paths]
        missing = list(dict.fromkeys(k for k in keys if k not in cached.row))
        if missing:
            path_of = dict(zip(keys, paths))
            chunks = [missing[s : s + self.chunk] for s in range(0, len(missing), self.chunk)]
            for chunk in tqdm(chunks, desc=f"features {model.name}", unit="chunk", leave=False):
                new = model.extract([path_of[k] for k in chunk])
                self._append(model, cached, chunk, new)
            self._save(model, cached)
        rows = np.asarray([cached.row[k] for k in keys], np.int64)
        return {k: v[rows] for k, v in cached.arrays.items()}

    @staticmethod
    def _append(model: SimilarityModel, cached: _Cached, keys: list[str], new: dict[str, np.ndarray]) -> None:
        if not new:
            raise SimilarityDataError(f"model {model.name} gave no feature array")
        for name, value in new.items():
            value = np.asarray(value)
            if value.shape[:1] != (len(keys),):
                raise SimilarityDataError(
                    f"model {model.name}: feature {name!r} has shape {value.shape} for {len(keys)} images"
                )
            old = cached.arrays.get(name)
            if old is not None and old.shape[1:] != value.shape[1:]:
                raise SimilarityDataError(
                    f"model {model.name}: feature {name!r} changed shape {old.shape[1:]} -> {value.shape[1:]}"
                )
            cached.arrays[name] = value if old is None else np.concatenate([old, value])
        if cached.arrays.keys() != new.keys():
            raise SimilarityDataError(
                f"model {model.name}: feature names changed {sorted(cached.arrays)} -> {sorted(new)}"
            )
        for k in keys:
            cached.row[k] = len(cached.keys)
            cached.keys.append(k)


def global_features(model: SimilarityModel, features: Mapping[str, np.ndarray]) -> np.ndarray:
    """The (n, d) "global" feature of ``model`` (what the ensemble's context and the miners of hard
    B's read); a typed error for a model without one."""
    if "global" not in features or np.asarray(features["global"]).ndim != 2:
        raise SimilarityDataError(
            f"model {model.name} has no 'global' (n, d) feature: it cannot serve as context or miner"
        )
    return np.asarray(features["global"])


def triplet_scores(
    models: Sequence[SimilarityModel], triplets: Triplets, store: FeatureStore
) -> tuple[np.ndarray, np.ndarray]:
    """(n, K) similarities s_k(R, A) and s_k(R, B)."""
    images = triplets.images()
    index = {p: i for i, p in enumerate(images)}
    r, a, b = (np.asarray([index[p] for p in col], np.int64) for col in (triplets.ref, triplets.a, triplets.b))
    sa, sb = np.zeros((len(triplets), len(models))), np.zeros((len(triplets), len(models)))
    for k, model in enumerate(models):
        feats = store.features(model, images)
        for out, cand in ((sa, a), (sb, b)):
            s = np.asarray(model.score(feats, r, cand), np.float64)
            if s.shape != (len(triplets),) or not np.isfinite(s).all():
                raise SimilarityDataError(
                    f"model {model.name} gave scores of shape {s.shape} (finite: {np.isfinite(s).all()}) "
                    f"for {len(triplets)} pairs"
                )
            out[:, k] = s
    return sa, sb


def context_descriptors(name: str, triplets: Triplets, store: FeatureStore) -> tuple[np.ndarray, np.ndarray]:
    """(R's context descriptors (n, D), every triplet image's (m, D)): model ``name``'s global
    features, the ensemble's context."""
    model = get_model(name)
    images = triplets.images()
    x = global_features(model, store.features(model, images)).astype(np.float64)
    index = {p: i for i, p in enumerate(images)}
    return x[[index[p] for p in triplets.ref]], x
