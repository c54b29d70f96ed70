"""2AFC: the similarity models against brute force, the feature cache, and the context-sensitive
ensemble (its decisions, its formula, its file)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from similarity.data import SimilarityDataError, load_rgb
from similarity.twoafc.config import EnsembleConfig, EvalConfig
from similarity.twoafc.ensemble import load_ensemble, train_ensemble
from similarity.twoafc.evaluation import evaluate
from similarity.twoafc.features import FeatureStore, context_descriptors, triplet_scores
from similarity.twoafc.models import ChamferTokens, ColourHistogram, GlobalCosine, MultiStageCosine, TinyImage
from similarity.twoafc.registry import get_model, register_model
from similarity.twoafc.triplets import read_triplets
from tests.support.twoafc import _image, _one_thread  # noqa: F401  (_one_thread: an autouse fixture)

# --------------------------------------------------------------------------------------------------
# Models against brute force, and the feature cache
# --------------------------------------------------------------------------------------------------


def test_colour_histogram_and_tiny_image_match_brute_force(tmp_path):
    paths = [_image(tmp_path / f"{i}.png", i, size=(20, 13)) for i in range(4)]
    hist = ColourHistogram("h", bins=4, side=20)
    f = hist.extract(paths)
    for i, p in enumerate(paths):
        counts = np.zeros(64)
        for r, g, b in np.asarray(Image.open(p).convert("RGB")).reshape(-1, 3):
            counts[(r // 64) * 16 + (g // 64) * 4 + b // 64] += 1
        np.testing.assert_allclose(f["global"][i], counts / counts.sum(), atol=1e-7)
    ref, cand = np.array([0, 0, 1, 3]), np.array([1, 2, 2, 3])
    expected = [sum(min(x, y) for x, y in zip(f["global"][r], f["global"][c])) for r, c in zip(ref, cand)]
    np.testing.assert_allclose(hist.score(f, ref, cand), expected, rtol=1e-6)
    assert hist.score(f, np.array([3]), np.array([3]))[0] == pytest.approx(1.0)
    tiny = TinyImage("t", side=8)
    g = tiny.extract(paths)["global"]
    np.testing.assert_allclose(np.linalg.norm(g, axis=1), 1, atol=1e-6)
    np.testing.assert_allclose(g.reshape(4, -1).sum(1), 0, atol=1e-4)
    np.testing.assert_allclose(
        tiny.score({"global": g}, ref, cand), [float(g[r] @ g[c]) for r, c in zip(ref, cand)], rtol=1e-6
    )


class _Counting:
    """A fake model: one number per image (its file size), counting extract calls."""

    def __init__(self, name: str, version: int = 1):
        self.name, self.version, self.calls = name, version, []

    def extract(self, paths):
        self.calls.append(list(paths))
        sizes = np.asarray([Path(p).stat().st_size for p in paths])
        return {"global": np.column_stack([sizes, np.full(len(paths), self.version)]).astype(np.float64), "size": sizes}

    def score(self, features, ref, cand):
        return -np.abs(features["size"][ref] - features["size"][cand]).astype(np.float64)

    def info(self):
        return {"version": self.version}


def test_feature_store_computes_each_image_once_and_notices_changes(tmp_path):
    paths = [_image(tmp_path / f"{i}.jpg", i) for i in range(5)]
    store = FeatureStore(tmp_path / "cache", chunk=2)
    m = _Counting("count")
    first = store.features(m, paths[:3])
    assert sum(len(c) for c in m.calls) == 3 and [len(c) for c in m.calls] == [2, 1]
    both = store.features(m, [paths[2], paths[4], paths[0], paths[4]])
    assert sum(len(c) for c in m.calls) == 4  # only paths[4] was new, asked for once
    assert both["size"].tolist() == [
        first["size"][2],
        paths[4].stat().st_size,
        first["size"][0],
        paths[4].stat().st_size,
    ]
    # A new store on the same directory reads the cache; another version of the model recomputes.
    fresh = _Counting("count")
    FeatureStore(tmp_path / "cache").features(fresh, paths[:5:2])
    assert fresh.calls == []
    changed = _Counting("count", version=2)
    FeatureStore(tmp_path / "cache").features(changed, paths[:2])
    assert sum(len(c) for c in changed.calls) == 2
    # A rewritten file is a new key.
    _image(paths[0], 99, size=(30, 30))
    FeatureStore(tmp_path / "cache").features(changed, paths[:2])
    assert changed.calls[-1] == [paths[0]]


def test_a_model_with_inconsistent_features_is_refused(tmp_path):
    paths = [_image(tmp_path / f"{i}.jpg", i) for i in range(3)]

    class Bad(_Counting):
        def extract(self, paths):
            return {"global": np.zeros((len(paths) + 1, 2))}

    with pytest.raises(SimilarityDataError, match="feature 'global' has shape"):
        FeatureStore().features(Bad("bad"), paths)


@pytest.mark.slow
def test_lite0_models_match_brute_force(photos, tmp_path):
    """GeM cosine, multi-stage and Chamfer on small images, against separately computed references."""
    import torch
    import torch.nn.functional as F

    from core.tokens import hamming
    from embed.extract import GlobalExtractor

    paths = []
    for name, image in list(photos.items())[:4]:
        paths.append(tmp_path / f"{name}.png")
        Image.fromarray(image).save(paths[-1])
    ref, cand = np.array([0, 0, 1, 2, 3]), np.array([1, 2, 3, 3, 0])
    loaded = [load_rgb(p, 96) for p in paths]

    gc = GlobalCosine("g", 96)
    f = gc.extract(paths)
    direct = GlobalExtractor(resolution=96)
    x = np.stack([direct.forward_uint8(im[None].copy())[0] for im in loaded])
    np.testing.assert_allclose(gc.score(f, ref, cand), [float(x[r] @ x[c]) for r, c in zip(ref, cand)], atol=1e-5)

    ms = MultiStageCosine("m", 96, stages=(4, 5))
    fm = ms.extract(paths)
    net = direct.net
    captured = {}
    hooks = [
        net.backbone.blocks[b].register_forward_hook(lambda mod, i, o, b=b: captured.__setitem__(b, o)) for b in (4, 5)
    ]
    stages = []
    for im in loaded:
        xin = torch.from_numpy(im[None].copy()).permute(0, 3, 1, 2).float().div(255)
        xin = (xin - 0.5) / 0.5
        with torch.no_grad():
            head = net(xin)[0]  # the GlobalModel path: GeM p=3 of the last map, L2-normalised
        stages.append([F.normalize(captured[b].mean(dim=(2, 3)), dim=1)[0].numpy() for b in (4, 5)] + [head.numpy()])
    for hook in hooks:
        hook.remove()
    expected = [np.mean([float(stages[r][s] @ stages[c][s]) for s in range(3)]) for r, c in zip(ref, cand)]
    np.testing.assert_allclose(ms.score(fm, ref, cand), expected, atol=1e-5)

    ch = ChamferTokens("c", "lite0-s16", resolution=96)
    fc = ch.extract(paths)
    expected = []
    for r, c in zip(ref, cand):
        cr, cc = fc["codes"][r, : fc["count"][r]], fc["codes"][c, : fc["count"][c]]
        assert len(cr) > 0
        expected.append(np.mean([1 - 2 * min(row) / 128 for row in hamming(cr, cc)]))
    np.testing.assert_allclose(ch.score(fc, ref, cand), expected, atol=1e-9)


class _Table:
    """A fake model reading precomputed numbers: pair scores by (ref, cand) file names, or a context vector."""

    def __init__(self, name: str, pairs: dict | None = None, vectors: dict | None = None):
        self.name, self.pairs, self.vectors = name, pairs, vectors

    def extract(self, paths):
        out = {"id": np.asarray([int(Path(p).stem) for p in paths])}
        if self.vectors is not None:
            out["global"] = np.stack([self.vectors[int(Path(p).stem)] for p in paths])
        return out

    def score(self, features, ref, cand):
        ids = features["id"]
        return np.asarray([self.pairs.get((ids[r], ids[c]), 0.0) for r, c in zip(ref, cand)])

    def info(self):
        return {"fake": self.name}


def _context_world(tmp_path: Path, n: int = 160, seed: int = 0) -> Path:
    """Triplets whose reference lies in one of two context clusters: model m0 is right on cluster 0
    and wrong on cluster 1, m1 the other way round, m2 is right half of the time at random. Every
    single model and majority vote score about 50%; weights that follow the context score ~100%."""
    rng = np.random.default_rng(seed)
    pairs = {m: {} for m in ("m0", "m1", "m2")}
    vectors, rows = {}, ["ref,a,b,label,group,split"]
    for i in range(n):
        r, a, b = 3 * i, 3 * i + 1, 3 * i + 2
        for f in (r, a, b):
            (tmp_path / f"{f}.jpg").write_bytes(b"x")
        cluster = i % 2
        vectors[r] = np.eye(8)[cluster] * 2 + 0.3 * rng.normal(size=8)
        vectors[a] = vectors[b] = rng.normal(size=8)
        label = int(rng.integers(0, 2))
        closer, farther = (a, b) if label == 0 else (b, a)
        right = {"m0": cluster == 0, "m1": cluster == 1, "m2": bool(rng.random() < 0.5)}
        for m, ok in right.items():
            margin = (0.5 + rng.random()) * {"m0": 1.0, "m1": 10.0, "m2": 0.1}[m]  # unlike scales: c_k matters
            pairs[m][(r, closer if ok else farther)] = margin
            pairs[m][(r, farther if ok else closer)] = 0.0
        rows.append(f"{r}.jpg,{a}.jpg,{b}.jpg,{label},c{i},{'val' if i < n // 2 else 'test'}")
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    for m in pairs:
        register_model(f"fake-{m}", lambda m=m: _Table(f"fake-{m}", pairs=pairs[m]))
    register_model("fake-ctx", lambda: _Table("fake-ctx", vectors=vectors))
    return tmp_path / "t.csv"


FAKES = ("fake-m0", "fake-m1", "fake-m2")


def test_ensemble_follows_the_context_where_single_models_and_voting_cannot(tmp_path):
    csv_path = _context_world(tmp_path)
    conf = EnsembleConfig(models=FAKES, context_model="fake-ctx", pca_dim=4, hidden=8, epochs=150)
    ens = train_ensemble(conf, csv_path, tmp_path / "ens.pt")
    info = json.loads((tmp_path / "ens.pt.json").read_text())
    assert info["split"] == "val" and info["n"] == 80 and info["pca_dim"] == 4
    out = evaluate(EvalConfig(), csv_path, ens, tmp_path / "report.json")
    acc = {m: s["accuracy_pct"] for m, s in out["methods"].items()}
    assert out["split"] == "test" and out["n"] == 80
    assert max(acc["fake-m0"], acc["fake-m1"], acc["majority_vote"], acc["mean_margin"]) < 70
    # The paper's weights (shares of the predicted probabilities) leave the coin-flipping m2 a third of
    # the say; log-odds weights give it none.
    assert acc["ensemble"] > 80 and acc["ensemble_log_odds"] > 95
    assert out["ensemble_vs_best_single"]["better"] > 20
    assert json.loads((tmp_path / "report.json").read_text())["methods"] == out["methods"]
    with pytest.raises(SimilarityDataError, match="differs"):
        evaluate(EvalConfig(models=("fake-m0", "fake-m1")), csv_path, ens)


def test_ensemble_decisions_follow_the_documented_formula(tmp_path):
    import torch

    csv_path = _context_world(tmp_path, n=60, seed=1)
    conf = EnsembleConfig(models=FAKES, context_model="fake-ctx", pca_dim=3, hidden=4, epochs=30)
    ens = load_ensemble(train_ensemble(conf, csv_path, tmp_path / "ens.pt"))
    data = read_triplets(csv_path, "val")
    store = FeatureStore()
    sa, sb = triplet_scores([get_model(m) for m in FAKES], data, store)
    margins = sa - sb
    # c_k: the median absolute non-zero margin on the training triplets.
    for k in range(3):
        nz = np.abs(margins[:, k])[margins[:, k] != 0]
        assert ens.margin_scale[k].item() == pytest.approx(float(np.median(nz)))
    ctx, fit = context_descriptors("fake-ctx", data, store)
    # The PCA: the leading right singular vectors of the centred training descriptors.
    centred = fit - fit.mean(0)
    _, _s, vt = np.linalg.svd(centred, full_matrices=False)
    np.testing.assert_allclose(np.abs(ens.pca_components.numpy()), np.abs(vt[:3]), atol=1e-8)
    decisions = ens.decide(margins, ctx)
    for i in range(len(data)):
        z = torch.from_numpy(
            ((ctx[i] - ens.pca_mean.numpy()) @ ens.pca_components.numpy().T) / ens.pca_scale.item()
        ).float()
        with torch.no_grad():
            p = [torch.sigmoid(reg(z[None]))[0, 0].item() for reg in ens.regressors]
        w = [x / sum(p) for x in p]
        total = sum(w[k] * margins[i, k] / ens.margin_scale[k].item() for k in range(3))
        assert decisions[i] == (1 if total > 0 else -1 if total < 0 else 0)
        assert sum(w) == pytest.approx(1.0)


def test_ensemble_file_round_trip_and_bad_files(tmp_path):
    import torch

    csv_path = _context_world(tmp_path, n=40, seed=2)
    conf = EnsembleConfig(models=FAKES, context_model="fake-ctx", pca_dim=2, hidden=4, epochs=5)
    path = train_ensemble(conf, csv_path, tmp_path / "ens.pt")
    a, b = load_ensemble(path), load_ensemble(path)
    x = np.random.default_rng(0).normal(size=(10, 8))
    np.testing.assert_array_equal(a.weights(x), b.weights(x))
    assert a.names == list(FAKES) and a.context_model == "fake-ctx"
    with pytest.raises(SimilarityDataError, match="do not fit"):
        a.weights(np.zeros((2, 5)))
    torch.save({"format": "other"}, tmp_path / "bad.pt")
    with pytest.raises(SimilarityDataError, match="not a 2AFC ensemble"):
        load_ensemble(tmp_path / "bad.pt")
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(SimilarityDataError, match="cannot load"):
        load_ensemble(tmp_path / "junk.pt")
    with pytest.raises(SimilarityDataError, match="at least two models"):
        EnsembleConfig(models=("fake-m0",))
