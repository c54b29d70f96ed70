"""SP's chance floor of inliers (rerank/ensemble.py), held to a plain loop."""

from __future__ import annotations

import numpy as np
import pytest

from core.errors import NeedleInputError
from rerank.ensemble import EnsembleConfig, combine, local_to_unit
from tests.support.rerank_tokens import random_shortlist


def plain_floor(counts: list[float], percentile: float) -> float:
    """The percentile written out: linear interpolation between the sorted counts."""
    ordered = sorted(counts)
    position = percentile / 100 * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


@pytest.mark.parametrize("percentile", [0.0, 50.0, 99.0, 99.5])
def test_sp_chance_floor_equals_a_plain_loop(percentile):
    """SP's local score: inliers beyond the shortlist's chance floor (a percentile of the counts of
    the candidates with tokens), capped, written out candidate by candidate."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        raw, has, s_global = random_shortlist(rng, 300)
        c = len(raw)
        conf = EnsembleConfig(lam=0.4, inlier_cap=30, inlier_floor=percentile, chamfer_weight=0.0)
        counts = [float(raw[i]) for i in range(c) if has[i]]
        floor = plain_floor(counts, percentile) if percentile > 0 and counts else 0.0
        want = []
        for i in range(c):
            local = min(max(float(raw[i]) - floor, 0.0), 30) / 30
            want.append(0.4 * s_global[i] + 0.6 * local if has[i] else s_global[i])
        np.testing.assert_allclose(combine("sp", s_global, raw, has, conf), want, rtol=0, atol=1e-12)
    # a shortlist of non-matches at 5-7 chance inliers and one true match: only its margin counts
    raw = np.array([40.0] + [5.0, 6.0, 7.0] * 333)
    unit = local_to_unit("sp", raw, EnsembleConfig(inlier_floor=99.5), np.ones(len(raw), bool))
    assert unit[0] == pytest.approx((40 - 7) / 50) and (unit[1:] == 0).all()
    with pytest.raises(NeedleInputError, match="inlier_floor"):
        EnsembleConfig(inlier_floor=100.0)
