"""Speed of local re-ranking with binary tokens on one CPU: matching, spatial verification (SP) and
Chamfer similarity of one query against a shortlist, on synthetic data of the real shapes.

The query has 300 tokens (100 per scale at 3 scales) or its 100 single-scale ones; the shortlist
has 1000 candidates of 100 tokens each. Random 128-bit codes almost never come within 32 bits of
each other, so matches are planted: most candidates share a few noisy tokens with the query
(chance-level evidence), some share dozens under a random similarity transform (true positives),
the rest nothing. ``--duplicates`` makes every candidate a near-duplicate of the query: every
candidate then has ~100 matches, SP's worst case.

Also times the bare ±1 bfloat16 matmul of the same size (query tokens x 100k candidate tokens,
one call, output in memory) that the brief's budget was measured against, and prints one JSON line
last with milliseconds per query (best of ``--repeats``) and the ratios to that matmul.

    .venv/bin/python bench/rerank_speed.py [--repeats 15] [--threads 2] [--duplicates]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCALES = (0.707, 1.0, 1.414)


def noisy_copy(codes: np.ndarray, rng: np.random.Generator, flip: float) -> np.ndarray:
    """``codes`` with each bit flipped with probability ``flip``."""
    bits = np.unpackbits(codes, axis=-1)
    bits ^= (rng.random(bits.shape) < flip).astype(np.uint8)
    return np.packbits(bits, axis=-1)


def make_query(rng: np.random.Generator, per_scale: int, scales: tuple[float, ...]):
    from core.tokens import LocalTokens

    n = per_scale * len(scales)
    return LocalTokens(
        rng.integers(0, 256, (n, 16), dtype=np.uint8),
        rng.uniform(0, 512, (n, 2)).astype(np.float32),
        np.repeat(np.array(scales, np.float32), per_scale),
        rng.random(n).astype(np.float32),
    )


def make_shortlist(rng: np.random.Generator, query, n_candidates: int, n_tokens: int, duplicates: bool):
    """Candidates with planted matches: 3% true positives (20-80 tokens under a similarity),
    40% with 2-8 noisy copies placed at random, the rest unrelated; all near-duplicates with
    ``duplicates``."""
    from core.tokens import TokenBatch

    C, T = n_candidates, n_tokens
    codes = rng.integers(0, 256, (C, T, 16), dtype=np.uint8)
    xy = rng.uniform(0, 512, (C, T, 2)).astype(np.float32)
    scale = rng.choice(np.array(SCALES, np.float32), (C, T))
    kind = rng.random(C)
    for c in range(C):
        if duplicates or kind[c] < 0.03:
            n = T if duplicates else int(rng.integers(20, 81))
            src = rng.choice(len(query), min(n, len(query)), replace=False)
            s = float(rng.uniform(0.6, 1.6))
            angle = float(rng.uniform(-0.2, 0.2))
            rot = s * np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
            k = len(src)
            codes[c, :k] = noisy_copy(query.codes[src], rng, 0.1)
            xy[c, :k] = query.xy[src] @ rot.T + rng.uniform(-50, 50, 2) + rng.normal(0, 3, (k, 2))
            scale[c, :k] = query.scale[src] / s
        elif kind[c] < 0.43:
            k = int(rng.integers(2, 9))
            src = rng.choice(len(query), k, replace=False)
            codes[c, :k] = noisy_copy(query.codes[src], rng, 0.15)
    return TokenBatch(codes, xy, scale, np.ones((C, T), np.float32), np.ones((C, T), bool))


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: allocations, the sign table, oneDNN kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def bench_query(query, shortlist, repeats: int) -> dict:
    import torch

    from rerank.chamfer import chamfer_from_nearest, chamfer_similarity
    from rerank.matching import MatchConfig, match_tokens, matches_from_nearest, nearest_tokens
    from rerank.spatial import verify

    config = MatchConfig()
    matches = match_tokens(query, shortlist, config)
    verification = verify(query, shortlist, matches)
    signs_q = torch.from_numpy(np.unpackbits(query.codes, axis=-1).astype(np.float32) * 2 - 1).to(torch.bfloat16)
    signs_d = torch.from_numpy(np.unpackbits(shortlist.codes.reshape(-1, 16), axis=-1).astype(np.float32) * 2 - 1).to(
        torch.bfloat16
    )

    def shared() -> None:  # one Hamming pass for matching and Chamfer, then SP
        nearest = nearest_tokens(query.codes, shortlist, within=config.threshold, mutual=config.mutual)
        chamfer_from_nearest(nearest)
        verify(query, shortlist, matches_from_nearest(nearest, config))

    result = {
        "query_tokens": len(query),
        "matches_total": int(matches.counts().sum()),
        "matches_max_per_candidate": int(matches.mask.shape[1]),
        "verified_candidates": int(verification.verified.sum()),
        "matching_ms": best_ms(lambda: match_tokens(query, shortlist, config), repeats),
        "sp_ms": best_ms(lambda: verify(query, shortlist, matches), repeats),
        "chamfer_ms": best_ms(lambda: chamfer_similarity(query, shortlist), repeats),
        "matching_sp_chamfer_shared_ms": best_ms(shared, repeats),
        "bare_bf16_matmul_ms": best_ms(lambda: signs_q @ signs_d.T, repeats),
    }
    result["matching_plus_sp_ms"] = result["matching_ms"] + result["sp_ms"]
    for key in ("matching_ms", "sp_ms", "chamfer_ms", "matching_plus_sp_ms"):
        result[key.replace("_ms", "_vs_matmul")] = round(result[key] / result["bare_bf16_matmul_ms"], 2)
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--candidates", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=100, help="tokens per candidate")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--duplicates", action="store_true", help="every candidate a near-duplicate (SP worst case)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    query = make_query(rng, 100, SCALES)
    shortlist = make_shortlist(rng, query, args.candidates, args.tokens, args.duplicates)
    single_scale = query.scale == 1.0
    from core.tokens import LocalTokens

    query_100 = LocalTokens(
        query.codes[single_scale], query.xy[single_scale], query.scale[single_scale], query.weight[single_scale]
    )
    runs = {}
    for name, q in (("query_300", query), ("query_100", query_100)):
        runs[name] = bench_query(q, shortlist, args.repeats)
        print(name, runs[name], flush=True)
    print(
        json.dumps(
            {
                "bench": "rerank_speed",
                "candidates": args.candidates,
                "tokens_per_candidate": args.tokens,
                "duplicates": args.duplicates,
                "threads": args.threads,
                "torch": torch.__version__,
                "machine": platform.processor() or platform.machine(),
                **runs,
            }
        )
    )


if __name__ == "__main__":
    main()
