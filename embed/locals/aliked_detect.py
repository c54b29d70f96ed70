"""ALIKED's keypoint detection (DKD) and feature reading for a batch of images that share one
padded shape (embed/locals/aliked.py: :meth:`AlikedTokens.batch`).

Each image lies in its own region of the padded batch (the replicate padding of the single-image
path, split evenly). Everything here reads only inside an image's region and treats the rest as
the single-image path treats what lies beyond its cropped map: max-pooling sees -inf there (what
``max_pool2d`` pads with), window and bilinear reads see zeros (what ``unfold`` and the zero
padding of bilinear sampling give), and top-k never picks it; ties in top-k fall to the lower
row-major index in both paths (:func:`ranking_keys`). So each image's keypoints are those of the
single-image path, while a batch costs the same few kernel launches as one image and no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_INDEX_BITS = 32  # ranking keys: a score's float bits above, the flat pixel index below


@dataclass(frozen=True)
class Regions:
    """Where each image of a padded batch (B, C, H', W') lies: ``left``, ``top``, ``width``,
    ``height`` are (B,) int64 tensors on the batch's device, ``padded`` is (H', W'). Positions are
    region pixels of shape (B, ...), the leading axis the image."""

    left: torch.Tensor
    top: torch.Tensor
    width: torch.Tensor
    height: torch.Tensor
    padded: tuple[int, int]

    @classmethod
    def of(cls, boxes: list[tuple[int, int, int, int]], padded: tuple[int, int], device: torch.device) -> Regions:
        """From host (left, top, width, height) boxes, one per image: one small upload."""
        left, top, width, height = torch.tensor(boxes, dtype=torch.int64).reshape(-1, 4).to(device).unbind(1)
        return cls(left, top, width, height, padded)

    def mask(self, margin: int = 0) -> torch.Tensor:
        """(B, 1, H', W') bool: the pixels of each image's region at least ``margin`` from its border."""
        rows = torch.arange(self.padded[0], device=self.top.device).view(1, 1, -1, 1)
        cols = torch.arange(self.padded[1], device=self.top.device).view(1, 1, 1, -1)
        top, left = self.top.view(-1, 1, 1, 1), self.left.view(-1, 1, 1, 1)
        bottom, right = top + self.height.view(-1, 1, 1, 1), left + self.width.view(-1, 1, 1, 1)
        return (rows >= top + margin) & (rows < bottom - margin) & (cols >= left + margin) & (cols < right - margin)

    def inside(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Whether integer region positions (x, y) lie in their image's region."""
        return (x >= 0) & (x < _each(self.width, x)) & (y >= 0) & (y < _each(self.height, y))

    def clamped(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Integer region positions clamped into the region (reads that are then masked stay in it)."""
        return (
            torch.minimum(x.clamp(min=0), _each(self.width, x) - 1),
            torch.minimum(y.clamp(min=0), _each(self.height, y) - 1),
        )

    def flat(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Index of region positions (x, y) into their image's flattened (H' * W') padded map."""
        return (y + _each(self.top, y)) * self.padded[1] + (x + _each(self.left, x))


def _each(per_image: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (B,) per-image value shaped to broadcast against positions (B, ...)."""
    return per_image.view(-1, *([1] * (like.ndim - 1)))


def ranking_keys(values: torch.Tensor, eligible: torch.Tensor | None = None) -> torch.Tensor:
    """int64 keys of non-negative float32 ``values`` (..., N) whose descending order is the values'
    descending order with ties broken by the lower index (row-major), -1 where not ``eligible``.

    ``topk`` on the keys picks the same pixels in a padded map as in the image's own crop (row-major
    order is the same in both), also among equal scores, where ``topk`` on the values may pick any:
    an image with fewer local maxima than requested keypoints is filled up with zero scores.
    """
    bits = values.contiguous().view(torch.int32).to(torch.int64)  # order-preserving for floats >= 0
    index = torch.arange(values.shape[-1], device=values.device)
    keys = (bits << _INDEX_BITS) + ((1 << _INDEX_BITS) - 1 - index)
    return keys if eligible is None else torch.where(eligible, keys, torch.full_like(keys, -1))


def masked_nms(scores: torch.Tensor, inside: torch.Tensor, radius: int) -> torch.Tensor:
    """``embed.locals.aliked._nms`` of each image's region of a padded (B, 1, H', W') score map,
    zero outside the regions: pixels outside are -inf in every pooled map, which is what
    ``max_pool2d`` pads a cropped map with, and never maxima."""

    def window_max(t: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(t, kernel_size=2 * radius + 1, stride=1, padding=radius)

    outside = torch.full_like(scores, -torch.inf)
    zeros = torch.zeros_like(scores)
    scores = torch.where(inside, scores, outside)
    is_max = (scores == window_max(scores)) & inside
    for _ in range(2):
        suppressed = window_max(torch.where(inside, is_max.float(), outside)) > 0
        rest = torch.where(suppressed & inside, zeros, scores)
        is_max = is_max | ((rest == window_max(rest)) & ~suppressed & inside)
    return torch.where(is_max, scores, zeros)


def detect(
    scores: torch.Tensor, regions: Regions, counts: list[int], window: torch.Tensor, radius: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DKD on each image's region of a padded (B, 1, H', W') score map, as ``AlikedTokens._keypoints``
    does on a cropped one: the ``counts[b]`` best local maxima away from the border, refined by a
    soft-argmax over their window (``window``: the (2r+1)^2 offsets (dx, dy) of a window of
    ``radius`` r, row-major), weighted by the score at the refined position.

    -> (xy (B, K, 2) region pixels, weight (B, K)), each row best first, K = max(counts); slots
    past ``counts[b]`` have weight -inf. All on the device: no host sync."""
    batch, width = scores.shape[0], scores.shape[3]
    inside = regions.mask()
    peaks = torch.where(regions.mask(radius), masked_nms(scores, inside, radius), 0.0)
    k = max(counts)
    index = torch.topk(ranking_keys(peaks.view(batch, -1), inside.view(batch, -1)), k).indices
    x, y = index % width - regions.left[:, None], index // width - regions.top[:, None]  # (B, K)
    steps = window.long()
    wx, wy = x[..., None] + steps[:, 0], y[..., None] + steps[:, 1]  # (B, K, w^2)
    flat_scores = scores.view(batch, -1)
    picked = flat_scores.gather(1, regions.flat(*regions.clamped(wx, wy)).view(batch, -1))
    windows = torch.where(regions.inside(wx, wy), picked.view_as(wx), 0.0)
    soft = ((windows - windows.max(-1, keepdim=True).values) / temperature).exp()
    residual = soft @ window / soft.sum(-1, keepdim=True)
    xy = torch.stack((x, y), -1).to(scores.dtype) + residual
    weight = bilinear_scores(flat_scores, regions, xy)
    valid = torch.arange(k, device=scores.device) < torch.tensor(counts, device=scores.device).view(-1, 1)
    weight = torch.where(valid, weight, -torch.inf)
    order = torch.argsort(-weight, dim=1, stable=True)
    return xy.gather(1, order[..., None].expand(-1, -1, 2)), weight.gather(1, order)


def bilinear_scores(flat: torch.Tensor, regions: Regions, xy: torch.Tensor) -> torch.Tensor:
    """(B, H' * W') maps read bilinearly at real region positions xy (B, K, 2), zero outside the
    region: ``grid_sample(align_corners=True)`` on the cropped map, without its round trip through
    normalised coordinates (whose rounding would reorder near-equal weights between the paths)."""
    x0, y0 = xy[..., 0].floor(), xy[..., 1].floor()
    fx, fy = xy[..., 0] - x0, xy[..., 1] - y0
    out = torch.zeros_like(fx)
    for dx, dy, w in ((0, 0, (1 - fx) * (1 - fy)), (1, 0, fx * (1 - fy)), (0, 1, (1 - fx) * fy), (1, 1, fx * fy)):
        x, y = (x0 + dx).long(), (y0 + dy).long()
        corner = flat.gather(1, regions.flat(*regions.clamped(x, y)))
        out = out + torch.where(regions.inside(x, y), w * corner, 0.0)
    return out


class Pixels:
    """Reads L2-normalised pixels of the images' regions of padded (B, C, H', W') feature maps: one
    gather along each image's contiguous flattened map for all its positions (indexing a cropped
    view per channel cost more than the rest of the descriptor head, and advanced indexing across
    the batch 3x more than the gather on CPU)."""

    def __init__(self, padded: torch.Tensor, regions: Regions):
        self.flat = padded.reshape(padded.shape[0], padded.shape[1], -1)
        self.regions = regions

    def read(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Integer region positions (B, *S), inside -> (B, C, *S)."""
        batch, channels = self.flat.shape[:2]
        flat = self.regions.flat(x, y).reshape(batch, 1, -1).expand(-1, channels, -1)
        return F.normalize(self.flat.gather(2, flat), dim=1).view(batch, channels, *x.shape[1:])

    def bilinear(self, xy: torch.Tensor) -> torch.Tensor:
        """(B, M, 2) real region positions -> (B, C, M): bilinear interpolation of the normalised
        pixels, zero outside the region; what ``grid_sample(normalize(features),
        align_corners=True)`` returns on the cropped map."""
        x0, y0 = xy[..., 0].floor(), xy[..., 1].floor()
        fx, fy = xy[..., 0] - x0, xy[..., 1] - y0
        out = torch.zeros(*self.flat.shape[:2], xy.shape[1], device=xy.device, dtype=self.flat.dtype)
        for dx, dy, w in ((0, 0, (1 - fx) * (1 - fy)), (1, 0, fx * (1 - fy)), (0, 1, (1 - fx) * fy), (1, 1, fx * fy)):
            x, y = (x0 + dx).long(), (y0 + dy).long()
            corner = self.read(*self.regions.clamped(x, y))
            out = out + (w * self.regions.inside(x, y))[:, None] * corner
        return out

    def patches_3x3(self, xy: torch.Tensor) -> torch.Tensor:
        """Integer (B, K, 2) region positions -> (B * K, C, 3, 3) windows centred on them, shifted
        to stay inside the region (as ALIKED's ``get_patches`` does)."""
        x0 = torch.minimum((xy[..., 0] - 1).clamp(min=0), _each(self.regions.width, xy[..., 0]) - 4)
        y0 = torch.minimum((xy[..., 1] - 1).clamp(min=0), _each(self.regions.height, xy[..., 1]) - 4)
        steps = torch.arange(3, device=xy.device)
        rows = (y0[..., None] + steps)[..., :, None].expand(*y0.shape, 3, 3)  # (B, K, row, col)
        cols = (x0[..., None] + steps)[..., None, :].expand(*x0.shape, 3, 3)
        patches = self.read(cols, rows)  # (B, C, K, 3, 3)
        return patches.transpose(1, 2).reshape(-1, self.flat.shape[1], 3, 3)

    def max_offset(self) -> torch.Tensor:
        """(B,) the descriptor head's offset bound per image: a quarter of the region's longer side."""
        return torch.maximum(self.regions.width, self.regions.height).to(self.flat.dtype) / 4.0
