"""Foreground feature averaging (similarity/ffa/*.py): the masks, pooling and descriptors against
brute-force references, the real Lite0 token maps and the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from eval.groups import GroupEvalConfig, GroupEvalError
from similarity.ffa.config import FFAConfig, FFAError
from similarity.ffa.descriptors import crop_resized, ffa_descriptors, foreground_box, pool_tokens
from similarity.ffa.masks import (
    FullMask,
    NormMask,
    PCAMask,
    PixelMaskFn,
    centredness,
    first_component_projection,
    grid_mask_from_pixels,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# --- masks --------------------------------------------------------------------------------------


def object_tokens(h: int = 6, w: int = 8, d: int = 5, seed: int = 0, box=(1, 4, 2, 6)) -> tuple[np.ndarray, np.ndarray]:
    """Tokens with an "object" block (box rows/cols, exclusive ends) that differs from the background."""
    rng = np.random.default_rng(seed)
    tokens = 0.1 * rng.normal(size=(h, w, d))
    truth = np.zeros((h, w), dtype=bool)
    truth[box[0] : box[1], box[2] : box[3]] = True
    tokens[truth] += np.linspace(1, 2, d)
    return tokens.astype(np.float32), truth


@pytest.mark.parametrize("seed", range(6))
def test_first_component_matches_covariance_eigenvector(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.normal(size=(5, 7, 4)).astype(np.float32)
    x = tokens.reshape(-1, 4).astype(np.float64)
    xc = x - x.mean(axis=0)
    _, vectors = np.linalg.eigh(xc.T @ xc)
    proj = xc @ vectors[:, -1]  # top eigenvector: eigh sorts ascending
    centre = centredness(5, 7).ravel()
    if proj @ (centre - centre.mean()) < 0:
        proj = -proj
    np.testing.assert_allclose(first_component_projection(tokens).ravel(), proj, atol=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_projection_sign_favours_the_centre(seed):
    tokens = np.random.default_rng(seed).normal(size=(6, 5, 3)).astype(np.float32)
    proj = first_component_projection(tokens)
    centre = centredness(6, 5)
    assert float((proj * (centre - centre.mean())).sum()) >= 0
    # A principal direction has no sign: negated tokens give the same oriented projection.
    np.testing.assert_allclose(first_component_projection(-tokens), proj, atol=1e-9)


def test_centredness():
    c = centredness(3, 5)
    assert c[1, 2] == 1.0 and c[0, 0] == 0.0 and c[1, 0] == 0.0 and c[1, 1] == pytest.approx(0.5)
    assert centredness(1, 1).tolist() == [[1.0]]


def test_pca_mask_finds_a_central_object_whatever_its_sign():
    tokens, truth = object_tokens()
    assert np.array_equal(PCAMask()(tokens, None), truth)
    # The same object made darker than the background: the sign rule still picks the centre.
    assert np.array_equal(PCAMask()(-tokens, None), truth)


def test_pca_mask_threshold_and_constant_tokens():
    tokens, _truth = object_tokens()
    strict = PCAMask(threshold=10.0)(tokens, None)
    assert not strict.any()  # nothing 10 std above the mean: the caller falls back
    assert not PCAMask()(np.ones((3, 3, 2), np.float32), None).any()


@pytest.mark.parametrize("fraction", [0.01, 0.25, 0.5, 1.0])
def test_norm_mask_keeps_the_largest_norms(fraction):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 3, size=(4, 5, 2)).astype(np.float32)  # tied norms: lower index first
    mask = NormMask(fraction)(tokens, None)
    norms = np.linalg.norm(tokens.reshape(20, 2), axis=1)
    keep = max(1, int(np.ceil(fraction * 20)))
    expected = sorted(range(20), key=lambda i: (-norms[i], i))[:keep]
    assert sorted(np.flatnonzero(mask.ravel()).tolist()) == sorted(expected)


def test_grid_mask_from_pixels_is_a_block_majority():
    rng = np.random.default_rng(0)
    pixels = rng.random((24, 40)) < 0.5
    grid = grid_mask_from_pixels(pixels, (6, 8))
    expected = pixels.reshape(6, 4, 8, 5).mean(axis=(1, 3)) > 0.5
    assert np.array_equal(grid, expected)
    with pytest.raises(FFAError):
        grid_mask_from_pixels(pixels[None], (6, 8))


def test_pixel_mask_fn_plugs_a_segmenter():
    image = np.zeros((32, 48, 3), np.uint8)
    fn = PixelMaskFn(lambda img: np.pad(np.ones((16, 16)), ((8, 8), (16, 16))), name="box")
    mask = fn(np.zeros((4, 6, 3), np.float32), image)
    expected = np.zeros((4, 6), bool)
    expected[1:3, 2:4] = True
    assert np.array_equal(mask, expected)
    with pytest.raises(FFAError, match="shape"):
        PixelMaskFn(lambda img: np.ones((3, 3)))(np.zeros((4, 6, 3), np.float32), image)


# --- pooling, boxes, descriptors ----------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["avg", "gem"])
def test_pool_tokens_matches_selected_tokens(pooling):
    rng = np.random.default_rng(0)
    tokens = rng.normal(size=(3, 4, 6)).astype(np.float32)
    mask = rng.random((3, 4)) < 0.5
    mask[0, 0] = True
    picked = [tokens[i, j].astype(np.float64) for i in range(3) for j in range(4) if mask[i, j]]
    if pooling == "avg":
        expected = np.mean(picked, axis=0)
    else:
        expected = np.mean([np.maximum(t, 1e-6) ** 3 for t in picked], axis=0) ** (1 / 3)
    np.testing.assert_allclose(pool_tokens(tokens, mask, pooling), expected / np.linalg.norm(expected), rtol=1e-5)
    with pytest.raises(FFAError):
        pool_tokens(tokens, np.zeros((3, 4), bool))


def test_unmasked_gem_equals_embed_pooling():
    import torch

    from embed.pooling import gem, l2_normalize

    tokens = np.abs(np.random.default_rng(1).normal(size=(5, 3, 8))).astype(np.float32)
    reference = l2_normalize(gem(torch.from_numpy(tokens).permute(2, 0, 1)[None])).numpy()[0]
    np.testing.assert_allclose(pool_tokens(tokens, None, "gem"), reference, rtol=1e-5)


def test_foreground_box():
    mask = np.zeros((4, 6), bool)
    mask[1, 2] = mask[2, 3] = True
    assert foreground_box(mask, (40, 60, 3)) == (10, 30, 20, 40)
    assert foreground_box(mask, (40, 60, 3), margin=5) == (0, 40, 0, 60)
    assert foreground_box(np.ones((3, 3), bool), (10, 11)) == (0, 10, 0, 11)  # uneven cells still cover all
    with pytest.raises(FFAError):
        foreground_box(np.zeros((2, 2), bool), (8, 8))


class PixelTokens:
    """A stand-in extractor: 4x4-pixel cells' mean colour as 3-d tokens; records its inputs."""

    def __init__(self):
        self.calls: list[list[tuple[int, ...]]] = []

    def __call__(self, images):
        self.calls.append([im.shape for im in images])
        out = []
        for im in images:
            h, w = im.shape[0] // 4, im.shape[1] // 4
            out.append(im[: 4 * h, : 4 * w].astype(np.float32).reshape(h, 4, w, 4, 3).mean(axis=(1, 3)) / 255 + 0.01)
        return out


def scene(seed: int = 0) -> np.ndarray:
    """A 32x48 image: a dark noisy background tinted by ``seed``, a bright red square in the middle."""
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 40, size=(32, 48, 3)).astype(np.uint8)
    image[..., seed % 3] += 60
    image[8:24, 16:32] = (250, 30, 30)
    return image


def test_crop_feat_pools_the_mask_and_full_mask_is_the_baseline():
    images = [scene(0), scene(1)]
    tokens = PixelTokens()
    fg_mask = PixelMaskFn(lambda img: img[..., 0] > 200, name="red")
    desc, stats = ffa_descriptors(FFAConfig(mask="none"), images, tokens, mask_fn=fg_mask)
    maps = PixelTokens()(images)
    for d, m, im in zip(desc, maps, images):
        np.testing.assert_allclose(d, pool_tokens(m, fg_mask(m, im)), rtol=1e-6)
    assert stats["mask"] == "red" and stats["foreground_fraction"] == pytest.approx(16 * 16 / (32 * 48))
    base, _ = ffa_descriptors(FFAConfig(mask="none"), images, tokens, maps=maps)
    np.testing.assert_allclose(base[0], pool_tokens(maps[0], None), rtol=1e-6)
    # The foreground is one colour: FFA descriptors of two different backgrounds agree; the baseline's do not.
    assert desc[0] @ desc[1] == pytest.approx(1.0, abs=1e-6) and base[0] @ base[1] < 0.99


def test_crop_img_re_extracts_the_foreground_box_only_when_needed():
    images = [scene(0)]
    tokens = PixelTokens()
    fg_mask = PixelMaskFn(lambda img: img[..., 0] > 200, name="red")
    conf = FFAConfig(mode="crop-img", resolution=48)
    desc, stats = ffa_descriptors(conf, images, tokens, mask_fn=fg_mask)
    assert tokens.calls == [[(32, 48, 3)], [(48, 48, 3)]]  # the whole image, then the 16x16 crop at 48 px
    crop = crop_resized(images[0], (8, 24, 16, 32), 48)
    np.testing.assert_allclose(desc[0], pool_tokens(PixelTokens()([crop])[0], None), rtol=1e-6)
    assert stats["cropped_images"] == 1 and stats["crop_area_fraction"] == pytest.approx(1 / 6)
    # A mask covering everything: no second pass, the baseline descriptor.
    tokens = PixelTokens()
    desc, stats = ffa_descriptors(FFAConfig(mode="crop-img", mask="none"), images, tokens)
    assert len(tokens.calls) == 1 and stats["cropped_images"] == 0
    np.testing.assert_allclose(desc[0], pool_tokens(PixelTokens()(images)[0], None), rtol=1e-6)


def test_empty_masks_fall_back_and_bad_masks_are_named():
    images = [scene(0), scene(1)]
    empty = PixelMaskFn(lambda img: np.zeros(img.shape[:2]), name="empty")
    desc, stats = ffa_descriptors(FFAConfig(), images, PixelTokens(), mask_fn=empty)
    assert stats["fallbacks"] == 2 and stats["foreground_fraction"] == 1.0
    np.testing.assert_allclose(desc[0], pool_tokens(PixelTokens()(images[:1])[0], None), rtol=1e-6)

    class Wrong:
        name = "wrong"

        def __call__(self, tokens, image):
            return np.ones((2, 2), bool)

    with pytest.raises(FFAError, match="wrong"):
        ffa_descriptors(FFAConfig(), images, PixelTokens(), mask_fn=Wrong())


def test_mask_choice_follows_the_config():
    from similarity.ffa.masks import get_mask_fn

    assert get_mask_fn(FFAConfig(mask="pca", pca_threshold=0.5)) == PCAMask(0.5)
    assert get_mask_fn(FFAConfig(mask="norm", norm_fraction=0.3)) == NormMask(0.3)
    assert get_mask_fn(FFAConfig(mask="none")) == FullMask()
    assert FullMask()(np.zeros((2, 3, 4)), None).all()


def test_config_is_checked():
    for bad in ({"mask": "sam"}, {"mode": "crop"}, {"pooling": "max"}, {"norm_fraction": 0.0}, {"min_tokens": 0}):
        with pytest.raises(FFAError):
            FFAConfig(**bad)
    with pytest.raises(GroupEvalError):
        GroupEvalConfig(odd_group_size=1)


# --- the real model and the CLI -----------------------------------------------------------------


@pytest.fixture(scope="module")
def lite0_tokens():
    import torch

    from similarity.ffa.tokens import TokenMaps

    torch.set_num_threads(1)
    return TokenMaps()


def test_baseline_gem_equals_the_global_descriptor(lite0_tokens, extractor, photos):
    from ingest.images import resized_size

    image = np.array(Image.fromarray(photos["chelsea"]).resize(resized_size(451, 300, 160)))
    tokens = lite0_tokens([image])[0]
    assert tokens.shape == (4, 5, 1280)  # stride 32, "same" padding
    np.testing.assert_allclose(pool_tokens(tokens, None, "gem"), extractor.forward_uint8(image[None])[0], atol=2e-5)


def write_class_folders(root: Path, photos) -> Path:
    """Three groups of three: each photo, its mirror and a crop; one more photo is a singleton."""
    for name in ("astronaut", "chelsea", "coffee"):
        d = root / name
        d.mkdir(parents=True)
        photo = photos[name]
        h, w = photo.shape[:2]
        for k, variant in enumerate([photo, photo[:, ::-1], photo[h // 8 : -h // 8, w // 8 : -w // 8]]):
            Image.fromarray(np.ascontiguousarray(variant)).save(d / f"{k}.jpg")
    (root / "rocket").mkdir()
    Image.fromarray(photos["rocket"]).save(root / "rocket" / "0.jpg")
    return root


def test_cli_eval_and_embed(tmp_path, photos):
    import torch

    from cli.main import main

    torch.set_num_threads(1)
    src = write_class_folders(tmp_path / "classes", photos)
    out = tmp_path / "report.json"
    args = [
        "similarity",
        "ffa",
        "eval",
        "--groups",
        str(src),
        "--mask",
        "pca",
        "--mode",
        "crop-img",
        "--resolution",
        "96",
        "--odd-trials",
        "40",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["counts"] == {
        "images": 10,
        "groups": 4,
        "queries": 9,
        "ari_pairs": 3,
        "ari_perfect_splits": report["counts"]["ari_perfect_splits"],
        "odd_trials": 40,
        "odd_eligible_groups": 3,
    }
    assert report["ffa"]["mask"] == "pca" and report["masks"]["mask"] == "pca" and report["extractor"]["weights_sha256"]
    assert report["top1"] > 60 and report["odd_one_out"] > 50  # real weights on near-duplicates, chance 33 / 25
    npz = tmp_path / "desc.npz"
    assert (
        main(
            [
                "similarity",
                "ffa",
                "embed",
                "--groups",
                str(src),
                "--mask",
                "norm",
                "--resolution",
                "96",
                "--out",
                str(npz),
            ]
        )
        == 0
    )
    with np.load(npz) as f:
        assert f["descriptors"].shape == (10, 1280) and list(f["labels"][:3]) == ["astronaut"] * 3
        np.testing.assert_allclose(np.linalg.norm(f["descriptors"], axis=1), 1.0, rtol=1e-5)
    assert json.loads((tmp_path / "desc.npz.json").read_text())["masks"]["mask"] == "norm"


def test_cli_bad_input_exits_2(tmp_path):
    from cli.main import main

    assert (
        main(["similarity", "ffa", "eval", "--groups", str(tmp_path / "missing"), "--out", str(tmp_path / "r.json")])
        == 2
    )
    assert (
        main(
            [
                "similarity",
                "ffa",
                "eval",
                "--groups",
                str(tmp_path),
                "--norm-fraction",
                "2",
                "--out",
                str(tmp_path / "r.json"),
            ]
        )
        == 2
    )
    assert not (tmp_path / "r.json").exists()


def test_load_rgb_names_an_undecodable_or_missing_image(tmp_path):
    from similarity.data import SimilarityDataError, load_rgb

    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8 not a jpeg")
    with pytest.raises(SimilarityDataError, match=r"cannot decode image .*bad.jpg"):
        load_rgb(bad, 64)
    with pytest.raises(SimilarityDataError, match=r"cannot read image .*missing.jpg"):
        load_rgb(tmp_path / "missing.jpg", 64)
