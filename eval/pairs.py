"""Asymmetric recall aR@k of paired retrieval (the Totally-Looks-Like protocol).

n pairs (left_i, right_i). From each left image the right images are ranked by cosine similarity
(and the other way round); pair i counts as found at k when right_i is among the k most similar
rights of left_i, **or** left_i among the k most similar lefts of right_i. aR@k is the share of
pairs found, times 100. Each direction's gallery is the other side of all n pairs plus, optionally,
distractor images shared by both directions (appended after the pair columns).

Ties are ordered as everywhere in needle (:func:`eval.metrics.rank_by_score`): on equal score the
lower gallery column comes first, so the pair's own column i only loses a tie to columns j < i.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from core.errors import NeedleInputError

NORM_EPS = 1e-8  # rows of norm below this are treated as zero vectors (cosine 0 with everything)


def cosine_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(n, m) cosine similarities of the rows of ``a`` (n, d) and ``b`` (m, d), float64; a zero row
    (e.g. an all-zero ReLU output) has cosine 0 with everything instead of NaN."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise NeedleInputError(f"cosine needs (n, d) and (m, d) arrays, got shapes {a.shape} and {b.shape}")
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), NORM_EPS)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), NORM_EPS)
    return a @ b.T


def own_column_ranks(scores: np.ndarray) -> np.ndarray:
    """0-based rank of column i in row i of an (n, m >= n) score matrix, ties to the lower column:
    #{j : s_ij > s_ii} + #{j < i : s_ij == s_ii}."""
    scores = np.asarray(scores)
    if scores.ndim != 2 or scores.shape[1] < scores.shape[0]:
        raise NeedleInputError(f"scores must be (n, m) with m >= n (pair columns first), got shape {scores.shape}")
    n = scores.shape[0]
    own = scores[np.arange(n), np.arange(n)][:, None]
    before = np.arange(scores.shape[1])[None, :] < np.arange(n)[:, None]
    return ((scores > own) | ((scores == own) & before)).sum(axis=1)


def _check_ks(ks: Sequence[int]) -> tuple[int, ...]:
    ks = tuple(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1 for k in ks):
        raise NeedleInputError(f"k values must be integers >= 1, got {ks!r}")
    return tuple(int(k) for k in ks)


def asymmetric_recall_from_scores(
    left_to_right: np.ndarray, right_to_left: np.ndarray, ks: Sequence[int]
) -> dict[int, float]:
    """aR@k x 100 for each k from the two directions' score matrices: row i of ``left_to_right``
    scores left_i against right_0..right_{n-1} then any distractors, and ``right_to_left`` the same
    for right_i against the lefts."""
    ks = _check_ks(ks)
    left_to_right = np.asarray(left_to_right)
    right_to_left = np.asarray(right_to_left)
    if left_to_right.shape[0] != right_to_left.shape[0] or left_to_right.shape[0] == 0:
        raise NeedleInputError(
            f"both directions need the same n >= 1 rows, got {left_to_right.shape} and {right_to_left.shape}"
        )
    rank = np.minimum(own_column_ranks(left_to_right), own_column_ranks(right_to_left))
    return {k: 100.0 * float(np.mean(rank < k)) for k in ks}


def asymmetric_recall(
    left: np.ndarray, right: np.ndarray, ks: Sequence[int] = (1, 5, 20), distractors: np.ndarray | None = None
) -> dict[int, float]:
    """aR@k x 100 of n pairs given their (n, d) left and right descriptors (cosine similarity),
    optionally with (m, d) distractors added to both directions' galleries."""
    left = np.asarray(left)
    right = np.asarray(right)
    if left.ndim != 2 or left.shape != right.shape:
        raise NeedleInputError(f"left and right descriptors must both be (n, d), got {left.shape} and {right.shape}")
    if distractors is not None and len(distractors):
        distractors = np.asarray(distractors)
        if distractors.ndim != 2 or distractors.shape[1] != left.shape[1]:
            raise NeedleInputError(f"distractors must be (m, {left.shape[1]}), got {distractors.shape}")
        right_gallery, left_gallery = np.concatenate([right, distractors]), np.concatenate([left, distractors])
    else:
        right_gallery, left_gallery = right, left
    return asymmetric_recall_from_scores(cosine_matrix(left, right_gallery), cosine_matrix(right, left_gallery), ks)
