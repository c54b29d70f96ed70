"""``needle query``: top-k keys and scores for an image file or a stored key, as JSON-ready dicts."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from index.search import SearchIndex
from ingest.errors import NeedleInputError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueryConfig:
    k: int = 10  # results per query
    nprobe: int | None = None  # IVF lists visited (IVF indexes only); None: the index's setting
    refine_factor: int | None = None  # IVF-PQ shortlist = this * k, re-scored exactly; None: the index's setting
    weights: str | None = None  # weights file for embedding query images; None: the one the index was built with


def results_json(index: SearchIndex, D: np.ndarray, I: np.ndarray) -> list[list[dict[str, Any]]]:
    """(D, I) -> per query a list of {key, row, score}, padding (-1) dropped."""
    keys = index.keys_of(I)
    return [
        [{"key": key, "row": int(i), "score": float(s)} for key, i, s in zip(krow, irow, drow) if i >= 0]
        for krow, irow, drow in zip(keys, I, D)
    ]


def recorded_extractor(index: SearchIndex, weights: str | None = None) -> tuple[dict[str, Any], str | None]:
    """(the global extractor's info recorded at ingestion, the weights file to use: ``weights``,
    else the recorded file when it still exists, else None for the preset's default)."""
    extractors = [e for e in index.infos.get("extractors", []) if e.get("extractor") == "global"]
    if not extractors:
        raise NeedleInputError(f"index {index.path} does not record its model: query by --key or --vectors instead")
    recorded = extractors[0].get("weights")
    if weights is None and recorded and Path(recorded).is_file():
        weights = recorded
    return extractors[0], weights


def query_extractor(index: SearchIndex, weights: str | None = None):
    """The global extractor the index's descriptors were made with (same model and resolution)."""
    from embed.extract import GlobalExtractor

    info, weights = recorded_extractor(index, weights)
    return GlobalExtractor(info["model"]["name"], weights, resolution=info["resolution"], precision=info.get("precision", "auto"))


def embed_image_files(index: SearchIndex, paths: list[Path], weights: str | None = None) -> np.ndarray:
    """(n, d) float32 descriptors of image files, made exactly as during ingestion."""
    from ingest.images import decode_resized

    extractor = query_extractor(index, weights)
    images = []
    for path in paths:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise NeedleInputError(f"cannot read query image {path}: {exc}") from exc
        images.append(decode_resized(data, extractor.resolution, str(path))[0])
    return extractor(images)["global"].astype(np.float32)


def embed_texts(index: SearchIndex, texts: list[str], weights: str | None = None) -> np.ndarray:
    """(n, d) descriptors of text queries, from the text tower of the index's (CLIP-like) model."""
    import torch

    from embed.models import build_global_model
    from embed.pooling import l2_normalize
    from embed.torchvision_compat import ensure_torchvision_importable

    if not texts or not all(t.strip() for t in texts):
        raise NeedleInputError("empty text query")
    info, weights = recorded_extractor(index, weights)
    model = info["model"]
    if model.get("library") != "open_clip":
        raise NeedleInputError(f"the index's model {model.get('name')!r} has no text tower: text queries need an open_clip model")
    ensure_torchvision_importable()
    import open_clip

    net, _ = build_global_model(model["name"], weights)
    tokens = open_clip.get_tokenizer(model["architecture"])(texts)
    with torch.inference_mode():
        return l2_normalize(net.backbone.encode_text(tokens)).numpy().astype(np.float32)


def load_vectors(path: Path, d: int) -> np.ndarray:
    """Query vectors from a .npy file: (d,) or (n, d)."""
    try:
        xq = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise NeedleInputError(f"cannot read query vectors {path}: {exc}") from exc
    xq = np.atleast_2d(xq).astype(np.float32)
    if xq.ndim != 2 or xq.shape[1] != d:
        raise NeedleInputError(f"query vectors {path} have shape {xq.shape}, the index expects (n, {d})")
    return xq


def query(index: SearchIndex, conf: QueryConfig, keys: list[str] = (), images: list[Path] = (),
          texts: list[str] = (), vectors: np.ndarray | None = None) -> list[dict[str, Any]]:
    """Search for every stored key, image file, text and vector; one result dict per query, in input order."""
    if not keys and not images and not texts and vectors is None:
        raise NeedleInputError("nothing to query: give --key, --image, --text or --vectors")
    if conf.k > index.ntotal:
        raise NeedleInputError(f"k={conf.k} is larger than the index ({index.ntotal} vectors)")
    blocks, labels = [], []
    if keys:
        blocks.append(np.stack([index.vector_of(k) for k in keys]))
        labels += [{"key": k} for k in keys]
    if images:
        blocks.append(embed_image_files(index, list(images), conf.weights))
        labels += [{"image": str(p)} for p in images]
    if texts:
        blocks.append(embed_texts(index, list(texts), conf.weights))
        labels += [{"text": t} for t in texts]
    if vectors is not None:
        blocks.append(vectors)
        labels += [{"vector": i} for i in range(len(vectors))]
    D, I = index.search(np.concatenate(blocks), conf.k, conf.nprobe, refine_factor=conf.refine_factor)
    return [{"query": label, "k": conf.k, "results": res} for label, res in zip(labels, results_json(index, D, I))]
