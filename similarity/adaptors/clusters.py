"""The adaptors' pseudo-granularities: k-means clusterings of the frozen descriptors of unlabelled
images (one set of pseudo-labels per cluster count), and each image's nearest neighbours in that
space (whose fusion attentions its own are pulled towards). Numpy only."""

from __future__ import annotations

import numpy as np

from eval import kmeans as kmeans_lib
from eval.kmeans import KMeansConfig
from similarity.adaptors.config import AdaptorsError


def pseudo_labels(x: np.ndarray, k: int, iterations: int = 50, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's k-means with k-means++ seeding (eval/kmeans.py), one run: (centroids (k, d) float32,
    labels (n,) int64).

    On convergence every label is the nearest centroid (ties to the lower index) and every centroid
    the mean of its points; an emptied cluster takes the point farthest from its centroid. Distances
    are computed as a matrix product (many clusters of many descriptors).
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or not np.isfinite(x).all():
        raise AdaptorsError(f"k-means needs a finite (n, d) array, got shape {x.shape}")
    if not 2 <= k <= len(x):
        raise AdaptorsError(f"cannot make {k} clusters of {len(x)} images (need 2 <= k <= images)")
    conf = KMeansConfig(max_iter=iterations, distances="expanded", empty="steal_point", coincident_draw="integers")
    result = kmeans_lib.kmeans(x, k, seed, conf, error=AdaptorsError)
    return result.centroids.astype(np.float32), result.labels


def nearest_neighbours(x: np.ndarray, k: int) -> np.ndarray:
    """(n, min(k, n - 1)) indices of each row's most similar other rows by inner product, most
    similar first, ties to the lower index."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    k = min(k, n - 1)
    if k < 1:
        raise AdaptorsError(f"nearest neighbours need at least two images, got {n}")
    order = np.argsort(-(x @ x.T), axis=1, kind="stable")
    others = order[order != np.arange(n)[:, None]].reshape(n, n - 1)
    return others[:, :k]
