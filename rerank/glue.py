"""A second verification of the top of a re-ranked shortlist with LightGlue (rerank/lightglue.py).

Spatial verification over 128-bit codes (rerank/spatial.py) scores every candidate of the shortlist
cheaply; LightGlue, a learned matcher, reads float descriptors and the keypoints' layout of both
images and finds matches under changes that defeat Hamming matching (extreme viewpoint, day and
night). It costs ~0.1-0.3 s per pair on a CPU core, so it verifies only the ``top`` candidates of
the first stage's order, and only re-orders them among themselves:

    s2 = s1 + weight * min(matches / cap, 1)   for the top candidates; s1 elsewhere

where s1 is the first stage's final score and ``matches`` the expected number of correct matches:
the sum of the probabilities of the mutual LightGlue matches above its threshold (on realbench's
hardest sources it separates positives from negatives better than the plain count or the inliers
of a spatial verification of the matches). The candidates' float descriptors are rebuilt from their
stored 128-bit codes (embed.itq.ITQ.reconstruct: no storage, no image reads; bench/rerank_glue.py
also measured re-extracted floats, which did not pay either); the query's are its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from core.errors import NeedleInputError
from core.tokens import LocalTokens
from rerank.lightglue import MATCH_THRESHOLD, load_lightglue, mutual_matches, normalize_keypoints


@dataclass(frozen=True)
class GlueConfig:
    top: int = 0  # candidates of the first stage's order verified again (0: no second stage)
    weight: float = 0.1  # added to a verified candidate's score at ``cap`` matches or more
    cap: int = 50  # expected matches at which the bonus saturates
    threshold: float = MATCH_THRESHOLD  # a match's LightGlue probability must exceed this
    side: float = 512.0  # longer side (pixels) of the frame the tokens' x/y are in: the tokens' base resolution

    def __post_init__(self) -> None:
        if self.top < 0:
            raise NeedleInputError(f"glue top must be >= 0, got {self.top}")
        if self.weight < 0 or not np.isfinite(self.weight):
            raise NeedleInputError(f"glue weight must be a finite number >= 0, got {self.weight}")
        if self.cap < 1:
            raise NeedleInputError(f"glue cap must be >= 1, got {self.cap}")
        if not 0.0 <= self.threshold < 1.0:
            raise NeedleInputError(f"glue threshold must be in [0, 1), got {self.threshold}")
        if self.side <= 0:
            raise NeedleInputError(f"glue side must be > 0 pixels, got {self.side}")


class GlueVerifier:
    """LightGlue on one device, matching one query against a batch of candidates."""

    def __init__(self, device: str | torch.device = "cpu", weights: str | None = None, batch: int = 8):
        self.device = torch.device(device)
        self.model = load_lightglue(weights, self.device)
        self.batch = batch

    @torch.inference_mode()
    def matches(
        self, query: LocalTokens, xy: np.ndarray, desc: np.ndarray, mask: np.ndarray, conf: GlueConfig
    ) -> np.ndarray:
        """Expected matches between the query and each candidate (the probabilities of the mutual
        matches above ``conf.threshold``, summed): candidates' keypoints xy (B, T, 2) in base
        pixels, unit descriptors (B, T, 128), mask (B, T) -> (B,) float."""
        if query.desc is None:
            raise NeedleInputError("the second verification needs the query's float descriptors (LocalTokens.desc)")
        counts = np.zeros(len(xy), np.float64)
        real = np.flatnonzero(np.asarray(mask).any(1))
        if len(query) == 0 or len(real) == 0:
            return counts
        q_xy = normalize_keypoints(torch.from_numpy(np.asarray(query.xy, np.float32)), conf.side).to(self.device)
        q_desc = torch.from_numpy(np.asarray(query.desc, np.float32)).to(self.device)
        for start in range(0, len(real), self.batch):
            at = real[start : start + self.batch]
            width = int(np.asarray(mask)[at].sum(1).max())
            c_xy = normalize_keypoints(torch.from_numpy(np.asarray(xy[at, :width], np.float32)), conf.side)
            c_desc = torch.from_numpy(np.asarray(desc[at, :width], np.float32))
            c_mask = torch.from_numpy(np.asarray(mask[at, :width], bool))
            b = len(at)
            scores = self.model(
                q_xy.expand(b, -1, -1),
                q_desc.expand(b, -1, -1),
                c_xy.to(self.device),
                c_desc.to(self.device),
                torch.ones(b, len(query), dtype=torch.bool, device=self.device),
                c_mask.to(self.device),
            )
            _, probability = mutual_matches(scores, conf.threshold)
            counts[at] = probability.sum(1).double().cpu().numpy()
        return counts


def glue_scores(scores: np.ndarray, top: np.ndarray, matches: np.ndarray, conf: GlueConfig) -> np.ndarray:
    """The first stage's final ``scores`` (C,) with the verified candidates' (positions ``top``, their
    expected ``matches``) raised by ``weight * min(matches / cap, 1)``."""
    out = np.asarray(scores, np.float64).copy()
    out[top] += conf.weight * np.minimum(np.asarray(matches, np.float64) / conf.cap, 1.0)
    return out
