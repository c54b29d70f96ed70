"""Local re-ranking with binary tokens: matching (plain and asymmetric distances, mutual nearest,
thresholds and ties) and Chamfer similarity, each vectorised path held to a plain per-pair loop."""

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
from tests.support.rerank_tokens import flip_bits, random_codes, tokens


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
