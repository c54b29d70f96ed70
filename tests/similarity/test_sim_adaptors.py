"""Adaptors with attention fusion on a frozen backbone (similarity/adaptors/*.py): the k-means pseudo
labels, the adapted network and its fusion against brute force, training, the adaptors file and the CLI."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module", autouse=True)
def _torch_setup():
    from ingest.torchvision_compat import ensure_torchvision_importable

    ensure_torchvision_importable()
    import torch

    torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------
# k-means and neighbours
# ---------------------------------------------------------------------------------------------


def test_kmeans_fixed_point_and_blobs():
    from similarity.adaptors.clusters import pseudo_labels as kmeans

    rng = np.random.default_rng(0)
    centres = rng.normal(size=(5, 8)) * 10
    truth = np.repeat(np.arange(5), 30)
    x = centres[truth] + rng.normal(size=(150, 8))
    c, labels = kmeans(x, 5, seed=1)
    d = ((x[:, None, :] - c[None].astype(np.float64)) ** 2).sum(-1)
    np.testing.assert_array_equal(labels, d.argmin(1))  # each point at its nearest centroid
    for j in range(5):
        np.testing.assert_allclose(c[j], x[labels == j].mean(0), rtol=1e-5, atol=1e-5)  # centroid = mean
    # the blobs are recovered up to a renaming
    assert len({(t, l) for t, l in zip(truth, labels)}) == 5
    c2, labels2 = kmeans(x, 5, seed=1)
    np.testing.assert_array_equal(labels, labels2)
    np.testing.assert_array_equal(c, c2)


def test_kmeans_no_empty_cluster_and_errors():
    from similarity.adaptors.clusters import pseudo_labels as kmeans
    from similarity.adaptors.config import AdaptorsError

    x = np.concatenate([np.zeros((10, 2)), np.ones((2, 2))])  # many duplicates: clusters could empty
    _, labels = kmeans(x, 4, seed=0)
    assert set(labels) == {0, 1, 2, 3}
    with pytest.raises(AdaptorsError, match="cannot make 13 clusters of 12"):
        kmeans(x, 13)
    with pytest.raises(AdaptorsError, match="finite"):
        kmeans(np.full((4, 2), np.nan), 2)


def test_nearest_neighbours_brute_force():
    from similarity.adaptors.clusters import nearest_neighbours

    rng = np.random.default_rng(3)
    x = rng.integers(0, 3, (20, 4)).astype(float)  # integer vectors: many tied similarities
    got = nearest_neighbours(x, 5)
    for q in range(20):
        want = sorted((j for j in range(20) if j != q), key=lambda j: (-float(x[q] @ x[j]), j))[:5]
        assert got[q].tolist() == want


# ---------------------------------------------------------------------------------------------
# The adapted network (a tiny random ViT; a random-init Lite0)
# ---------------------------------------------------------------------------------------------


def tiny_vit():
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        embed_dim=32,
        depth=3,
        num_heads=2,
        num_classes=0,
    ).eval()


def tiny_lite0():
    import timm

    return timm.create_model("tf_efficientnet_lite0", pretrained=False).eval()


def test_vit_frozen_path_is_the_backbone_and_zero_adaptors_are_identity():
    import torch
    import torch.nn.functional as F

    from similarity.adaptors.config import FUSED
    from similarity.adaptors.net import make_adapted_net

    torch.manual_seed(0)
    vit = tiny_vit()
    net = make_adapted_net(vit, granularities=(2, 3), pooling="cls")
    assert net.stage_ids == (0, 1, 2)  # every block
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = F.normalize(vit.forward_features(x)[:, 0], dim=-1)
        for mode in ("frozen", 0, 1, FUSED):
            torch.testing.assert_close(net(x, mode), want)


def test_cnn_frozen_path_is_the_global_model():
    import torch

    from embed.models import GlobalModel
    from embed.registry import get_model_config
    from similarity.adaptors.net import make_adapted_net

    torch.manual_seed(0)
    lite = tiny_lite0()
    net = make_adapted_net(lite, granularities=(2,), pooling="gem")
    assert net.stage_ids == (5, 6)
    reference = GlobalModel(get_model_config("tf_efficientnet_lite0.gem"), lite).eval()
    x = torch.randn(2, 3, 64, 48)
    with torch.no_grad():
        torch.testing.assert_close(net(x, "frozen"), reference(x))
        torch.testing.assert_close(net(x, 0), reference(x))  # zero-initialised adaptor


def _randomise_adaptors(net, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.slots.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("kind", ["vit", "cnn"])
def test_fusion_matches_brute_force(kind):
    import torch

    from similarity.adaptors.net import make_adapted_net

    torch.manual_seed(0)
    backbone = tiny_vit() if kind == "vit" else tiny_lite0()
    net = make_adapted_net(
        backbone,
        granularities=(2, 3, 4),
        pooling="cls" if kind == "vit" else "gem",
        stages=(1,) if kind == "vit" else (6,),
        fusion_dim=8,
    ).eval()
    _randomise_adaptors(net)
    slot = next(iter(net.slots.values()))
    h = torch.randn(2, 5, 32) if kind == "vit" else torch.randn(2, 320, 3, 2)
    with torch.no_grad():
        out, weights = slot(h, "fused")
        for b in range(2):
            pool = (lambda t: t.mean(0)) if kind == "vit" else (lambda t: t.mean((1, 2)))
            deltas = [a(h[b : b + 1])[0] for a in slot.adaptors]
            q = slot.query.weight @ pool(h[b])
            logits = torch.stack([(slot.key.weight @ pool(h[b] + d)) @ q for d in deltas]) / math.sqrt(8)
            w = torch.exp(logits - logits.max())
            w = w / w.sum()
            torch.testing.assert_close(weights[b], w, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(out[b], h[b] + sum(wi * d for wi, d in zip(w, deltas)), rtol=1e-4, atol=1e-4)
        for i in range(3):  # a single adaptor: h + f_i(h)
            torch.testing.assert_close(slot(h, i)[0], h + slot.adaptors[i](h))


def test_attention_propagation_loss_brute_force():
    import torch

    from similarity.adaptors.training import attention_propagation_loss

    g = torch.Generator().manual_seed(0)
    bank = torch.softmax(torch.randn(10, 2, 3, generator=g), -1)
    weights = torch.softmax(torch.randn(4, 2, 3, generator=g), -1)
    neighbours = torch.randint(0, 10, (4, 5), generator=g)
    total = 0.0
    for b in range(4):
        for s in range(2):
            t = sum(bank[j, s] for j in neighbours[b]) / 5
            total += float(sum(t[i] * math.log(t[i] / weights[b, s, i]) for i in range(3)))
    assert float(attention_propagation_loss(weights, bank, neighbours)) == pytest.approx(total / 8, rel=1e-5)


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("kind", ["vit", "cnn"])
def test_training_keeps_backbone_frozen_and_only_adaptors_learn(kind):
    import torch

    from similarity.adaptors.config import FUSED, AdaptorsConfig
    from similarity.adaptors.net import make_adapted_net
    from similarity.adaptors.training import train_adaptor, train_fusion

    torch.manual_seed(0)
    backbone = tiny_vit() if kind == "vit" else tiny_lite0()
    net = make_adapted_net(backbone, granularities=(2, 3), pooling="cls" if kind == "vit" else "gem")
    before = _state(backbone)  # parameters and BatchNorm running statistics
    slots_before = _state(net.slots)
    side = 32 if kind == "vit" else 64
    with torch.no_grad():
        cache = net.stem(torch.randn(8, 3, side, side))
    conf = AdaptorsConfig(epochs=1, fusion_epochs=1, batch_size=4)
    gen = torch.Generator().manual_seed(0)
    centroids = np.random.default_rng(0).normal(size=(3, net.dim)).astype(np.float32)
    train_adaptor(net, cache, np.array([0, 1, 2, 0, 1, 2, 0, 1]), centroids, 1, conf, gen)

    for name, value in _state(backbone).items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=f"backbone {name} changed")
    assert all(p.grad is None for p in backbone.parameters())
    after = _state(net.slots)
    changed = {k for k in after if not torch.equal(after[k], slots_before[k])}
    assert changed and all(".adaptors.1." in k for k in changed)  # only adaptor set 1 learned
    assert all(p.grad is not None for p in net.adaptor_parameters(1))
    assert all(p.grad is None for p in net.adaptor_parameters(0) + net.fusion_parameters())
    assert net.heads[0].weight.grad is None and net.heads[1].weight.grad is not None

    knn = np.array([[(i + 1) % 8, (i + 2) % 8] for i in range(8)])
    history = train_fusion(net, cache, [np.arange(8) % 2, np.arange(8) % 3], knn, conf, gen)
    assert len(history) == 1 and np.isfinite(history[0]["classification"])
    for name, value in _state(backbone).items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=f"backbone {name} changed")
    fused = _state(net.slots)
    changed = {k for k in fused if not torch.equal(fused[k], after[k])}
    assert changed and all(k.endswith(("query.weight", "key.weight")) for k in changed)
    assert all(p.grad is None for p in net.adaptor_parameters(0) + net.adaptor_parameters(1))
    assert net.training is False and backbone.training is False
    with torch.no_grad():
        assert net.forward_cached(cache, FUSED)[0].shape == (8, net.dim)


def test_train_adaptors_is_deterministic_and_round_trips(tmp_path):
    import torch

    from similarity.adaptors.config import FUSED, AdaptorsConfig
    from similarity.adaptors.files import load_adaptors, save_adaptors
    from similarity.adaptors.net import make_adapted_net
    from similarity.adaptors.training import train_adaptors

    conf = AdaptorsConfig(granularities=(2, 3), epochs=1, fusion_epochs=1, batch_size=4, neighbours=2)
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        vit = tiny_vit()
        torch.manual_seed(1)
        net = make_adapted_net(vit, granularities=conf.granularities, pooling="cls")
        with torch.no_grad():
            cache = net.stem(torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(2)))
        record = train_adaptors(net, cache, conf)
        outs.append((net, vit, cache, record))
    (net, vit, cache, record), (net2, *_rest) = outs
    for k, v in net.slots.state_dict().items():
        torch.testing.assert_close(v, net2.slots.state_dict()[k], rtol=0, atol=0)
    assert [g["k"] for g in record["granularities"]] == [2, 3]
    assert set(record["fusion_mean_weights"]) == {"stage_0", "stage_1", "stage_2"}

    path = save_adaptors(
        net,
        conf,
        {
            "name": "tiny-vit",
            "pooling": "cls",
            "gem_p": 3.0,
            "weights": None,
            "weights_sha256": None,
            "mean": [0.5] * 3,
            "std": [0.5] * 3,
        },
        tmp_path / "a.pt",
    )
    loaded, conf2, record2 = load_adaptors(path, backbone=vit)
    assert conf2.granularities == (2, 3) and record2["name"] == "tiny-vit"
    with torch.no_grad():
        for mode in ("frozen", 0, 1, FUSED):
            torch.testing.assert_close(loaded.forward_cached(cache, mode)[0], net.forward_cached(cache, mode)[0])


def test_bad_inputs_are_typed_errors(tmp_path):
    from similarity.adaptors.config import AdaptorsError, parse_ints
    from similarity.adaptors.files import load_adaptors
    from similarity.adaptors.net import make_adapted_net

    with pytest.raises(AdaptorsError, match="stages must be increasing"):
        make_adapted_net(tiny_vit(), granularities=(2,), pooling="cls", stages=(2, 1))
    with pytest.raises(AdaptorsError, match="stages must be increasing"):
        make_adapted_net(tiny_vit(), granularities=(2,), pooling="cls", stages=(3,))
    with pytest.raises(AdaptorsError, match="neither"):
        import torch

        make_adapted_net(torch.nn.Linear(2, 2), granularities=(2,))
    with pytest.raises(AdaptorsError, match="comma-separated"):
        parse_ints("8,x", "--granularities")
    with pytest.raises(AdaptorsError, match="does not exist"):
        load_adaptors(tmp_path / "missing.pt")
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(AdaptorsError, match="cannot load"):
        load_adaptors(tmp_path / "bad.pt")


def test_training_images_of_a_realbench_directory_are_its_distractors_only(tmp_path):
    from similarity.adaptors.images import training_images

    (tmp_path / "images").mkdir()
    (tmp_path / "distractors").mkdir()
    for name in ("q1", "q2"):
        Image.new("RGB", (8, 8)).save(tmp_path / "images" / f"{name}.jpg")
    Image.new("RGB", (8, 8)).save(tmp_path / "distractors" / "d1.jpg")
    (tmp_path / "groups.csv").write_text("key,group,source\nq1,g,x\nq2,g,x\n")
    (tmp_path / "distractors.csv").write_text("file,source_repo,source_path,license\nd1.jpg,r,p,l\n")
    assert training_images(tmp_path) == [tmp_path / "distractors" / "d1.jpg"]
    assert sorted(training_images(tmp_path / "images")) == [
        tmp_path / "images" / "q1.jpg",
        tmp_path / "images" / "q2.jpg",
    ]


def _write_photos(root, photos, names, variants):
    """Images of each photo under root/<photo>/ : shifted crops and mirrors."""
    for name in names:
        (root / name).mkdir(parents=True)
        image = photos[name]
        h, w = image.shape[:2]
        for v in range(variants):
            crop = image[v * h // 16 : h - (variants - v) * h // 16, v * w // 16 :]
            if v % 2:
                crop = crop[:, ::-1]
            Image.fromarray(np.ascontiguousarray(crop)).save(root / name / f"{v}.jpg")


def test_cli_train_and_eval_end_to_end(tmp_path, photos, capsys):
    """Lite0 with its real weights, at 64 pixels: train on one set of photos, evaluate on others."""
    import json

    from cli.main import main

    _write_photos(tmp_path / "unlabelled", photos, ["astronaut", "coffee", "rocket"], 4)
    _write_photos(tmp_path / "classes", photos, ["chelsea", "camera", "coins"], 3)
    out = tmp_path / "adaptors.pt"
    assert (
        main(
            [
                "similarity",
                "adaptors",
                "train",
                "--images",
                str(tmp_path / "unlabelled"),
                "--out",
                str(out),
                "--granularities",
                "2,3",
                "--resolution",
                "64",
                "--epochs",
                "1",
                "--fusion-epochs",
                "1",
                "--batch-size",
                "8",
            ]
        )
        == 0
    )
    made = json.loads((tmp_path / "adaptors.pt.json").read_text())
    assert made["trained_on"] == 12 and made["stages"] == [5, 6]
    capsys.readouterr()
    assert (
        main(
            [
                "similarity",
                "adaptors",
                "eval",
                "--classes",
                str(tmp_path / "classes"),
                "--model",
                str(out),
                "--resolution",
                "64",
                "--out",
                str(tmp_path / "m.json"),
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert set(result["results"]) == {"frozen", "single_k2", "single_k3", "fused"}
    assert result["images"] == 9 and result["groups"] == 3
    for metrics in result["results"].values():
        assert 0 <= metrics["map_at_r"] <= 100 and 0 <= metrics["r_precision"] <= 100
    assert json.loads((tmp_path / "m.json").read_text()) == result
    # frozen through the adaptors file = frozen without it
    assert main(["similarity", "adaptors", "eval", "--classes", str(tmp_path / "classes"), "--resolution", "64"]) == 0
    assert json.loads(capsys.readouterr().out)["results"]["frozen"] == result["results"]["frozen"]


def test_cli_bad_input_exits_2(tmp_path):
    from cli.main import main

    assert (
        main(["similarity", "adaptors", "train", "--images", str(tmp_path / "none"), "--out", str(tmp_path / "a.pt")])
        == 2
    )
    assert (
        main(
            [
                "similarity",
                "adaptors",
                "train",
                "--images",
                str(tmp_path),
                "--out",
                str(tmp_path / "a.pt"),
                "--granularities",
                "8,x",
            ]
        )
        == 2
    )
    assert main(["similarity", "adaptors", "eval", "--classes", str(tmp_path / "none")]) == 2


def test_untrained_fusion_is_the_mean_of_the_adaptors():
    import torch

    from similarity.adaptors.net import make_adapted_net

    torch.manual_seed(0)
    net = make_adapted_net(tiny_lite0(), granularities=(2, 3, 4), pooling="gem", stages=(6,)).eval()
    slot = net.slots["6"]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for a in slot.adaptors:  # trained-looking adaptors, fusion as initialised (query at zero)
            for p in a.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        h = torch.randn(2, 320, 3, 3, generator=g)
        out, weights = slot(h, "fused")
        torch.testing.assert_close(weights, torch.full((2, 3), 1 / 3))
        torch.testing.assert_close(out, h + sum(a(h) for a in slot.adaptors) / 3)
