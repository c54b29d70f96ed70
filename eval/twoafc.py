"""Two-alternative forced choice (2AFC) accuracy, and the decisions of ensembles of similarity models.

A triplet (R, A, B) has a label in [0, 1]: the probability that B is the closer one (0: A is closer,
1: B is closer; NIGHTS' vote fractions give values in between). A decision is +1 (A is closer),
-1 (B is closer) or 0 (a tie). Its credit is DreamSim's 2AFC score::

    credit = [d > 0] * (1 - label) + [d < 0] * label + [d = 0] * 0.5

so a tie earns half, whatever the label, and accuracy is the mean credit. A similarity model decides
by the sign of its margin ``s(R, A) - s(R, B)``. Ensembles decide from the (n, K) margins of K models:
majority vote is the sign of the sum of the K votes; the weighted ensemble is the sign of
``sum_k w_k * m_k`` (per-triplet weights).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from core.errors import NeedleInputError


class TwoAFCError(NeedleInputError):
    """2AFC inputs that do not fit together (lengths, shapes) or labels outside [0, 1]."""


def check_labels(labels: Any) -> np.ndarray:
    """(n,) float64 labels, each in [0, 1] (the probability that B is the closer candidate)."""
    out = np.asarray(labels, dtype=np.float64)
    if out.ndim != 1:
        raise TwoAFCError(f"labels must be a 1-d array, got shape {out.shape}")
    bad = np.flatnonzero(~np.isfinite(out) | (out < 0) | (out > 1))
    if len(bad):
        raise TwoAFCError(
            f"labels must lie in [0, 1]; triplet {int(bad[0])} has {out[bad[0]]!r} ({len(bad)} bad in all)"
        )
    return out


def decisions_from_scores(score_a: Any, score_b: Any) -> np.ndarray:
    """(n,) int8 decisions from similarities: +1 where s(R, A) > s(R, B), -1 where smaller, 0 on ties."""
    a = np.asarray(score_a, dtype=np.float64)
    b = np.asarray(score_b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise TwoAFCError(f"scores of A and B must be two 1-d arrays of one length, got {a.shape} and {b.shape}")
    return np.sign(a - b).astype(np.int8)


def credit(decisions: Any, labels: Any) -> np.ndarray:
    """(n,) float64 2AFC credit of each decision (ties earn 0.5)."""
    d = np.asarray(decisions)
    y = check_labels(labels)
    if d.shape != y.shape:
        raise TwoAFCError(f"{d.shape[0] if d.ndim else d.shape} decisions for {len(y)} labels")
    return (d > 0) * (1.0 - y) + (d < 0) * y + (d == 0) * 0.5


def accuracy(decisions: Any, labels: Any) -> float:
    """Mean 2AFC credit in [0, 1]; NaN for no triplets."""
    c = credit(decisions, labels)
    return float(c.mean()) if len(c) else float("nan")


def summary(decisions: Any, labels: Any) -> dict[str, Any]:
    """Accuracy (percent), its binomial standard error (percent), and the counts behind it."""
    d = np.asarray(decisions)
    c = credit(d, labels)
    n = len(c)
    acc = float(c.mean()) if n else float("nan")
    stderr = math.sqrt(acc * (1 - acc) / n) if n else float("nan")
    return {
        "accuracy_pct": round(100 * acc, 2),
        "stderr_pct": round(100 * stderr, 2),
        "n": n,
        "credit": round(float(c.sum()), 2),
        "ties": int((d == 0).sum()),
    }


def _check_margins(margins: Any) -> np.ndarray:
    m = np.asarray(margins, dtype=np.float64)
    if m.ndim != 2:
        raise TwoAFCError(f"margins must be (n triplets, K models), got shape {m.shape}")
    return m


def majority_vote(margins: Any) -> np.ndarray:
    """(n,) int8: the sign of the sum of the K models' votes (each the sign of its margin)."""
    return np.sign(np.sign(_check_margins(margins)).sum(axis=1)).astype(np.int8)


def weighted_decision(margins: Any, weights: Any) -> np.ndarray:
    """(n,) int8: the sign of ``sum_k weights[i, k] * margins[i, k]`` for each triplet i."""
    m = _check_margins(margins)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != m.shape:
        raise TwoAFCError(f"weights of shape {w.shape} do not fit margins of shape {m.shape}")
    return np.sign((w * m).sum(axis=1)).astype(np.int8)


def paired(decisions_1: Any, decisions_2: Any, labels: Any) -> dict[str, int]:
    """How often method 1 earned more credit than method 2 on the same triplet, and less."""
    diff = credit(decisions_1, labels) - credit(decisions_2, labels)
    return {"better": int((diff > 0).sum()), "worse": int((diff < 0).sum()), "same": int((diff == 0).sum())}
