"""The model registry, weights loading, pooling and the torchvision import fix."""

import numpy as np
import pytest
import torch

from embed.extract import batches_by_shape
from embed.models import build_global_model, load_weights
from embed.pooling import gem
from embed.registry import MODELS, RANDOM, UnknownModelError, WeightsError, get_model_config, one_level_up
from ingest.torchvision_compat import ensure_torchvision_importable


def test_one_level_up_rule():
    assert [one_level_up(r) for r in (224, 256, 320, 336, 384, 448, 512, 518)] == [
        384,
        384,
        512,
        512,
        512,
        512,
        724,
        724,
    ]
    assert get_model_config("tf_efficientnet_lite0.gem").resolution == 384


def test_unknown_model_lists_known_ones():
    with pytest.raises(UnknownModelError, match=r"tf_efficientnet_lite0\.gem"):
        get_model_config("nope")


def test_gem_limits():
    x = torch.rand(2, 4, 5, 6) + 0.1
    torch.testing.assert_close(gem(x, p=1.0), x.mean(dim=(2, 3)), rtol=1e-5, atol=1e-6)
    assert torch.all(gem(x, p=50.0) <= x.amax(dim=(2, 3)) + 1e-4)
    assert torch.all(gem(x, p=50.0) >= 0.9 * x.amax(dim=(2, 3)))


def test_torchvision_imports_after_fix():
    ensure_torchvision_importable()
    import timm  # noqa: F401
    import torchvision

    assert torchvision.__version__


def test_packaged_weights_map_in_order_and_classify(photos):
    from PIL import Image

    model, path = build_global_model("tf_efficientnet_lite0.gem")
    assert path is not None and path.name.endswith(".pth")
    image = np.array(Image.fromarray(photos["chelsea"]).resize((224, 224)))  # writable: torch shares its memory
    x = (torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255 - 0.5) / 0.5
    with torch.no_grad():
        logits = model.backbone(x)
    assert logits.argmax().item() in {281, 282, 285}  # tabby / tiger cat / Egyptian cat


def test_wrong_weights_file_is_named(tmp_path):
    bad = tmp_path / "bad.pth"
    torch.save({"conv.weight": torch.zeros(3, 3)}, bad)
    model, _ = build_global_model("tf_efficientnet_lite0.gem")
    with pytest.raises(WeightsError, match=r"bad\.pth"):
        load_weights(model.backbone, bad, "auto")
    with pytest.raises(WeightsError, match="does not exist"):
        build_global_model("resnet50.gem", tmp_path / "missing.pth")


def test_random_initialisation_only_when_asked_and_then_seeded():
    with pytest.raises(WeightsError, match=r"'resnet50.gem' has no packaged weights.*--weights.*--random-init"):
        build_global_model("resnet50.gem")  # never a silent random initialisation
    a, _ = build_global_model("timm:resnet18", RANDOM)
    torch.manual_seed(123)  # the global RNG state does not matter: the initialisation is seeded
    b, _ = build_global_model("timm:resnet18", RANDOM)
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def test_local_weights_file_round_trips(tmp_path):
    model, _ = build_global_model("tf_efficientnet_lite0.gem")
    saved = tmp_path / "lite0_timm_names.pth"
    torch.save(model.backbone.state_dict(), saved)
    again, path = build_global_model("tf_efficientnet_lite0.gem", saved)
    assert path == saved
    x = torch.rand(1, 3, 96, 128)
    torch.testing.assert_close(again(x), model(x))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit_base_patch16_224.cls", "open_clip.ViT-B-16.head", "resnet50.gem"])
def test_random_init_presets_give_unit_descriptors(name):
    model, path = build_global_model(name, RANDOM)
    assert path is None
    conf = MODELS[name]
    size = (224, 224) if conf.library == "open_clip" else (160, 240)
    with torch.no_grad():
        out = model(torch.rand(2, 3, *size))
    assert out.ndim == 2 and out.shape[0] == 2
    torch.testing.assert_close(out.norm(dim=1), torch.ones(2), rtol=1e-4, atol=1e-4)


def test_batches_group_equal_shapes():
    images = [np.zeros(s, np.uint8) for s in [(4, 6, 3), (6, 4, 3), (4, 6, 3), (4, 6, 3)]]
    batches = batches_by_shape(images, batch_size=2)
    assert sorted(map(sorted, batches)) == [[0, 2], [1], [3]]
