"""Query-side multi-scale and rotation settings, checked where they are given (a config, a flag)
without importing the extractor that uses them (embed.extract)."""

from __future__ import annotations

import math
from typing import Any

from core.errors import NeedleInputError

ROTATIONS = (1, 2, 4)  # rotation counts: none, 0/180 degrees, 0/90/180/270 degrees


def check_scales_rotations(scales: Any, rotations: Any) -> tuple[tuple[float, ...], int]:
    """``(scales, rotations)`` validated: a non-empty sequence of positive scales and 1, 2 or 4
    rotations. Raises NeedleInputError naming the bad value."""
    try:
        values = tuple(float(s) for s in scales)
    except (TypeError, ValueError) as exc:
        raise NeedleInputError(f"scales must be a sequence of positive numbers, got {scales!r}") from exc
    if not values or not all(math.isfinite(s) and s > 0 for s in values):
        raise NeedleInputError(f"scales must be a non-empty sequence of positive numbers, got {scales!r}")
    if isinstance(rotations, bool) or rotations not in ROTATIONS:
        raise NeedleInputError(f"rotations must be one of {ROTATIONS}, got {rotations!r}")
    return values, int(rotations)
