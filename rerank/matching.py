"""Tentative correspondences between one query's tokens and every candidate of a shortlist.

For each query token and each candidate, the candidate token nearest in Hamming distance; kept as a
match when it is within ``max_distance`` bits and, optionally, mutual (that candidate token's nearest
query token is this one). Ties go to the lowest index, both ways, so the vectorised path gives
exactly the matches of the plain loop ``match_pair`` over ``core.tokens.hamming``.

``nearest_tokens`` is the one place that computes Hamming distances against a shortlist; Chamfer
similarity (``rerank.chamfer``) reads the same reductions. How it is fast on a CPU:

* codes become ±1 bfloat16 vectors, and a query token's dot product with a candidate token is
  ``128 - 2 * hamming``. Integers up to 256 are exact in bfloat16 and the matmul accumulates in float32,
  so the bfloat16 matmul is exact and ~4x faster than float32 (AVX512-BF16).
* one extra column adds 128 to every real token's product and 0 to padded ones (zero rows), so
  the products are ``256 - 2 * hamming >= 0`` for real tokens and 0 for padding. Non-negative
  bfloat16 values order like their bit patterns read as int16, and int16 reductions are ~4x faster
  in torch than bfloat16 ones: maxima are taken on the int16 view, with no conversion pass.
* candidates go through in chunks whose (tokens x query) block stays in cache, and only the
  maxima are reduced over the whole block; which token is nearest is found on the columns of the
  pairs within the threshold only, and which query token is nearest to that token on its row only
  (or on every row of the chunk when most of them are needed, near-duplicate candidates).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from core.errors import NeedleInputError
from core.tokens import CODE_BITS, CODE_BYTES, LocalTokens, TokenBatch, hamming

# A chunk's similarity block holds about this many bfloat16 values (3 MB): small enough to stay in
# L2/L3 between the matmul and its reductions, large enough for an efficient matmul. Measured on a
# 2-core Zen4, 300 query tokens x 1000 candidates: 0.5M 25 ms, 1M 22 ms, 1.5M 21 ms, 3M 68 ms.
BLOCK_VALUES = 1_500_000
_PAD_BYTE = 256  # row of the sign table that is all zeros: padded tokens
_REAL_BYTE = 257  # row whose first entry is 1: the offset column of a real token
_WIDTH = (CODE_BYTES + 1) * 8  # 128 sign columns + the offset column + 7 zero columns
_OFFSET = float(CODE_BITS)  # added to real tokens' dot products: 128 + dot = 256 - 2 * hamming
# Asymmetric matching: a query token's 128 ITQ projections become integer bit weights whose absolute
# values sum to exactly this (largest-remainder rounding). Integers: every weight (|w| < 256) and
# every product (0..1024) is exact in the float32 accumulation; 512 itself is exact in bfloat16, and
# the bfloat16 products keep a resolution of half a bit of weighted Hamming distance.
ASYMMETRIC_TOTAL = 512


class RerankInputError(NeedleInputError):
    """Re-ranking inputs that do not fit together (shapes, indices) or a configuration value out of range."""


@dataclass(frozen=True)
class MatchConfig:
    """Which nearest neighbours count as tentative correspondences."""

    max_distance: int = 32  # keep a match only within this many differing bits (of 128); 0..128
    mutual: bool = True  # also require the candidate token's nearest query token to be this query token
    # Score the query's float ITQ projections (where its tokens carry them: image queries) against
    # the database's binary codes: bits weigh by the query's confidence in them (weighted Hamming
    # distance, in bits); the database side stays 128 bits. Stored-key queries have no projections
    # and match with plain Hamming distances. realbench: SP 52.5 -> 56.5 mAP@1k (cross-validated).
    asymmetric: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.max_distance <= CODE_BITS:
            raise RerankInputError(f"max_distance must be in 0..{CODE_BITS} bits, got {self.max_distance}")


@dataclass(frozen=True)
class NearestTokens:
    """Hamming nearest-neighbour reductions of one query's tokens against each candidate.

    ``distance`` covers every (candidate, query token); the index arrays cover only the pairs within
    the ``within`` bits asked for, ordered by candidate then query token.
    """

    distance: np.ndarray  # (C, Q) int16: bits to the candidate's nearest token; CODE_BITS where it has none
    has_tokens: np.ndarray  # (C,) bool: the candidate has at least one real token
    candidate: np.ndarray  # (n,) int64 candidate of each pair within ``within`` bits
    query: np.ndarray  # (n,) int64 query token
    token: np.ndarray  # (n,) int64 nearest candidate token (position in the TokenBatch row; lowest on ties)
    mutual: (
        np.ndarray | None
    )  # (n,) bool: the token's nearest query token (lowest on ties) is ``query``; None if not asked
    within: int  # the distance the pairs were collected within (-1: none collected)

    @property
    def pair_distance(self) -> np.ndarray:
        """(n,) Hamming distance of each collected pair."""
        return self.distance[self.candidate, self.query]


@dataclass(frozen=True)
class Matches:
    """Tentative correspondences of one query with each candidate, padded to the largest count M.

    A candidate's matches are ordered by query token index (the order ``match_pair`` gives).
    """

    query: np.ndarray  # (C, M) int64 query token index; 0 where padded
    token: np.ndarray  # (C, M) int64 candidate token index (position in the TokenBatch row); 0 where padded
    distance: np.ndarray  # (C, M) int16 Hamming distance; 0 where padded
    mask: np.ndarray  # (C, M) bool, True for real matches

    def __len__(self) -> int:
        return len(self.mask)

    def counts(self) -> np.ndarray:
        """(C,) number of matches per candidate."""
        return self.mask.sum(1)

    def pairs(self, c: int) -> np.ndarray:
        """Candidate ``c``'s matches as (m, 2) int64 (query token, candidate token) rows."""
        m = self.mask[c]
        return np.stack([self.query[c, m], self.token[c, m]], axis=1)


@functools.lru_cache(maxsize=1)
def _sign_table() -> torch.Tensor:
    """(258, 8) bfloat16: rows 0..255 are a byte's bits as ±1 in ``np.packbits`` order, 256 zeros
    (padding), 257 the offset unit. Built on first use, not at import."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.float32) * 2 - 1
    extra = np.zeros((2, 8), np.float32)
    extra[1, 0] = 1.0
    return torch.from_numpy(np.concatenate([bits, extra])).to(torch.bfloat16)


def asymmetric_weights(proj: np.ndarray) -> np.ndarray:
    """(Q, 128) ITQ projections -> (Q, 128) float32 integer bit weights, the sign of each projection
    (>= 0: +, as the code's bit) times its share of ``ASYMMETRIC_TOTAL``, rounded so that every row's
    absolute values sum to exactly ``ASYMMETRIC_TOTAL`` (floors, then +1 to the largest remainders,
    ties to the lower bit). A row of zeros weighs every bit equally."""
    magnitude = np.abs(np.asarray(proj, np.float64))
    if magnitude.ndim != 2 or magnitude.shape[1] != CODE_BITS or not np.isfinite(magnitude).all():
        raise RerankInputError(f"query projections must be finite (Q, {CODE_BITS}), got shape {magnitude.shape}")
    total = magnitude.sum(1, keepdims=True)
    magnitude = np.where(total > 0, magnitude, 1.0)
    share = magnitude * ASYMMETRIC_TOTAL / magnitude.sum(1, keepdims=True)
    weight = np.floor(share)
    missing = (ASYMMETRIC_TOTAL - weight.sum(1)).astype(np.int64)  # 0..127
    by_remainder = np.argsort(-(share - weight), axis=1, kind="stable")
    bump = np.arange(CODE_BITS)[None, :] < missing[:, None]
    np.put_along_axis(weight, by_remainder, np.take_along_axis(weight, by_remainder, 1) + bump, 1)
    return np.where(np.asarray(proj) >= 0, weight, -weight).astype(np.float32)


@functools.lru_cache(maxsize=1)
def _bf16_matmul_is_fast() -> bool:
    """Whether this CPU multiplies bfloat16 matrices faster than float32 ones (AVX512-BF16, AMX).

    Without such instructions torch emulates bfloat16 matmuls, ~12x slower than float32 (measured
    on a 2-core AVX2 EPYC: 421 vs 35 ms for 10,000 x 136 x 300). Either way the products are the
    same numbers (see ``_products``), so this only picks the faster path; probed once per process."""
    import time

    a = torch.ones((2000, _WIDTH), dtype=torch.float32)
    b = torch.ones((_WIDTH, 256), dtype=torch.float32)
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        x @ y  # warm-up
        start = time.perf_counter()
        for _ in range(3):
            x @ y
        seconds[dtype] = time.perf_counter() - start
    return seconds[torch.bfloat16] < seconds[torch.float32]


def _products(signs: torch.Tensor, q_t: torch.Tensor) -> torch.Tensor:
    """``signs @ q_t`` as bfloat16. Every product is an integer summed exactly in float32 (by the
    bfloat16 matmul's float32 accumulation, or a float32 matmul) and then rounded once to bfloat16:
    the same numbers on either path."""
    if _bf16_matmul_is_fast():
        return signs @ q_t
    return (signs.float() @ q_t.float()).to(torch.bfloat16)


def _query_matrix(codes: np.ndarray, weights: np.ndarray | None = None) -> torch.Tensor:
    """(Q, 136) bfloat16: ±1 bits (or the asymmetric integer weights), then the offset (128, or
    ``ASYMMETRIC_TOTAL``) in the offset column (times the candidates' 1 or 0)."""
    if weights is not None:
        q = torch.zeros((len(weights), _WIDTH), dtype=torch.bfloat16)
        q[:, :CODE_BITS] = torch.from_numpy(np.asarray(weights, np.float32))
        q[:, CODE_BITS] = float(ASYMMETRIC_TOTAL)
        return q
    rows = np.full((len(codes), CODE_BYTES + 1), _PAD_BYTE, np.int32)
    rows[:, :CODE_BYTES] = codes
    q = F.embedding(torch.from_numpy(rows), _sign_table()).reshape(len(codes), _WIDTH)
    q[:, CODE_BITS] = _OFFSET
    return q


def _candidate_rows(candidates: TokenBatch) -> torch.Tensor:
    """(C*T, 17) int32 sign-table rows: each code byte, then the offset unit; padded tokens all zeros."""
    C, T = candidates.mask.shape
    rows = np.full((C, T, CODE_BYTES + 1), _PAD_BYTE, np.int32)
    np.copyto(rows[..., :CODE_BYTES], candidates.codes, where=candidates.mask[..., None])
    rows[..., CODE_BYTES][candidates.mask] = _REAL_BYTE
    return torch.from_numpy(rows.reshape(C * T, CODE_BYTES + 1))


def _bf16_bits(value: float) -> int:
    """The int16 bit pattern of ``value`` in bfloat16 (monotone in value for value >= 0)."""
    return int(torch.tensor(value, dtype=torch.bfloat16).view(torch.int16))


def _check_inputs(query_codes: np.ndarray, candidates: TokenBatch) -> None:
    if query_codes.ndim != 2 or query_codes.shape[1] != CODE_BYTES or query_codes.dtype != np.uint8:
        raise RerankInputError(
            f"query codes must be (Q, {CODE_BYTES}) uint8, got {query_codes.shape} {query_codes.dtype}"
        )
    codes, mask = candidates.codes, candidates.mask
    if codes.ndim != 3 or codes.shape[2] != CODE_BYTES or codes.dtype != np.uint8:
        raise RerankInputError(f"candidate codes must be (C, T, {CODE_BYTES}) uint8, got {codes.shape} {codes.dtype}")
    if mask.shape != codes.shape[:2] or mask.dtype != bool:
        raise RerankInputError(f"candidate mask must be (C, T) = {codes.shape[:2]} bool, got {mask.shape} {mask.dtype}")


def nearest_tokens(
    query_codes: np.ndarray,
    candidates: TokenBatch,
    *,
    within: int = 32,
    mutual: bool = True,
    block_values: int = BLOCK_VALUES,
    query_weights: np.ndarray | None = None,
) -> NearestTokens:
    """Hamming nearest neighbours of each query token in each candidate (all exact).

    ``query_codes`` (Q, 16) uint8. Always returns the (C, Q) distances to each candidate's nearest
    token; for the pairs within ``within`` bits (-1: none, for Chamfer alone) also which token is
    nearest and, with ``mutual``, whether that token's nearest query token is this one.

    With ``query_weights`` (Q, 128) from ``asymmetric_weights`` the distances are weighted Hamming
    distances in bits, ``128 * (weight of the disagreeing bits) / ASYMMETRIC_TOTAL``, read from the
    bfloat16 products (half-bit resolution) and rounded up to whole bits; nearest means the largest
    bfloat16 product (lowest index among equals).
    """
    _check_inputs(query_codes, candidates)
    if query_weights is not None and query_weights.shape != (len(query_codes), CODE_BITS):
        raise RerankInputError(
            f"query weights of shape {query_weights.shape} do not fit {len(query_codes)} tokens of {CODE_BITS} bits"
        )
    total = float(CODE_BITS if query_weights is None else ASYMMETRIC_TOTAL)  # products are 2 * total at distance 0
    if not -1 <= within <= CODE_BITS:
        raise RerankInputError(f"within must be in -1..{CODE_BITS} bits, got {within}")
    C, T = candidates.mask.shape
    Q = len(query_codes)
    has_tokens = candidates.mask.any(1)
    distance = np.full((C, Q), CODE_BITS, np.int16)
    empty = np.zeros(0, np.int64)
    if C == 0 or T == 0 or Q == 0:
        return NearestTokens(distance, has_tokens, empty, empty, empty, np.zeros(0, bool) if mutual else None, within)

    table = _sign_table()
    q_t = _query_matrix(query_codes, query_weights).t().contiguous()  # (136, Q): block = candidate rows @ q_t
    rows = _candidate_rows(candidates)
    # 2 * total * (1 - within / 128) is the smallest product of a pair within ``within`` bits
    # (256 - 2 * within for plain codes; a multiple of 8 up to 1024, exact in bfloat16, asymmetric)
    threshold = _bf16_bits(total * (CODE_BITS - within) / 64) if within >= 0 else None
    chunk = max(1, block_values // max(1, T * Q))
    best = torch.empty((C, Q), dtype=torch.int16)
    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    with torch.inference_mode():
        for c0 in range(0, C, chunk):
            c1 = min(C, c0 + chunk)
            signs = F.embedding(rows[c0 * T : c1 * T], table).reshape(-1, _WIDTH)
            block = _products(signs, q_t).view(torch.int16).view(c1 - c0, T, Q)  # 256 - 2h, as int16 bits
            torch.amax(block, dim=1, out=best[c0:c1])
            if threshold is not None:
                found.append(_pairs_in_chunk(block, best[c0:c1], threshold, candidates.mask[c0:c1], c0, mutual))
    distance = _bits_to_hamming(best, total)
    distance[~has_tokens] = CODE_BITS  # an all-padding candidate's "nearest" is a zero row
    if threshold is None:
        return NearestTokens(distance, has_tokens, empty, empty, empty, None, within)
    cand, query, token = (torch.cat([part[i] for part in found]).numpy().astype(np.int64) for i in range(3))
    mut = torch.cat([part[3] for part in found]).numpy() if mutual else None
    return NearestTokens(distance, has_tokens, cand, query, token, mut, within)


def _bits_to_hamming(best: torch.Tensor, total: float = _OFFSET) -> np.ndarray:
    """int16 bit patterns of bfloat16 products ``2 * total * (1 - h / 128)`` -> h, rounded up
    (exact for plain codes, whose h are integers). -0.0 (bits -32768) reads as 0, i.e. 128."""
    products = best.view(torch.bfloat16).float().numpy().astype(np.float64)
    return np.ceil((2 * total - products) * (CODE_BITS / 2) / total).astype(np.int16)


def _pairs_in_chunk(
    block: torch.Tensor,
    best: torch.Tensor,
    threshold: int,
    mask: np.ndarray,
    c0: int,
    mutual: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The (candidate, query token) pairs of one chunk within the threshold, their nearest token
    (lowest index among equals) and, with ``mutual``, whether they are mutual nearest neighbours.

    ``max(dim).indices`` is the first maximal index (documented by torch), and ~2x faster than
    ``argmax`` on int16 here."""
    n_c, T, Q = block.shape
    keep = (best >= threshold) & torch.from_numpy(mask.any(1))[:, None]
    ci, qi = keep.nonzero(as_tuple=True)
    columns = block[ci, :, qi]  # (n, T) products of each kept query token with the candidate's tokens
    # Within < 128 bits a kept pair's maximum is >= 2, above every padded slot (0): no masking needed.
    # At 128 any real token qualifies; products of exactly 0 could be -0.0 (bits -32768), so clamp
    # them to +0.0 to tie by index with other zeros, and put padded slots below everything.
    edge = threshold <= 0
    if edge:
        columns = torch.where(torch.from_numpy(mask)[ci], columns.clamp_min(0), -1)
    token = columns.max(1).indices
    mut = None
    if mutual:
        flat = ci * T + token
        rows = block.view(n_c * T, Q)
        if 4 * len(flat) > n_c * T:  # many pairs: one pass over every row beats gathering most of them
            nearest_query = (rows.clamp_min(0) if edge else rows).max(1).indices[flat]
        else:  # few pairs: only the rows of their tokens, each once
            unique, inverse = torch.unique(flat, return_inverse=True)
            picked = rows[unique]
            nearest_query = (picked.clamp_min(0) if edge else picked).max(1).indices[inverse]
        mut = nearest_query == qi
    return ci + c0, qi, token, mut


def query_weights_of(query: LocalTokens, config: MatchConfig) -> np.ndarray | None:
    """The asymmetric bit weights of ``query`` where ``config`` asks for them and its tokens carry
    projections; None (plain Hamming distances) otherwise."""
    if not config.asymmetric or query.proj is None:
        return None
    return asymmetric_weights(query.proj)


def match_tokens(query: LocalTokens, candidates: TokenBatch, config: MatchConfig = MatchConfig()) -> Matches:
    """Tentative correspondences of ``query`` with every candidate of the shortlist."""
    weights = query_weights_of(query, config)
    return matches_from_nearest(
        nearest_tokens(
            query.codes, candidates, within=config.max_distance, mutual=config.mutual, query_weights=weights
        ),
        config,
    )


def matches_from_nearest(nearest: NearestTokens, config: MatchConfig = MatchConfig()) -> Matches:
    """The matches of ``config`` among already computed nearest neighbours (which must have been
    collected within at least ``config.max_distance`` bits, with ``mutual`` when the config asks)."""
    if nearest.within < config.max_distance:
        raise RerankInputError(
            f"nearest tokens were collected within {nearest.within} bits, the match config needs {config.max_distance}"
        )
    if config.mutual and nearest.mutual is None:
        raise RerankInputError("the match config asks for mutual matches but nearest tokens were computed without")
    distance = nearest.pair_distance
    keep = distance <= config.max_distance
    if config.mutual:
        keep &= nearest.mutual
    return _pad_matches(
        len(nearest.distance), nearest.candidate[keep], nearest.query[keep], nearest.token[keep], distance[keep]
    )


def _pad_matches(
    n_candidates: int, cand: np.ndarray, query: np.ndarray, token: np.ndarray, distance: np.ndarray
) -> Matches:
    """Scatter pairs sorted by candidate into (C, M) arrays, M the largest count."""
    counts = np.bincount(cand, minlength=n_candidates)
    M = int(counts.max(initial=0))
    starts = np.cumsum(counts) - counts
    slot = np.arange(len(cand)) - starts[cand]
    out_q = np.zeros((n_candidates, M), np.int64)
    out_t = np.zeros((n_candidates, M), np.int64)
    out_d = np.zeros((n_candidates, M), np.int16)
    mask = np.zeros((n_candidates, M), bool)
    out_q[cand, slot], out_t[cand, slot], out_d[cand, slot], mask[cand, slot] = query, token, distance, True
    return Matches(out_q, out_t, out_d, mask)


def asymmetric_distances(weights: np.ndarray, candidate_codes: np.ndarray) -> np.ndarray:
    """Plain reference of the asymmetric distances (Q, n) float64 in bits, as ``nearest_tokens``
    reads them: the exact integer products ``total + w . signs`` rounded to bfloat16, then to bits."""
    signs = np.unpackbits(candidate_codes, axis=1).astype(np.int64) * 2 - 1
    products = ASYMMETRIC_TOTAL + np.asarray(weights, np.int64) @ signs.T
    rounded = torch.from_numpy(products.astype(np.float32)).to(torch.bfloat16).double().numpy()
    return (2 * ASYMMETRIC_TOTAL - rounded) * (CODE_BITS / 2) / ASYMMETRIC_TOTAL


def match_pair(
    query_codes: np.ndarray,
    candidate_codes: np.ndarray,
    config: MatchConfig = MatchConfig(),
    query_weights: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plain reference for one pair: (query index, candidate index, distance) int64 arrays, by query index.

    Each query token's nearest candidate token (the lowest index among equally near ones), kept
    within ``max_distance`` and, with ``mutual``, when that token's nearest query token (again the
    lowest index) is this one. ``candidate_codes`` are the candidate's real tokens only. With
    ``query_weights`` the distances are ``asymmetric_distances`` (rounded up to whole bits when reported).
    """
    found: list[tuple[int, int, int]] = []
    if len(query_codes) and len(candidate_codes):
        if query_weights is None:
            dist = hamming(query_codes, candidate_codes)
        else:
            exact = asymmetric_distances(query_weights, candidate_codes)
            for q in range(len(query_codes)):
                t = int(np.argmin(exact[q]))
                if exact[q, t] > config.max_distance:
                    continue
                if config.mutual and int(np.argmin(exact[:, t])) != q:
                    continue
                found.append((q, t, int(np.ceil(exact[q, t]))))
            out = np.array(found, np.int64).reshape(-1, 3)
            return out[:, 0], out[:, 1], out[:, 2]
        for q in range(len(query_codes)):
            t = int(np.argmin(dist[q]))  # np.argmin returns the first minimum
            if dist[q, t] > config.max_distance:
                continue
            if config.mutual and int(np.argmin(dist[:, t])) != q:
                continue
            found.append((q, t, int(dist[q, t])))
    out = np.array(found, np.int64).reshape(-1, 3)
    return out[:, 0], out[:, 1], out[:, 2]
