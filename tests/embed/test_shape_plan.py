"""The bounded shape plan (embed/shape_plan.py): snapped sides, fixed batch sizes, the warm-up, and
that neither batching nor the batch padding changes a descriptor; the grid travels with the index."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest

from core.errors import NeedleInputError
from embed.extract import GlobalExtractor
from embed.registry import RANDOM
from embed.shape_plan import (
    DEFAULT_GRID,
    batch_pieces,
    fixed_batch_sizes,
    model_shape_grid,
    plan_batches,
    snap,
    warm_shapes,
)
from ingest.config import IngestConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: one intra-op thread


def identity(h: int, w: int) -> tuple[int, int]:  # a CNN's input shape: the image's own
    return h, w


def test_snap_rounds_each_side_to_the_grid():
    assert snap(384, 300, 32) == (384, 288)
    assert snap(384, 310, 32) == (384, 320)
    assert snap(7, 384, 32) == (32, 384)  # at least one step
    assert snap(383, 301, 0) == (383, 301)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 24, 25, 31, 32, 33, 100])
def test_batch_pieces_cover_n_with_the_fixed_sizes_only(n):
    sizes = fixed_batch_sizes(32)
    assert sizes == (32, 8)
    pieces = batch_pieces(n, sizes)
    assert sum(count for count, _ in pieces) == n
    assert all(padded in sizes and 0 < count <= padded for count, padded in pieces)
    # Never more padding than one small batch, and full batches of the largest size first.
    assert sum(padded - count for count, padded in pieces) <= 8
    assert [p for p in pieces if p == (32, 32)] == [(32, 32)] * (n // 32)


def test_free_batches_on_cpu_are_unpadded():
    plan = plan_batches([(10, 20)] * 5, 2, identity)
    assert [(len(idx), padded) for idx, _, padded in plan] == [(2, 2), (2, 2), (1, 1)]


def test_grid_bounds_the_shapes_of_real_photo_sizes():
    rng = np.random.default_rng(0)
    shapes = [(384, int(w)) for w in rng.integers(100, 385, 300)] + [(int(h), 384) for h in rng.integers(100, 385, 300)]
    assert len(set(shapes)) > 200  # what web photos bring: hundreds of shapes
    plan = plan_batches(shapes, 32, identity, grid=32, fixed_sizes=(32, 8))
    built = {shape for _, shape, _ in plan}
    assert built <= set(warm_shapes(384, 32, identity)) and len(warm_shapes(384, 32, identity)) == 23
    assert {padded for _, _, padded in plan} <= {32, 8}
    for idx, shape, _ in plan:
        assert {snap(*shapes[i], 32) for i in idx} == {shape}
    assert sorted(i for idx, _, _ in plan for i in idx) == list(range(len(shapes)))


def test_exact_shapes_group_by_model_input_shape():
    shapes = [(10, 20), (12, 20), (10, 20), (16, 16), (10, 20), (10, 20)]
    plan = plan_batches(shapes, 2, identity)
    for idx, shape, _ in plan:
        assert len(idx) <= 2 and {shapes[i] for i in idx} == {shape}

    def padded16(h: int, w: int) -> tuple[int, int]:  # a ViT with 16-pixel patches
        return -(-h // 16) * 16, -(-w // 16) * 16

    plan = plan_batches(shapes, 8, padded16)
    assert [sorted(idx) for idx, _, _ in plan] == [[0, 1, 2, 4, 5], [3]]
    assert plan[0][1] == (12, 20)  # built at the members' largest sides; the model pads the rest


def test_bad_grids_are_refused_naming_the_value():
    with pytest.raises(NeedleInputError, match="-4"):
        model_shape_grid("tf_efficientnet_lite0.gem", -4)
    with pytest.raises(NeedleInputError, match="shape_grid"):
        IngestConfig(shape_grid=-1)


def test_bounded_shapes_to_warm():
    assert warm_shapes(384, 0, identity) is None  # a CNN's exact shapes: one per shorter side

    def padded16(h: int, w: int) -> tuple[int, int]:  # a ViT with 16-pixel patches
        return -(-h // 16) * 16, -(-w // 16) * 16

    vit = warm_shapes(512, 0, padded16)
    assert vit is not None and len(vit) == 63 and all(h % 16 == 0 and w % 16 == 0 for h, w in vit)


def test_model_default_grid():
    # The grid bounds a CNN's shapes on a GPU; a CPU has no set-up to bound and stays exact.
    assert model_shape_grid("tf_efficientnet_lite0.gem", None, "cuda") == DEFAULT_GRID
    assert model_shape_grid("tf_efficientnet_lite0.gem", None, "cpu") == 0
    assert model_shape_grid("siglip_B16_384.head", None, "cuda") == 0  # patch multiples: bounded, exact
    assert model_shape_grid("tf_efficientnet_lite0.gem", 0, "cuda") == 0


def _photos_of_many_shapes(seed: int) -> list[np.ndarray]:
    """Smooth random images (not noise: resizing noise is not what photos do) of mixed sizes."""
    rng = np.random.default_rng(seed)
    out = []
    for h, w in [(64, 50), (64, 46), (64, 64), (40, 64), (64, 50), (64, 20), (64, 58)]:
        small = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3)).astype(np.float32)
        big = np.kron(small, np.ones((8, 8, 1)))[:h, :w]
        out.append(big.astype(np.uint8))
    return out


@pytest.fixture(scope="module")
def snapped():
    return GlobalExtractor("timm:resnet18", RANDOM, resolution=64, precision="fp32", shape_grid=16)


def test_snapped_batches_equal_each_image_alone(snapped):
    images = _photos_of_many_shapes(0)
    batched = snapped(images)["global"].astype(np.float32)
    alone = np.stack([snapped.forward_uint8(im[None])[0] for im in images])
    np.testing.assert_allclose(batched, alone, atol=2e-3)


def test_padding_the_batch_dimension_changes_no_descriptor():
    fixed = GlobalExtractor("timm:resnet18", RANDOM, resolution=64, precision="fp32", fixed_batches=True, batch_size=8)
    free = GlobalExtractor("timm:resnet18", RANDOM, resolution=64, precision="fp32", fixed_batches=False, batch_size=8)
    assert fixed.batch_sizes == (8, 2) and free.batch_sizes == ()
    images = _photos_of_many_shapes(1)
    np.testing.assert_allclose(fixed(images)["global"], free(images)["global"], atol=1e-3)


def test_an_image_already_on_the_grid_is_not_resampled(snapped):
    exact = GlobalExtractor("timm:resnet18", RANDOM, resolution=64, precision="fp32", shape_grid=0)
    on_grid = [im for im in _photos_of_many_shapes(2) if im.shape[:2] == snap(*im.shape[:2], 16)]
    assert on_grid
    np.testing.assert_allclose(snapped(on_grid)["global"], exact(on_grid)["global"], atol=1e-3)


def test_warm_runs_every_shape_at_every_fixed_size():
    extractor = GlobalExtractor(
        "timm:resnet18", RANDOM, resolution=64, precision="fp32", shape_grid=32, fixed_batches=True, batch_size=4
    )
    warmed = extractor.warm()
    assert warmed["shapes"] == 3 and warmed["batches"] == 6  # 64x32, 32x64, 64x64 at batch 4 and 1
    exact = GlobalExtractor("timm:resnet18", RANDOM, resolution=160, precision="fp32", shape_grid=0)
    assert exact.warm()["batches"] == 0  # 319 exact shapes: not a bounded set, nothing warmed


def test_the_query_side_uses_the_grid_the_index_recorded(snapped):
    from query.retrieve import query_extractor

    info = snapped.info()
    assert info["shape_grid"] == 16

    class Index:
        infos: ClassVar[dict] = {"extractors": [info]}
        path = "idx"

    assert query_extractor(Index()).shape_grid == 16
    before_the_grid = {k: v for k, v in info.items() if k != "shape_grid"}
    Index.infos = {"extractors": [before_the_grid]}
    assert query_extractor(Index()).shape_grid == 0  # an older index: exact shapes, as it was made
