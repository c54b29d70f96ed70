"""Chamfer similarity between a query's binary tokens and each candidate's.

For each query token its best similarity over the candidate's tokens, ``1 - 2 * hamming / 128``
(the cosine of the ±1 codes), averaged over the query tokens (unweighted). Padded candidate tokens
never match. A candidate without tokens, or a query without tokens, scores 0: no evidence either
way, rather than the -1 of codes that disagree in every bit.

The distances come from ``rerank.matching.nearest_tokens``, the one place that computes Hamming
distances against a shortlist: pass its result to ``chamfer_from_nearest`` when matching was run
too, and the distances are computed once for both.
"""

from __future__ import annotations

import numpy as np

from core.tokens import CODE_BITS, LocalTokens, TokenBatch
from rerank.matching import NearestTokens, nearest_tokens


def chamfer_similarity(query: LocalTokens, candidates: TokenBatch) -> np.ndarray:
    """(C,) float64 Chamfer similarity of ``query`` with each candidate, in [-1, 1]."""
    return chamfer_from_nearest(nearest_tokens(query.codes, candidates, within=-1))


def chamfer_from_nearest(nearest: NearestTokens) -> np.ndarray:
    """(C,) float64 Chamfer similarity from already computed nearest-token distances."""
    C, Q = nearest.distance.shape
    if Q == 0:
        return np.zeros(C)
    similarity = 1.0 - 2.0 * nearest.distance.astype(np.float64) / CODE_BITS
    return np.where(nearest.has_tokens, similarity.mean(1), 0.0)
