"""Re-ranking one query's shortlist with local tokens: a method's local scores, then the ensemble.

Methods: ``sp`` (spatial verification: inliers of the best transform), ``chamfer`` (mean best-match
similarity of the binary codes), ``ames`` (the AMES transformer's logit). The shortlist's tokens come
from the index's local store (index/locals.py); the query's from the local extractor the index was
built with, at the query-side scales (query/retrieve.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from core.errors import NeedleInputError
from core.tokens import LocalTokens, TokenBatch
from rerank.chamfer import chamfer_from_nearest
from rerank.device import resolve_device
from rerank.ensemble import METHODS, EnsembleConfig, combine, rerank_order
from rerank.expand import ExpansionConfig
from rerank.glue import GlueConfig
from rerank.lightglue import INPUT_DIM as LIGHTGLUE_INPUT_DIM
from rerank.matching import MatchConfig, matches_from_nearest, nearest_tokens, query_weights_of
from rerank.spatial import SpatialConfig, verify

if TYPE_CHECKING:
    from embed.itq import ITQ
    from index.locals import LocalStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RerankConfig:
    method: str = "sp"  # sp | chamfer | ames
    shortlist: int = 1000  # global top candidates re-ranked
    # s = lam * global + (1 - lam) * f(local) [+ w_c * chamfer for SP; w_c left open: the token kind's]
    ensemble: EnsembleConfig = field(default_factory=EnsembleConfig)
    # tentative correspondences (Hamming threshold, mutual); a threshold left open (None) is the token kind's
    match: MatchConfig = field(default_factory=MatchConfig)
    spatial: SpatialConfig = field(default_factory=SpatialConfig)  # spatial verification thresholds
    ames: str | None = None  # AMES checkpoint (method ames)
    # Query-side extraction factors of the base resolution, and tokens kept at each; None: the token
    # kind's own (embed.locals.presets.RERANK_BY_KIND: Lite0 3 x 100 at 0.75/1/1.5, ALIKED 300 at 1).
    query_scales: tuple[float, ...] | None = None
    query_top_k: int | None = None
    db_tokens: int | None = None  # use only each candidate's best this many tokens (None: all stored)
    # α-QE over the verified top after SP, then the shortlist scored again (rerank/expand.py); None:
    # the token kind's own (RERANK_BY_KIND: ALIKED the mean of the top 5 with >= 10 inliers, Lite0
    # none), none where no kind is known. Other methods have no inliers: no expansion.
    expansion: ExpansionConfig | None = None
    # LightGlue over the top of the final order (rerank/glue.py); top 0 (the default): no second stage
    glue: GlueConfig = field(default_factory=GlueConfig)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise NeedleInputError(f"unknown re-ranking method {self.method!r}; choose from {METHODS}")
        if self.shortlist < 1:
            raise NeedleInputError(f"shortlist must be >= 1, got {self.shortlist}")
        if self.method == "ames" and not self.ames:
            raise NeedleInputError(
                "re-ranking with AMES needs a checkpoint (--ames FILE, trained by `needle ames train`)"
            )


def with_kind_defaults(conf: RerankConfig, kind: str | None) -> RerankConfig:
    """``conf`` with what it leaves open (None) set to the token kind's own settings
    (embed.locals.presets.RERANK_BY_KIND); kind None (not known): no expansion, no Chamfer term, the
    query side left open, MatchConfig's generic threshold."""
    ensemble = conf.ensemble
    if kind is None:
        if ensemble.chamfer_weight is None:
            ensemble = replace(ensemble, chamfer_weight=0.0)
        return replace(conf, expansion=conf.expansion or ExpansionConfig(), ensemble=ensemble)
    from embed.locals.presets import RERANK_BY_KIND

    if kind not in RERANK_BY_KIND:
        raise NeedleInputError(f"unknown local-token kind {kind!r}; known: {sorted(RERANK_BY_KIND)}")
    own = RERANK_BY_KIND[kind]
    if ensemble.chamfer_weight is None:
        ensemble = replace(ensemble, chamfer_weight=own.chamfer_weight)
    return replace(
        conf,
        ensemble=ensemble,
        match=conf.match if conf.match.max_distance is not None else replace(conf.match, max_distance=own.max_hamming),
        query_scales=conf.query_scales or own.query_scales,
        query_top_k=conf.query_top_k or own.query_top_k,
        expansion=conf.expansion or ExpansionConfig(*own.expansion),
    )


@dataclass(frozen=True)
class LocalScores:
    """One query's local evidence on its shortlist."""

    raw: np.ndarray  # (C,) the method's raw score (inliers, Chamfer similarity, AMES logit)
    has_locals: np.ndarray  # (C,) bool: the candidate has tokens
    inliers: np.ndarray | None = None  # (C,) SP inlier counts
    evidence: Callable[[int], dict[str, Any]] | None = None  # SP: candidate -> its inlier point pairs, built on demand
    # (C,) SP: each candidate's Chamfer similarity, from the nearest-token distances its matching
    # computed (the ensemble's chamfer_weight term)
    chamfer: np.ndarray | None = None


def no_local_scores(n: int) -> LocalScores:
    """The local scores of ``n`` candidates matched with no query token: none has evidence, and
    each keeps its global score."""
    return LocalScores(np.zeros(n), np.zeros(n, bool), chamfer=np.zeros(n))


def candidate_width(conf: RerankConfig, longest: Callable[[], int]) -> int | None:
    """Token columns a shortlist's candidates are gathered to: ``conf.db_tokens``; for AMES
    without it, the index's longest row (``longest()``), so that every AMES batch has one shape
    and a candidate's logit does not depend on the candidates gathered with it (a shortlist split
    over shards scores exactly as in one process); otherwise None, each gather's longest row (SP
    and Chamfer score every candidate on its own)."""
    if conf.db_tokens is not None or conf.method != "ames":
        return conf.db_tokens
    return int(longest())


class Reranker:
    """Scores shortlists with one method; holds the AMES model when that is the method. ``kind``:
    the index's local-token kind, whose settings fill what ``conf`` leaves open. ``device``: where
    this process scores ("cpu", "cuda", "auto": rerank.device.resolve_device; "cuda" without a GPU
    is an error, never a silent CPU): the AMES model lives there, and Hamming matching and spatial
    verification's tables run there. It is the process's, not the request's: ``conf`` (what a
    coordinator sends its shards) does not hold it."""

    def __init__(
        self,
        conf: RerankConfig,
        kind: str | None = None,
        device: str | torch.device = "cpu",
        itq: ITQ | Callable[[], ITQ] | None = None,
    ):
        conf = with_kind_defaults(conf, kind)
        self.conf = conf
        self.device = resolve_device(device)
        # The index's ITQ projection (or what loads it, asked for only when the second stage runs):
        # the second verification rebuilds the candidates' float descriptors from their codes.
        self._itq = itq
        self._glue: Any = None
        self.ames = None
        if conf.method == "ames":
            from rerank.ames import load_ames

            self.ames = load_ames(conf.ames, map_location=self.device)

    def local_scores(self, query: LocalTokens, candidates: TokenBatch) -> LocalScores:
        has_locals = candidates.mask.any(1)
        if len(query) == 0:  # nothing to match: every candidate keeps its global score
            return no_local_scores(len(candidates))
        if self.conf.method == "ames":
            from rerank.ames import score_shortlist

            return LocalScores(score_shortlist(self.ames, query, candidates).astype(np.float64), has_locals)
        weights = query_weights_of(query, self.conf.match)  # None: plain Hamming distances
        if self.conf.method == "chamfer":
            nearest = nearest_tokens(
                query.codes, candidates, within=-1, mutual=False, query_weights=weights, device=self.device
            )
            return LocalScores(chamfer_from_nearest(nearest), has_locals)
        nearest = nearest_tokens(
            query.codes,
            candidates,
            within=self.conf.match.threshold,
            mutual=self.conf.match.mutual,
            query_weights=weights,
            device=self.device,
        )
        matches = matches_from_nearest(nearest, self.conf.match)
        result = verify(query, candidates, matches, self.conf.spatial, self.device)
        inliers = np.where(result.verified, result.inliers, 0)
        # Evidence is drawn for the few results shown, not for the whole shortlist.
        return LocalScores(
            inliers.astype(np.float64),
            has_locals,
            inliers,
            functools.partial(_inlier_evidence, query, candidates, matches, result),
            chamfer_from_nearest(nearest),
        )

    def scores_of_stored(
        self, store: LocalStore, positions: list[np.ndarray], queries: Sequence[LocalTokens]
    ) -> list[LocalScores]:
        """Each query's local scores against the stored tokens at its shortlist's ``positions[q]``
        in ``store`` (an index's local store in this process: index.search.SearchIndex)."""
        db_tokens = candidate_width(self.conf, lambda: store.max_tokens)
        return [self.local_scores(query, store.batch(at, db_tokens)) for at, query in zip(positions, queries)]

    def glue_of_stored(self, store: LocalStore, positions: np.ndarray, query: LocalTokens) -> np.ndarray:
        """The second verification's expected matches (rerank/glue.py) of the query with the stored
        tokens at ``positions`` in ``store``, the candidates' descriptors rebuilt from their codes."""
        candidates = store.batch(positions, self.conf.db_tokens)
        itq = self.itq()
        if itq.dim != LIGHTGLUE_INPUT_DIM:
            raise NeedleInputError(
                f"the second verification's LightGlue weights are for ALIKED's {LIGHTGLUE_INPUT_DIM}-d "
                f"descriptors; this index's local tokens are {itq.dim}-d (re-rank without --glue-top)"
            )
        desc = np.zeros((*candidates.codes.shape[:2], itq.dim), np.float32)
        desc[candidates.mask] = itq.reconstruct(candidates.codes[candidates.mask])
        if query.desc is None:  # a stored query: its descriptors rebuilt from its codes as well
            query = replace(query, desc=itq.reconstruct(query.codes))
        return self.glue_verifier().matches(query, candidates.xy, desc, candidates.mask, self.conf.glue)

    def itq(self) -> ITQ:
        if self._itq is None:
            raise NeedleInputError(
                "the second verification (--glue-top) needs the index's ITQ projection to rebuild descriptors "
                "from the stored codes; its local tokens record none"
            )
        if callable(self._itq):
            self._itq = self._itq()
        return self._itq

    def glue_verifier(self) -> Any:
        if self._glue is None:
            from rerank.glue import GlueVerifier

            self._glue = GlueVerifier(self.device)
        return self._glue

    def rerank(
        self, rows: np.ndarray, s_global: np.ndarray, query: LocalTokens, candidates: TokenBatch
    ) -> tuple[np.ndarray, np.ndarray, LocalScores]:
        """(order of the shortlist, its final scores, the local evidence)."""
        local = self.local_scores(query, candidates)
        order, scores = self.order(rows, s_global, local)
        return order, scores, local

    def order(self, rows: np.ndarray, s_global: np.ndarray, local: LocalScores) -> tuple[np.ndarray, np.ndarray]:
        """(order of a shortlist, its final scores) from its global scores and local evidence."""
        scores = combine(self.conf.method, s_global, local.raw, local.has_locals, self.conf.ensemble, local.chamfer)
        return rerank_order(scores, rows), scores


def _inlier_evidence(query: LocalTokens, candidates: TokenBatch, matches: Any, result: Any, c: int) -> dict[str, Any]:
    """Candidate ``c``'s inlier correspondences as point pairs, for drawing."""
    inl = matches.mask[c] & result.inlier_mask[c]
    q_idx, d_idx = matches.query[c, inl], matches.token[c, inl]
    return {
        "inliers": int(result.inliers[c]) if result.verified[c] else 0,
        "query_xy": query.xy[q_idx].round(1).tolist(),
        "db_xy": candidates.xy[c, d_idx].round(1).tolist(),
    }
