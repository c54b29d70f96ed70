"""The adaptation function (similarity/afn/*.py) and asymmetric recall (eval/pairs.py):
every fast computation against an explicit reference, pair sources, features, training, the CLI."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from core.errors import NeedleInputError
from eval.metrics import rank_by_score
from eval.pairs import asymmetric_recall, asymmetric_recall_from_scores, cosine_matrix, own_column_ranks
from similarity.afn.config import HEAD, MODEL_FORMAT, AdaptationFunctionError, AfnConfig, EvalConfig, FeatureConfig
from similarity.afn.evaluation import evaluate_splits, split_indices
from similarity.afn.features import build_layer_model, extract_features
from similarity.afn.model import fit_afn, fit_pca, load_model, save_model
from similarity.afn.pair_features import PairFeatures
from similarity.afn.pairs import load_pairs
from similarity.afn.training import symmetric_loss, train_adaptation
from similarity.data import SimilarityDataError

torch.set_num_threads(1)


# --- asymmetric recall ----------------------------------------------------------------------------


def _ar_reference(l2r: np.ndarray, r2l: np.ndarray, k: int) -> float:
    """Brute force: sort every row (ties to the lower column), look for the pair's own column in
    the first k, from either side."""
    n = l2r.shape[0]
    found = 0
    for i in range(n):
        from_left = list(rank_by_score(l2r[i : i + 1])[0][:k])
        from_right = list(rank_by_score(r2l[i : i + 1])[0][:k])
        found += (i in from_left) or (i in from_right)
    return 100.0 * found / n


@pytest.mark.parametrize("seed", range(6))
def test_asymmetric_recall_matches_bruteforce_with_ties_and_distractors(seed):
    rng = np.random.default_rng(seed)
    n, m = int(rng.integers(1, 9)), int(rng.integers(0, 6))
    # Scores from three values only: ties everywhere, so the tie rule is exercised.
    l2r = rng.integers(0, 3, size=(n, n + m)).astype(float)
    r2l = rng.integers(0, 3, size=(n, n + m)).astype(float)
    ks = list(range(1, n + m + 2))
    fast = asymmetric_recall_from_scores(l2r, r2l, ks)
    for k in ks:
        assert fast[k] == pytest.approx(_ar_reference(l2r, r2l, k)), k


def test_asymmetric_recall_of_features_matches_explicit_cosines():
    rng = np.random.default_rng(1)
    left, right, dis = rng.normal(size=(7, 5)), rng.normal(size=(7, 5)), rng.normal(size=(4, 5))
    left[2] = 0.0  # a zero vector: cosine 0 with everything, not NaN

    def cos(a, b):
        na, nb = math.sqrt(sum(v * v for v in a)), math.sqrt(sum(v * v for v in b))
        return 0.0 if na < 1e-8 or nb < 1e-8 else sum(x * y for x, y in zip(a, b)) / (na * nb)

    l2r = np.array([[cos(a, b) for b in [*right, *dis]] for a in left])
    r2l = np.array([[cos(a, b) for b in [*left, *dis]] for a in right])
    np.testing.assert_allclose(cosine_matrix(left, np.concatenate([right, dis])), l2r, atol=1e-12)
    got = asymmetric_recall(left, right, (1, 2, 3, 11), distractors=dis)
    for k in (1, 2, 3, 11):
        assert got[k] == pytest.approx(_ar_reference(l2r, r2l, k))
    assert got[11] == 100.0  # k >= gallery size: every pair is found


def test_a_pair_found_from_one_side_only_counts_once():
    # Pair 0: left_0 ranks right_1 first (miss at k=1) but right_0 ranks left_0 first (hit).
    l2r = np.array([[0.5, 0.9], [0.1, 0.8]])
    r2l = np.array([[0.9, 0.1], [0.95, 0.2]])
    assert own_column_ranks(l2r).tolist() == [1, 0]
    assert own_column_ranks(r2l).tolist() == [0, 1]
    assert asymmetric_recall_from_scores(l2r, r2l, [1]) == {1: 100.0}
    # A tie with a lower column goes to that column: the pair's own column 1 comes second.
    assert own_column_ranks(np.array([[1.0, 0.0], [0.5, 0.5]])).tolist() == [0, 1]


def test_asymmetric_recall_rejects_bad_input():
    x = np.ones((3, 4))
    with pytest.raises(NeedleInputError, match="k values"):
        asymmetric_recall(x, x, [0])
    with pytest.raises(NeedleInputError, match="both be"):
        asymmetric_recall(x, np.ones((2, 4)))
    with pytest.raises(NeedleInputError, match="distractors"):
        asymmetric_recall(x, x, [1], distractors=np.ones((2, 5)))
    with pytest.raises(NeedleInputError, match="m >= n"):
        own_column_ranks(np.ones((3, 2)))


# --- loss, PCA, training --------------------------------------------------------------------------


@pytest.mark.parametrize("sigma", [1.0, 1.5, 15.0])
def test_symmetric_loss_matches_explicit_softmax(sigma):
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(5, 6)), rng.normal(size=(5, 6))
    a[1] = 0.0
    got = float(symmetric_loss(torch.tensor(a), torch.tensor(b), sigma))

    def cos(u, v):
        nu, nv = max(math.sqrt(sum(x * x for x in u)), 1e-8), max(math.sqrt(sum(x * x for x in v)), 1e-8)
        return sum(x * y for x, y in zip(u, v)) / (nu * nv)

    s = [[cos(a[i], b[j]) for j in range(5)] for i in range(5)]
    # sigma multiplies the cosine (an inverse temperature), as in the authors' code.
    rows = [-(sigma * s[i][i]) + math.log(sum(math.exp(sigma * s[i][j]) for j in range(5))) for i in range(5)]
    cols = [-(sigma * s[j][j]) + math.log(sum(math.exp(sigma * s[i][j]) for i in range(5))) for j in range(5)]
    assert got == pytest.approx(0.5 * sum(rows) / 5 + 0.5 * sum(cols) / 5, rel=1e-9)


def test_pca_matches_sklearn_and_caps_its_dimension(caplog):
    from sklearn.decomposition import PCA

    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 12)) @ rng.normal(size=(12, 12))
    ours = fit_pca(x, 5)
    ref = PCA(5).fit(x)
    np.testing.assert_allclose(ours.mean, ref.mean_)
    # Components agree up to sign; the projections then too.
    np.testing.assert_allclose(np.abs(ours.components @ ref.components_.T), np.eye(5), atol=1e-8)
    np.testing.assert_allclose(np.abs(ours.apply(x)), np.abs(ref.transform(x)), rtol=1e-4, atol=1e-4)
    with caplog.at_level("WARNING"):
        capped = fit_pca(x[:6], 256)
    assert capped.dim == 5 and "PCA to 5 dimensions" in caplog.text
    with pytest.raises(AdaptationFunctionError, match="PCA needs"):
        fit_pca(x[:1], 4)


def _hidden_pairs(n: int, seed: int = 0) -> PairFeatures:
    """Pairs that share 6 signal dimensions, buried under 26 larger, independent nuisance ones:
    raw cosine confuses them; a learned projection does not."""
    rng = np.random.default_rng(seed)
    signal = rng.normal(size=(n, 6))
    left = np.concatenate([signal + 0.1 * rng.normal(size=(n, 6)), 1.5 * rng.normal(size=(n, 26))], axis=1)
    right = np.concatenate([signal + 0.1 * rng.normal(size=(n, 6)), 1.5 * rng.normal(size=(n, 26))], axis=1)
    return PairFeatures(left.astype(np.float32), right.astype(np.float32), [f"p{i}" for i in range(n)], {"toy": 1})


def test_adaptation_learns_a_pairing_raw_cosine_misses():
    feats = _hidden_pairs(80)
    conf = AfnConfig(pca_dim=32, hidden_dim=64, epochs=150, lr=1e-2)
    result = evaluate_splits(feats, conf, EvalConfig(splits=2, ks=(1, 5)), sigmas=(15.0,))
    before, after = result["pairs"]["before_raw"]["aR@1"]["mean"], result["pairs"]["sigma=15"]["aR@1"]["mean"]
    assert after > before + 20, (before, after)
    assert result["protocol"]["train_pairs"] == 60 and result["protocol"]["test_pairs"] == 20
    # Deterministic for a seed.
    again = evaluate_splits(feats, conf, EvalConfig(splits=2, ks=(1, 5)), sigmas=(15.0,))
    assert again["pairs"] == result["pairs"]


def test_training_lowers_the_loss_and_minibatches_cover_every_pair():
    feats = _hidden_pairs(31)
    for batch in (0, 8):  # 31 = 3 x 8 + 7; the last batch is kept (>= 2 pairs)
        module, history = train_adaptation(
            feats.left, feats.right, AfnConfig(hidden_dim=16, epochs=30, lr=1e-2, batch_size=batch)
        )
        assert history[-1] < history[0]
        assert module.weight_matrix.bias is None and module.weight_matrix.weight.shape == (16, 32)
    with pytest.raises(AdaptationFunctionError, match="batch_size"):
        AfnConfig(batch_size=1)


def test_model_round_trip_and_bad_files(tmp_path):
    feats = _hidden_pairs(20)
    model, _ = fit_afn(feats, AfnConfig(pca_dim=8, hidden_dim=16, epochs=3))
    path = save_model(model, tmp_path / "m.pt")
    loaded = load_model(path)
    np.testing.assert_allclose(loaded.embed(feats.left), model.embed(feats.left), rtol=1e-6)
    # embed == ReLU(W (x - mean) P^T), computed the long way.
    ref = np.maximum(
        (feats.left.astype(np.float64) - model.pca.mean) @ model.pca.components.T @ model.weight.T.astype(np.float64), 0
    )
    np.testing.assert_allclose(model.embed(feats.left), ref, rtol=1e-4, atol=1e-5)
    assert loaded.feature_config == {"toy": 1} and loaded.pca.dim == 8
    (tmp_path / "bad.pt").write_bytes(b"not a model")
    with pytest.raises(AdaptationFunctionError, match=r"bad.pt"):
        load_model(tmp_path / "bad.pt")
    torch.save(
        {
            "format": MODEL_FORMAT,
            "pca_mean": torch.zeros(4),
            "pca_components": torch.zeros(2, 5),
            "weight": torch.zeros(3, 2),
        },
        tmp_path / "shapes.pt",
    )
    with pytest.raises(AdaptationFunctionError, match="inconsistent shapes"):
        load_model(tmp_path / "shapes.pt")


def test_split_indices_are_disjoint_deterministic_and_sized():
    train, test = split_indices(56, 0.25, 3)
    assert len(test) == 14 and len(train) == 42
    assert sorted([*train, *test]) == list(range(56))
    t2, s2 = split_indices(56, 0.25, 3)
    assert (t2 == train).all() and (s2 == test).all()
    assert not np.array_equal(split_indices(56, 0.25, 4)[1], test)
    with pytest.raises(AdaptationFunctionError, match="cannot be split"):
        split_indices(3, 0.25, 0)


# --- pair sources ---------------------------------------------------------------------------------


def _img(path: Path, value: int, size=(40, 30)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(value)
    Image.fromarray(rng.integers(0, 255, size=(size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def test_pairs_from_groups_take_the_first_two_images_of_each_group(tmp_path):
    rows = [("a1", "A"), ("b1", "B"), ("a2", "A"), ("a3", "A"), ("c1", "C"), ("b2", "B")]
    for i, (key, _) in enumerate(rows):
        _img(tmp_path / "images" / f"{key}.jpg", i)
    with open(tmp_path / "groups.csv", "w", newline="") as f:
        csv.writer(f).writerows([("key", "group", "source"), *[(k, g, "x") for k, g in rows]])
    pairs = load_pairs(tmp_path)
    assert pairs.names == ("A", "B")  # C is a singleton
    assert [p.stem for p in pairs.left] == ["a1", "b1"] and [p.stem for p in pairs.right] == ["a2", "b2"]


def test_tll_layout_and_csv_pairs(tmp_path):
    for name in ("x.jpg", "y.jpg"):
        _img(tmp_path / "tll" / "left" / name, 1)
        _img(tmp_path / "tll" / "right" / name, 2)
    pairs = load_pairs(tmp_path / "tll")
    assert pairs.names == ("x.jpg", "y.jpg") and pairs.left[1].parent.name == "left"
    _img(tmp_path / "tll" / "right" / "z.jpg", 3)
    with pytest.raises(SimilarityDataError, match=r"only in right/: \['z.jpg'\]"):
        load_pairs(tmp_path / "tll")

    _img(tmp_path / "imgs" / "a.png", 4)
    _img(tmp_path / "imgs" / "b.png", 5)
    (tmp_path / "pairs.csv").write_text(
        f"left,right\nimgs/a.png,imgs/b.png\n{tmp_path / 'imgs' / 'b.png'},imgs/a.png\n"
    )
    pairs = load_pairs(tmp_path / "pairs.csv")
    assert pairs.left == (tmp_path / "imgs" / "a.png", tmp_path / "imgs" / "b.png")
    (tmp_path / "bad.csv").write_text("left,right\nimgs/a.png,imgs/missing.png\n")
    with pytest.raises(SimilarityDataError, match=r"line 2 column right names 'imgs/missing.png'"):
        load_pairs(tmp_path / "bad.csv")
    (tmp_path / "cols.csv").write_text("a,b\n1,2\n")
    with pytest.raises(SimilarityDataError, match="left,right"):
        load_pairs(tmp_path / "cols.csv")
    with pytest.raises(SimilarityDataError, match="neither"):
        load_pairs(tmp_path / "nothing_here")


# --- features (the real Lite0 weights, tiny images) ------------------------------------------------


@pytest.fixture(scope="module")
def lite0_small():
    conf = FeatureConfig(layers=("blocks.2", "blocks.5", HEAD), resolution=64, batch_size=4)
    return conf, build_layer_model(conf)


def test_features_are_per_layer_normalised_spatial_means(tmp_path, lite0_small):
    conf, model = lite0_small
    net, mean, std, weights = model
    assert weights is not None  # the shipped ImageNet weights, not a random init
    paths = [_img(tmp_path / f"{i}.png", i, size) for i, size in enumerate([(40, 30), (30, 40), (40, 30)])]
    feats = extract_features(paths, conf, model=model)
    assert feats.shape == (3, 40 + 192 + 1280) and feats.dtype == np.float32

    # Reference: timm's own forward_features, stage outputs caught by hooks, one image at a time.
    from similarity.data import load_rgb

    backbone = net.backbone
    for i, path in enumerate(paths):
        caught = {}
        hooks = [
            backbone.blocks[b].register_forward_hook(lambda _m, _i, out, b=b, caught=caught: caught.__setitem__(b, out))
            for b in (2, 5)
        ]
        x = torch.from_numpy(load_rgb(path, 64).copy()).permute(2, 0, 1)[None].float() / 255.0
        x = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
        with torch.inference_mode():
            head = backbone.forward_features(x)
        for h in hooks:
            h.remove()
        parts = [caught[2], caught[5], head]
        ref = np.concatenate([(p.mean(dim=(2, 3)) / p.mean(dim=(2, 3)).norm()).numpy()[0] for p in parts])
        np.testing.assert_allclose(feats[i], ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        [np.linalg.norm(feats[0, a:b]) for a, b in ((0, 40), (40, 232), (232, 1512))], 1, atol=1e-5
    )
    with pytest.raises(AdaptationFunctionError, match="unknown layer"):
        build_layer_model(FeatureConfig(layers=("blocks.9",)))


# --- CLI ------------------------------------------------------------------------------------------


def test_cli_features_train_eval(tmp_path, photos, capsys):
    from cli.main import main

    # TLL layout: each photo on the left, its mirrored, slightly cropped self on the right.
    for name, image in list(photos.items())[:5]:
        (tmp_path / "tll" / "left").mkdir(parents=True, exist_ok=True)
        (tmp_path / "tll" / "right").mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(tmp_path / "tll" / "left" / f"{name}.jpg")
        h = image.shape[0]
        Image.fromarray(np.ascontiguousarray(image[h // 10 :, ::-1])).save(tmp_path / "tll" / "right" / f"{name}.jpg")
    small = ["--resolution", "64", "--layers", "blocks.4", "head"]
    feats = tmp_path / "feats.npz"
    assert main(["similarity", "afn", "features", "--pairs", str(tmp_path / "tll"), "--out", str(feats), *small]) == 0
    record = json.loads((tmp_path / "feats.npz.json").read_text())
    assert record["pairs_count"] == 5 and record["dim"] == 112 + 1280

    model = tmp_path / "model.pt"
    assert (
        main(
            [
                "similarity",
                "afn",
                "train",
                "--pairs",
                str(feats),
                "--out",
                str(model),
                "--epochs",
                "5",
                "--sigma",
                "1.5",
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "model.pt.json").read_text())["pca_dim"] == 9  # 10 images: capped at n - 1
    capsys.readouterr()
    # A model evaluated on raw pairs extracts with the model's own feature settings.
    assert (
        main(
            [
                "similarity",
                "afn",
                "eval",
                "--pairs",
                str(tmp_path / "tll"),
                "--model",
                str(model),
                "--out",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["pairs"]) == {"before_raw", "before_pca", "after"} and printed["protocol"]["sigma"] == 1.5
    assert json.loads((tmp_path / "r.json").read_text())["pairs"] == printed["pairs"]

    assert (
        main(
            [
                "similarity",
                "afn",
                "eval",
                "--pairs",
                str(feats),
                "--splits",
                "2",
                "--epochs",
                "3",
                "--sigma",
                "1",
                "15",
                "--test-fraction",
                "0.4",
            ]
        )
        == 0
    )
    split_result = json.loads(capsys.readouterr().out)
    assert set(split_result["pairs"]) == {"before_raw", "before_pca", "sigma=1", "sigma=15"}
    assert split_result["pairs"]["sigma=15"]["aR@20"] == {"mean": 100.0, "two_std": 0.0}  # 2 test pairs

    # Bad input: exit code 2 (typed errors), never a traceback.
    assert main(["similarity", "afn", "eval", "--pairs", str(feats), "--model", str(feats)]) == 2
    assert main(["similarity", "afn", "eval", "--pairs", str(feats), "--resolution", "96"]) == 2
    assert main(["similarity", "afn", "train", "--pairs", str(tmp_path / "nope"), "--out", str(model)]) == 2
