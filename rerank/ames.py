"""AMES re-ranking: a small transformer that scores two images from their local descriptors.

Suma et al., "AMES: Asymmetric and Memory-Efficient Similarity Estimation for Instance-level
Retrieval", ECCV 2024 (official code: github.com/pavelsuma/ames). This is our own implementation of
the same computation, with the same parameter names and shapes, so that the published checkpoints
load unchanged:

* both token sets are L2-normalised and mapped to the model dimension by ``remap_local``: for the
  binarised model a sign projection (``remap_local.0.W``, d x 128) then Linear + LayerNorm; for the
  full-precision one Linear + LayerNorm;
* the sequence ``[mtc_token, query tokens, database tokens]`` goes through post-norm layers, each a
  self-attention restricted to tokens of the same image, a cross-attention restricted to tokens of
  the other image (the ``mtc`` token sees and is seen by everything in both), and a ReLU MLP;
* the logit is a linear classifier on the final ``mtc`` token.

needle stores local tokens binarised (128-bit ITQ codes, see ``core.tokens``), so the binarised
model also takes already-binarised ±1 inputs (``forward_codes``), which skip the sign projection.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from core.atomic import write_atomic
from core.checkpoint import load_torch_file
from core.errors import NeedleInputError
from core.tokens import CODE_BITS, LocalTokens, TokenBatch

log = logging.getLogger(__name__)


class AMESCheckpointError(NeedleInputError):
    """An AMES checkpoint that is missing, unreadable, or whose parameters do not fit the model."""


class AMESInputError(NeedleInputError):
    """Inputs that the AMES model cannot score (wrong shapes, float descriptors missing, ...)."""


@dataclass(frozen=True)
class AMESConfig:
    """Architecture of an AMES model; the defaults are the published DINOv2 models'."""

    local_dim: int = 768  # dimension of the local descriptors fed to ``forward`` (DINOv2: 768)
    model_dim: int = 128  # transformer width; also the number of bits of the binarised model
    heads: int = 2  # attention heads per (self / cross) attention block
    layers: int = 5  # decoder layers
    ff_dim: int = 1024  # hidden width of each layer's MLP
    binarized: bool = True  # sign-projected inputs (remap_local.0.W) rather than a float Linear


class SignProjection(nn.Module):
    """The official binarisation layer: x L2-normalised, projected by W (d x bits), then its sign.

    While training, the sign is replaced by the smooth erf(x / sqrt(2 sigma)) so that W gets a
    gradient; with sigma = 1e-6 it is a sign for any projection further than ~0.005 from zero.
    """

    def __init__(self, dim: int, bits: int, sigma: float = 1e-6):
        super().__init__()
        self.sigma = sigma
        # Official default when no ITQ file is given: a Gaussian projection (random-hyperplane LSH).
        self.W = nn.Parameter(torch.randn(dim, bits))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.normalize(x, p=2, dim=-1) @ self.W
        if self.training and self.W.requires_grad:
            return torch.erf(x / math.sqrt(2 * self.sigma))
        return torch.sign(x)

    def extra_repr(self) -> str:
        return f"dims={self.W.shape[0]}, bits={self.W.shape[1]}"


class DecoderLayer(nn.Module):
    """One post-norm AMES layer: masked self-attention, masked cross-attention, ReLU MLP."""

    def __init__(self, dim: int, heads: int, ff_dim: int):
        super().__init__()
        # Both blocks attend over the same joint sequence; only their masks differ.
        self.self_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.linear1 = nn.Linear(dim, ff_dim)
        self.linear2 = nn.Linear(ff_dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)

    def forward(
        self, x: torch.Tensor, sa_mask: torch.Tensor, ca_mask: torch.Tensor, padding: torch.Tensor
    ) -> torch.Tensor:
        # need_weights=False: the official code discards the weights; skipping them lets torch use
        # its fused attention kernels, same result up to float rounding.
        x = self.norm1(x + self.self_attn(x, x, x, attn_mask=sa_mask, key_padding_mask=padding, need_weights=False)[0])
        x = self.norm2(x + self.cross_attn(x, x, x, attn_mask=ca_mask, key_padding_mask=padding, need_weights=False)[0])
        return self.norm3(x + self.linear2(F.relu(self.linear1(x))))

    def forward_fused(self, x: torch.Tensor, sa_keep: torch.Tensor, ca_keep: torch.Tensor) -> torch.Tensor:
        """``forward`` with each attention one ``F.scaled_dot_product_attention`` whose boolean mask
        (B, 1, L, L), True = may attend, holds mask and padding: no float mask per head built in every
        call (H100, fp16, 1,000 candidates: 66 -> 42 ms). CUDA inference only (``AMES._score``)."""
        x = self.norm1(x + _fused_attention(self.self_attn, x, sa_keep))
        x = self.norm2(x + _fused_attention(self.cross_attn, x, ca_keep))
        return self.norm3(x + self.linear2(F.relu(self.linear1(x))))


def _fused_attention(attn: nn.MultiheadAttention, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """What ``attn(x, x, x, ...)`` computes (in-projection, heads, out-projection), by SDPA with ``keep``."""
    B, L, D = x.shape
    h = attn.num_heads
    qkv = F.linear(x, attn.in_proj_weight, attn.in_proj_bias).view(B, L, 3, h, D // h).permute(2, 0, 3, 1, 4)
    out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=keep)
    return attn.out_proj(out.transpose(1, 2).reshape(B, L, D))


class Decoder(nn.Module):
    """The layer stack; post-norm, so no final norm (its absence keeps the checkpoint's key set)."""

    def __init__(self, conf: AMESConfig):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(conf.model_dim, conf.heads, conf.ff_dim) for _ in range(conf.layers))

    def forward(
        self, x: torch.Tensor, sa_mask: torch.Tensor, ca_mask: torch.Tensor, padding: torch.Tensor
    ) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, sa_mask, ca_mask, padding)
        return x


def _init_weights(m: nn.Module) -> None:
    # The official initialisation, so that training from scratch starts where theirs does.
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


def attention_masks(q: int, t: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean (1+q+t)^2 masks, True = may not attend, for the sequence [mtc, q src, t tgt].

    Self-attention stays within each image, cross-attention goes only to the other image; the mtc
    token (index 0) is never masked, neither as a query nor as a key.
    """
    n = 1 + q + t
    src = torch.zeros(n, dtype=torch.bool, device=device)
    src[1 : 1 + q] = True
    tgt = torch.zeros(n, dtype=torch.bool, device=device)
    tgt[1 + q :] = True
    sa = (src[:, None] & tgt[None, :]) | (tgt[:, None] & src[None, :])
    ca = (src[:, None] & src[None, :]) | (tgt[:, None] & tgt[None, :])
    return sa, ca


class AMES(nn.Module):
    """The AMES similarity model; ``forward`` computes what the official ``AMES.forward`` does."""

    def __init__(self, conf: AMESConfig = AMESConfig()):
        super().__init__()
        if conf.binarized and conf.model_dim != CODE_BITS:
            # The binarised model's width is its number of bits, and needle's codes have 128.
            log.warning("binarised AMES with model_dim=%d cannot take needle's %d-bit codes", conf.model_dim, CODE_BITS)
        self.conf = conf
        self.mtc_token = nn.Parameter(torch.empty(conf.model_dim))
        if conf.binarized:
            self.remap_local = nn.Sequential(
                SignProjection(conf.local_dim, conf.model_dim),
                nn.Linear(conf.model_dim, conf.model_dim),
                nn.LayerNorm(conf.model_dim),
            )
        else:
            self.remap_local = nn.Sequential(nn.Linear(conf.local_dim, conf.model_dim), nn.LayerNorm(conf.model_dim))
        self.decoder = Decoder(conf)
        self.classifier = nn.Linear(conf.model_dim, 1)
        nn.init.trunc_normal_(self.mtc_token, std=0.02)
        self.apply(_init_weights)

    def set_projection(self, proj: np.ndarray | torch.Tensor) -> None:
        """Use an ITQ projection (d x bits, any d) as the sign projection ``remap_local.0.W``.

        With W = the projection the stored codes were made with, ``forward`` on float descriptors
        and ``forward_codes`` on their codes agree (for an ITQ without mean subtraction).
        """
        if not self.conf.binarized:
            raise AMESInputError("set_projection needs a binarised AMES model; this one is full precision")
        w = (
            proj.detach().float()
            if isinstance(proj, torch.Tensor)
            else torch.from_numpy(np.asarray(proj, dtype=np.float32))
        )
        if w.ndim != 2 or w.shape[1] != self.conf.model_dim:
            raise AMESInputError(f"ITQ projection has shape {tuple(w.shape)}, expected (d, {self.conf.model_dim})")
        layer = self.remap_local[0]
        requires_grad = layer.W.requires_grad
        layer.W = nn.Parameter(w.to(layer.W.device).clone(), requires_grad=requires_grad)
        self.conf = replace(self.conf, local_dim=int(w.shape[0]))

    def forward(
        self, src_local: torch.Tensor, src_mask: torch.Tensor, tgt_local: torch.Tensor, tgt_mask: torch.Tensor
    ) -> torch.Tensor:
        """Logits (B,) of "same object" for float descriptors src (B,Q,D), tgt (B,T,D).

        Masks are (B,Q) / (B,T) bool, True = padding (the official convention).
        """
        self._check(src_local, src_mask, tgt_local, tgt_mask, self.conf.local_dim, "descriptors")
        src = self.remap_local(F.normalize(src_local, p=2, dim=-1))
        tgt = self.remap_local(F.normalize(tgt_local, p=2, dim=-1))
        if not self.training and not self.conf.binarized:
            # The official evaluation keeps database tokens in float16; the round trip makes our
            # scores equal theirs.
            tgt = tgt.half().float()
        return self._score(src, src_mask, tgt, tgt_mask)

    def forward_codes(
        self, src_signs: torch.Tensor, src_mask: torch.Tensor, tgt_signs: torch.Tensor, tgt_mask: torch.Tensor
    ) -> torch.Tensor:
        """Logits (B,) for already-binarised ±1 tokens (B,Q,bits), (B,T,bits), e.g. ``unpack_signs``.

        Equals ``forward`` on the float descriptors when the codes are sign(x @ remap_local.0.W):
        the sign projection is skipped and the codes enter its successor directly.
        """
        if not self.conf.binarized:
            raise AMESInputError("forward_codes needs a binarised AMES model; this one is full precision")
        self._check(src_signs, src_mask, tgt_signs, tgt_mask, self.conf.model_dim, "codes")
        post = self.remap_local[1:]
        return self._score(post(src_signs), src_mask, post(tgt_signs), tgt_mask)

    def _score(
        self, src: torch.Tensor, src_mask: torch.Tensor, tgt: torch.Tensor, tgt_mask: torch.Tensor
    ) -> torch.Tensor:
        B, Q, _ = src.shape
        T = tgt.shape[1]
        x = torch.cat([self.mtc_token.expand(B, 1, -1), src, tgt], dim=1)
        padding = torch.cat([src_mask.new_zeros(B, 1), src_mask, tgt_mask], dim=1).bool()
        sa_mask, ca_mask = attention_masks(Q, T, x.device)
        if x.device.type == "cuda" and not self.training:
            sa_keep = ~(sa_mask[None, None] | padding[:, None, None, :])
            ca_keep = ~(ca_mask[None, None] | padding[:, None, None, :])
            for layer in self.decoder.layers:
                x = layer.forward_fused(x, sa_keep, ca_keep)
        else:
            x = self.decoder(x, sa_mask, ca_mask, padding)
        return self.classifier(x[:, 0]).view(-1)

    @staticmethod
    def _check(
        src: torch.Tensor, src_mask: torch.Tensor, tgt: torch.Tensor, tgt_mask: torch.Tensor, dim: int, what: str
    ) -> None:
        if src.ndim != 3 or tgt.ndim != 3 or src.shape[-1] != dim or tgt.shape[-1] != dim or len(src) != len(tgt):
            raise AMESInputError(
                f"AMES {what} must be (B,Q,{dim}) and (B,T,{dim}), got {tuple(src.shape)} and {tuple(tgt.shape)}"
            )
        if tuple(src_mask.shape) != tuple(src.shape[:2]) or tuple(tgt_mask.shape) != tuple(tgt.shape[:2]):
            raise AMESInputError(
                f"AMES padding masks {tuple(src_mask.shape)}, {tuple(tgt_mask.shape)} do not match tokens "
                f"{tuple(src.shape[:2])}, {tuple(tgt.shape[:2])}"
            )


# --- checkpoints ----------------------------------------------------------------------------------

_WRAPPERS = ("state", "state_dict", "model")


def _unwrap(obj: Any, path: Path) -> dict[str, torch.Tensor]:
    """The bare state dict inside a checkpoint: official files hold {"state": ..., ...}."""
    if isinstance(obj, Mapping):
        for key in _WRAPPERS:
            if key in obj and isinstance(obj[key], Mapping):
                return _unwrap(obj[key], path)
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            # Multi-GPU training saves names as "module.<name>".
            return {k.removeprefix("module."): v for k, v in obj.items()}
    raise AMESCheckpointError(
        f"{path}: not an AMES checkpoint (no state dict at the top or under {'/'.join(_WRAPPERS)})"
    )


def _infer_config(sd: Mapping[str, torch.Tensor], path: Path, heads: int) -> AMESConfig:
    """The architecture implied by the state dict's shapes (all but the number of heads)."""

    def get(key: str) -> torch.Tensor:
        if key not in sd:
            raise AMESCheckpointError(f"{path}: missing key {key!r}")
        return sd[key]

    binarized = "remap_local.0.W" in sd
    local_dim = int(get("remap_local.0.W").shape[0]) if binarized else int(get("remap_local.0.weight").shape[-1])
    model_dim = int(get("mtc_token").shape[0])
    layer_ids = {int(m.group(1)) for k in sd if (m := re.match(r"decoder\.layers\.(\d+)\.", k))}
    if not layer_ids:
        raise AMESCheckpointError(f"{path}: no decoder.layers.* keys")
    ff_dim = int(get("decoder.layers.0.linear1.weight").shape[0])
    return AMESConfig(
        local_dim=local_dim,
        model_dim=model_dim,
        heads=heads,
        layers=max(layer_ids) + 1,
        ff_dim=ff_dim,
        binarized=binarized,
    )


def load_ames(path: str | Path, conf: AMESConfig | None = None, map_location: str | torch.device = "cpu") -> AMES:
    """An AMES model in eval mode from an official or needle checkpoint.

    The architecture is inferred from the state dict (binarised or not, local_dim, layers, ff_dim);
    the number of heads, which shapes do not reveal, comes from ``conf``, else from the needle
    checkpoint's "config", else the published 2. Any missing, unexpected or mis-shaped parameter is
    an ``AMESCheckpointError`` naming the file and the key.
    """
    path = Path(path)
    obj = load_torch_file(path, AMESCheckpointError, "AMES checkpoint", map_location)
    sd = _unwrap(obj, path)
    if conf is None:
        saved = obj.get("config") if isinstance(obj, Mapping) else None
        heads = int(saved["heads"]) if isinstance(saved, Mapping) and "heads" in saved else AMESConfig.heads
        conf = _infer_config(sd, path, heads)
    model = AMES(conf)
    expected = model.state_dict()
    for key, value in expected.items():
        if key not in sd:
            raise AMESCheckpointError(f"{path}: missing key {key!r} (expected shape {list(value.shape)})")
        if tuple(sd[key].shape) != tuple(value.shape):
            raise AMESCheckpointError(
                f"{path}: key {key!r} has shape {list(sd[key].shape)}, expected {list(value.shape)}"
            )
    unexpected = sorted(set(sd) - set(expected))
    if unexpected:
        raise AMESCheckpointError(f"{path}: unexpected keys {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    model.load_state_dict(sd, strict=True)
    log.info("loaded AMES from %s: %s", path, conf)
    return model.to(map_location).eval()


def save_ames(model: AMES, path: str | Path, extra: Mapping[str, Any] | None = None) -> Path:
    """Write {"state": state_dict, "config": ...} atomically (.tmp then rename), loadable by load_ames."""
    payload: dict[str, Any] = {
        "state": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "config": asdict(model.conf),
    }
    if extra:
        payload.update(extra)
    return write_atomic(Path(path), lambda tmp: torch.save(payload, tmp))


# --- scoring --------------------------------------------------------------------------------------


def pad_descriptors(
    images: Sequence[LocalTokens], dim: int, length: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Float descriptors (B, T, dim) of several images, zero-padded to ``length`` tokens (default:
    the longest), and their padding mask (B, T), True = padding (the official convention), for
    ``AMES.forward``."""
    T = max((len(t) for t in images), default=0) if length is None else length
    out = np.zeros((len(images), T, dim), np.float32)
    pad = np.ones((len(images), T), bool)
    for b, t in enumerate(images):
        if len(t) and (t.desc is None or t.desc.shape[1] != dim):
            got = None if t.desc is None else t.desc.shape
            raise AMESInputError(f"full-precision AMES needs float descriptors of dim {dim}; image {b} has {got}")
        out[b, : len(t)] = t.desc if len(t) else 0
        pad[b, : len(t)] = False
    return out, pad


# Candidates per forward pass: the CPU's 64 as ever (its logits are the reference); on CUDA larger
# batches keep the GPU busy (H100, fp16, 1,000 x 100 tokens, 300 query tokens: 250 45 ms, 500 42, 1000 41).
CPU_BATCH = 64
CUDA_BATCH = 500
PRECISIONS = ("auto", "fp32", "fp16", "bf16")  # score_shortlist's ``precision``; auto: fp32 on a CPU, fp16 on CUDA


def signs_of_codes(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes (..., 16) uint8 -> (..., 128) float32 ±1 on their device, as ``core.tokens.unpack_signs``
    (most significant bit first): only the packed bytes (1/32 of the signs) cross to a GPU."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=codes.device)
    bits = (codes.unsqueeze(-1) >> shifts) & 1  # (..., 16, 8)
    return bits.reshape(*codes.shape[:-1], CODE_BITS).float() * 2.0 - 1.0


def _precision(device: torch.device, precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` on ``device`` (None: float32)."""
    if precision not in PRECISIONS:
        raise AMESInputError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        precision = "fp16" if device.type == "cuda" else "fp32"
    if precision != "fp32" and device.type != "cuda":
        raise AMESInputError(f"precision {precision} is for CUDA; the model is on {device}")
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)


def score_shortlist(
    model: AMES,
    query: LocalTokens,
    candidates: TokenBatch | Sequence[LocalTokens],
    batch_size: int | None = None,
    precision: str = "auto",
) -> np.ndarray:
    """AMES logits (C,) of the query (as src) against each candidate (as tgt), as in the official
    evaluation; batched with the query repeated, every batch ``batch_size`` candidates (default
    ``CPU_BATCH`` / ``CUDA_BATCH`` by the model's device) padded to the candidates' width
    (``candidates.mask.shape[1]``: gather them to a fixed width, as query.retrieve does, for logits
    that depend on nothing else).

    The model's device is where it runs: a binarised model's packed codes and masks go there once,
    are unpacked to signs there batch by batch, and the logits come back in one copy at the end (no
    host synchronisation per batch). ``precision``: "auto" is float32 on a CPU (unchanged) and
    float16 autocast on CUDA (H100, 1,000 candidates: logits within 1.2e-3 of the CPU's; the tests
    allow 1e-2); "fp32" (within 1e-6, 3x slower), "bf16" (within 1e-2, a noisier order), "fp16".

    A binarised model scores the 128-bit codes (``forward_codes``); a full-precision one needs the
    float descriptors (``desc``), so its candidates must be a sequence of ``LocalTokens``.
    """
    device = next(model.parameters()).device
    batch_size = batch_size if batch_size is not None else (CUDA_BATCH if device.type == "cuda" else CPU_BATCH)
    if batch_size < 1:
        raise AMESInputError(f"batch_size must be >= 1, got {batch_size}")
    autocast = _precision(device, precision)
    if isinstance(candidates, TokenBatch):
        batch = candidates
        images: Sequence[LocalTokens] | None = None
    else:
        images = list(candidates)
        batch = TokenBatch.stack(images)
    if len(batch) == 0:
        return np.zeros(0, np.float32)
    if not model.conf.binarized and images is None:
        raise AMESInputError("full-precision AMES needs float descriptors: pass candidates as LocalTokens with desc")
    was_training = model.training
    model.eval()  # training mode would binarise with erf and skip the float16 round trip
    try:
        amp = torch.autocast(device.type, autocast) if autocast is not None else contextlib.nullcontext()
        with torch.inference_mode(), amp:
            logits = _batched_logits(model, query, batch, images, batch_size, device)
        return logits.float().cpu().numpy()
    finally:
        model.train(was_training)


def _batched_logits(
    model: AMES,
    query: LocalTokens,
    batch: TokenBatch,
    images: Sequence[LocalTokens] | None,
    batch_size: int,
    device: torch.device,
) -> torch.Tensor:
    """(C,) logits on ``device``, batch by batch (see ``score_shortlist``)."""
    C = len(batch)
    if model.conf.binarized:
        q = signs_of_codes(torch.from_numpy(np.require(query.codes, requirements="W")).to(device))
        codes = torch.from_numpy(np.require(batch.codes, requirements="W")).to(device)  # one upload; W: copy read-only
    else:
        qd, _ = pad_descriptors([query], model.conf.local_dim)
        q = torch.from_numpy(qd[0]).to(device)
    padding = torch.from_numpy(~batch.mask).to(device)
    q_pad = torch.zeros(1, len(query), dtype=torch.bool, device=device)
    qs, q_pads = q.expand(batch_size, -1, -1), q_pad.expand(batch_size, -1)
    out = torch.empty(C, dtype=torch.float32, device=device)
    slots = torch.arange(batch_size, device=device)
    for start in range(0, C, batch_size):
        stop = min(start + batch_size, C)
        # Every batch has one shape, (batch_size, the candidates' width): a logit then does not
        # depend on the candidates scored beside it (a shortlist split over shards scores as one).
        # The last batch is filled with copies of its first candidate.
        rows = torch.where(slots < stop - start, slots + start, start)
        if model.conf.binarized:
            logits = model.forward_codes(qs, q_pads, signs_of_codes(codes[rows]), padding[rows])
        else:
            picked = [images[r] for r in rows.tolist()]
            td, _ = pad_descriptors(picked, model.conf.local_dim, batch.mask.shape[1])
            logits = model.forward(qs, q_pads, torch.from_numpy(td).to(device), padding[rows])
        out[start:stop] = logits[: stop - start].float()
    return out


def ensemble(global_scores: np.ndarray, logits: np.ndarray, lamb: float, temp: float) -> np.ndarray:
    """The official global+local score: lamb * s_global + (1 - lamb) * sigmoid(temp * logit)."""
    g = np.asarray(global_scores, dtype=np.float64)
    z = np.asarray(logits, dtype=np.float64)
    if g.shape != z.shape:
        raise AMESInputError(f"global scores {g.shape} and AMES logits {z.shape} differ in shape")
    return lamb * g + (1.0 - lamb) / (1.0 + np.exp(-temp * z))
