"""A bounded set of input shapes and batch sizes per model, so that a GPU sees each kernel
configuration once (at warm-up) instead of for hours.

On a GPU every new (batch size, height, width) costs seconds of kernel set-up (cuDNN's engine
choice, runtime-compiled kernels): EfficientNet-Lite0 on an H200 took 98 s for its first pass over
1,500 web photos in 37 shapes and 0.84 s for the second. Web photos bring new shapes and batch
remainders for as long as the job runs. Two rules bound them:

- **Sides snapped to a grid.** An image resized to its longer side R keeps its aspect ratio, so its
  shorter side can take any of R values. Snapping each side to the nearest multiple of ``grid``
  (a resize by at most grid/2 pixels, done on the device) leaves 2R/grid - 1 shapes: 23 for R = 384
  and grid 32. This changes descriptors slightly (see docs/gpu.md for the realbench mAP with and
  without), so the grid an index was built with is recorded in its infos and the query side uses it.
- **Fixed batch sizes.** A group of n images of one shape is cut into batches of the plan's sizes
  only, the last one padded with blank images whose outputs are dropped. Padding the batch dimension
  never changes a descriptor (inference mode: no batch statistics).

On a CPU there is no per-shape set-up: batch sizes stay free (no padded rows to compute).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from core.errors import NeedleInputError

DEFAULT_GRID = 32  # pixels; a multiple of the usual ViT patch (16) and of CNN strides (32)


def check_grid(grid: int) -> int:
    """``grid`` as a validated int: 0 (exact shapes) or a positive number of pixels."""
    if isinstance(grid, bool) or not isinstance(grid, int) or grid < 0:
        raise NeedleInputError(f"shape grid must be 0 (exact shapes) or a positive number of pixels, got {grid!r}")
    return grid


def model_shape_grid(model: str, grid: int | None, device: str = "cpu") -> int:
    """The grid a registry ``model`` uses on ``device`` ("cpu"/"cuda"): ``grid`` when given; else
    DEFAULT_GRID for a CNN on a GPU, whose exact shapes are unbounded (one per shorter side), and 0
    (exact) otherwise: on a CPU there is no per-shape set-up to bound, a ViT's inputs are padded to
    a multiple of its patch (at most 2R/patch shapes, each exact), and a fixed-size tower padded to
    a square has one shape already."""
    from embed.registry import get_model_config

    if grid is not None:
        return check_grid(grid)
    return DEFAULT_GRID if device == "cuda" and get_model_config(model).pooling == "gem" else 0


def snap(height: int, width: int, grid: int) -> tuple[int, int]:
    """(height, width) with each side rounded to the nearest multiple of ``grid`` (at least one
    grid step); ``grid`` 0 leaves it unchanged."""
    if grid == 0:
        return height, width
    return max(grid, round(height / grid) * grid), max(grid, round(width / grid) * grid)


def fixed_batch_sizes(batch_size: int) -> tuple[int, ...]:
    """The batch sizes a GPU extractor uses: ``batch_size`` and a quarter of it (remainders), so two
    kernel configurations per shape; padding a remainder to a quarter batch wastes little, and a
    small batch leaves the GPU as idle as a padded one."""
    quarter = max(1, batch_size // 4)
    return (batch_size,) if quarter == batch_size else (batch_size, quarter)


def batch_pieces(n: int, sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """Cut ``n`` images into batches of the fixed ``sizes`` (largest first): [(images, padded
    size)], fewest padded rows with one launch counted as ``sizes[-1]`` rows. ``sizes`` empty: one
    batch of n (no padding)."""
    if not sizes:
        return [(n, n)] if n else []
    largest, launch = sizes[0], sizes[-1]
    pieces = [(largest, largest)] * (n // largest)
    rest = n % largest
    # best[r]: (cost, pieces) for r remaining images, cost = padded rows + launch per batch.
    best: list[tuple[int, list[tuple[int, int]]]] = [(0, [])]
    for r in range(1, rest + 1):
        options = []
        for size in sizes:
            used = min(size, r)
            cost, before = best[r - used]
            options.append((cost + (size - used) + launch, [*before, (used, size)]))
        best.append(min(options, key=lambda option: option[0]))
    return pieces + best[rest][1]


def plan_batches(
    shapes: list[tuple[int, int]],
    batch_size: int,
    input_shape: Callable[[int, int], tuple[int, int]],
    grid: int = 0,
    fixed_sizes: tuple[int, ...] = (),
) -> list[tuple[list[int], tuple[int, int], int]]:
    """Batches of image indices with the (H, W) each batch is built at and its padded batch size,
    from the images' (h, w).

    With a ``grid``, images share a batch when their snapped sizes are equal, and each is resized
    to it, as alone. With exact shapes (``grid`` 0), they share one when their model input shapes
    (``input_shape``: a ViT's padding to a multiple of its patch, a square tower's padding to a
    square) are equal, each zero-padded to it, which is what the model does to each alone. Padding
    CNN inputs across sizes was measured and rejected: zeros beyond an image's border reach its
    cells through the receptive field (EfficientNet-Lite0 on realbench: cosine to the per-image
    descriptor 0.93 at worst). ``fixed_sizes``: cut each group into these batch sizes only (see
    :func:`batch_pieces`); empty: batches of at most ``batch_size``, unpadded.
    """
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, (h, w) in enumerate(shapes):
        # Snapped: each image is resized to its own snapped size, as alone. Exact: zero-padded to the
        # input shape the model pads it to anyway.
        groups[snap(h, w, grid) if grid else input_shape(h, w)].append(i)
    plan = []
    for idx in groups.values():
        pieces = batch_pieces(len(idx), fixed_sizes) if fixed_sizes else _free(len(idx), batch_size)
        start = 0
        for count, padded in pieces:
            part = idx[start : start + count]
            start += count
            if grid:
                shape = snap(*shapes[part[0]], grid)
            else:
                shape = (max(shapes[i][0] for i in part), max(shapes[i][1] for i in part))
            plan.append((part, shape, padded))
    return plan


def _free(n: int, batch_size: int) -> list[tuple[int, int]]:
    """Batches of at most ``batch_size``, none padded (CPU)."""
    return [(min(batch_size, n - s),) * 2 for s in range(0, n, batch_size)]


def warm_shapes(
    resolution: int, grid: int, input_shape: Callable[[int, int], tuple[int, int]], limit: int = 128
) -> list[tuple[int, int]] | None:
    """Every input shape an image resized to longer side ``resolution`` can have under ``grid``
    (both orientations), each once, as the (H, W) the extractor builds a batch at: what a worker
    warms. None when there are more than ``limit`` (a CNN's exact shapes: one per shorter side)."""
    seen: dict[tuple[int, int], tuple[int, int]] = {}
    for short in range(1, resolution + 1):
        for h, w in ((resolution, short), (short, resolution)):
            snapped = snap(h, w, grid)
            seen.setdefault(input_shape(*snapped), snapped if grid else input_shape(*snapped))
            if len(seen) > limit:
                return None
    return list(seen.values())
