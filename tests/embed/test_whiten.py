"""Whitening baselines (PCA, learned from pairs) and training classes made by augmentation."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from embed.adapt import AdapterError, load_adapter, save_adapter
from embed.augment import AugmentConfig, AugmentError, augmented_views
from embed.augment import main as make_classes
from embed.whiten import WhitenConfig, learned_whitening, pair_difference_covariance, pca_whitening, positive_pairs
from embed.whiten import main as whiten
from tests.support.index import write_descriptor_file

torch.set_num_threads(1)


def _weights(adapter) -> tuple[np.ndarray, np.ndarray]:
    return adapter.layer.weight.detach().numpy().astype(np.float64), adapter.layer.bias.detach().numpy().astype(
        np.float64
    )


def _correlated(n: int, d: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)) @ rng.normal(size=(d, d)) + rng.normal(size=d)


def _classes(seed: int, n_classes: int = 30, per_class: int = 6, d: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Classes whose within-class noise is large along 4 (rotated) directions and small elsewhere;
    the noise directions are the same for every seed (so whitening learned on one set carries over)."""
    rotation = np.linalg.qr(np.random.default_rng(99).normal(size=(d, d)))[0]
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(n_classes), per_class)
    scales = np.where(np.arange(d) < 4, 2.0, 0.15)
    x = rng.normal(size=(n_classes, d))[labels] + (rng.normal(size=(len(labels), d)) * scales) @ rotation.T
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32), labels


def _nn_accuracy(x: np.ndarray, labels: np.ndarray) -> float:
    sims = x @ x.T
    np.fill_diagonal(sims, -np.inf)
    return float((labels[sims.argmax(1)] == labels).mean())


# --- PCA whitening ----------------------------------------------------------------------------------


def test_pca_whitening_decorrelates_and_matches_sklearn():
    from sklearn.decomposition import PCA

    x = _correlated(400, 12)
    adapter = pca_whitening(x, 6, eps=0)
    w, b = _weights(adapter)
    cov = np.cov(x.T, bias=True)
    np.testing.assert_allclose(w @ cov @ w.T, np.eye(6), atol=1e-5)
    np.testing.assert_allclose(b, -w @ x.mean(0), rtol=1e-5, atol=1e-5)
    # sklearn whitens with the (n - 1) variance; ours uses n. Components agree up to their sign.
    reference = PCA(6, whiten=True).fit(x).transform(x) * np.sqrt(len(x) / (len(x) - 1))
    ours = x @ w.T + b
    signs = np.sign((ours * reference).sum(0))
    np.testing.assert_allclose(ours, reference * signs, atol=1e-4)
    unit = reference * signs / np.linalg.norm(reference, axis=1, keepdims=True)
    np.testing.assert_allclose(adapter.apply(x), unit, atol=1e-4)
    # The regulariser shrinks the whitening of each component to λ / (λ + r) variance.
    shrunk = _weights(pca_whitening(x, 6, eps=0.1))[0]
    variances = np.diag(shrunk @ cov @ shrunk.T)
    assert (variances < 1).all() and np.all(np.diff(variances) <= 1e-9)


def test_pca_whitening_rejects_impossible_shapes_and_leaves_torch_rng_alone():
    x = _correlated(5, 8)
    with pytest.raises(AdapterError, match=r"min\(d, n - 1\) = 4"):
        pca_whitening(x, 5)
    with pytest.raises(AdapterError, match="dimension 8"):
        pca_whitening(x, 9)
    with pytest.raises(AdapterError, match=r"\(8,\)"):
        pca_whitening(x[0], 2)
    bad = x.copy()
    bad[1, 2] = np.nan
    with pytest.raises(AdapterError, match="NaN"):
        pca_whitening(bad, 2)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    pca_whitening(x, 3)
    assert torch.equal(before, torch.get_rng_state())


# --- learned whitening ------------------------------------------------------------------------------


def test_learned_whitening_damps_within_class_variation_on_unseen_classes():
    x, labels = _classes(seed=0)
    test_x, test_labels = _classes(seed=1)  # other classes, same kind of noise
    learned = learned_whitening(x, labels, 12).apply(test_x)
    assert _nn_accuracy(learned, test_labels) >= _nn_accuracy(test_x, test_labels) + 0.2
    assert _nn_accuracy(learned, test_labels) > _nn_accuracy(pca_whitening(x, 12).apply(test_x), test_labels)


def test_learned_whitening_algebra():
    x, labels = _classes(seed=2, n_classes=40, per_class=4, d=10)
    x = x.astype(np.float64)
    eps = 1e-3
    w, b = _weights(learned_whitening(x, labels, 7, eps=eps))
    c_s, n_pairs = pair_difference_covariance(x, labels)
    assert n_pairs == 40 * 6
    r = eps * np.trace(c_s) / len(c_s)
    # P1 whitens the (regularised) pair differences and P2 is orthonormal: W (C_S + r I) Wᵀ = I.
    np.testing.assert_allclose(w @ (c_s + r * np.eye(10)) @ w.T, np.eye(7), atol=1e-4)
    # P2 holds the principal directions of the P1-whitened descriptors, in decreasing variance.
    projected = w @ np.cov(x.T, bias=True) @ w.T
    np.testing.assert_allclose(projected, np.diag(np.diag(projected)), atol=1e-4 * projected.max())
    assert np.all(np.diff(np.diag(projected)) <= 1e-6)
    np.testing.assert_allclose(b, -w @ x.mean(0), rtol=1e-5, atol=1e-5)


def test_pair_covariance_closed_form_equals_enumerated_pairs_and_sampling_is_seeded():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(60, 5))
    labels = rng.choice(["a", "b", "c", "d", "e", "f", "g"], size=60)
    labels[0] = "single"  # a class of one: no pair
    i, j = np.triu_indices(60, k=1)
    same = labels[i] == labels[j]
    diffs = x[i[same]] - x[j[same]]
    c_s, n_pairs = pair_difference_covariance(x, labels)
    assert n_pairs == same.sum()
    np.testing.assert_allclose(c_s, diffs.T @ diffs / len(diffs), atol=1e-12)
    a, b = positive_pairs(labels, 500, seed=1)
    assert (labels[a] == labels[b]).all() and (a != b).all() and "single" not in labels[a]
    np.testing.assert_array_equal(positive_pairs(labels, 500, seed=1)[0], a)
    sampled, n_sampled = pair_difference_covariance(x, labels, max_pairs=50, seed=1)
    assert n_sampled == 50 and not np.allclose(sampled, c_s)


def test_learned_whitening_rejects_bad_inputs():
    x = _correlated(20, 6)
    with pytest.raises(AdapterError, match="no class"):
        learned_whitening(x, np.arange(20), 4)
    with pytest.raises(AdapterError, match=r"labels \(19,\)"):
        learned_whitening(x, np.zeros(19), 4)
    with pytest.raises(AdapterError, match="out_dim 7"):
        learned_whitening(x, np.arange(20) // 2, 7)


# --- the whiten stage -------------------------------------------------------------------------------


def test_whiten_stage_round_trips_and_records_the_method(tmp_path):
    from cli.main import main as cli

    x, labels = _classes(seed=3, n_classes=8, per_class=10, d=16)
    desc = tmp_path / "desc"
    write_descriptor_file(desc, "000000", 0, x[:40].astype(np.float16))
    write_descriptor_file(desc, "000001", 1, x[40:].astype(np.float16))
    x16 = x.astype(np.float16).astype(np.float32)
    out = tmp_path / "pca.pt"
    assert cli(["adapt", "whiten", "--method", "pca", "--descriptors", str(desc), "--dim", "8", "--out", str(out)]) == 0
    loaded = load_adapter(out)
    np.testing.assert_allclose(loaded.apply(x16), pca_whitening(x16, 8).apply(x16), atol=1e-5)
    record = json.loads((tmp_path / "pca.pt.json").read_text())
    assert record["method"] == "whiten-pca" and record["samples"] == 80 and record["out_dim"] == 8
    # What save_adapter writes loads back and applies identically.
    again = load_adapter(save_adapter(loaded, tmp_path / "copy.pt"))
    np.testing.assert_array_equal(again.apply(x16), loaded.apply(x16))

    keys = [f"{shard}/{i:05d}" for shard in ("000000", "000001") for i in range(40)]
    (tmp_path / "labels.csv").write_text("key,label\n" + "".join(f"{k},c{l}\n" for k, l in zip(keys, labels)))
    learned = tmp_path / "learned.pt"
    assert (
        cli(
            [
                "adapt",
                "whiten",
                "--method",
                "learned",
                "--descriptors",
                str(desc),
                "--labels",
                str(tmp_path / "labels.csv"),
                "--dim",
                "8",
                "--out",
                str(learned),
            ]
        )
        == 0
    )
    np.testing.assert_allclose(
        load_adapter(learned).apply(x16), learned_whitening(x16, labels, 8).apply(x16), atol=1e-5
    )
    record = json.loads((tmp_path / "learned.pt.json").read_text())
    assert record["method"] == "whiten-learned" and record["classes"] == 8 and record["pairs"] == 8 * 45
    assert cli(["adapt", "whiten", "--method", "learned", "--descriptors", str(desc), "--out", str(learned)]) == 2
    assert cli(["adapt", "whiten", "--descriptors", str(desc), "--dim", "100", "--out", str(out)]) == 2
    with pytest.raises(AdapterError, match="'zca'"):
        whiten(WhitenConfig(method="zca"), desc, None, out)


# --- training classes by augmentation -------------------------------------------------------------


def _images(folder, count: int = 4, seed: int = 0) -> None:
    """Smooth random colour images (PIL), half JPEG and half PNG, of different sizes."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        coarse = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
        image = Image.fromarray(coarse).resize((160 + 20 * i, 120), Image.Resampling.BICUBIC)
        image.save(folder / f"img{i}.{'jpg' if i % 2 == 0 else 'png'}")


def _tar_members(path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def test_make_classes_is_deterministic_labels_match_tars_and_bad_images_are_skipped(tmp_path):
    _images(tmp_path / "in", 4)
    (tmp_path / "in" / "broken.jpg").write_bytes(b"not an image")
    good = (tmp_path / "in" / "img0.jpg").read_bytes()
    (tmp_path / "in" / "truncated.jpg").write_bytes(good[: len(good) // 3])
    conf = AugmentConfig(views=3, seed=7, max_side=96, samples_per_tar=5)
    labels_a = make_classes(conf, tmp_path / "in", tmp_path / "a")
    labels_b = make_classes(conf, tmp_path / "in", tmp_path / "b")
    tars = sorted(p.name for p in (tmp_path / "a").glob("classes-*.tar"))
    assert tars == ["classes-000000.tar", "classes-000001.tar", "classes-000002.tar"]  # 12 views, 5 per tar
    for name in tars:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert labels_a.read_bytes() == labels_b.read_bytes()

    with open(labels_a, newline="") as f:
        rows = list(csv.DictReader(f))
    members = {
        f"{name[: -len('.tar')]}/{member.rsplit('.', 1)[0]}": (name, member)
        for name in tars
        for member in _tar_members(tmp_path / "a" / name)
    }
    assert sorted(r["key"] for r in rows) == sorted(members)
    assert len(rows) == 12 and len({r["label"] for r in rows}) == 4
    for row in rows:
        name, _ = members[row["key"]]
        sample = row["key"].split("/", 1)[1]
        meta = json.loads(_tar_members(tmp_path / "a" / name)[f"{sample}.json"])
        assert f"c{meta['class']:06d}" == row["label"] and meta["source"].startswith("img")
        assert max(Image.open(io.BytesIO(_tar_members(tmp_path / "a" / name)[f"{sample}.jpg"])).size) <= 96
    info = json.loads((tmp_path / "a" / "augment_info.json").read_text())
    assert info["skipped"] == 2 and sorted(info["skipped_files"]) == ["broken.jpg", "truncated.jpg"]
    assert info["classes"] == 4 and info["samples"] == 12

    other = make_classes(
        AugmentConfig(views=3, seed=8, max_side=96, samples_per_tar=5), tmp_path / "in", tmp_path / "c"
    )
    assert (tmp_path / "c" / "classes-000001.tar").read_bytes() != (tmp_path / "a" / "classes-000001.tar").read_bytes()
    assert other.read_text() == labels_a.read_text()  # same keys and classes, other views
    # A smaller re-run into the same directory leaves no tar of the earlier run behind.
    make_classes(AugmentConfig(views=1, seed=7, max_side=96, samples_per_tar=5), tmp_path / "in", tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "augment_info.json",
        "classes-000000.tar",
        "labels.csv",
    ]


def test_augmented_views_differ_and_the_first_is_the_resized_original():
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, size=(12, 16, 3), dtype=np.uint8)).resize(
        (320, 240), Image.Resampling.BICUBIC
    )
    conf = AugmentConfig(max_side=100)
    views = augmented_views(image, 6, np.random.default_rng(1), conf)
    assert len(views) == 6 and all(max(v.size) <= 100 and v.mode == "RGB" for v in views)
    assert views[0].size == (100, 75)
    np.testing.assert_array_equal(np.asarray(views[0]), np.asarray(image.resize((100, 75), Image.Resampling.BICUBIC)))
    digests = {hashlib.sha256(v.tobytes() + str(v.size).encode()).hexdigest() for v in views}
    assert len(digests) == 6
    again = augmented_views(image, 6, np.random.default_rng(1), conf)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(views, again))


def test_make_classes_cli_and_bad_inputs(tmp_path):
    from cli.main import main as cli

    _images(tmp_path / "in", 3, seed=1)
    assert (
        cli(
            [
                "adapt",
                "make-classes",
                "--images",
                str(tmp_path / "in"),
                "--out",
                str(tmp_path / "out"),
                "--views",
                "2",
                "--seed",
                "1",
                "--max-side",
                "64",
            ]
        )
        == 0
    )
    rows = (tmp_path / "out" / "labels.csv").read_text().splitlines()
    assert rows[0] == "key,label" and rows[1] == "classes-000000/c000000_v00,c000000" and len(rows) == 7
    assert cli(["adapt", "make-classes", "--images", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) == 2
    with pytest.raises(AugmentError, match="views"):
        make_classes(AugmentConfig(views=0), tmp_path / "in", tmp_path / "out")
