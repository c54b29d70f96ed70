"""Spatial verification of tentative correspondences, vectorised over the whole shortlist.

Each match proposes a similarity transform from query to database base pixels: scale
``s = f_q / f_d`` from the two tokens' extraction factors, no rotation (CNN tokens carry no
orientation), and the translation that maps the query point onto the database point. A hypothesis
counts as inliers the matches whose transformed query point lands within ``inlier_threshold``
pixels of its database point; the best one per candidate (lowest match index among equal counts)
is then refined LO-RANSAC style: a least-squares affine transform (6 dof) is fitted to its inliers,
inliers are counted again under it, and this repeats while the count grows.

``verify`` does this for every candidate at once (numpy float64; candidates are grouped by match
count so the (matches x matches) hypothesis tables are sized by each group's own count, not the
batch's largest). ``verify_pair`` is the plain per-pair version the tests hold it to: the same
hypotheses, thresholds and tie rules, the affine fitted with ``np.linalg.lstsq`` instead of the
batched normal equations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from core.tokens import LocalTokens, TokenBatch
from rerank.matching import Matches, RerankInputError
from rerank.spatial_tables import hypothesis_inliers, pair_table, rows_of

# (matches x matches) hypothesis-table entries per group of candidates: two float64 arrays of this
# size are live at once, 8 MB at 500k; 250k..1M measured the same (bench/rerank_speed.py --duplicates).
GROUP_VALUES = 500_000
# On a GPU (``verify(..., device=)``) the tables of a whole shortlist at once: fewer, larger kernels.
DEVICE_GROUP_VALUES = 64_000_000
_FAR = 1e150  # where padded matches' database points are put: squared distances ~1e300, finite, never inliers
# A fit is degenerate (its inliers' query points are collinear, or nearly) when the scatter's
# eigenvalues satisfy l1 * l2 <= RANK_TOL * (l1 + l2)^2, i.e. l2 / l1 <= ~1e-9.
RANK_TOL = 1e-9


@dataclass(frozen=True)
class SpatialConfig:
    """Spatial verification parameters."""

    inlier_threshold: float = (
        24.0  # database base pixels a transformed query point may miss by: 1.5 token cells of 16 px
    )
    min_scale: float = (
        1 / 3
    )  # hypotheses whose scale f_q / f_d is below this are not tried (their matches still count as inliers)
    max_scale: float = 3.0  # nor those above this
    lo_iterations: int = 3  # affine refinements at most; each is kept only if it has more inliers than the best so far
    min_fit_inliers: int = (
        4  # fit an affine only to this many inliers or more: 3 determine one exactly, chance included
    )
    min_inliers: int = 5  # fewer inliers than this and the candidate is not verified (score 0)
    # Two-match similarity hypotheses (rotation, scale, translation from two correspondences), tried
    # after the single-match ones: every pair among each candidate's ``pair_seeds`` closest matches
    # (Hamming distance, then match order). 0 or 1: single-match hypotheses only (no rotation).
    # 8 (28 pairs): realbench's cross-validated mAP@1k with asymmetric matching 56.5 -> 57.1, and the
    # demo's rotated views verified (bench/results/rerank_realbench.json).
    pair_seeds: int = 8
    max_rotation: float = 180.0  # degrees: pair hypotheses rotating more than this are not tried
    # A pair hypothesis's scale must lie within this factor of both seeds' token scale ratio f_q / f_d.
    pair_scale_tolerance: float = 2.0
    pair_min_span: float = 16.0  # query base pixels the two seeds must lie apart (closer: rotation ill-defined)

    def __post_init__(self) -> None:
        if not self.inlier_threshold > 0:
            raise RerankInputError(f"inlier_threshold must be > 0 pixels, got {self.inlier_threshold}")
        if not 0 < self.min_scale <= self.max_scale:
            raise RerankInputError(f"need 0 < min_scale <= max_scale, got {self.min_scale} and {self.max_scale}")
        if self.lo_iterations < 0:
            raise RerankInputError(f"lo_iterations must be >= 0, got {self.lo_iterations}")
        if self.min_fit_inliers < 3:
            raise RerankInputError(f"min_fit_inliers must be >= 3 (an affine has 6 dof), got {self.min_fit_inliers}")
        if self.min_inliers < 1:
            raise RerankInputError(f"min_inliers must be >= 1, got {self.min_inliers}")
        if self.pair_seeds < 0:
            raise RerankInputError(f"pair_seeds must be >= 0, got {self.pair_seeds}")
        if not 0 <= self.max_rotation <= 180:
            raise RerankInputError(f"max_rotation must be in [0, 180] degrees, got {self.max_rotation}")
        if not self.pair_scale_tolerance >= 1:
            raise RerankInputError(f"pair_scale_tolerance must be >= 1, got {self.pair_scale_tolerance}")
        if not self.pair_min_span > 0:
            raise RerankInputError(f"pair_min_span must be > 0 pixels, got {self.pair_min_span}")


@dataclass(frozen=True)
class Verification:
    """Spatial verification of every candidate of a shortlist, aligned with its ``Matches``."""

    inliers: np.ndarray  # (C,) int64 inliers of the best model (counted even below min_inliers)
    affine: np.ndarray  # (C, 2, 3) float64 query -> database base pixels [A | t]; zeros where no hypothesis
    inlier_mask: np.ndarray  # (C, M) bool over the candidate's matches
    refined: np.ndarray  # (C,) bool: the model is an LO affine, not a single-match similarity
    verified: np.ndarray  # (C,) bool: inliers >= min_inliers

    def scores(self, cap: int = 50) -> np.ndarray:
        """(C,) normalised inlier counts in [0, 1]: 0 where not verified."""
        return normalized_inliers(np.where(self.verified, self.inliers, 0), cap=cap, min_inliers=1)


@dataclass(frozen=True)
class PairVerification:
    """``verify_pair``'s result for one candidate."""

    inliers: int
    affine: np.ndarray  # (2, 3) float64; zeros where no hypothesis
    inlier_mask: np.ndarray  # (m,) bool over the pair's matches
    refined: bool
    verified: bool


def normalized_inliers(inliers: np.ndarray | int, cap: int = 50, min_inliers: int = 5) -> np.ndarray:
    """``min(inliers, cap) / cap``, and 0 below ``min_inliers``: a score in [0, 1] that a few
    dozen inliers saturate, so that one huge match count does not swamp a score ensemble."""
    if cap < 1:
        raise RerankInputError(f"cap must be >= 1, got {cap}")
    counts = np.asarray(inliers)
    return np.where(counts >= min_inliers, np.minimum(counts, cap) / cap, 0.0)


# ---------------------------------------------------------------------------------------------
# batched


def verify(
    query: LocalTokens,
    candidates: TokenBatch,
    matches: Matches,
    config: SpatialConfig = SpatialConfig(),
    device: torch.device | str | None = None,
) -> Verification:
    """Spatially verify every candidate's matches (see the module docstring).

    ``device`` (default the CPU): where the (matches x matches) hypothesis tables, single-match and
    pair, are built and counted (torch float64: the same IEEE operations in the same order on any
    device, so a GPU gives identical inlier counts). Choosing hypotheses, LO's affine fits and the
    rest stay numpy on the CPU: only each table's counts and chosen rows come back."""
    _check_matches(query, candidates, matches)
    dev = torch.device("cpu") if device is None else torch.device(device)
    C, M = matches.mask.shape
    inliers = np.zeros(C, np.int64)
    affine = np.zeros((C, 2, 3))
    inlier_mask = np.zeros((C, M), bool)
    refined = np.zeros(C, bool)
    # a candidate's matches span its first ``extent`` slots (``match_tokens`` packs them to the left)
    # (no match slots at all, M = 0: every candidate has none; argmax of an empty row would fail)
    extent = np.where(matches.mask.any(1), M - matches.mask[:, ::-1].argmax(1), 0) if M else np.zeros(C, np.int64)
    for group in _groups(extent, GROUP_VALUES if dev.type == "cpu" else DEVICE_GROUP_VALUES):
        m = int(extent[group].max())
        g = _verify_group(query, candidates, matches, group, m, config, dev)
        inliers[group], affine[group], inlier_mask[group, :m], refined[group] = g
    return Verification(inliers, affine, inlier_mask, refined, inliers >= config.min_inliers)


def _check_matches(query: LocalTokens, candidates: TokenBatch, matches: Matches) -> None:
    C, T = candidates.mask.shape
    if matches.mask.shape[0] != C or not matches.query.shape == matches.token.shape == matches.mask.shape:
        raise RerankInputError(f"matches of shape {matches.mask.shape} do not fit {C} candidates")
    q, t = matches.query[matches.mask], matches.token[matches.mask]
    if len(q) and (q.min() < 0 or q.max() >= len(query)):
        raise RerankInputError(f"match query indices span {q.min()}..{q.max()}, the query has {len(query)} tokens")
    if len(t) and (t.min() < 0 or t.max() >= T):
        raise RerankInputError(f"match token indices span {t.min()}..{t.max()}, candidates have {T} slots")
    rows = np.broadcast_to(np.arange(C)[:, None], matches.mask.shape)[matches.mask]
    if not candidates.mask[rows, t].all():
        raise RerankInputError("some matches point at padded candidate tokens")


def _groups(counts: np.ndarray, budget: int) -> list[np.ndarray]:
    """Candidates with matches (``counts`` > 0), in ascending count, cut into groups of at most
    ``budget`` hypothesis-table entries (group size x largest count squared), at least one each."""
    order = np.argsort(counts, kind="stable")
    order = order[counts[order] > 0]
    groups, start = [], 0
    for end in range(1, len(order) + 1):
        m = int(counts[order[end - 1]])
        if (end - start) * m * m > budget and end - 1 > start:
            groups.append(order[start : end - 1])
            start = end - 1
    if start < len(order):
        groups.append(order[start:])
    return groups


def _verify_group(
    query: LocalTokens,
    candidates: TokenBatch,
    matches: Matches,
    group: np.ndarray,
    m: int,
    config: SpatialConfig,
    device: torch.device,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    valid = matches.mask[group, :m]
    qi, ti = matches.query[group, :m], matches.token[group, :m]
    xq = query.xy[qi].astype(np.float64)  # (G, m, 2)
    xd = candidates.xy[group[:, None], ti].astype(np.float64)
    s = query.scale[qi].astype(np.float64) / candidates.scale[group[:, None], ti].astype(np.float64)
    thr2 = float(config.inlier_threshold) ** 2
    tx = xd[..., 0] - s * xq[..., 0]
    ty = xd[..., 1] - s * xq[..., 1]
    counts, table = hypothesis_inliers(
        np.where(valid[..., None], xq, 0.0), np.where(valid[..., None], xd, _FAR), s, tx, ty, thr2, device
    )
    counts[~(valid & (s >= config.min_scale) & (s <= config.max_scale))] = -1
    best = counts.argmax(1)  # the first maximum: the lowest match index
    rows = np.arange(len(group))
    count = np.maximum(counts[rows, best], 0)
    mask = rows_of(table, best) & (count > 0)[:, None]
    model = np.zeros((len(group), 2, 3))
    model[:, 0, 0] = model[:, 1, 1] = s[rows, best]
    model[:, 0, 2], model[:, 1, 2] = tx[rows, best], ty[rows, best]
    model[count == 0] = 0.0
    refined = np.zeros(len(group), bool)
    if config.pair_seeds >= 2:
        # Rotation-aware hypotheses where a verification is still possible (enough matches): a
        # pair's similarity replaces the single-match one only with strictly more inliers.
        tried = valid.sum(1) >= max(2, config.min_inliers)
        if tried.any():
            t = np.flatnonzero(tried)
            p_count, p_mask, p_model = _pair_hypotheses(
                xq[t], xd[t], s[t], valid[t], matches.distance[group[t], :m], config, device
            )
            better = p_count > count[t]
            b = t[better]
            count[b], mask[b], model[b] = p_count[better], p_mask[better], p_model[better]

    active = count >= config.min_fit_inliers
    for _ in range(config.lo_iterations):
        if not active.any():
            break
        a = np.flatnonzero(active)
        fit, ok = fit_affine(xq[a], xd[a], mask[a])
        new_mask = (_affine_residual2(fit, xq[a], xd[a]) <= thr2) & valid[a]
        new_count = new_mask.sum(1)
        better = ok & (new_count > count[a])
        b = a[better]
        count[b], mask[b], model[b], refined[b] = new_count[better], new_mask[better], fit[better], True
        active[:] = False
        active[b] = count[b] >= config.min_fit_inliers
    return count, model, mask, refined


def _pair_hypotheses(
    xq: np.ndarray,
    xd: np.ndarray,
    s: np.ndarray,
    valid: np.ndarray,
    distance: np.ndarray,
    config: SpatialConfig,
    device: torch.device | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The best two-match similarity hypothesis of each candidate (G of them, m match slots): its
    inlier count (-1 where no pair qualifies), inlier mask (G, m) and model (G, 2, 3).

    Seeds: each candidate's ``pair_seeds`` valid matches of lowest Hamming distance (stable: match
    order among equals); hypotheses: the seed pairs (a, b), a < b, in ``np.triu_indices`` order;
    ties go to the first. A pair maps query points to database points by the similarity
    ``z -> (c + i d) z + t`` (complex notation) that sends both seeds' query points onto their
    database points. ``verify_pair`` computes the same numbers with the same operations."""
    G, m = valid.shape
    S = min(m, config.pair_seeds)
    count, mask, model = np.full(G, -1, np.int64), np.zeros((G, m), bool), np.zeros((G, 2, 3))
    ia, ib = np.triu_indices(S, 1)
    if len(ia) == 0:
        return count, mask, model
    order = np.argsort(np.where(valid, distance.astype(np.int64), np.iinfo(np.int64).max), axis=1, kind="stable")[:, :S]
    seed_ok = np.take_along_axis(valid, order, 1)
    span2 = float(config.pair_min_span) ** 2
    thr2 = float(config.inlier_threshold) ** 2
    tol = float(config.pair_scale_tolerance)
    cos_max = math.cos(math.radians(config.max_rotation))
    dev = device or torch.device("cpu")
    chunk = max(1, (GROUP_VALUES if dev.type == "cpu" else DEVICE_GROUP_VALUES) // (len(ia) * m))
    for g0 in range(0, G, chunk):
        sl = slice(g0, min(G, g0 + chunk))
        r = np.arange(sl.stop - sl.start)[:, None]
        a, b = order[sl][:, ia], order[sl][:, ib]  # (g, P) match slots of the two seeds
        q, d_ = xq[sl], xd[sl]
        pa, pb, da, db = q[r, a], q[r, b], d_[r, a], d_[r, b]  # (g, P, 2)
        dpx, dpy = pb[..., 0] - pa[..., 0], pb[..., 1] - pa[..., 1]
        ddx, ddy = db[..., 0] - da[..., 0], db[..., 1] - da[..., 1]
        den = dpx * dpx + dpy * dpy
        safe = np.where(den > 0, den, 1.0)
        c = (ddx * dpx + ddy * dpy) / safe  # scale * cos(rotation)
        d = (ddy * dpx - ddx * dpy) / safe  # scale * sin(rotation)
        scale = np.sqrt(c * c + d * d)
        tx = da[..., 0] - (c * pa[..., 0] - d * pa[..., 1])
        ty = da[..., 1] - (d * pa[..., 0] + c * pa[..., 1])
        sa, sb = s[sl][r, a], s[sl][r, b]
        ok = seed_ok[sl][:, ia] & seed_ok[sl][:, ib] & (den >= span2)
        ok &= (scale >= config.min_scale) & (scale <= config.max_scale)
        ok &= (scale * tol >= sa) & (scale <= sa * tol) & (scale * tol >= sb) & (scale <= sb * tol)
        if config.max_rotation < 180.0:
            ok &= c >= scale * cos_max
        counts, table_t = pair_table(q, d_, c, d, tx, ty, valid[sl], thr2, dev)
        counts[~ok] = -1
        best = counts.argmax(1)
        rows = np.arange(len(best))
        count[sl] = counts[rows, best]
        mask[sl] = rows_of(table_t, best) & (count[sl] >= 0)[:, None]
        cb, db_, tb, ub = c[rows, best], d[rows, best], tx[rows, best], ty[rows, best]
        model[sl] = np.stack([np.stack([cb, -db_, tb], 1), np.stack([db_, cb, ub], 1)], 1)
        model[sl][count[sl] < 0] = 0.0
    return count, mask, model


def _affine_residual2(model: np.ndarray, xq: np.ndarray, xd: np.ndarray) -> np.ndarray:
    """Squared distances (..., m) between ``model`` (..., 2, 3) applied to ``xq`` and ``xd``."""
    a = model[..., None, :, :]
    rx = a[..., 0, 0] * xq[..., 0] + a[..., 0, 1] * xq[..., 1] + a[..., 0, 2] - xd[..., 0]
    ry = a[..., 1, 0] * xq[..., 0] + a[..., 1, 1] * xq[..., 1] + a[..., 1, 2] - xd[..., 1]
    return rx * rx + ry * ry


def fit_affine(src: np.ndarray, dst: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted least-squares affine maps ``dst ~ A src + t``, batched.

    ``src``, ``dst`` (B, n, 2), ``weight`` (B, n) (bool or non-negative). Returns (B, 2, 3)
    ``[A | t]`` float64 and (B,) bool ``ok``; where the weighted source points are (nearly)
    collinear, or have no weight, the fit is not ``ok`` and its entries are 0. Centred normal
    equations solved in closed form: the 2x2 scatter's inverse, with translation from the means.
    """
    src = np.asarray(src, np.float64)
    dst = np.asarray(dst, np.float64)
    w = np.asarray(weight, np.float64)
    total = w.sum(-1)
    safe_total = np.where(total > 0, total, 1.0)
    src_mean = (w[:, None, :] @ src)[:, 0] / safe_total[:, None]
    dst_mean = (w[:, None, :] @ dst)[:, 0] / safe_total[:, None]
    # centring first keeps the normal equations conditioned for pixel coordinates in the hundreds
    xs, xd = src - src_mean[:, None], dst - dst_mean[:, None]
    weighted = (w[..., None] * xs).transpose(0, 2, 1)
    scatter = weighted @ xs  # sum w xs xs^T
    cross = (weighted @ xd).transpose(0, 2, 1)  # sum w xd xs^T
    a, b, d = scatter[:, 0, 0], scatter[:, 0, 1], scatter[:, 1, 1]
    det = a * d - b * b
    ok = (total > 0) & (det > RANK_TOL * (a + d) ** 2)
    safe_det = np.where(ok, det, 1.0)
    inverse = np.stack([d, -b, -b, a], -1).reshape(-1, 2, 2) / safe_det[:, None, None]
    linear = cross @ inverse
    out = np.zeros((len(src), 2, 3))
    out[:, :, :2] = linear
    out[:, :, 2] = dst_mean - (linear @ src_mean[:, :, None])[:, :, 0]
    out[~ok] = 0.0
    return out, ok


# ---------------------------------------------------------------------------------------------
# per-pair reference


def verify_pair(
    query: LocalTokens,
    candidate: LocalTokens,
    pairs: np.ndarray,
    config: SpatialConfig = SpatialConfig(),
    distance: np.ndarray | None = None,
) -> PairVerification:
    """Plain reference for one candidate: ``pairs`` (m, 2) (query token, candidate token) indices,
    in match order (ties between hypotheses go to the lowest row); ``distance`` (m,) the matches'
    Hamming distances, which choose the pair seeds (None: all equal, match order)."""
    pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
    m = len(pairs)
    xq = query.xy[pairs[:, 0]].astype(np.float64)
    xd = candidate.xy[pairs[:, 1]].astype(np.float64)
    scale = query.scale[pairs[:, 0]].astype(np.float64) / candidate.scale[pairs[:, 1]].astype(np.float64)
    thr2 = float(config.inlier_threshold) ** 2
    best_count, best_mask, best_model = 0, np.zeros(m, bool), np.zeros((2, 3))
    for h in range(m):
        s = float(scale[h])
        if not config.min_scale <= s <= config.max_scale:
            continue
        tx = float(xd[h, 0]) - s * float(xq[h, 0])
        ty = float(xd[h, 1]) - s * float(xq[h, 1])
        mask = np.zeros(m, bool)
        for j in range(m):
            rx = s * float(xq[j, 0]) + tx - float(xd[j, 0])
            ry = s * float(xq[j, 1]) + ty - float(xd[j, 1])
            mask[j] = rx * rx + ry * ry <= thr2
        if mask.sum() > best_count:  # strictly more: the lowest index wins ties
            best_count, best_mask = int(mask.sum()), mask
            best_model = np.array([[s, 0.0, tx], [0.0, s, ty]])
    if config.pair_seeds >= 2 and m >= max(2, config.min_inliers):
        pair = _pair_reference(xq, xd, scale, np.zeros(m) if distance is None else distance, config)
        if pair is not None and pair[0] > best_count:
            best_count, best_mask, best_model = pair
    refined = False
    for _ in range(config.lo_iterations):
        if best_count < config.min_fit_inliers:
            break
        model = _lstsq_affine(xq[best_mask], xd[best_mask])
        if model is None:
            break
        # the batched path's formula and operation order, so that equal models round equally
        rx = model[0, 0] * xq[:, 0] + model[0, 1] * xq[:, 1] + model[0, 2] - xd[:, 0]
        ry = model[1, 0] * xq[:, 0] + model[1, 1] * xq[:, 1] + model[1, 2] - xd[:, 1]
        mask = rx * rx + ry * ry <= thr2
        if mask.sum() <= best_count:
            break
        best_count, best_mask, best_model, refined = int(mask.sum()), mask, model, True
    return PairVerification(best_count, best_model, best_mask, refined, best_count >= config.min_inliers)


def _pair_reference(
    xq: np.ndarray, xd: np.ndarray, scale: np.ndarray, distance: np.ndarray, config: SpatialConfig
) -> tuple[int, np.ndarray, np.ndarray] | None:
    """The best two-match similarity of one candidate, one hypothesis and one match at a time:
    (inliers, mask, model), or None where no pair qualifies."""
    m = len(xq)
    seeds = [int(i) for i in np.argsort(np.asarray(distance), kind="stable")[: config.pair_seeds]]
    thr2 = float(config.inlier_threshold) ** 2
    tol = float(config.pair_scale_tolerance)
    cos_max = math.cos(math.radians(config.max_rotation))
    best = None
    for i, a in enumerate(seeds):
        for b in seeds[i + 1 :]:
            dpx, dpy = float(xq[b, 0]) - float(xq[a, 0]), float(xq[b, 1]) - float(xq[a, 1])
            ddx, ddy = float(xd[b, 0]) - float(xd[a, 0]), float(xd[b, 1]) - float(xd[a, 1])
            den = dpx * dpx + dpy * dpy
            if den < float(config.pair_min_span) ** 2:
                continue
            c = (ddx * dpx + ddy * dpy) / den
            d = (ddy * dpx - ddx * dpy) / den
            s = math.sqrt(c * c + d * d)
            if not config.min_scale <= s <= config.max_scale:
                continue
            if not all(s * tol >= float(r) and s <= float(r) * tol for r in (scale[a], scale[b])):
                continue
            if config.max_rotation < 180.0 and not c >= s * cos_max:
                continue
            tx = float(xd[a, 0]) - (c * float(xq[a, 0]) - d * float(xq[a, 1]))
            ty = float(xd[a, 1]) - (d * float(xq[a, 0]) + c * float(xq[a, 1]))
            mask = np.zeros(m, bool)
            for j in range(m):
                rx = c * float(xq[j, 0]) - d * float(xq[j, 1]) + tx - float(xd[j, 0])
                ry = d * float(xq[j, 0]) + c * float(xq[j, 1]) + ty - float(xd[j, 1])
                mask[j] = rx * rx + ry * ry <= thr2
            if best is None or mask.sum() > best[0]:
                best = (int(mask.sum()), mask, np.array([[c, -d, tx], [d, c, ty]]))
    return best


def _lstsq_affine(src: np.ndarray, dst: np.ndarray) -> np.ndarray | None:
    """(2, 3) least-squares affine by ``np.linalg.lstsq``; None for (nearly) collinear sources
    (the batched path's criterion, from the singular values of the centred points)."""
    sv = np.linalg.svd(src - src.mean(0), compute_uv=False)
    l1, l2 = sv[0] ** 2, sv[-1] ** 2 if len(sv) > 1 else 0.0
    if not l1 * l2 > RANK_TOL * (l1 + l2) ** 2:
        return None
    design = np.concatenate([src, np.ones((len(src), 1))], axis=1)
    solution, *_ = np.linalg.lstsq(design, dst, rcond=None)  # (3, 2): rows A^T then t
    return solution.T.copy()
