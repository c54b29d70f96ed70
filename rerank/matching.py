"""Tentative correspondences between one query's tokens and every candidate of a shortlist.

For each query token and each candidate, the candidate token nearest in Hamming distance; kept as a
match when it is within ``max_distance`` bits and, optionally, mutual (that candidate token's nearest
query token is this one). Ties go to the lowest index, both ways, so the vectorised path gives
exactly the matches of the plain loop ``match_pair`` over ``core.tokens.hamming``.

``nearest_tokens`` is the one place that computes Hamming distances against a shortlist; Chamfer
similarity (``rerank.chamfer``) reads the same reductions. How it is fast on a CPU:

* a query token's product with a candidate token is ``total + w . signs``: ``2 * total`` where the
  codes agree, 0 where they disagree in every bit, ``256 - 2 * hamming`` for plain codes (``total``
  128, ``w`` the query's ±1 bits); asymmetric queries weigh their bits (``total`` 512). It is summed
  from table lookups, one per code byte (the dot product of that byte's 8 signs with the query's 8
  entries) and one for the token's slot (the offset ``total``): ``F.embedding_bag`` does 17
  gathers and adds per (token, query token) where a matrix product does 129 multiply-adds, ~2x
  faster on a 2-core AVX2 CPU than the float32 matmul (~20x than its emulated bfloat16 one).
* every table entry is an integer times ``2**13``, and the slot row also adds ``T - 1 - t`` for
  the candidate token t and ``Q - 1 - q`` for query token q. Each sum is a key
  ``product * 2**13 + (T - 1 - t) + (Q - 1 - q)``, an integer below ``2**24``, exact in float32
  whatever the order of summation; padded tokens' keys are ``-2**13``. The largest key over a
  candidate's tokens is the largest product and, among equal ones, the lowest token; over the
  query tokens, likewise the lowest query token: two ``amax`` reductions give what would otherwise
  take index-returning reductions (several times slower in torch), with no conversion pass
  (float64 keys, ``2**30``, where T + Q does not fit 13 bits).
* candidates go through in chunks whose (tokens x query) block of keys stays in cache.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from core.errors import NeedleInputError
from core.tokens import CODE_BITS, CODE_BYTES, LocalTokens, TokenBatch, hamming

# A chunk's block of keys holds about this many values (2.4 MB of float32): small enough to stay in
# L2/L3 between the lookups and the reductions. Measured on a 2-core AVX2 EPYC, 300 query tokens x
# 1000 candidates x 100 tokens (the whole re-ranking): 0.15M 131 ms, 0.3M 104, 0.6M 91, 1.5M 95.
BLOCK_VALUES = 600_000
# On a GPU the whole shortlist's keys at once (300 query x 1000 candidates x 100 tokens: 30M, 120 MB
# of float32): one lookup and two reductions, no cache to stay in.
DEVICE_BLOCK_VALUES = 64_000_000
DEFAULT_MAX_DISTANCE = 32  # MatchConfig's Hamming threshold where neither it nor a token kind sets one
_PAD_BYTE = 256  # row of the sign table that is all zeros: padded tokens
_SIGN_ROWS = 257
# Keys: products times 2**bits plus the two tie-breaks (< 2**bits together). float32 holds every
# integer below 2**24: products up to 1024 (2**10) leave 13 bits; float64 (53 bits) takes the rest.
_KEY_BITS = {torch.float32: 13, torch.float64: 30}
# Asymmetric matching: a query token's 128 ITQ projections become integer bit weights whose absolute
# values sum to exactly this (largest-remainder rounding). Integers: every product (0..1024) is
# exact, and distances have a resolution of a quarter bit (128 / 512).
ASYMMETRIC_TOTAL = 512


class RerankInputError(NeedleInputError):
    """Re-ranking inputs that do not fit together (shapes, indices) or a configuration value out of range."""


@dataclass(frozen=True)
class MatchConfig:
    """Which nearest neighbours count as tentative correspondences."""

    # Keep a match only within this many differing bits (of 128), 0..128; None: the token kind's own
    # where the re-ranking knows it (embed.locals.presets.RERANK_BY_KIND: Lite0 32, ALIKED 28), else 32.
    max_distance: int | None = None
    mutual: bool = True  # also require the candidate token's nearest query token to be this query token
    # Score the query's float ITQ projections (where its tokens carry them: image queries) against
    # the database's binary codes: bits weigh by the query's confidence in them (weighted Hamming
    # distance, in bits); the database side stays 128 bits. Stored-key queries have no projections
    # and match with plain Hamming distances. realbench: SP 52.5 -> 56.5 mAP@1k (cross-validated).
    asymmetric: bool = True

    def __post_init__(self) -> None:
        if self.max_distance is not None and not 0 <= self.max_distance <= CODE_BITS:
            raise RerankInputError(f"max_distance must be in 0..{CODE_BITS} bits, got {self.max_distance}")

    @property
    def threshold(self) -> int:
        """The Hamming threshold in use: ``max_distance``, or 32 where it was left open."""
        return DEFAULT_MAX_DISTANCE if self.max_distance is None else self.max_distance


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
    """(257, 8) float32: rows 0..255 are a byte's bits as ±1 in ``np.packbits`` order, 256 zeros
    (padding). Built on first use, not at import."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.float32) * 2 - 1
    return torch.from_numpy(np.concatenate([bits, np.zeros((1, 8), np.float32)]))


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


def _query_matrix(codes: np.ndarray, weights: np.ndarray | None = None) -> torch.Tensor:
    """(Q, 129) float32: ±1 bits (or the asymmetric integer weights), then the offset ``total`` (128,
    or ``ASYMMETRIC_TOTAL``) that real candidate tokens add: products ``total + w . signs``."""
    q = torch.empty((len(codes), CODE_BITS + 1), dtype=torch.float32)
    if weights is not None:
        q[:, :CODE_BITS] = torch.from_numpy(np.asarray(weights, np.float32))
        q[:, CODE_BITS] = float(ASYMMETRIC_TOTAL)
    else:
        q[:, :CODE_BITS] = torch.from_numpy(np.unpackbits(codes, axis=1).astype(np.float32) * 2 - 1)
        q[:, CODE_BITS] = float(CODE_BITS)
    return q


class _KeyTable:
    """The keys of one query against any candidate tokens, by table lookup (module docstring).

    Rows: 16 blocks of 258, one per code byte k (sign-table row v: ``2**bits`` times the dot
    product of v's 8 signs with the query's entries ``8k..8k+8``; 0 for the padding row), then one
    row per token slot t, the offset ``2**bits * total`` plus the ties ``(T - 1 - t) + (Q - 1 - q)``,
    and one for padded slots, ``-2**bits``: 17 lookups per token."""

    def __init__(self, q: torch.Tensor, T: int, device: torch.device | None = None):
        Q = len(q)
        ties = (T - 1) + (Q - 1)  # the largest sum of the two tie-breaks must fit below the product's bits
        self.dtype = torch.float32 if ties < 1 << _KEY_BITS[torch.float32] else torch.float64
        self.bits = _KEY_BITS[self.dtype]
        unit = float(1 << self.bits)
        per_byte = q[:, :CODE_BITS].to(self.dtype).reshape(Q, CODE_BYTES, 8) * unit
        table = torch.einsum("vi,qki->kvq", _sign_table().to(self.dtype), per_byte)  # (16, 258, Q)
        slots = torch.empty((T + 1, Q), dtype=self.dtype)
        slots[:T] = q[:, CODE_BITS].to(self.dtype) * unit + torch.arange(Q - 1, -1, -1, dtype=self.dtype)
        slots[:T] += torch.arange(T - 1, -1, -1, dtype=self.dtype)[:, None]
        slots[T] = -unit
        self.table = torch.cat([table.reshape(-1, Q), slots]).contiguous().to(device or "cpu")

    def indices(self, candidates: TokenBatch) -> torch.Tensor:
        """(C * T, 17) int32 table rows of the candidates' tokens: each code byte's sign-table row
        (the padding row for padded tokens), then the token's slot row (the padding slot's)."""
        C, T = candidates.mask.shape
        base = np.arange(CODE_BYTES, dtype=np.int32) * _SIGN_ROWS
        out = np.empty((C, T, CODE_BYTES + 1), np.int32)
        np.add(candidates.codes, base, out=out[..., :CODE_BYTES])
        np.copyto(out[..., :CODE_BYTES], base + _PAD_BYTE, where=~candidates.mask[..., None])
        out[..., CODE_BYTES] = np.where(candidates.mask, np.arange(T, dtype=np.int32), T) + CODE_BYTES * _SIGN_ROWS
        return torch.from_numpy(out.reshape(C * T, CODE_BYTES + 1))

    def keys(self, indices: torch.Tensor) -> torch.Tensor:
        """(n, Q) keys of ``indices`` (n, 17)."""
        return F.embedding_bag(indices, self.table, mode="sum")

    def split(self, keys: torch.Tensor, tie: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 (product, the other tie) of maximal ``keys`` whose own tie (one side's) is ``tie``:
        products -1 where the key is a padded token's."""
        keys = keys.long()
        return keys >> self.bits, (keys & ((1 << self.bits) - 1)) - tie


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
    block_values: int | None = None,
    query_weights: np.ndarray | None = None,
    device: torch.device | str | None = None,
) -> NearestTokens:
    """Hamming nearest neighbours of each query token in each candidate (all exact).

    ``query_codes`` (Q, 16) uint8. Always returns the (C, Q) distances to each candidate's nearest
    token; for the pairs within ``within`` bits (-1: none, for Chamfer alone) also which token is
    nearest and, with ``mutual``, whether that token's nearest query token is this one.

    With ``query_weights`` (Q, 128) from ``asymmetric_weights`` the distances are weighted Hamming
    distances in bits, ``128 * (weight of the disagreeing bits) / ASYMMETRIC_TOTAL`` (quarter bits),
    rounded up to whole bits where reported; nearest means the smallest exact weighted distance
    (lowest index among equals), and a pair is within ``within`` bits when its exact distance is.

    ``device`` (default the CPU): where the key table and its lookups and reductions run. Every key
    is an exact integer in float32/float64 (module docstring), so a GPU finds exactly the CPU's
    neighbours, whatever order it sums in. ``block_values`` (default ``BLOCK_VALUES`` on a CPU,
    ``DEVICE_BLOCK_VALUES`` elsewhere): keys per chunk of candidates.
    """
    _check_inputs(query_codes, candidates)
    if query_weights is not None and query_weights.shape != (len(query_codes), CODE_BITS):
        raise RerankInputError(
            f"query weights of shape {query_weights.shape} do not fit {len(query_codes)} tokens of {CODE_BITS} bits"
        )
    total = CODE_BITS if query_weights is None else ASYMMETRIC_TOTAL  # products are 2 * total at distance 0
    if not -1 <= within <= CODE_BITS:
        raise RerankInputError(f"within must be in -1..{CODE_BITS} bits, got {within}")
    C, T = candidates.mask.shape
    Q = len(query_codes)
    has_tokens = candidates.mask.any(1)
    distance = np.full((C, Q), CODE_BITS, np.int16)
    empty = np.zeros(0, np.int64)
    if C == 0 or T == 0 or Q == 0:
        return NearestTokens(distance, has_tokens, empty, empty, empty, np.zeros(0, bool) if mutual else None, within)

    dev = torch.device("cpu") if device is None else torch.device(device)
    if block_values is None:
        block_values = BLOCK_VALUES if dev.type == "cpu" else DEVICE_BLOCK_VALUES
    table = _KeyTable(_query_matrix(query_codes, query_weights), T, dev)
    by_query = within >= 0 and mutual  # the tokens' nearest query tokens are needed
    with torch.inference_mode():
        best, nearest_query = _reduce_keys(table, table.indices(candidates).to(dev), C, T, Q, by_query, block_values)
        query_tie = torch.arange(Q - 1, -1, -1, dtype=torch.int64, device=dev)[None, :]
        product, token_tie = table.split(best, query_tie)  # (C, Q): -1 for candidates without tokens
        # distance = (2 * total - product) * 128 / (2 * total), rounded up; exact integers for plain codes
        distance_t = -((product - 2 * total) * CODE_BITS // (2 * total))
        distance = np.where(has_tokens[:, None], distance_t.cpu().numpy(), CODE_BITS).astype(np.int16)
        if within < 0:
            return NearestTokens(distance, has_tokens, empty, empty, empty, None, within)
        # within ``within`` bits: product >= 2 * total * (1 - within / 128), an integer (total: 128 or 512)
        keep = product >= 2 * total * (CODE_BITS - within) // CODE_BITS
        keep &= torch.from_numpy(has_tokens).to(dev)[:, None]
        cand, query = keep.nonzero(as_tuple=True)
        token = (T - 1) - token_tie[cand, query]
        mut = None
        if by_query:
            _, query_tie_of_token = table.split(nearest_query[cand, token], (T - 1) - token)
            mut = ((Q - 1) - query_tie_of_token == query).cpu().numpy()
        return NearestTokens(
            distance, has_tokens, cand.cpu().numpy(), query.cpu().numpy(), token.cpu().numpy(), mut, within
        )


def _reduce_keys(
    table: _KeyTable, indices: torch.Tensor, C: int, T: int, Q: int, by_query: bool, block_values: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, Q) the largest key over each candidate's tokens, and (C, T) over the query tokens (empty
    unless ``by_query``), chunk by chunk of candidates (``block_values`` keys at a time)."""
    dev = indices.device
    best = torch.empty((C, Q), dtype=table.dtype, device=dev)
    nearest_query = torch.empty((C, T) if by_query else (0, 0), dtype=table.dtype, device=dev)
    chunk = max(1, block_values // max(1, T * Q))
    for c0 in range(0, C, chunk):
        c1 = min(C, c0 + chunk)
        block = table.keys(indices[c0 * T : c1 * T]).view(c1 - c0, T, Q)
        torch.amax(block, dim=1, out=best[c0:c1])
        if by_query:
            torch.amax(block, dim=2, out=nearest_query[c0:c1])
    return best, nearest_query


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
        nearest_tokens(query.codes, candidates, within=config.threshold, mutual=config.mutual, query_weights=weights),
        config,
    )


def matches_from_nearest(nearest: NearestTokens, config: MatchConfig = MatchConfig()) -> Matches:
    """The matches of ``config`` among already computed nearest neighbours (which must have been
    collected within at least ``config.max_distance`` bits, with ``mutual`` when the config asks)."""
    if nearest.within < config.threshold:
        raise RerankInputError(
            f"nearest tokens were collected within {nearest.within} bits, the match config needs {config.threshold}"
        )
    if config.mutual and nearest.mutual is None:
        raise RerankInputError("the match config asks for mutual matches but nearest tokens were computed without")
    distance = nearest.pair_distance
    keep = distance <= config.threshold
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
    """Plain reference of the asymmetric distances (Q, n) float64 in bits: the weight of the bits
    where the codes disagree, times 128 / ``ASYMMETRIC_TOTAL``."""
    signs = np.unpackbits(candidate_codes, axis=1).astype(np.int64) * 2 - 1
    agreement = np.asarray(weights, np.int64) @ signs.T  # total - 2 * (weight of the disagreeing bits)
    return (ASYMMETRIC_TOTAL - agreement) / 2 * CODE_BITS / ASYMMETRIC_TOTAL


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
                if exact[q, t] > config.threshold:
                    continue
                if config.mutual and int(np.argmin(exact[:, t])) != q:
                    continue
                found.append((q, t, int(np.ceil(exact[q, t]))))
            out = np.array(found, np.int64).reshape(-1, 3)
            return out[:, 0], out[:, 1], out[:, 2]
        for q in range(len(query_codes)):
            t = int(np.argmin(dist[q]))  # np.argmin returns the first minimum
            if dist[q, t] > config.threshold:
                continue
            if config.mutual and int(np.argmin(dist[:, t])) != q:
                continue
            found.append((q, t, int(dist[q, t])))
    out = np.array(found, np.int64).reshape(-1, 3)
    return out[:, 0], out[:, 1], out[:, 2]
