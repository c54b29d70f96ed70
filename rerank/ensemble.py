"""Combining global and local scores: s = λ·s_global + (1 − λ)·f(s_local) [+ w_c·max(0, chamfer) for
SP], and choosing λ (and AMES's γ) by grid search on validation queries, never on the test queries.

f maps each method's raw local score to [0, 1]: spatial verification min(max(0, inliers − floor),
cap) / cap (0 below the minimum inlier count, already applied by the verifier), Chamfer max(0,
chamfer) (the mean best-match similarity, 1 − 2·hamming/128), AMES sigmoid(γ·logit) as in its
paper's code. Candidates without local tokens keep their global score.

SP's Chamfer term (``chamfer_weight`` w_c) adds the candidate's Chamfer similarity to its ensemble
score: geometry-free evidence, the mean over the query's tokens of their best similarity in the
candidate, which SP's matching has already computed (its nearest-token distances), so it costs
nothing. It ranks the hard positives that SP leaves below the minimum of inliers (extreme viewpoint,
day and night): on realbench most of the wide-baseline sources' positives have none. Its default is
the token kind's (filled in by rerank.rerank.with_kind_defaults): ALIKED 0.3, which every
source-held-out fold chose there; none for kinds not measured with it.

SP's floor is the shortlist's own chance level: a percentile (``inlier_floor``; 99.5: the 5th
largest count of a 1,000-candidate shortlist) of its candidates' inlier counts, so that only inliers
beyond what textures and repeated patterns reach by chance re-order the shortlist. It is off by
default: held out by source on realbench (bench/rerank.py, issue 37) every source's fold chose no
floor, and the demo's rotated views of textured photos, for which it was introduced before two-match
hypotheses and asymmetric matching, read 99.92 mAP without it and 99.21 with it (global-only 99.04).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core.errors import NeedleInputError
from rerank.config import METHODS


@dataclass(frozen=True)
class EnsembleConfig:
    # weight of the global score (1 - lam for the local one); realbench held out by source: every fold chose 0.45 for SP
    lam: float = 0.45
    gamma: float = 1.0  # AMES: sigmoid temperature over its logit
    inlier_cap: int = 50  # SP: inliers (beyond the floor) at which the local score saturates at 1
    # SP: percentile of the shortlist's inlier counts subtracted from each (its chance level); 0: none,
    # the default (held out by source, no fold chose one)
    inlier_floor: float = 0.0
    # SP: weight w_c of the candidate's Chamfer similarity added to the ensemble (0: none); None: the
    # token kind's own (embed.locals.presets.RERANK_BY_KIND: ALIKED 0.3, which every held-out fold
    # chose on realbench; the other kinds, not measured with it, none), none where no kind is known
    chamfer_weight: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.lam <= 1.0:
            raise NeedleInputError(f"ensemble lambda must be in [0, 1], got {self.lam}")
        if self.inlier_cap < 1:
            raise NeedleInputError(f"inlier_cap must be >= 1, got {self.inlier_cap}")
        if not 0.0 <= self.inlier_floor < 100.0:
            raise NeedleInputError(f"inlier_floor must be a percentile in [0, 100), got {self.inlier_floor}")
        if self.chamfer_weight is not None and not 0.0 <= self.chamfer_weight <= 1.0:
            raise NeedleInputError(f"chamfer_weight must be in [0, 1], got {self.chamfer_weight}")


def inlier_floor(raw: np.ndarray, has_locals: np.ndarray, percentile: float) -> float:
    """The shortlist's chance level of SP inliers: ``percentile`` of the counts of the candidates
    with tokens (linear interpolation, ``np.percentile``'s default); 0 when off or none has tokens."""
    counts = np.asarray(raw, np.float64)[np.asarray(has_locals, bool)]
    return float(np.percentile(counts, percentile)) if percentile > 0 and len(counts) else 0.0


def local_to_unit(
    method: str, raw: np.ndarray, conf: EnsembleConfig, has_locals: np.ndarray | None = None
) -> np.ndarray:
    """A method's raw local scores -> f(s_local) in [0, 1] (SP's floor over the candidates with
    tokens, ``has_locals``; all of them when None)."""
    raw = np.asarray(raw, dtype=np.float64)
    if method == "sp":
        floor = inlier_floor(raw, np.ones(len(raw), bool) if has_locals is None else has_locals, conf.inlier_floor)
        return np.minimum(np.maximum(raw - floor, 0.0), conf.inlier_cap) / conf.inlier_cap
    if method == "chamfer":
        return np.clip(raw, 0.0, 1.0)
    if method == "ames":
        return 1.0 / (1.0 + np.exp(-conf.gamma * raw))
    raise NeedleInputError(f"unknown re-ranking method {method!r}; choose from {METHODS}")


def local_term(
    method: str,
    raw_local: np.ndarray,
    has_locals: np.ndarray,
    conf: EnsembleConfig,
    chamfer: np.ndarray | None = None,
) -> np.ndarray:
    """(1 − λ)·f(s_local), plus SP's Chamfer term: what the ensemble adds to λ·s_global (the same
    for a second global score, α-QE's). ``chamfer``: SP's (C,) Chamfer similarities, needed when
    ``conf.chamfer_weight`` is on."""
    unit = local_to_unit(method, raw_local, conf, has_locals)
    return (1.0 - conf.lam) * unit + chamfer_term(method, conf, chamfer, len(unit))


def chamfer_term(method: str, conf: EnsembleConfig, chamfer: np.ndarray | None, n: int) -> np.ndarray | float:
    """SP's Chamfer term of ``n`` candidates, w_c·max(0, chamfer); 0 for other methods or without
    a weight (0, or None: no token kind filled it in)."""
    if method != "sp" or not conf.chamfer_weight:
        return 0.0
    if chamfer is None:
        raise NeedleInputError(
            f"the ensemble's chamfer_weight {conf.chamfer_weight} needs the candidates' Chamfer similarities "
            "(SP's local scores carry them)"
        )
    chamfer = np.asarray(chamfer, np.float64)
    if chamfer.shape != (n,):
        raise NeedleInputError(f"Chamfer similarities of shape {chamfer.shape} do not fit {n} candidates")
    return conf.chamfer_weight * np.maximum(chamfer, 0.0)


def combine(
    method: str,
    s_global: np.ndarray,
    raw_local: np.ndarray,
    has_locals: np.ndarray,
    conf: EnsembleConfig,
    chamfer: np.ndarray | None = None,
) -> np.ndarray:
    """Final scores of a shortlist: the ensemble where a candidate has tokens, else its global score."""
    mixed = conf.lam * np.asarray(s_global, np.float64) + local_term(method, raw_local, has_locals, conf, chamfer)
    return np.where(has_locals, mixed, s_global)


def rerank_order(scores: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Order of a shortlist by descending score, ties to the lower row id (as the index does)."""
    return np.lexsort((rows, -np.asarray(scores)))


@dataclass(frozen=True)
class ValidationQuery:
    """What the grid search needs of one validation query's shortlist."""

    rows: np.ndarray  # (C,) candidate row ids in global order
    s_global: np.ndarray  # (C,) global scores
    raw_local: np.ndarray  # (C,) the method's raw local scores
    has_locals: np.ndarray  # (C,) bool
    positive: np.ndarray  # (C,) bool: candidate is a positive
    n_positives: int  # positives in the whole database (AP's denominator)
    chamfer: np.ndarray | None = None  # (C,) SP's Chamfer similarities (for its chamfer_weight)


def ap_of_order(positive_in_order: np.ndarray, n_positives: int, k: int) -> float:
    """AP@k (ILIAS) of a ranked list of hit flags whose query has ``n_positives`` positives."""
    hits = np.asarray(positive_in_order[:k], dtype=bool)
    if n_positives < 1:
        raise NeedleInputError("a query without positives has no AP")
    ranks = np.flatnonzero(hits) + 1
    return float((np.arange(1, len(ranks) + 1) / ranks).sum() / min(k, n_positives))


def mean_ap(queries: Sequence[ValidationQuery], method: str, conf: EnsembleConfig, k: int) -> float:
    """mAP@k x 100 of the validation queries re-ranked with ``conf``."""
    aps = []
    for q in queries:
        scores = combine(method, q.s_global, q.raw_local, q.has_locals, conf, q.chamfer)
        aps.append(ap_of_order(q.positive[rerank_order(scores, q.rows)], q.n_positives, k))
    return 100.0 * float(np.mean(aps))


DEFAULT_LAMBDAS = tuple(np.round(np.linspace(0.0, 1.0, 21), 3))
DEFAULT_GAMMAS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)


def grid_search(
    queries: Sequence[ValidationQuery],
    method: str,
    k: int = 1000,
    lambdas: Sequence[float] = DEFAULT_LAMBDAS,
    gammas: Sequence[float] = DEFAULT_GAMMAS,
    inlier_cap: int = 50,
    inlier_floor: float = EnsembleConfig.inlier_floor,
    chamfer_weight: float = 0.0,
) -> tuple[EnsembleConfig, float]:
    """The (λ, γ) of best validation mAP@k (γ only for AMES); ties go to the first in grid order."""
    if not queries:
        raise NeedleInputError("grid search needs at least one validation query")
    best: tuple[EnsembleConfig, float] | None = None
    for lam, gamma in itertools.product(lambdas, gammas if method == "ames" else (1.0,)):
        conf = EnsembleConfig(
            lam=float(lam),
            gamma=float(gamma),
            inlier_cap=inlier_cap,
            inlier_floor=inlier_floor,
            chamfer_weight=chamfer_weight if method == "sp" else 0.0,
        )
        value = mean_ap(queries, method, conf, k)
        if best is None or value > best[1] + 1e-12:
            best = (conf, value)
    assert best is not None  # the grid is never empty: lambdas and gammas have defaults
    return best
