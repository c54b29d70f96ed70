"""k-means: k-means++ seeding (Arthur and Vassilvitskii) and Lloyd iterations. Numpy only.

The one copy that both k-means users run: the grouped evaluation (eval/groups.py, K=2 splits of
the images of two groups, best of several restarts) and the adaptors' pseudo-labels
(similarity/adaptors/clusters.py, 8 to 128 clusters of about 1,500 descriptors, one run).

They differ in three numerical choices, which :class:`KMeansConfig` keeps as settings so that each
caller gets, for a seed, exactly the clusters it has always got:

- how squared distances are computed: ``direct`` sums ``(x - c)^2`` (an (n, k, d) temporary: fine
  for a few clusters of a few images) or ``expanded`` takes ``|x|^2 - 2 x.c + |c|^2`` clipped at 0
  (an (n, k) matrix product: fit for many clusters of many descriptors);
- what an emptied cluster gets: ``move_centre`` moves its centre onto the point worst served by its
  own centre (every cluster empty in one step gets that point; labels follow at the next
  assignment, and once more against the final centres), ``steal_point`` moves that point (taken
  from a cluster that keeps another one) into the empty cluster before the means are taken (the
  labels returned are those of the last assignment, every cluster non-empty);
- how seeding draws the next centre when every point already lies on a chosen one (all k-means++
  weights 0): uniformly, by ``choice`` (``rng.choice(n, p=uniform)``) or ``integers``
  (``rng.integers(n)``), the same distribution from different draws of the generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from core.errors import NeedleInputError

DISTANCES = ("direct", "expanded")
EMPTY_CLUSTER_RULES = ("move_centre", "steal_point")
COINCIDENT_DRAWS = ("choice", "integers")


class KMeansError(NeedleInputError):
    """Points or settings k-means cannot work with."""


@dataclass(frozen=True)
class KMeansConfig:
    restarts: int = 1  # seedings, each followed by Lloyd iterations; the result of lowest inertia is kept
    max_iter: int = 100  # Lloyd iterations per restart at most (they stop once no label changes)
    distances: str = "direct"  # squared distances: "direct" or "expanded" (module docstring)
    empty: str = "move_centre"  # what an emptied cluster gets: "move_centre" or "steal_point"
    coincident_draw: str = "choice"  # seeding's draw when all points lie on chosen centres: "choice" or "integers"

    def __post_init__(self) -> None:
        if self.restarts < 1 or self.max_iter < 1:
            raise KMeansError(f"restarts and max_iter must be >= 1, got {self.restarts} and {self.max_iter}")
        for name, value, allowed in (
            ("distances", self.distances, DISTANCES),
            ("empty", self.empty, EMPTY_CLUSTER_RULES),
            ("coincident_draw", self.coincident_draw, COINCIDENT_DRAWS),
        ):
            if value not in allowed:
                raise KMeansError(f"unknown {name} {value!r}; choose from {allowed}")


@dataclass(frozen=True, eq=False)
class KMeansResult:
    centroids: np.ndarray  # (k, d) float64
    labels: np.ndarray  # (n,) int64 cluster of each point
    inertia: float  # sum of the squared distances of the points to their cluster's centroid


def squared_distances(x: np.ndarray, c: np.ndarray, how: str = "direct") -> np.ndarray:
    """(n, k) squared Euclidean distances of the rows of ``x`` to the rows of ``c``, computed
    ``direct`` or ``expanded`` (module docstring)."""
    if how == "expanded":
        return np.maximum((x * x).sum(1)[:, None] - 2.0 * x @ c.T + (c * c).sum(1)[None, :], 0.0)
    return ((x[:, None, :] - c[None]) ** 2).sum(-1)


def kmeans_plus_plus(
    x: np.ndarray, k: int, rng: np.random.Generator, conf: KMeansConfig = KMeansConfig()
) -> np.ndarray:
    """(k, d) initial centres: the first a uniformly drawn point, each next one drawn with
    probability proportional to its squared distance to the nearest centre chosen so far."""
    n = len(x)
    centres = [x[rng.integers(n)]]
    closest = squared_distances(x, centres[0][None], conf.distances)[:, 0]
    for _ in range(1, k):
        total = closest.sum()
        if total > 0:
            pick = rng.choice(n, p=closest / total)
        elif conf.coincident_draw == "integers":
            pick = rng.integers(n)
        else:
            pick = rng.choice(n, p=np.full(n, 1.0 / n))
        centres.append(x[pick])
        closest = np.minimum(closest, squared_distances(x, x[pick][None], conf.distances)[:, 0])
    return np.stack(centres).astype(np.float64)


def _update_moving_empty_centres(
    x: np.ndarray, labels: np.ndarray, d: np.ndarray, centres: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each centre the mean of its points; an empty cluster's centre moves onto the point worst
    served by its centre, so K stays K."""
    for c in range(len(centres)):
        members = x[labels == c]
        if len(members):
            centres[c] = members.mean(axis=0)
        else:
            centres[c] = x[int(d[np.arange(len(x)), labels].argmax())]
    return labels, centres


def _update_stealing_points(
    x: np.ndarray, labels: np.ndarray, d: np.ndarray, centres: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """An empty cluster takes the point worst served by its centre among the clusters that keep
    another point (k <= n, so there is always one); then each centre is the mean of its points."""
    k = len(centres)
    counts = np.bincount(labels, minlength=k)
    served = d[np.arange(len(x)), labels]
    for empty in np.flatnonzero(counts == 0):
        far = int(np.where(counts[labels] > 1, served, -np.inf).argmax())
        counts[labels[far]] -= 1
        counts[empty] += 1
        labels[far] = empty
    centres = np.zeros_like(centres)
    np.add.at(centres, labels, x)
    centres /= np.bincount(labels, minlength=k)[:, None]
    return labels, centres


_UPDATES: dict[str, Callable[..., tuple[np.ndarray, np.ndarray]]] = {
    "move_centre": _update_moving_empty_centres,
    "steal_point": _update_stealing_points,
}


def lloyd(x: np.ndarray, centres: np.ndarray, conf: KMeansConfig = KMeansConfig()) -> KMeansResult:
    """Lloyd iterations from ``centres`` until no label changes or ``conf.max_iter`` are done."""
    n = len(x)
    labels = np.full(n, -1)
    for _ in range(conf.max_iter):
        d = squared_distances(x, centres, conf.distances)
        new = d.argmin(axis=1)
        if np.array_equal(new, labels):
            break
        labels, centres = _UPDATES[conf.empty](x, new, d, centres)
    d = squared_distances(x, centres, conf.distances)
    if conf.empty == "move_centre":  # the centres moved after the last assignment
        labels = d.argmin(axis=1)
    return KMeansResult(centres, labels.astype(np.int64), float(d[np.arange(n), labels].sum()))


def kmeans(
    x: np.ndarray,
    k: int,
    seed: int = 0,
    conf: KMeansConfig = KMeansConfig(),
    error: type[NeedleInputError] = KMeansError,
) -> KMeansResult:
    """k-means of the rows of ``x`` into ``k`` clusters: the best (lowest inertia) of
    ``conf.restarts`` k-means++ seedings drawn from one generator seeded with ``seed``, each
    followed by Lloyd iterations. ``error``: the typed error raised for unusable points."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or not 1 <= k <= len(x):
        raise error(f"k-means with k={k} needs an (n >= k, d) array, got shape {x.shape}")
    rng = np.random.default_rng(seed)
    best = None
    for _ in range(conf.restarts):
        result = lloyd(x, kmeans_plus_plus(x, k, rng, conf), conf)
        if best is None or result.inertia < best.inertia - 1e-12:
            best = result
    return best
