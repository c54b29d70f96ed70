"""Local re-ranking with binary tokens: matching, spatial verification and Chamfer similarity,
each vectorised path held to a plain per-pair loop, the affine fit to kornia and numpy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from core.errors import NeedleInputError
from core.tokens import CODE_BITS, LocalTokens, TokenBatch, hamming
from rerank.chamfer import chamfer_from_nearest, chamfer_similarity
from rerank.matching import (
    ASYMMETRIC_TOTAL,
    MatchConfig,
    Matches,
    RerankInputError,
    asymmetric_distances,
    asymmetric_weights,
    match_pair,
    match_tokens,
    matches_from_nearest,
    nearest_tokens,
)
from rerank.spatial import SpatialConfig, fit_affine, normalized_inliers, verify, verify_pair

SCALES = np.array([0.707, 1.0, 1.414], np.float32)


def flip_bits(codes: np.ndarray, n_bits: np.ndarray | int, rng: np.random.Generator) -> np.ndarray:
    """Copies of ``codes`` (n, 16) with exactly ``n_bits`` (per row) bits flipped."""
    bits = np.unpackbits(codes, axis=-1)
    n_bits = np.broadcast_to(n_bits, len(codes))
    for row, k in zip(bits, n_bits):
        row[rng.choice(CODE_BITS, int(k), replace=False)] ^= 1
    return np.packbits(bits, axis=-1)


def tokens(
    codes: np.ndarray, rng: np.random.Generator, xy: np.ndarray | None = None, scale: np.ndarray | None = None
) -> LocalTokens:
    n = len(codes)
    return LocalTokens(
        codes,
        rng.uniform(0, 400, (n, 2)).astype(np.float32) if xy is None else xy.astype(np.float32),
        rng.choice(SCALES, n) if scale is None else scale.astype(np.float32),
        np.ones(n, np.float32),
    )


def random_codes(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, 256, (n, 16), dtype=np.uint8)


def shortlist(rng: np.random.Generator, query: LocalTokens, n_candidates: int = 24) -> list[LocalTokens]:
    """Candidates of 0..30 tokens, many near copies of query tokens (0..70 bits flipped, so that
    distances straddle the thresholds), exact duplicates within a candidate (ties), one empty."""
    out = []
    for c in range(n_candidates):
        n = 0 if c == 3 else int(rng.integers(1, 31))
        codes = random_codes(n, rng)
        k = int(rng.integers(0, n + 1))
        src = rng.integers(0, len(query), k)
        flips = np.where(rng.random(k) < 0.2, 0, rng.integers(0, 70, k))  # some exact copies for max_distance=0
        codes[:k] = flip_bits(query.codes[src], flips, rng)
        if n >= 4:
            codes[n - 1] = codes[1]  # a later duplicate: ties must go to token 1
        out.append(tokens(codes, rng))
    return out


def query_with_duplicates(rng: np.random.Generator, n: int = 40) -> LocalTokens:
    codes = random_codes(n, rng)
    codes[7] = codes[2]  # duplicate query tokens: mutual ties must go to query token 2
    codes[8] = flip_bits(codes[3:4], 1, rng)[0]
    return tokens(codes, rng)


def loop_matches(query: LocalTokens, candidates: list[LocalTokens], config: MatchConfig) -> list[np.ndarray]:
    out = []
    for cand in candidates:
        qi, ti, di = match_pair(query.codes, cand.codes, config)
        out.append(np.stack([qi, ti, di], 1))
    return out


def batched_as_list(matches: Matches) -> list[np.ndarray]:
    return [
        np.concatenate([matches.pairs(c), matches.distance[c, matches.mask[c], None]], 1) for c in range(len(matches))
    ]


# ---------------------------------------------------------------------------------------------
# matching


@pytest.mark.parametrize(
    "config",
    [
        MatchConfig(),
        MatchConfig(mutual=False),
        MatchConfig(max_distance=0),
        MatchConfig(max_distance=45, mutual=False),
        MatchConfig(max_distance=CODE_BITS),
    ],
)
def test_batched_matching_equals_loop(config: MatchConfig) -> None:
    rng = np.random.default_rng(0)
    query = query_with_duplicates(rng)
    candidates = shortlist(rng, query)
    batch = TokenBatch.stack(candidates, length=32)  # 2 padded slots beyond the longest candidate
    want = loop_matches(query, candidates, config)
    assert sum(len(w) for w in want) >= 10  # the data does produce matches
    # one chunk for all and one candidate per chunk
    for block_values in (10**9, 1):
        nearest = nearest_tokens(
            query.codes, batch, within=config.threshold, mutual=config.mutual, block_values=block_values
        )
        got = batched_as_list(matches_from_nearest(nearest, config))
        assert [len(w) for w in want] == [len(g) for g in got]
        for c, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(g, w, err_msg=f"candidate {c}, block {block_values}")
        assert len(got[3]) == 0  # the empty candidate
    np.testing.assert_array_equal(batched_as_list(match_tokens(query, batch, config))[5], want[5])


def projections_of(codes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Float projections whose signs are ``codes`` (magnitudes of very different sizes, exact zeros
    on set bits included), as an ITQ projection of the query's descriptors would give."""
    bits = np.unpackbits(codes, axis=1).astype(bool)
    magnitude = rng.exponential(1.0, bits.shape) * rng.choice([0.1, 1.0, 5.0], (len(codes), 1))
    magnitude[rng.random(bits.shape) < 0.02] = 0.0
    return np.where(bits, magnitude, -np.maximum(magnitude, 1e-3)).astype(np.float32)


def test_asymmetric_weights() -> None:
    rng = np.random.default_rng(20)
    codes = random_codes(50, rng)
    proj = projections_of(codes, rng)
    w = asymmetric_weights(proj)
    assert (np.abs(w).sum(1) == ASYMMETRIC_TOTAL).all() and (w == np.round(w)).all()
    bits = np.unpackbits(codes, axis=1).astype(bool)
    assert ((w > 0) == (bits & (w != 0))).all()  # the signs are the codes' bits (a zero weight has none)
    share = np.abs(proj) * ASYMMETRIC_TOTAL / np.abs(proj).sum(1, keepdims=True)
    assert (np.abs(np.abs(w) - share) < 1).all()  # each weight is its share rounded down or up
    assert (asymmetric_weights(np.zeros((1, CODE_BITS))) == ASYMMETRIC_TOTAL / CODE_BITS).all()
    with pytest.raises(RerankInputError, match="finite"):
        asymmetric_weights(np.full((1, CODE_BITS), np.nan))


@pytest.mark.parametrize(
    "config",
    [
        MatchConfig(asymmetric=True),
        MatchConfig(asymmetric=True, mutual=False, max_distance=45),
        MatchConfig(asymmetric=True, max_distance=CODE_BITS),
    ],
)
def test_asymmetric_matching_equals_loop(config: MatchConfig) -> None:
    """Float query projections against binary codes: the batched path gives the loop's matches and
    distances (weighted Hamming distances rounded up), and Chamfer the loop's mean."""
    rng = np.random.default_rng(21)
    query = query_with_duplicates(rng)
    query = LocalTokens(query.codes, query.xy, query.scale, query.weight, proj=projections_of(query.codes, rng))
    weights = asymmetric_weights(query.proj)
    candidates = shortlist(rng, query)
    batch = TokenBatch.stack(candidates, length=32)
    want = []
    for cand in candidates:
        qi, ti, di = match_pair(query.codes, cand.codes, config, weights)
        want.append(np.stack([qi, ti, di], 1))
    assert sum(len(w) for w in want) >= 10
    for block_values in (10**9, 1):
        nearest = nearest_tokens(
            query.codes,
            batch,
            within=config.threshold,
            mutual=config.mutual,
            block_values=block_values,
            query_weights=weights,
        )
        got = batched_as_list(matches_from_nearest(nearest, config))
        for c, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(g, w, err_msg=f"candidate {c}, block {block_values}")
    got = batched_as_list(match_tokens(query, batch, config))
    for c, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, err_msg=f"candidate {c}")
    # the plain path where the query carries no projections, or the config does not ask
    plain = loop_matches(query, candidates, dataclasses.replace(config, asymmetric=False))
    bare = LocalTokens(query.codes, query.xy, query.scale, query.weight)
    for c, g in enumerate(batched_as_list(match_tokens(bare, batch, config))):
        np.testing.assert_array_equal(g, plain[c])
    # Chamfer over the asymmetric distances
    from rerank.rerank import RerankConfig, Reranker

    chamfer = Reranker(RerankConfig(method="chamfer", match=config)).local_scores(query, batch).raw
    for c, cand in enumerate(candidates):
        if len(cand) == 0:
            assert chamfer[c] == 0.0
            continue
        nearest_bits = np.ceil(asymmetric_distances(weights, cand.codes).min(1))
        assert chamfer[c] == pytest.approx(np.mean(1 - 2 * nearest_bits / CODE_BITS), abs=1e-12)


def test_matching_with_mask_holes() -> None:
    """Padding between real tokens (a hand-built batch): indices are batch positions, ties by position."""
    rng = np.random.default_rng(1)
    query = query_with_duplicates(rng)
    candidates = shortlist(rng, query, 8)
    T = 48
    codes = np.zeros((8, T, 16), np.uint8)
    mask = np.zeros((8, T), bool)
    positions = []
    for c, cand in enumerate(candidates):
        pos = np.sort(rng.choice(T, len(cand), replace=False))
        codes[c, pos], mask[c, pos] = cand.codes, True
        positions.append(pos)
    batch = TokenBatch(
        codes, np.zeros((8, T, 2), np.float32), np.ones((8, T), np.float32), np.zeros((8, T), np.float32), mask
    )
    for config in (MatchConfig(), MatchConfig(max_distance=CODE_BITS, mutual=False)):
        got = batched_as_list(match_tokens(query, batch, config))
        for c, w in enumerate(loop_matches(query, candidates, config)):
            w = w.copy()
            w[:, 1] = positions[c][w[:, 1]]
            np.testing.assert_array_equal(got[c], w)


def test_matching_threshold_and_tie_rules() -> None:
    rng = np.random.default_rng(2)
    q = random_codes(3, rng)
    at = flip_bits(q[0:1], 32, rng)[0]  # exactly 32 bits from query token 0
    beyond = flip_bits(q[1:2], 33, rng)[0]  # exactly 33 bits from query token 1
    cand = np.stack([at, beyond, q[2], q[2]])  # token 3 duplicates token 2
    assert hamming(q, cand)[[0, 1, 2, 2], [0, 1, 2, 3]].tolist() == [32, 33, 0, 0]
    query = tokens(q, rng)
    batch = TokenBatch.stack([tokens(cand, rng)])
    m = match_tokens(query, batch, MatchConfig(max_distance=32))
    assert m.pairs(0).tolist() == [[0, 0], [2, 2]]  # 32 kept, 33 not; the tie goes to token 2
    assert m.distance[0, m.mask[0]].tolist() == [32, 0]
    m = match_tokens(query, batch, MatchConfig(max_distance=33))
    assert m.pairs(0).tolist() == [[0, 0], [1, 1], [2, 2]]

    # two identical query tokens both have token 0 as nearest; only the first is its mutual nearest
    query = tokens(np.stack([q[0], q[0]]), rng)
    batch = TokenBatch.stack([tokens(q[:1], rng)])
    assert match_tokens(query, batch, MatchConfig()).pairs(0).tolist() == [[0, 0]]
    assert match_tokens(query, batch, MatchConfig(mutual=False)).pairs(0).tolist() == [[0, 0], [1, 0]]


def test_mutual_drops_a_token_nearer_to_another_query_token() -> None:
    rng = np.random.default_rng(3)
    t = random_codes(1, rng)
    query = tokens(np.concatenate([flip_bits(t, 10, rng), flip_bits(t, 3, rng)]), rng)  # token 1 is nearer to t
    batch = TokenBatch.stack([tokens(t, rng)])
    assert match_tokens(query, batch, MatchConfig(mutual=True)).pairs(0).tolist() == [[1, 0]]
    assert match_tokens(query, batch, MatchConfig(mutual=False)).pairs(0).tolist() == [[0, 0], [1, 0]]


def test_nearest_distances_and_small_blocks() -> None:
    """Chunks of one candidate (tiny block) give the same result as one chunk for everything."""
    rng = np.random.default_rng(4)
    query = query_with_duplicates(rng)
    candidates = shortlist(rng, query)
    batch = TokenBatch.stack(candidates)
    small = nearest_tokens(query.codes, batch, within=40, block_values=1)
    large = nearest_tokens(query.codes, batch, within=40, block_values=10**9)
    for field in ("distance", "candidate", "query", "token", "mutual"):
        np.testing.assert_array_equal(getattr(small, field), getattr(large, field))
    for c, cand in enumerate(candidates):
        want = hamming(query.codes, cand.codes).min(1) if len(cand) else np.full(len(query), CODE_BITS)
        np.testing.assert_array_equal(small.distance[c], want)
    assert small.has_tokens.tolist() == [len(c) > 0 for c in candidates]


def test_matching_rejects_bad_inputs() -> None:
    with pytest.raises(NeedleInputError, match="129"):
        MatchConfig(max_distance=129)
    rng = np.random.default_rng(5)
    query = tokens(random_codes(4, rng), rng)
    batch = TokenBatch.stack([tokens(random_codes(3, rng), rng)])
    bad = TokenBatch(batch.codes[..., :8], batch.xy, batch.scale, batch.weight, batch.mask)
    with pytest.raises(RerankInputError, match=r"\(1, 3, 8\)"):
        match_tokens(query, bad)
    nearest = nearest_tokens(query.codes, batch, within=10, mutual=False)
    with pytest.raises(RerankInputError, match="within 10 bits"):
        matches_from_nearest(nearest, MatchConfig(max_distance=32, mutual=False))
    with pytest.raises(RerankInputError, match="mutual"):
        matches_from_nearest(nearest, MatchConfig(max_distance=10, mutual=True))


# ---------------------------------------------------------------------------------------------
# Chamfer


def test_chamfer_equals_loop() -> None:
    rng = np.random.default_rng(6)
    query = query_with_duplicates(rng)
    query = LocalTokens(
        np.concatenate([query.codes, np.zeros((1, 16), np.uint8)]),  # all-zero code: padded
        np.zeros((41, 2), np.float32),
        np.ones(41, np.float32),
        np.ones(41, np.float32),
    )  # slots must not match it
    candidates = shortlist(rng, query)
    got = chamfer_similarity(query, TokenBatch.stack(candidates, length=40))
    for c, cand in enumerate(candidates):
        if len(cand) == 0:
            want = 0.0
        else:
            want = np.mean(
                [
                    max(
                        1 - 2 * int(hamming(query.codes[i : i + 1], cand.codes[j : j + 1])[0, 0]) / 128
                        for j in range(len(cand))
                    )
                    for i in range(len(query))
                ]
            )
        assert got[c] == pytest.approx(want, abs=1e-12), c
    assert got[3] == 0.0
    assert chamfer_similarity(LocalTokens.empty(), TokenBatch.stack(candidates)).tolist() == [0.0] * len(candidates)


def test_one_hamming_pass_serves_matching_and_chamfer() -> None:
    rng = np.random.default_rng(7)
    query = query_with_duplicates(rng)
    batch = TokenBatch.stack(shortlist(rng, query))
    nearest = nearest_tokens(query.codes, batch, within=32, mutual=True)
    np.testing.assert_array_equal(chamfer_from_nearest(nearest), chamfer_similarity(query, batch))
    shared, alone = matches_from_nearest(nearest), match_tokens(query, batch)
    for field in ("query", "token", "distance", "mask"):
        np.testing.assert_array_equal(getattr(shared, field), getattr(alone, field))


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


def test_float64_keys_where_token_and_query_counts_do_not_fit_13_bits() -> None:
    """Keys are float32 while T + Q ties fit 13 bits; beyond, float64: the same matches as the loop
    (plain and asymmetric), ties included."""
    from rerank import matching

    rng = np.random.default_rng(22)
    query = query_with_duplicates(rng)
    weights = asymmetric_weights(projections_of(query.codes, rng))
    candidates = shortlist(rng, query, n_candidates=6)
    assert matching._KeyTable(torch.zeros((len(query), 136)), 8193 - len(query)).dtype == torch.float32
    batch = TokenBatch.stack(candidates, length=8194 - len(query))  # T + Q = 8194: float64
    assert matching._KeyTable(torch.zeros((len(query), 136)), batch.mask.shape[1]).dtype == torch.float64
    for w in (None, weights):
        config = MatchConfig(max_distance=45)
        want = [np.stack(match_pair(query.codes, cand.codes, config, w), 1) for cand in candidates]
        assert sum(len(x) for x in want) >= 5
        nearest = nearest_tokens(query.codes, batch, within=45, query_weights=w)
        got = batched_as_list(matches_from_nearest(nearest, config))
        for c, (g, x) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(g, x, err_msg=f"candidate {c}")


def test_joined_batches_equal_one_stacked_batch() -> None:
    """TokenBatch.concat (a shard group's members' candidates scored together) pads as stack does."""
    rng = np.random.default_rng(5)
    query = tokens(random_codes(30, rng), rng)
    candidates = shortlist(rng, query, 9)
    parts = [TokenBatch.stack(candidates[:4]), TokenBatch.stack(candidates[4:5]), TokenBatch.stack(candidates[5:])]
    assert len({p.codes.shape[1] for p in parts}) > 1  # of different lengths
    joined, whole = TokenBatch.concat(parts), TokenBatch.stack(candidates)
    for name in ("codes", "xy", "scale", "weight", "mask"):
        np.testing.assert_array_equal(getattr(joined, name), getattr(whole, name))
