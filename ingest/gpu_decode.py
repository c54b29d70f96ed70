"""Decoding JPEGs on the GPU (nvjpeg through torchvision) and resizing them there.

An alternative to PIL on CPU threads for GPU workers whose model outruns their CPUs' decoding:
``needle ingest --decoder nvjpeg``. The images come back to the host as uint8 (H, W, 3) arrays,
so everything downstream is the same as with PIL. Samples nvjpeg cannot take (PNG, CMYK JPEGs,
corrupt bytes) are decoded by PIL, one by one, so a batch never fails as a whole.

The pixels are not PIL's: the resize is torch's antialiased bicubic from the full-size decode
(PIL decodes at a reduced DCT scale first, in draft mode), so descriptors differ slightly from
PIL-decoded ones (``bench/ingest_throughput.py`` reports the smallest cosine between the two).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any

from core.errors import ImageDecodeError
from ingest.images import decode_resized_many, resized_size

log = logging.getLogger(__name__)

JPEG_MAGIC = b"\xff\xd8\xff"


def is_jpeg(data: bytes) -> bool:
    return data[:3] == JPEG_MAGIC


class GpuJpegDecoder:
    """Batched JPEG decode + isotropic resize on a CUDA device.

    ``__call__(items)`` takes [(key, bytes)] and returns, per item, ({longer side: RGB uint8 array},
    width, height) or raises nothing: an undecodable item comes back as its ImageDecodeError.
    """

    batch = 64  # samples per call: nvjpeg's batched decode
    concurrency = 1  # one call at a time: the decodes share the GPU and its stream

    def __init__(self, device: str = "cuda", decode_jpeg: Any = None):
        """``decode_jpeg``: torchvision's by default; another function of the same signature
        (``(tensors, mode=, device=)``) only to test this class without a GPU."""
        import torch

        from ingest.torchvision_compat import ensure_torchvision_importable

        ensure_torchvision_importable()
        from torchvision.io import ImageReadMode
        from torchvision.io import decode_jpeg as torchvision_decode_jpeg

        self.torch = torch
        self.device = torch.device(device)
        decode_jpeg = decode_jpeg or torchvision_decode_jpeg

        self._decode_jpeg = decode_jpeg
        self._rgb = ImageReadMode.RGB
        # Its own stream, so that decoding overlaps the model's kernels on the default stream.
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def __call__(self, items: list[tuple[str, bytes]], longer_sides: tuple[int, ...]) -> list[Any]:
        torch = self.torch
        out: list[Any] = [None] * len(items)
        gpu = [i for i, (_, data) in enumerate(items) if data and is_jpeg(data)]
        decoded: dict[int, Any] = {}
        if gpu:
            with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                decoded = self._decode_many([items[i] for i in gpu], gpu)
                for i, image in decoded.items():
                    out[i] = self._resize(image, longer_sides)
            if self.stream is not None:
                self.stream.synchronize()  # once per batch, after every copy back was queued
            for i in decoded:
                sizes, width, height = out[i]
                out[i] = ({side: t.numpy() for side, t in sizes.items()}, width, height)
        for i, (key, data) in enumerate(items):  # the rest, and whatever nvjpeg refused, through PIL
            if i not in decoded:
                try:
                    out[i] = decode_resized_many(data, longer_sides, key)
                except ImageDecodeError as exc:
                    out[i] = exc
        return out

    def _decode_many(self, items: list[tuple[str, bytes]], positions: list[int]) -> dict[int, Any]:
        torch = self.torch
        tensors = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for _, data in items]
        try:
            images = self._decode_jpeg(tensors, mode=self._rgb, device=self.device)
            return dict(zip(positions, images))
        except RuntimeError:
            # One bad JPEG fails the whole batch: decode one by one to find it (PIL then names it).
            result = {}
            for position, tensor in zip(positions, tensors):
                try:
                    result[position] = self._decode_jpeg(tensor, mode=self._rgb, device=self.device)
                except RuntimeError as exc:
                    log.debug("nvjpeg refused sample %d (%s): decoding it with PIL", position, exc)
            return result

    def _resize(self, image: Any, longer_sides: tuple[int, ...]) -> tuple[dict[int, Any], int, int]:
        torch = self.torch
        height, width = int(image.shape[1]), int(image.shape[2])
        sizes = {}
        for side in longer_sides:
            w, h = resized_size(width, height, side)
            if (w, h) == (width, height):
                resized = image
            else:
                x = image[None].float()
                x = torch.nn.functional.interpolate(x, size=(h, w), mode="bicubic", antialias=True, align_corners=False)
                resized = x[0].round_().clamp_(0, 255).to(torch.uint8)
            sizes[side] = resized.permute(1, 2, 0).contiguous().to("cpu", non_blocking=True)
        return sizes, width, height
