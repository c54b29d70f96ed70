"""``needle adapt whiten``: PCA whitening and learned whitening of global descriptors, as baselines
to the trained linear adaptation (:mod:`embed.adapt`).

- **PCA whitening** (unsupervised; as in Jégou and Chum, "Negative evidences and co-occurrences in
  image retrieval: the benefit of PCA and whitening", ECCV 2012): centre the descriptors on their
  mean, project on the top ``out_dim`` eigenvectors of their covariance and scale each component by
  ``1 / sqrt(eigenvalue + r)``, so that the kept components are decorrelated with unit variance.
- **Learned whitening** (supervised, from matching pairs; Radenović, Tolias and Chum, "CNN image
  retrieval learns from BoW: unsupervised fine-tuning with hard examples", ECCV 2016, and
  "Fine-tuning CNN image retrieval with no human annotation", TPAMI 2018, after Mikolajczyk and
  Matas, ICCV 2007): ``P1 = C_S^-1/2`` whitens the covariance ``C_S`` of the differences of matching
  (same-label) pairs, then ``P2`` rotates onto the top ``out_dim`` principal directions of the
  ``P1``-whitened descriptors: ``W = P2ᵀ P1``, ``b = -W m`` with ``m`` the descriptors' mean. Variation
  between views of one object is damped, variation between objects is kept.

Both are the same kind of file as a trained adapter (``x -> L2(W x + b)``, saved by
:func:`embed.adapt.save_adapter`), so ``needle index build --adapt`` and queries take them as they are.
The regulariser ``r`` is ``eps`` times the mean eigenvalue (the trace over ``d``) of the matrix being
inverted, so that the same ``eps`` suits descriptors of any dimension and scale. Everything is
computed in float64; the covariance's eigenpairs and their signs (largest entry positive, so that
results do not depend on the LAPACK build) come from :func:`embed.pca.eigh_descending`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch

from core.atomic import write_json_atomic
from embed import DEFAULT_EPS, WhitenConfig
from embed import WHITEN_METHODS as METHODS
from embed.adapt import AdapterError, LinearAdapter, labelled_descriptors, read_labels, save_adapter
from embed.pca import eigh_descending
from ingest.descriptors import STATUS_OK, list_descriptor_files, read_global

log = logging.getLogger(__name__)

_CHUNK = 16384  # rows converted to float64 at a time when accumulating second moments


# --- linear algebra ---------------------------------------------------------------------------------


def _check_matrix(x: np.ndarray, what: str = "descriptors") -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[0] < 2 or x.shape[1] < 1:
        raise AdapterError(f"{what} must be an (n >= 2, d) array, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise AdapterError(f"{what} of shape {x.shape} hold NaN or inf")
    return x


def _check_out_dim(out_dim: int, n: int, d: int) -> None:
    if not 1 <= out_dim <= min(d, n - 1):
        raise AdapterError(
            f"out_dim {out_dim} must be between 1 and min(d, n - 1) = {min(d, n - 1)} "
            f"for {n} descriptors of dimension {d}"
        )


def _moments(blocks: Iterable[np.ndarray]) -> tuple[int, np.ndarray, np.ndarray]:
    """(n, mean, covariance (normalised by n)) of row blocks, accumulated in float64 without
    holding them all: the blocks may be the files of a large collection."""
    n, total, outer, d = 0, None, None, None
    for block in blocks:
        for start in range(0, len(block), _CHUNK):
            chunk = np.asarray(block[start : start + _CHUNK], dtype=np.float64)
            if total is None:
                d = chunk.shape[1]
                total, outer = np.zeros(d), np.zeros((d, d))
            elif chunk.shape[1] != d:
                raise AdapterError(f"descriptor blocks of dimension {chunk.shape[1]} and {d} cannot be mixed")
            n += len(chunk)
            total += chunk.sum(0)
            outer += chunk.T @ chunk
    if n < 2:
        raise AdapterError(f"need at least 2 descriptors to whiten, got {n}")
    mean = total / n
    # Shifting by the mean after summing is exact enough here: descriptors are L2-normalised and
    # float64 keeps ~16 digits, far more than the float16 descriptors carry.
    return n, mean, _symmetric(outer / n - np.outer(mean, mean))


def _symmetric(c: np.ndarray) -> np.ndarray:
    return (c + c.T) / 2


def _regulariser(values: np.ndarray, eps: float) -> float:
    if not eps >= 0:
        raise AdapterError(f"eps must be >= 0, got {eps}")
    return float(eps * values.mean())


def _inverse_sqrt(c: np.ndarray, eps: float) -> tuple[np.ndarray, float]:
    """(symmetric ``(C + r I)^-1/2``, r) of a covariance, ``r = eps * trace(C) / d``; raises
    AdapterError when ``C + r I`` is singular (``eps=0`` on rank-deficient data)."""
    values, vectors = eigh_descending(c)
    r = _regulariser(values, eps)
    if values[-1] + r <= 0:
        raise AdapterError(f"covariance of shape {c.shape} is singular (rank {int((values > 0).sum())}): give eps > 0")
    return (vectors / np.sqrt(values + r)) @ vectors.T, r


def _to_adapter(weight: np.ndarray, bias: np.ndarray) -> LinearAdapter:
    # fork_rng: LinearAdapter's initialisation (overwritten here) must not move the global torch RNG.
    with torch.random.fork_rng(devices=[]):
        adapter = LinearAdapter(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        adapter.layer.weight.copy_(torch.from_numpy(weight.astype(np.float32)))
        adapter.layer.bias.copy_(torch.from_numpy(bias.astype(np.float32)))
    return adapter.eval()


# --- PCA whitening ------------------------------------------------------------------------------------


def _fit_pca_whitening(
    n: int, mean: np.ndarray, cov: np.ndarray, out_dim: int, eps: float
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(W, b, infos) of PCA whitening from the descriptors' moments (the covariance's eigenpairs:
    embed/pca.py)."""
    _check_out_dim(out_dim, n, len(mean))
    values, vectors = eigh_descending(cov)
    r = _regulariser(values, eps)
    kept = values[:out_dim]
    if kept[-1] + r <= 0:
        raise AdapterError(
            f"only {int((values > 0).sum())} of the {out_dim} components asked for have variance: "
            "give eps > 0 or a smaller out_dim"
        )
    weight = vectors[:, :out_dim].T / np.sqrt(kept + r)[:, None]
    total = float(values.sum())
    infos = {
        "samples": n,
        "explained_variance": float(kept.sum() / total) if total > 0 else 0.0,
        "eigenvalues_kept": [float(kept[0]), float(kept[-1])],
        "regulariser": r,
    }
    return weight, -weight @ mean, infos


def pca_whitening(x: np.ndarray, out_dim: int, eps: float = DEFAULT_EPS) -> LinearAdapter:
    """PCA whitening of (n, d) descriptors as an adapter: ``W = diag(λ + r)^-1/2 Pᵀ`` (top ``out_dim``
    eigenpairs of the covariance), ``b = -W μ``, so that ``adapter(x) = L2(W (x - μ))``."""
    x = _check_matrix(x)
    weight, bias, _ = _fit_pca_whitening(*_moments([x]), out_dim, eps)
    return _to_adapter(weight, bias)


# --- learned whitening ----------------------------------------------------------------------------


def _check_labels(x: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(integer class of each row, size of each class)."""
    labels = np.asarray(labels)
    if labels.shape != (len(x),):
        raise AdapterError(f"need one label per descriptor: descriptors {x.shape}, labels {labels.shape}")
    _, classes, sizes = np.unique(labels, return_inverse=True, return_counts=True)
    if not (sizes >= 2).any():
        raise AdapterError(
            f"no class of the {len(sizes)} labels has 2 descriptors: learned whitening needs matching pairs"
        )
    return classes, sizes


def positive_pairs(labels: np.ndarray, max_pairs: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``max_pairs`` same-label pairs (i, j), i != j, drawn uniformly (with replacement) from all
    unordered same-label pairs, reproducibly for ``seed``."""
    _, classes, sizes = np.unique(np.asarray(labels), return_inverse=True, return_counts=True)
    pair_counts = sizes * (sizes - 1) / 2
    if max_pairs < 1 or pair_counts.sum() == 0:
        raise AdapterError(
            f"cannot draw {max_pairs} positive pairs from {len(sizes)} classes of sizes up to {sizes.max()}"
        )
    rng = np.random.default_rng(seed)
    members = np.argsort(classes, kind="stable")
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    cls = rng.choice(len(sizes), size=max_pairs, p=pair_counts / pair_counts.sum())
    a = rng.integers(0, sizes[cls])
    b = (a + rng.integers(1, sizes[cls])) % sizes[cls]  # any other member, uniformly
    return members[starts[cls] + a], members[starts[cls] + b]


def pair_difference_covariance(
    x: np.ndarray, labels: np.ndarray, max_pairs: int | None = None, seed: int = 0
) -> tuple[np.ndarray, int]:
    """(C_S, number of pairs): the mean of ``(x_i - x_j)(x_i - x_j)ᵀ`` over same-label pairs.

    All pairs use the closed form ``Σ_{i<j in c} (x_i - x_j)(x_i - x_j)ᵀ = n_c Σ_{i in c} (x_i - μ_c)(x_i - μ_c)ᵀ``
    (no pair is enumerated); when ``max_pairs`` is smaller than their number, a seeded sample of
    :func:`positive_pairs` is used instead."""
    x = _check_matrix(x)
    classes, sizes = _check_labels(x, labels)
    total_pairs = int((sizes * (sizes - 1) // 2).sum())
    if max_pairs is not None and max_pairs < total_pairs:
        i, j = positive_pairs(classes, max_pairs, seed)
        cov = np.zeros((x.shape[1], x.shape[1]))
        for start in range(0, len(i), _CHUNK):
            diff = x[i[start : start + _CHUNK]].astype(np.float64) - x[j[start : start + _CHUNK]]
            cov += diff.T @ diff
        return _symmetric(cov / len(i)), len(i)
    scatter = np.zeros((x.shape[1], x.shape[1]))
    for c in np.flatnonzero(sizes >= 2):
        centred = x[classes == c].astype(np.float64)
        centred -= centred.mean(0)
        scatter += sizes[c] * (centred.T @ centred)
    return _symmetric(scatter / total_pairs), total_pairs


def _fit_learned(
    x: np.ndarray, labels: np.ndarray, out_dim: int, eps: float, max_pairs: int | None, seed: int
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(W, b, infos) of learned whitening."""
    x = _check_matrix(x)
    _, sizes = _check_labels(x, labels)
    _check_out_dim(out_dim, len(x), x.shape[1])
    c_s, n_pairs = pair_difference_covariance(x, labels, max_pairs, seed)
    p1, r = _inverse_sqrt(c_s, eps)
    n, mean, cov = _moments([x])
    values, vectors = eigh_descending(p1 @ cov @ p1)  # p1 is symmetric
    weight = vectors[:, :out_dim].T @ p1
    infos = {
        "samples": n,
        "pairs": n_pairs,
        "classes_with_pairs": int((sizes >= 2).sum()),
        "regulariser": r,
        "explained_variance": float(values[:out_dim].sum() / values.sum()) if values.sum() > 0 else 0.0,
    }
    return weight, -weight @ mean, infos


def learned_whitening(
    x: np.ndarray,
    labels: np.ndarray,
    out_dim: int,
    eps: float = DEFAULT_EPS,
    max_pairs: int | None = None,
    seed: int = 0,
) -> LinearAdapter:
    """Radenović-style learned whitening of (n, d) descriptors with one label each (any hashable
    values; pairs of equal labels are the matching pairs): ``W = P2ᵀ P1``, ``b = -W m``."""
    weight, bias, _ = _fit_learned(x, labels, out_dim, eps, max_pairs, seed)
    return _to_adapter(weight, bias)


# --- the stage ------------------------------------------------------------------------------------


def ok_descriptor_blocks(descriptors: Path) -> Iterable[np.ndarray]:
    """The ok, finite rows of each file of a descriptor directory, one (n, d) float16 block per file."""
    for path in list_descriptor_files(Path(descriptors)):
        table, xb = read_global(path, ("status",))
        ok = pc.equal(table["status"], STATUS_OK).to_numpy(zero_copy_only=False)
        finite = np.isfinite(xb).all(axis=1)
        if (ok & ~finite).any():
            log.warning("%s: %d descriptors with NaN/inf left out", path, int((ok & ~finite).sum()))
        yield xb[ok & finite]


def fit(conf: WhitenConfig, descriptors: Path, labels: Path | None = None) -> tuple[LinearAdapter, dict[str, Any]]:
    """The whitening of ``conf.method`` fitted on a descriptor directory, and what it was fitted on.

    pca: every ok row, streamed file by file, or only the labelled rows when ``labels`` is given;
    learned: the labelled rows (``labels`` required)."""
    if conf.method not in METHODS:
        raise AdapterError(f"unknown whitening method {conf.method!r}; choose one of {', '.join(METHODS)}")
    if conf.method == "learned" and labels is None:
        raise AdapterError("learned whitening needs a label file (key,label): matching pairs are rows of one label")
    if labels is not None:
        x, y, classes = labelled_descriptors(Path(descriptors), read_labels(Path(labels)))
    if conf.method == "pca":
        moments = _moments([x] if labels is not None else ok_descriptor_blocks(Path(descriptors)))
        weight, bias, infos = _fit_pca_whitening(*moments, conf.out_dim, conf.eps)
    else:
        weight, bias, infos = _fit_learned(x, y, conf.out_dim, conf.eps, conf.max_pairs, conf.seed)
        infos["classes"] = len(classes)
    return _to_adapter(weight, bias), infos


def main(conf: WhitenConfig, descriptors: Path, labels: Path | None, output: Path) -> Path:
    """Fit the whitening of ``descriptors``; write ``output`` (an adapter file) and ``output``.json."""
    start = time.perf_counter()
    adapter, infos = fit(conf, Path(descriptors), None if labels is None else Path(labels))
    path = save_adapter(adapter, Path(output))
    record = {
        "method": f"whiten-{conf.method}",
        "config": asdict(conf),
        "descriptors": str(descriptors),
        "labels": None if labels is None else str(labels),
        "in_dim": adapter.in_dim,
        "out_dim": adapter.out_dim,
        **infos,
        "seconds": round(time.perf_counter() - start, 3),
    }
    write_json_atomic(record, path.with_name(path.name + ".json"))
    log.info(
        "whitening %s (%s): %d -> %d from %d descriptors",
        path,
        conf.method,
        adapter.in_dim,
        adapter.out_dim,
        infos["samples"],
    )
    return path
