"""Local token models: the AMES detector head and ViT patch tokens (embed/locals/vit.py), kornia
SIFT / RootSIFT (embed/locals/sift.py), and both through LocalExtractor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from core.errors import NeedleInputError
from embed.itq import train_itq
from embed.locals.extract import LocalExtractor
from embed.locals.presets import LocalConfig
from embed.locals.vit import SpatialAttention2d, ViTAmesTokens, build_vit_ames, grid_size, load_detector_weights
from embed.registry import RANDOM, WeightsError

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference" / "ames_state_dict_shapes.json"
AMES_MODEL = "vit_base_patch14_reg4_dinov2.ames"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: one intra-op thread


def _reference_shapes() -> dict[str, list[int]]:
    if not REFERENCE.is_file():
        pytest.skip(f"AMES reference shapes not found at {REFERENCE}")
    return json.loads(REFERENCE.read_text())["dinov2_detector_SpatialAttention2d_in768"]


def _random_detector_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in SpatialAttention2d(768).state_dict().items():
        if name == "bn.num_batches_tracked":
            state[name] = torch.tensor(1234)
        elif name == "bn.running_var":
            state[name] = torch.rand(tensor.shape, generator=g) + 0.5
        else:
            state[name] = torch.randn(tensor.shape, generator=g) * 0.1
    return state


# --- the AMES detector head -------------------------------------------------------------------------


def test_detector_state_dict_matches_ames_reference():
    expected = _reference_shapes()
    actual = {name: list(t.shape) for name, t in SpatialAttention2d(768).state_dict().items()}
    assert actual == expected


@pytest.mark.parametrize("wrap", ["bare", "state", "state_dict", "module_prefix"])
def test_detector_loads_ames_checkpoint_layouts(tmp_path: Path, wrap: str):
    state = _random_detector_state()
    payload = {
        "bare": state,
        "state": {"state": state, "epoch": 7},  # AMES's layout: torch.save({"state": sd, ...})
        "state_dict": {"state_dict": state},
        "module_prefix": {"model": {f"module.{k}": v for k, v in state.items()}},
    }[wrap]
    path = tmp_path / "detector.pt"
    torch.save(payload, path)
    detector = SpatialAttention2d(768)
    load_detector_weights(detector, path)
    for name, tensor in detector.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_detector_weights_errors_name_file_and_key(tmp_path: Path):
    state = _random_detector_state()
    bad_shape = dict(state, **{"conv2.weight": torch.zeros(1, 512, 1, 1)})
    torch.save({"state": bad_shape}, tmp_path / "shape.pt")
    with pytest.raises(WeightsError, match=r"shape\.pt.*conv2\.weight"):
        load_detector_weights(SpatialAttention2d(768), tmp_path / "shape.pt")
    missing = {k: v for k, v in state.items() if k != "bn.running_mean"}
    torch.save(missing, tmp_path / "missing.pt")
    with pytest.raises(WeightsError, match=r"missing\.pt.*bn\.running_mean"):
        load_detector_weights(SpatialAttention2d(768), tmp_path / "missing.pt")
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsError, match=r"garbage\.pt"):
        load_detector_weights(SpatialAttention2d(768), tmp_path / "garbage.pt")
    with pytest.raises(WeightsError, match=r"absent\.pt"):
        load_detector_weights(SpatialAttention2d(768), tmp_path / "absent.pt")


def test_detector_forward_matches_hand_computation():
    c = 768
    detector = SpatialAttention2d(c)
    detector.load_state_dict(_random_detector_state(seed=1))
    detector.eval()
    x = torch.randn(2, c, 3, 5, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        desc, weight = detector(x)
    p = {k: v.double() for k, v in detector.state_dict().items()}
    xd = x.double()
    # 1x1 conv = a matrix product over channels; BN in eval mode uses the running statistics.
    y = torch.einsum("oc,bchw->bohw", p["conv1.weight"][:, :, 0, 0], xd) + p["conv1.bias"].view(1, c, 1, 1)
    y = (y - p["bn.running_mean"].view(1, c, 1, 1)) / torch.sqrt(p["bn.running_var"].view(1, c, 1, 1) + 1e-5)
    y = y * p["bn.weight"].view(1, c, 1, 1) + p["bn.bias"].view(1, c, 1, 1)
    expected_desc = y / y.norm(dim=1, keepdim=True)
    logit = torch.einsum("oc,bchw->bohw", p["conv2.weight"][:, :, 0, 0], y.clamp(min=0)) + p["conv2.bias"].view(
        1, 1, 1, 1
    )
    expected_weight = torch.log1p(torch.exp(logit))
    assert desc.shape == (2, c, 3, 5) and weight.shape == (2, 1, 3, 5)
    torch.testing.assert_close(desc.double(), expected_desc, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.double(), expected_weight, atol=1e-5, rtol=1e-5)


# --- ViT patch tokens ------------------------------------------------------------------------------


class _PatchMeanViT(nn.Module):
    """A stand-in timm ViT: each patch token is its patch's mean colour, after 5 prefix tokens."""

    num_prefix_tokens = 5
    num_features = 3

    def __init__(self):
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.patch_size = (14, 14)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        patches = torch.nn.functional.avg_pool2d(x, 14).flatten(2).transpose(1, 2)
        return torch.cat([torch.full((len(x), 5, 3), 99.0), patches], 1)


@pytest.mark.parametrize("hw", [(70, 98), (75, 100), (100, 61), (518, 389), (10, 9)])
def test_vit_token_grid_cells_cover_the_input_evenly(hw: tuple[int, int]):
    """Cell (i, j) of the grid sees the input region [j W/w, (j+1) W/w) x [i H/h, (i+1) H/h): the
    token at that cell of a ramp image (value = pixel x or y) is the centre of that region, which is
    where embed.locals.extract._grid_tokens puts it."""
    height, width = hw
    model = ViTAmesTokens(_PatchMeanViT(), SpatialAttention2d(3)).eval()
    ys, xs = torch.meshgrid(torch.arange(height) + 0.5, torch.arange(width) + 0.5, indexing="ij")
    ramp = torch.stack([xs, ys, torch.zeros_like(xs)])[None].float()
    with torch.no_grad():
        tokens = model.patch_tokens(ramp)
    h, w = grid_size(height, width, 14)
    assert tokens.shape == (1, 3, h, w)
    centres_x = (torch.arange(w) + 0.5) * width / w
    centres_y = (torch.arange(h) + 0.5) * height / h
    # Antialiased resampling blurs the ramp's ends by under a pixel; interior cells are exact.
    torch.testing.assert_close(tokens[0, 0, 0, 1:-1], centres_x[1:-1], atol=0.02, rtol=0)
    torch.testing.assert_close(tokens[0, 1, 1:-1, 0], centres_y[1:-1], atol=0.02, rtol=0)
    assert (tokens[0, 0, 0] - centres_x).abs().max() < 1.0
    assert (tokens[0, 1, :, 0] - centres_y).abs().max() < 1.0


def test_vit_tokens_reject_non_vit_backbones():
    with pytest.raises(NeedleInputError, match="not a timm ViT"):
        ViTAmesTokens(nn.Linear(3, 3), SpatialAttention2d(3))
    with pytest.raises(NeedleInputError, match="width"):
        ViTAmesTokens(_PatchMeanViT(), SpatialAttention2d(8))


@pytest.fixture(scope="module")
def vit_ames() -> ViTAmesTokens:
    conf = LocalConfig(kind="vit_ames", model=AMES_MODEL, resolution=98)
    model, mean, std, path = build_vit_ames(conf, RANDOM)
    assert path is None and len(mean) == 3 and len(std) == 3
    return model


@pytest.mark.parametrize("hw", [(70, 98), (98, 70), (75, 100)])
def test_vit_ames_tokens_shapes_and_norms(vit_ames: ViTAmesTokens, hw: tuple[int, int]):
    assert vit_ames.dim == 768 and vit_ames.num_prefix_tokens == 5 and vit_ames.patch_size == 14
    x = torch.randn(2, 3, *hw, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        desc, weight = vit_ames(x)
    h, w = round(hw[0] / 14), round(hw[1] / 14)
    assert desc.shape == (2, 768, h, w) and weight.shape == (2, h, w)
    assert desc.dtype == torch.float32 and weight.dtype == torch.float32
    torch.testing.assert_close(desc.norm(dim=1), torch.ones(2, h, w), atol=1e-5, rtol=0)
    assert bool((weight >= 0).all())


def test_vit_ames_bf16_autocast_agrees_with_fp32(vit_ames: ViTAmesTokens):
    x = torch.randn(1, 3, 70, 98, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        vit_ames.precision = "fp32"
        d32, _w32 = vit_ames(x)
        vit_ames.precision = "bf16"
        d16, w16 = vit_ames(x)
        vit_ames.precision = "auto"
    assert d16.dtype == torch.float32
    torch.testing.assert_close(d16.norm(dim=1), torch.ones_like(w16), atol=1e-5, rtol=0)
    assert float((d16 * d32).sum(1).min()) > 0.98


def test_build_vit_ames_loads_detector_weights(tmp_path: Path):
    state = _random_detector_state(seed=3)
    torch.save({"state": state}, tmp_path / "det.pt")
    conf = LocalConfig(kind="vit_ames", model=AMES_MODEL, resolution=98, detector_weights=str(tmp_path / "det.pt"))
    model, *_ = build_vit_ames(conf, RANDOM)
    assert not model.training and torch.equal(model.detector.conv1.weight, state["conv1.weight"])
    with pytest.raises(WeightsError, match=r"nope\.pt"):
        build_vit_ames(
            LocalConfig(kind="vit_ames", model=AMES_MODEL, detector_weights=str(tmp_path / "nope.pt")), RANDOM
        )
    with pytest.raises(WeightsError, match="--detector-weights"):  # a random detector only when asked for
        build_vit_ames(LocalConfig(kind="vit_ames", model=AMES_MODEL, resolution=98), str(tmp_path / "backbone.pt"))


@pytest.fixture(scope="module")
def vit_extractor() -> LocalExtractor:
    itq = train_itq(np.random.default_rng(0).normal(size=(400, 768)), iterations=5)
    conf = LocalConfig(kind="vit_ames", model=AMES_MODEL, resolution=98, top_k=20, keep_desc=True)
    return LocalExtractor(conf, RANDOM, itq=itq)


def test_local_extractor_vit_ames_two_aspect_ratios(vit_extractor: LocalExtractor, photos):
    images = [np.asarray(Image.fromarray(photos["astronaut"]).resize(size)) for size in ((98, 70), (70, 98), (98, 61))]
    described = vit_extractor.describe(images)
    for image, tokens in zip(images, described):
        height, width = image.shape[:2]
        assert len(tokens.xy) == 20 and tokens.desc.shape == (20, 768)
        assert (tokens.xy[:, 0] > 0).all() and (tokens.xy[:, 0] < width).all()
        assert (tokens.xy[:, 1] > 0).all() and (tokens.xy[:, 1] < height).all()
        np.testing.assert_allclose(np.linalg.norm(tokens.desc, axis=1), 1.0, atol=1e-5)
        assert (np.diff(tokens.weight) <= 0).all()
    columns = vit_extractor(images)
    assert columns["local_codes"][0].shape == (20, 16) and columns["local_desc"][1].shape == (20, 768)
    local = vit_extractor.tokens(images[:2])
    assert local[0].codes.shape == (20, 16) and local[1].xy.shape == (20, 2)
    np.testing.assert_array_equal(local[0].scale, 1.0)


# --- SIFT / RootSIFT --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sift():
    from embed.locals.sift import SiftTokens

    return SiftTokens().eval().to("cpu")


@pytest.fixture(scope="module")
def astronaut_512() -> np.ndarray:
    from ingest.demo_data import load_skimage_photo

    return np.asarray(Image.fromarray(load_skimage_photo("astronaut")).resize((512, 512), Image.BICUBIC))


@pytest.fixture(scope="module")
def astronaut_sift(sift, astronaut_512: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return sift(astronaut_512)


def _mutual_nn(da: np.ndarray, db: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sim = da @ db.T
    ab, ba = sim.argmax(1), sim.argmax(0)
    keep = np.nonzero(ba[ab] == np.arange(len(ab)))[0]
    return keep, ab[keep]


def test_sift_tokens_on_a_photo(sift, astronaut_sift):
    xy, weight, desc = astronaut_sift
    n = len(xy)
    assert 500 <= n <= 1000 and sift.dim == 128
    assert xy.shape == (n, 2) and weight.shape == (n,) and desc.shape == (n, 128)
    assert xy.dtype == weight.dtype == desc.dtype == np.float32
    assert (xy >= 0).all() and (xy[:, 0] <= 512).all() and (xy[:, 1] <= 512).all()
    assert (weight > 0).all() and (desc >= 0).all()
    np.testing.assert_allclose(np.linalg.norm(desc, axis=1), 1.0, atol=1e-5)


def test_sift_recovers_a_translation(sift, astronaut_512: np.ndarray, astronaut_sift):
    dx, dy = 37, 21
    shifted = np.ascontiguousarray(astronaut_512[dy:, dx:])
    xa, _, da = astronaut_sift
    xb, _, db = sift(shifted)
    ia, ib = _mutual_nn(da, db)
    diff = xa[ia] - xb[ib]
    assert len(ia) > 200
    np.testing.assert_allclose(np.median(diff, axis=0), [dx, dy], atol=0.5)
    assert np.mean(np.linalg.norm(diff - [dx, dy], axis=1) < 2) > 0.8


def test_sift_matches_a_rotated_copy(sift, astronaut_512: np.ndarray, astronaut_sift):
    angle = 25.0
    rotated = np.asarray(Image.fromarray(astronaut_512).rotate(angle, resample=Image.BICUBIC, center=(256, 256)))
    xa, _, da = astronaut_sift
    xb, _, db = sift(rotated)
    ia, ib = _mutual_nn(da, db)
    # PIL turns the image counter-clockwise on screen about the centre of the 512 px frame.
    t = np.deg2rad(angle)
    p = xa[ia] - 256
    expected = (
        np.stack([np.cos(t) * p[:, 0] + np.sin(t) * p[:, 1], -np.sin(t) * p[:, 0] + np.cos(t) * p[:, 1]], 1) + 256
    )
    inliers = np.linalg.norm(expected - xb[ib], axis=1) < 3
    assert inliers.sum() > 300 and inliers.mean() > 0.8


def test_sift_on_flat_tiny_and_bad_images(sift):
    for image in (np.zeros((64, 64, 3), np.uint8), np.full((5, 7, 3), 128, np.uint8), np.zeros((40, 30), np.uint8)):
        xy, weight, desc = sift(image)
        assert xy.shape == (0, 2) and weight.shape == (0,) and desc.shape == (0, 128)
    with pytest.raises(NeedleInputError, match="uint8"):
        sift(np.zeros((32, 32, 3), np.float32))
    with pytest.raises(NeedleInputError, match=r"\(32, 32, 4\)"):
        sift(np.zeros((32, 32, 4), np.uint8))


def test_local_extractor_sift(photos):
    conf = LocalConfig(kind="sift", resolution=256, top_k=100, keep_desc=True, scales=(0.75, 1.0))
    extractor = LocalExtractor(conf, itq=None)
    images = [
        np.asarray(Image.fromarray(photos[name]).resize(size))
        for name, size in (("astronaut", (256, 256)), ("chelsea", (256, 171)))
    ]
    for image, tokens in zip(images, extractor.describe(images)):
        height, width = image.shape[:2]
        assert len(tokens.xy) == 100 and tokens.desc.shape == (100, 128)
        assert (tokens.xy >= 0).all() and (tokens.xy[:, 0] <= width).all() and (tokens.xy[:, 1] <= height).all()
        assert set(np.unique(tokens.scale_index)) <= {0, 1}
    columns = extractor(images)
    assert columns["local_desc"][1].shape == (100, 128) and "local_codes" not in columns
