"""The query path's second verification: LightGlue over the top of a re-ranked shortlist
(rerank/glue.py), made where the candidates' tokens are (``Index.glue_matches``: in this process from
the local store; with shards, each shard for its own rows), then the top re-ordered among itself."""

from __future__ import annotations

from typing import Any

import numpy as np

from core.errors import NeedleInputError
from core.tokens import LocalTokens
from query.index_protocol import Index
from query.recorded import QueryFiles, index_itq
from rerank.glue import glue_scores
from rerank.rerank import RerankConfig, Reranker


def make_reranker(
    conf: RerankConfig, index: Index, kind: str | None, device: Any = "cpu", files: QueryFiles | None = None
) -> Reranker:
    """A Reranker for ``index``: its token kind's settings, and the index's ITQ projection loaded (and
    verified) only when the second verification first runs."""
    if conf.glue.top and kind not in (None, "aliked"):
        raise NeedleInputError(
            f"the second verification (--glue-top) is LightGlue for ALIKED tokens; index {index.path} has "
            f"{kind!r} tokens"
        )
    given = (files or QueryFiles()).itq
    return Reranker(conf, kind, device, itq=lambda: index_itq(index.infos, index.path, given))


def second_verification(
    index: Index, reranker: Reranker, rows: np.ndarray, order: np.ndarray, scores: np.ndarray, query: LocalTokens
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(order, scores, expected matches per shortlist member: NaN where not verified, or None
    without a second stage): the first ``conf.glue.top`` of ``order`` verified again and ordered
    among themselves by s1 + weight * min(matches / cap, 1); the rest as they were."""
    glue = reranker.conf.glue
    n = min(glue.top, len(order))
    if n == 0 or len(query) == 0:
        return order, scores, None
    top = order[:n]
    matches = np.full(len(order), np.nan)
    matches[top] = index.glue_matches(reranker, rows[top], query)
    scores = glue_scores(scores, top, matches[top], glue)
    # among the verified, higher score first; equal scores keep the first stage's order
    order = np.concatenate([top[np.argsort(-scores[top], kind="stable")], order[n:]])
    return order, scores, matches
