"""The second verification (rerank/glue.py) and the descriptors it reads where only codes are
stored (embed.itq.ITQ.reconstruct)."""

from __future__ import annotations

import numpy as np
import pytest

from core.errors import NeedleInputError
from core.tokens import LocalTokens
from embed.itq import train_itq
from rerank.glue import GlueConfig, GlueVerifier, glue_scores


def _descriptors(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 128)) * np.linspace(2.0, 0.2, 128) + 0.3
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def itq():
    return train_itq(_descriptors(4000, seed=0))


def test_reconstructed_descriptors_have_the_codes_and_point_near_the_originals(itq):
    x = _descriptors(1000, seed=1)
    codes = itq.binarize(x)
    rebuilt = itq.reconstruct(codes)
    assert np.array_equal(itq.binarize(rebuilt), codes)
    np.testing.assert_allclose(np.linalg.norm(rebuilt, axis=1), 1.0, rtol=1e-5)
    own = (rebuilt * x).sum(1)
    other = (rebuilt * np.roll(x, 1, axis=0)).sum(1)
    assert own.mean() > 0.75 and own.min() > 0.5  # one bit per projection: ~sqrt(2/pi) of the original
    assert other.mean() < 0.25
    with pytest.raises(NeedleInputError, match="uint8"):
        itq.reconstruct(codes.astype(np.int32))


def test_glue_raises_only_the_verified_top_and_keeps_it_above_the_rest():
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5])
    out = glue_scores(scores, np.array([0, 1, 2]), np.array([0, 100, 10]), GlueConfig(top=3, weight=0.2, cap=50))
    np.testing.assert_allclose(out, [0.9, 1.0, 0.74, 0.6, 0.5])
    assert np.argsort(-out).tolist() == [1, 0, 2, 3, 4]


@pytest.mark.parametrize(
    "field, value", [("top", -1), ("weight", -0.1), ("weight", float("nan")), ("cap", 0), ("threshold", 1.0)]
)
def test_bad_glue_settings_are_typed_errors_naming_the_field(field, value):
    with pytest.raises(NeedleInputError, match=field):
        GlueConfig(**{field: value})


def test_a_candidate_seen_from_another_view_matches_more_than_unrelated_ones(itq):
    """The query's keypoints moved by a similarity, descriptors rebuilt from codes, against two
    unrelated candidates: the match counts come from LightGlue on the published weights."""
    rng = np.random.default_rng(3)
    desc = _descriptors(150, seed=3)
    xy = rng.uniform(0, 512, size=(150, 2)).astype(np.float32)
    query = LocalTokens(itq.binarize(desc), xy, np.ones(150, np.float32), np.ones(150, np.float32), desc)
    angle = 0.3
    rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]], np.float32)
    keep = rng.permutation(150)[:100]
    same_xy = (xy[keep] - 256) @ rotation.T * 0.8 + 256
    same = itq.reconstruct(itq.binarize(desc[keep]))
    others = [itq.reconstruct(itq.binarize(_descriptors(100, seed=s))) for s in (4, 5)]
    c_xy = np.stack([same_xy, *(rng.uniform(0, 512, size=(100, 2)) for _ in others)]).astype(np.float32)
    c_desc = np.stack([same, *others])
    mask = np.ones((3, 100), bool)
    mask[2, 60:] = False  # a shorter candidate, padded
    counts = GlueVerifier(batch=2).matches(query, c_xy, c_desc, mask, GlueConfig(top=3))
    assert counts[0] >= 50 and counts[1] < counts[0] / 3 and counts[2] < counts[0] / 3
    empty = GlueVerifier().matches(query, c_xy, c_desc, np.zeros((3, 100), bool), GlueConfig(top=3))
    assert empty.tolist() == [0.0, 0.0, 0.0]
