"""Local re-ranking with binary tokens: spatial verification of their matches (single- and
two-match hypotheses, affine refinements), each batched path held to a plain per-pair loop, the
affine fit to kornia and numpy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from core.errors import NeedleInputError
from core.tokens import LocalTokens, TokenBatch
from rerank.matching import Matches, RerankInputError, match_tokens
from rerank.spatial import SpatialConfig, fit_affine, normalized_inliers, verify, verify_pair
from tests.support.rerank_tokens import SCALES, flip_bits, random_codes, tokens

# ---------------------------------------------------------------------------------------------
# spatial verification


def padded_matches(pairs: list[np.ndarray]) -> Matches:
    C, M = len(pairs), max(len(p) for p in pairs)
    q, t, mask = np.zeros((C, M), np.int64), np.zeros((C, M), np.int64), np.zeros((C, M), bool)
    for c, p in enumerate(pairs):
        q[c, : len(p)], t[c, : len(p)], mask[c, : len(p)] = p[:, 0], p[:, 1], True
    return Matches(q, t, np.zeros((C, M), np.int16), mask)


def assert_batched_equals_pairs(query, candidates, pairs, batch, matches, config) -> None:
    result = verify(query, batch, matches, config)
    for c, (cand, p) in enumerate(zip(candidates, pairs)):
        ref = verify_pair(query, cand, p, config)
        assert result.inliers[c] == ref.inliers, c
        np.testing.assert_array_equal(result.inlier_mask[c, : len(p)], ref.inlier_mask, err_msg=f"candidate {c}")
        assert not result.inlier_mask[c, len(p) :].any()
        assert result.refined[c] == ref.refined and result.verified[c] == ref.verified, c
        np.testing.assert_allclose(result.affine[c], ref.affine, rtol=1e-9, atol=1e-7, err_msg=f"candidate {c}")
    return result


def test_batched_verification_equals_pairs_on_random_matches() -> None:
    """Random correspondences in a small area with a large threshold: hypotheses with many inliers,
    ties between them, scales outside [1/3, 3], affine refinements taken and refused."""
    rng = np.random.default_rng(8)
    query = tokens(
        random_codes(80, rng), rng, xy=rng.uniform(0, 200, (80, 2)), scale=rng.choice([0.25, 0.707, 1, 1.414], 80)
    )
    candidates, pairs = [], []
    for _ in range(60):
        n = int(rng.integers(0, 60))
        candidates.append(
            tokens(
                random_codes(n, rng),
                rng,
                xy=rng.uniform(0, 200, (n, 2)),
                scale=rng.choice([0.2, 0.707, 1, 1.414, 4.0], n),
            )
        )
        m = min(n, int(rng.integers(0, 45)))
        pairs.append(
            np.stack([np.sort(rng.choice(80, m, replace=False)), rng.choice(n, m, replace=False)], 1).reshape(-1, 2)
        )
    config = SpatialConfig(inlier_threshold=40.0, min_inliers=6)
    result = assert_batched_equals_pairs(
        query, candidates, pairs, TokenBatch.stack(candidates), padded_matches(pairs), config
    )
    assert result.refined.sum() >= 5 and (~result.refined & (result.inliers >= 4)).sum() >= 5
    assert 5 <= result.verified.sum() < 60

    # the same matches with padding slots between them (order kept): same verification
    width = 2 * max(len(p) for p in pairs)
    slots = [np.sort(rng.choice(width, len(p), replace=False)) for p in pairs]
    shape = (len(pairs), width)
    holey = Matches(
        np.zeros(shape, np.int64), np.zeros(shape, np.int64), np.zeros(shape, np.int16), np.zeros(shape, bool)
    )
    for c, (p, slot) in enumerate(zip(pairs, slots)):
        holey.query[c, slot], holey.token[c, slot], holey.mask[c, slot] = p[:, 0], p[:, 1], True
    spread = verify(query, TokenBatch.stack(candidates), holey, config)
    np.testing.assert_array_equal(spread.inliers, result.inliers)
    for c, slot in enumerate(slots):
        np.testing.assert_array_equal(spread.inlier_mask[c, slot], result.inlier_mask[c, : len(slot)])
    assert spread.inlier_mask.sum() == result.inlier_mask.sum()


def planted_candidate(
    rng: np.random.Generator,
    query: LocalTokens,
    affine: np.ndarray,
    scale_ratio: float,
    n_inliers: int = 30,
    n_outliers: int = 30,
) -> LocalTokens:
    """A candidate whose first ``n_inliers`` tokens are the query's (codes with 8 bits flipped) at
    ``affine``-mapped positions plus 1 px noise, then tokens copied from other query tokens at
    random positions (wrong matches), then unrelated tokens."""
    src = rng.choice(100, n_inliers + n_outliers, replace=False)
    codes = np.concatenate([flip_bits(query.codes[src], 8, rng), random_codes(20, rng)])
    xy = rng.uniform(0, 600, (len(codes), 2))
    xy[:n_inliers] = query.xy[src[:n_inliers]] @ affine[:, :2].T + affine[:, 2] + rng.normal(0, 1, (n_inliers, 2))
    scale = rng.choice(SCALES, len(codes)).astype(np.float64)
    scale[: len(src)] = query.scale[src] / scale_ratio
    return tokens(codes, rng, xy=xy, scale=scale)


@pytest.mark.parametrize("kind", ["similarity", "affine"])
def test_planted_transform_is_found(kind: str) -> None:
    rng = np.random.default_rng(9)
    if kind == "similarity":
        affine, ratio = np.array([[1.3, 0.0, 40.0], [0.0, 1.3, -25.0]]), 1.3
    else:  # shear and anisotropy: a single-match similarity misses far points, the LO affine gets them
        affine, ratio = np.array([[1.15, 0.15, 30.0], [-0.1, 0.9, 60.0]]), 1.0
    query = tokens(random_codes(100, rng), rng, xy=rng.uniform(0, 400, (100, 2)))
    planted = planted_candidate(rng, query, affine, ratio)
    unrelated = planted_candidate(rng, query, affine, ratio, n_inliers=0, n_outliers=60)  # only wrong matches
    candidates = [planted, unrelated]
    batch = TokenBatch.stack(candidates)
    matches = match_tokens(query, batch)
    assert matches.counts().tolist() == [60, 60]  # every planted and every wrong token is matched
    result = verify(query, batch, matches)
    assert result.inliers[0] >= 30 and result.verified[0]
    inlier_tokens = matches.token[0, result.inlier_mask[0]]
    assert set(range(30)) <= set(inlier_tokens.tolist())
    np.testing.assert_allclose(result.affine[0, :, :2], affine[:, :2], atol=0.02)
    np.testing.assert_allclose(result.affine[0, :, 2], affine[:, 2], atol=5.0)
    assert result.refined[0] == (kind == "affine")  # the similarity has all inliers already: no affine adds any
    assert result.scores()[1] == 0.0 and not result.verified[1] and result.inliers[1] < 5
    assert result.scores()[0] == pytest.approx(min(result.inliers[0], 50) / 50)
    pairs = [matches.pairs(c) for c in range(2)]
    assert_batched_equals_pairs(query, candidates, pairs, batch, matches, SpatialConfig())
    if kind == "affine":  # without LO the similarity alone finds fewer inliers
        assert verify(query, batch, matches, SpatialConfig(lo_iterations=0)).inliers[0] < result.inliers[0]


def test_hypothesis_ties_go_to_the_lowest_match() -> None:
    """Two clusters of 5 matches under different translations: the first one wins."""
    rng = np.random.default_rng(10)
    xq = rng.uniform(0, 100, (10, 2))
    xd = xq.copy()
    xd[:5] += [300.0, 0.0]
    xd[5:] += [0.0, 300.0]
    query = tokens(random_codes(10, rng), rng, xy=xq, scale=np.ones(10))
    cand = tokens(random_codes(10, rng), rng, xy=xd, scale=np.ones(10))
    pairs = np.stack([np.arange(10), np.arange(10)], 1)
    for order in (pairs, pairs[::-1]):
        result = verify(query, TokenBatch.stack([cand]), padded_matches([order]), SpatialConfig(inlier_threshold=1.0))
        first = order[0, 0] < 5
        assert result.inliers[0] == 5
        np.testing.assert_array_equal(result.inlier_mask[0], (order[:, 0] < 5) == first)
        assert (
            verify_pair(query, cand, order, SpatialConfig(inlier_threshold=1.0)).inlier_mask.tolist()
            == result.inlier_mask[0].tolist()
        )


@pytest.mark.parametrize("scale, found", [(3.0, True), (3.01, False), (1 / 3, True), (0.33, False)])
def test_hypothesis_scale_range(scale: float, found: bool) -> None:
    """Matches consistent under a similarity of ``scale`` are found only within [1/3, 3]."""
    rng = np.random.default_rng(11)
    xq = rng.uniform(0, 100, (8, 2))
    query = tokens(random_codes(8, rng), rng, xy=xq, scale=np.full(8, scale))  # f_q / f_d = scale
    cand = tokens(random_codes(8, rng), rng, xy=scale * xq + 7.0, scale=np.ones(8))
    pairs = np.stack([np.arange(8), np.arange(8)], 1)
    result = verify(query, TokenBatch.stack([cand]), padded_matches([pairs]))
    assert result.inliers[0] == (8 if found else 0)
    assert verify_pair(query, cand, pairs).inliers == result.inliers[0]
    if found:
        np.testing.assert_allclose(result.affine[0], [[scale, 0, 7], [0, scale, 7]], atol=1e-4)


def rotated_candidate(rng: np.random.Generator, query: LocalTokens, degrees: float, ratio: float) -> LocalTokens:
    """A candidate whose first 30 tokens are the query's first 30 under a similarity rotating by
    ``degrees`` and scaling by ``ratio`` (1 px noise), then 20 unrelated tokens."""
    theta = np.radians(degrees)
    rot = ratio * np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
    xy = rng.uniform(0, 500, (50, 2))
    xy[:30] = query.xy[:30] @ rot.T + [60.0, -20.0] + rng.normal(0, 1, (30, 2))
    scale = np.ones(50)
    scale[:30] = query.scale[:30] / ratio
    return tokens(random_codes(50, rng), rng, xy=xy, scale=scale)


@pytest.mark.parametrize("degrees", [0.0, 25.0, -60.0, 170.0])
def test_pair_hypotheses_find_rotations(degrees: float) -> None:
    """Single-match hypotheses carry no rotation: under 25 degrees or more they find a few inliers
    near the seed only; two-match hypotheses recover the rotation (within ``max_rotation``)."""
    rng = np.random.default_rng(12)
    query = tokens(random_codes(60, rng), rng, xy=rng.uniform(0, 400, (60, 2)), scale=np.ones(60))
    cand = rotated_candidate(rng, query, degrees, 1.2)
    pairs = np.stack([np.arange(40), np.arange(40)], 1)  # 30 true matches, 10 wrong ones
    distance = rng.integers(0, 30, 40).astype(np.int16)
    matches = Matches(pairs[None, :, 0], pairs[None, :, 1], distance[None], np.ones((1, 40), bool))
    batch = TokenBatch.stack([cand])
    plain = verify(query, batch, matches, SpatialConfig(lo_iterations=0, pair_seeds=0))
    config = SpatialConfig(lo_iterations=0, pair_seeds=8)
    rotated = verify(query, batch, matches, config)
    assert rotated.inliers[0] >= 28 and set(np.flatnonzero(rotated.inlier_mask[0])) <= set(range(30))
    t = np.radians(degrees)
    np.testing.assert_allclose(
        rotated.affine[0, :, :2], 1.2 * np.array([[np.cos(t), -np.sin(t)], [np.sin(t), np.cos(t)]]), atol=0.05
    )
    if abs(degrees) >= 25:
        assert plain.inliers[0] < 15
    ref = verify_pair(query, cand, pairs, config, distance)
    assert ref.inliers == rotated.inliers[0] and ref.inlier_mask.tolist() == rotated.inlier_mask[0].tolist()
    np.testing.assert_array_equal(ref.affine, rotated.affine[0])
    # a rotation limit below the planted angle: no pair hypothesis of the true transform is tried
    limited = verify(query, batch, matches, SpatialConfig(lo_iterations=0, pair_seeds=8, max_rotation=20.0))
    assert (limited.inliers[0] >= 28) == (abs(degrees) <= 20)


@pytest.mark.parametrize(
    "config",
    [
        SpatialConfig(inlier_threshold=40.0, min_inliers=6, pair_seeds=6),
        SpatialConfig(inlier_threshold=30.0, min_inliers=3, pair_seeds=12, max_rotation=45.0, lo_iterations=0),
        SpatialConfig(inlier_threshold=60.0, pair_seeds=4, pair_scale_tolerance=1.5, pair_min_span=40.0),
    ],
)
def test_batched_pair_hypotheses_equal_the_loop(config: SpatialConfig) -> None:
    """Random and rotated correspondences with random Hamming distances (ties included): the
    batched two-match hypotheses give the loop's inliers, masks and models."""
    rng = np.random.default_rng(13)
    query = tokens(random_codes(80, rng), rng, xy=rng.uniform(0, 300, (80, 2)), scale=rng.choice([0.707, 1, 1.414], 80))
    candidates, pairs, angles = [], [], {}
    for c in range(50):
        if c % 5 == 0:
            angles[c] = float(rng.uniform(-180, 180))
            cand = rotated_candidate(rng, query, angles[c], float(rng.choice([0.8, 1.0, 1.3])))
            p = np.stack([np.arange(35), np.arange(35)], 1)
        else:
            n = int(rng.integers(0, 50))
            cand = tokens(random_codes(n, rng), rng, xy=rng.uniform(0, 300, (n, 2)), scale=rng.choice([0.5, 1, 2.0], n))
            m = min(n, int(rng.integers(0, 40)))
            p = np.stack([np.sort(rng.choice(80, m, replace=False)), rng.choice(n, m, replace=False)], 1).reshape(-1, 2)
        candidates.append(cand)
        pairs.append(p)
    matches = padded_matches(pairs)
    distance = rng.integers(0, 6, matches.mask.shape).astype(np.int16) * matches.mask
    matches = Matches(matches.query, matches.token, distance, matches.mask)
    result = verify(query, TokenBatch.stack(candidates), matches, config)
    for c, (cand, p) in enumerate(zip(candidates, pairs)):
        ref = verify_pair(query, cand, p, config, distance[c, : len(p)])
        assert result.inliers[c] == ref.inliers, c
        np.testing.assert_array_equal(result.inlier_mask[c, : len(p)], ref.inlier_mask, err_msg=f"candidate {c}")
        assert result.refined[c] == ref.refined and result.verified[c] == ref.verified, c
        np.testing.assert_allclose(result.affine[c], ref.affine, rtol=1e-9, atol=1e-7, err_msg=f"candidate {c}")
    allowed = [c for c, angle in angles.items() if abs(angle) < config.max_rotation - 1]  # 1 degree of noise
    assert len(allowed) >= 2 and (result.inliers[allowed] >= 25).all()
    if config.lo_iterations == 0:  # (refinements start from different models: no order after them)
        plain = verify(query, TokenBatch.stack(candidates), matches, dataclasses.replace(config, pair_seeds=0))
        assert (result.inliers >= plain.inliers).all()


def test_verification_rejects_bad_inputs() -> None:
    rng = np.random.default_rng(11)
    query = tokens(random_codes(5, rng), rng)
    batch = TokenBatch.stack([tokens(random_codes(3, rng), rng)], length=5)
    with pytest.raises(RerankInputError, match="padded"):
        verify(query, batch, padded_matches([np.array([[0, 4]])]))
    with pytest.raises(RerankInputError, match="7"):
        verify(query, batch, padded_matches([np.array([[7, 0]])]))
    with pytest.raises(NeedleInputError, match="-1"):
        SpatialConfig(inlier_threshold=-1)


def test_normalized_inliers() -> None:
    np.testing.assert_array_equal(normalized_inliers(np.array([0, 4, 5, 20, 50, 80])), [0, 0, 0.1, 0.4, 1.0, 1.0])
    np.testing.assert_array_equal(normalized_inliers(np.array([3, 10]), cap=10, min_inliers=3), [0.3, 1.0])


def test_verify_a_batch_without_any_match_slot() -> None:
    """Candidates none of which matched (a shard's few members of a shortlist): all unverified,
    no error (the match table has zero columns)."""
    rng = np.random.default_rng(0)
    query = LocalTokens(
        rng.integers(0, 256, (4, 16), dtype=np.uint8),
        rng.random((4, 2)).astype(np.float32),
        np.ones(4, np.float32),
        np.ones(4, np.float32),
    )
    C, T = 3, 5
    batch = TokenBatch(
        rng.integers(0, 256, (C, T, 16), dtype=np.uint8),
        rng.random((C, T, 2)).astype(np.float32),
        np.ones((C, T), np.float32),
        np.ones((C, T), np.float32),
        np.ones((C, T), bool),
    )
    empty = np.zeros((C, 0), np.int64)
    result = verify(query, batch, Matches(empty, empty, np.zeros((C, 0), np.int16), np.zeros((C, 0), bool)))
    assert result.inliers.tolist() == [0, 0, 0] and not result.verified.any()


# ---------------------------------------------------------------------------------------------
# the affine fit against external references


def test_affine_fit_matches_kornia_and_lstsq() -> None:
    from kornia.geometry.solvers import find_affine

    rng = np.random.default_rng(12)
    B, n = 16, 25
    src = rng.uniform(0, 500, (B, n, 2))
    true = np.concatenate([rng.normal(0, 0.4, (B, 2, 2)) + np.eye(2), rng.uniform(-50, 50, (B, 2, 1))], 2)
    dst = np.einsum("bij,bnj->bni", true[:, :, :2], src) + true[:, None, :, 2] + rng.normal(0, 3, (B, n, 2))
    weight = rng.random((B, n)) < 0.7
    weight[:, :3] = True
    fit, ok = fit_affine(src, dst, weight)
    assert ok.all()
    ref = find_affine(torch.from_numpy(src), torch.from_numpy(dst), torch.from_numpy(weight.astype(np.float64))).numpy()
    np.testing.assert_allclose(fit, ref[:, :2], rtol=1e-9, atol=1e-8)
    for b in range(B):
        design = np.concatenate([src[b, weight[b]], np.ones((weight[b].sum(), 1))], 1)
        solution = np.linalg.lstsq(design, dst[b, weight[b]], rcond=None)[0]
        np.testing.assert_allclose(fit[b], solution.T, rtol=1e-9, atol=1e-8)
    exact, _ = fit_affine(
        src, np.einsum("bij,bnj->bni", true[:, :, :2], src) + true[:, None, :, 2], np.ones((B, n), bool)
    )
    np.testing.assert_allclose(exact, true, atol=1e-9)


def test_affine_fit_refuses_collinear_points() -> None:
    from kornia.geometry.solvers import find_affine

    t = np.linspace(0, 100, 10)
    src = np.stack([t, 2 * t + 1], 1)[None]
    dst = src + 5.0
    fit, ok = fit_affine(src, dst, np.ones((1, 10)))
    assert not ok[0] and not fit.any()
    assert torch.isnan(
        find_affine(torch.from_numpy(src), torch.from_numpy(dst))[:, :2]
    ).all()  # kornia agrees: degenerate
    _, ok = fit_affine(src, dst, np.zeros((1, 10)))  # no weight at all
    assert not ok[0]
