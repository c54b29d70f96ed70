"""The model zoo: ILIAS presets over timm/open_clip, generic specs, any aspect ratio, --pretrained offline."""

import time
from typing import ClassVar

import pytest
import torch

from embed.models import build_global_model
from embed.registry import MODELS, PRETRAINED, RANDOM, UnknownModelError, WeightsError, get_model_config, one_level_up
from ingest.torchvision_compat import ensure_torchvision_importable

ZOO = sorted(n for n, c in MODELS.items() if c.dim is not None)
LARGE = {n for n in ZOO if any(k in n for k in ("_L", "large", "L14", "L16", "L320"))}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(2)


def _check_descriptors(name: str) -> None:
    model, path = build_global_model(name, None if get_model_config(name).weights else RANDOM)
    assert path is None or name == "tf_efficientnet_lite0.gem"  # the only preset with packaged weights
    conf = get_model_config(name)
    with torch.no_grad():
        for size in ((64, 96), (96, 64)):
            out = model(torch.rand(2, 3, *size))
            assert out.shape == (2, conf.dim), (name, size, tuple(out.shape))
            assert out.dtype == torch.float32
            torch.testing.assert_close(out.norm(dim=1), torch.ones(2), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in LARGE else n for n in ZOO])
def test_preset_gives_unit_descriptors_of_recorded_dim_for_any_aspect_ratio(name):
    _check_descriptors(name)


def test_presets_exist_in_installed_libraries():
    ensure_torchvision_importable()
    import open_clip
    import timm

    clip_models = set(open_clip.list_models())
    clip_pretrained = set(open_clip.list_pretrained())
    for name, conf in MODELS.items():
        if conf.library == "timm":
            assert timm.is_model(conf.architecture), name
            if conf.pretrained:
                assert timm.get_pretrained_cfg(conf.pretrained) is not None, name
        else:
            assert conf.architecture in clip_models, name
            if conf.pretrained:
                assert (conf.architecture, conf.pretrained) in clip_pretrained, name


def test_ilias_families_are_present():
    for name in [
        "siglip_B16_224.head",
        "siglip_B16_256.head",
        "siglip_B16_384.head",
        "siglip_B16_512.head",
        "siglip_L16_256.head",
        "siglip_L16_384.head",
        "siglip2_L16_512.head",
        "dinov2_B14.cls",
        "dinov2_B14_reg.cls",
        "dinov2_L14.cls",
        "dinov2_L14_reg.cls",
        "openclip_B16_laion2b.head",
        "openclip_L14_laion2b.head",
        "openclip_convnext_BW.head",
        "evaclip_B16.head",
        "metaclip_B16.head",
        "clip_B16_openai.head",
        "clip_RN50_openai.head",
        "resnet50.gem",
        "resnet101.gem",
        "convnext_base.gem",
    ]:
        assert name in MODELS, name


def test_test_resolutions_follow_one_level_up():
    assert get_model_config("siglip_B16_224.head").resolution == 384
    assert get_model_config("siglip_B16_256.head").resolution == 384
    assert get_model_config("siglip_B16_384.head").resolution == 512
    assert get_model_config("siglip2_L16_512.head").resolution == 724
    assert get_model_config("dinov2_B14.cls").resolution == 724
    assert get_model_config("resnet101.gem").resolution == 384
    assert get_model_config("openclip_convnext_L320.head").resolution == 512
    # fixed-size open_clip towers keep their train resolution (padded to a square, resized)
    assert get_model_config("clip_B16_openai.head").resolution == 224
    for name, conf in MODELS.items():
        if conf.test_resolution is None:
            assert conf.resolution == one_level_up(conf.train_resolution), name


def test_poolings_and_normalisation_follow_the_methods():
    assert get_model_config("siglip_B16_224.head").pooling == "head"
    assert get_model_config("siglip_B16_224.head").mean == (0.5, 0.5, 0.5)
    assert get_model_config("dinov2_L14_reg.cls").pooling == "cls"
    assert get_model_config("convnext_base.gem").pooling == "gem"
    assert get_model_config("metaclip_B16.head").std == pytest.approx((0.26862954, 0.26130258, 0.27577711))


def test_generic_timm_spec():
    conf = get_model_config("timm:resnet18")
    assert (conf.library, conf.architecture, conf.pooling, conf.train_resolution, conf.resolution) == (
        "timm",
        "resnet18",
        "gem",
        224,
        384,
    )
    vit = get_model_config("timm:vit_small_patch16_224.augreg_in21k@head")
    assert (vit.architecture, vit.pooling, vit.pretrained, vit.mean) == (
        "vit_small_patch16_224",
        "head",
        "vit_small_patch16_224.augreg_in21k",
        (0.5, 0.5, 0.5),
    )
    assert dict(vit.factory_kwargs)["dynamic_img_size"] is True
    assert get_model_config("timm:vit_small_patch14_dinov2").pooling == "cls"
    assert get_model_config("timm:vit_small_patch14_dinov2").resolution == 724
    model, _ = build_global_model("timm:resnet18", RANDOM)
    with torch.no_grad():
        out = model(torch.rand(1, 3, 64, 96))
    assert out.shape == (1, 512)


def test_generic_open_clip_spec():
    conf = get_model_config("open_clip:ViT-S-32")
    assert (conf.library, conf.pooling, conf.train_resolution, conf.dim, conf.pretrained) == (
        "open_clip",
        "head",
        224,
        384,
        None,
    )
    conf = get_model_config("open_clip:ViT-B-32/laion2b_s34b_b79k")
    assert conf.pretrained == "laion2b_s34b_b79k" and conf.dim == 512
    assert get_model_config("open_clip:convnext_base_w").resolution == 384
    model, _ = build_global_model("open_clip:ViT-S-32", RANDOM)
    with torch.no_grad():
        out = model(torch.rand(1, 3, 96, 64))
    assert out.shape == (1, 384)


@pytest.mark.parametrize(
    "spec", ["nope", "timm:nope", "timm:resnet18.nosuchtag", "open_clip:nope", "open_clip:ViT-B-32/nosuchtag"]
)
def test_unknown_specs_say_how_to_list(spec):
    with pytest.raises(UnknownModelError, match="list"):
        get_model_config(spec)


def test_text_tower_of_clip_presets():
    ensure_torchvision_importable()
    import open_clip

    for name in ("clip_B16_openai.head", "evaclip_B16.head"):
        net, _ = build_global_model(name, RANDOM)
        tokens = open_clip.get_tokenizer(MODELS[name].architecture)(["a red bicycle"])
        with torch.no_grad():
            text = net.backbone.encode_text(tokens)
        assert text.shape == (1, MODELS[name].dim)


@pytest.mark.parametrize("name", ["resnet50.gem", "siglip_B16_224.head", "clip_B16_openai.head", "timm:resnet18"])
def test_pretrained_offline_fails_fast_with_how_to(name):
    start = time.monotonic()
    with pytest.raises(WeightsError, match=r"offline.*--weights") as info:
        build_global_model(name, pretrained=True)
    assert name in str(info.value)
    with pytest.raises(WeightsError, match="offline"):
        build_global_model(name, PRETRAINED)  # the `--pretrained` spelling through the weights argument
    assert time.monotonic() - start < 5


def test_pretrained_fetch_failure_is_a_weights_error(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    ensure_torchvision_importable()
    import timm

    def no_network(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(timm, "create_model", no_network)
    with pytest.raises(WeightsError, match=r"resnet50\.gem.*no network.*--weights"):
        build_global_model("resnet50.gem", pretrained=True)


def test_pretrained_and_local_file_are_exclusive(tmp_path):
    with pytest.raises(WeightsError, match="not both"):
        build_global_model("resnet50.gem", tmp_path / "w.pth", pretrained=True)


def test_models_command_lists_presets(capsys):
    from cli.main import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "siglip_B16_384.head" in out and "dinov2_L14_reg.cls" in out
    line = next(l for l in out.splitlines() if l.startswith("siglip_B16_384.head"))
    assert "384" in line and "512" in line and "head" in line and "768" in line


def test_ingest_pretrained_and_weights_are_exclusive(capsys):
    from cli.main import main

    assert main(["ingest", "--shards", "x.tar", "--out", "o", "--pretrained", "--weights", "w.pth"]) == 2
    assert "give one of --weights, --pretrained, not several" in capsys.readouterr().err
    assert main(["ingest", "--shards", "x.tar", "--out", "o", "--pretrained", "--random-init"]) == 2
    assert "give one of --pretrained, --random-init, not several" in capsys.readouterr().err


def test_pretrained_is_recorded_and_queries_ask_for_it_again(monkeypatch):
    """An index ingested with --pretrained records it, so query embedding fetches the same weights
    (not a random initialisation)."""
    import embed.extract as extract
    from query.retrieve import recorded_extractor

    calls = []

    def fake_build(name, weights=None, pretrained=False):
        calls.append(weights)
        from embed.models import build_global_model

        return build_global_model(name, RANDOM)

    monkeypatch.setattr(extract, "build_global_model", fake_build)
    extractor = extract.GlobalExtractor("resnet50.gem", weights="pretrained", resolution=64)
    info = extractor.info()
    assert calls == ["pretrained"] and info["weights"] == "pretrained" and info["weights_sha256"] is None

    class Index:
        infos: ClassVar[dict] = {"extractors": [info]}
        path = "idx"

    assert recorded_extractor(Index())[1] == "pretrained"


def test_readme_lists_every_preset_with_its_resolutions():
    import re
    from pathlib import Path

    from embed.registry import MODELS, get_model_config

    readme = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    rows = {
        m.group(1): m.group(2, 3, 4, 5)
        for m in re.finditer(r"^\| `([^`]+)` \| (\w+) \| (\d+) \| (\d+) \| (\w+) \|", readme, re.M)
    }
    for name in MODELS:
        conf = get_model_config(name)
        assert rows.get(name) == (conf.library, str(conf.train_resolution), str(conf.resolution), conf.pooling), name
