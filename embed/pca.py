"""Principal component analysis: the one copy of PCA fitting every caller uses. Numpy only.

Two algorithms, one function each, because their inputs differ:

- :func:`fit_pca`, from samples held in memory: the components are the leading right singular
  vectors of the centred samples (a thin SVD; no covariance matrix is formed, so the dimension may
  exceed the number of samples). At most ``min(dim, n - 1, D)`` are kept: n centred samples span
  at most n - 1 directions. Used by the adaptation function's projection, the 2AFC ensemble's
  context and FFA's per-image foreground direction.
- :func:`eigh_descending`, from a covariance matrix: its eigenpairs, largest first. Used by PCA
  whitening and learned whitening (embed/whiten.py), whose covariance is accumulated file by file
  from descriptors that are never all in memory at once.

A principal direction has no sign of its own. :func:`fixed_signs` makes each one's
largest-magnitude entry positive, so that results do not depend on the LAPACK build; callers that
orient the direction themselves (FFA) or use only its span keep the solver's signs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.errors import NeedleInputError


class PCAError(NeedleInputError):
    """Samples that cannot be fitted, or features that do not fit a fitted PCA."""


@dataclass(frozen=True)
class PCA:
    """A fitted projection ``x -> (x - mean) @ components.T``."""

    mean: np.ndarray  # (D,) float64 mean of the fitted rows
    components: np.ndarray  # (k, D) float64 orthonormal rows, by decreasing variance
    # (min(n, D),) float64 singular values of the centred fitted rows, descending (all of them, not
    # only the k kept); None for a projection read back from a file
    singular_values: np.ndarray | None = None

    @property
    def dim(self) -> int:
        return int(self.components.shape[0])

    def apply(self, x: np.ndarray) -> np.ndarray:
        """(n, D) features -> (n, k) float32 projections."""
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.mean.shape[0]:
            raise PCAError(f"features of shape {x.shape} do not fit a PCA of D={self.mean.shape[0]}")
        return ((x - self.mean) @ self.components.T).astype(np.float32)


def fixed_signs(rows: np.ndarray) -> np.ndarray:
    """``rows`` each multiplied by -1 or 1 so that its largest-magnitude entry (the first of equal
    ones) is positive; an all-zero row stays as it is."""
    signs = np.sign(rows[np.arange(len(rows)), np.abs(rows).argmax(axis=1)])
    return rows * np.where(signs == 0, 1.0, signs)[:, None]


def fit_pca(
    x: np.ndarray, dim: int, *, fix_signs: bool = True, what: str = "features", error: type[NeedleInputError] = PCAError
) -> PCA:
    """Centred PCA of the rows of ``x`` to ``min(dim, n - 1, D)`` components (thin SVD).

    ``fix_signs``: orient each component by :func:`fixed_signs` (else the SVD's signs). ``what``
    names the rows and ``error`` is the typed error raised for fewer than two of them, so that each
    caller reports in its own terms."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or len(x) < 2:
        raise error(f"PCA needs (n >= 2, D) {what}, got shape {x.shape}")
    if dim < 1:
        raise error(f"PCA needs a dimension >= 1, got {dim}")
    mean = x.mean(axis=0)
    _, singular_values, vt = np.linalg.svd(x - mean, full_matrices=False)
    components = vt[: min(dim, len(x) - 1, x.shape[1])]
    return PCA(mean, fixed_signs(components) if fix_signs else components, singular_values)


def eigh_descending(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues (descending, negatives from rounding clipped to 0) and eigenvectors (columns,
    each oriented by :func:`fixed_signs`) of a symmetric matrix (symmetrised first)."""
    values, vectors = np.linalg.eigh((c + c.T) / 2)
    order = np.argsort(values)[::-1]
    # Contiguous columns, as the matrix products of the callers have always been given them.
    return np.clip(values[order], 0, None), np.ascontiguousarray(fixed_signs(vectors[:, order].T).T)
