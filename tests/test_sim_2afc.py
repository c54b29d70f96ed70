"""2AFC: the accuracy and ensemble decisions against plain loops, triplet files (ours and NIGHTS'),
triplets made from groups, the similarity models against brute force, the feature cache, the
context-sensitive ensemble, and the CLI."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from eval import twoafc as metric
from similarity.data import SimilarityDataError, load_groups, load_rgb, realbench_distractors
from similarity.twoafc_config import EnsembleConfig, EvalConfig
from similarity.twoafc_ensemble import load_ensemble, train_ensemble
from similarity.twoafc_evaluation import evaluate
from similarity.twoafc_features import FeatureStore, context_descriptors, triplet_scores
from similarity.twoafc_mining import TripletConfig, make_triplets
from similarity.twoafc_models import ChamferTokens, ColourHistogram, GlobalCosine, MultiStageCosine, TinyImage
from similarity.twoafc_registry import get_model, register_model
from similarity.twoafc_triplets import read_triplets, resolve_split, write_triplets


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------
# eval/twoafc.py against loops
# --------------------------------------------------------------------------------------------------


def _credit_loop(d: int, y: float) -> float:
    if d > 0:
        return 1.0 - y
    if d < 0:
        return y
    return 0.5


def test_credit_and_accuracy_match_a_plain_loop():
    rng = np.random.default_rng(0)
    decisions = rng.integers(-1, 2, size=200)
    labels = np.where(rng.random(200) < 0.7, rng.integers(0, 2, size=200), rng.random(200))
    expected = [_credit_loop(int(d), float(y)) for d, y in zip(decisions, labels)]
    np.testing.assert_allclose(metric.credit(decisions, labels), expected)
    assert metric.accuracy(decisions, labels) == pytest.approx(np.mean(expected))
    # Sign conventions: label 0 means A is closer; a tie earns half whatever the label.
    assert metric.credit([1, -1, 0, 0], [0, 1, 0, 1]).tolist() == [1, 1, 0.5, 0.5]
    assert metric.credit([1, -1], [1, 0]).tolist() == [0, 0]
    s = metric.summary([1, 0, -1, 1], [0, 0, 0, 1])
    assert s == {
        "accuracy_pct": 37.5,
        "stderr_pct": round(100 * math.sqrt(0.375 * 0.625 / 4), 2),
        "n": 4,
        "credit": 1.5,
        "ties": 1,
    }


def test_decisions_majority_and_weighted_match_loops():
    rng = np.random.default_rng(1)
    n, K = 300, 5
    margins = rng.normal(size=(n, K)) * (rng.random((n, K)) < 0.8)  # some exact zeros (ties of one model)
    weights = rng.random((n, K))
    sa = rng.normal(size=n)
    sb = np.where(rng.random(n) < 0.1, sa, rng.normal(size=n))
    for i in range(n):
        assert metric.decisions_from_scores(sa, sb)[i] == (1 if sa[i] > sb[i] else -1 if sa[i] < sb[i] else 0)
    votes = metric.majority_vote(margins)
    weighted = metric.weighted_decision(margins, weights)
    for i in range(n):
        total = sum((1 if m > 0 else -1 if m < 0 else 0) for m in margins[i])
        assert votes[i] == (1 if total > 0 else -1 if total < 0 else 0)
        s = sum(w * m for w, m in zip(weights[i], margins[i]))
        assert weighted[i] == (1 if s > 0 else -1 if s < 0 else 0)
    assert metric.paired([1, 1, -1], [1, -1, 1], [0, 0, 0]) == {"better": 1, "worse": 1, "same": 1}


def test_bad_labels_and_shapes_are_refused():
    with pytest.raises(metric.TwoAFCError, match="triplet 1"):
        metric.credit([1, 1], [0, 1.5])
    with pytest.raises(metric.TwoAFCError):
        metric.credit([1, 1, 1], [0, 1])
    with pytest.raises(metric.TwoAFCError):
        metric.weighted_decision(np.zeros((3, 2)), np.zeros((3, 3)))


# --------------------------------------------------------------------------------------------------
# Triplet files
# --------------------------------------------------------------------------------------------------


def _image(path: Path, seed: int, size: tuple[int, int] = (48, 40)) -> Path:
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(5, 6, 3), dtype=np.uint8)
    array = np.asarray(Image.fromarray(blocks).resize(size, Image.Resampling.NEAREST))
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, quality=95)
    return path


def test_our_csv_format_reads_relative_paths_splits_and_soft_labels(tmp_path):
    for name in "rab":
        _image(tmp_path / "img" / f"{name}.jpg", ord(name))
    rows = [
        "ref,a,b,label,group,split,kind",
        "img/r.jpg,img/a.jpg,img/b.jpg,0,g1,val,hard",
        f"{tmp_path / 'img/r.jpg'},img/b.jpg,img/a.jpg,0.25,g2,test,",
    ]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    all_ = read_triplets(tmp_path / "t.csv")
    assert len(all_) == 2 and all_.ref[0] == tmp_path / "img/r.jpg" and all_.label.tolist() == [0, 0.25]
    val = read_triplets(tmp_path / "t.csv", "val")
    assert len(val) == 1 and val.group == ("g1",) and val.kind == ("hard",)
    assert resolve_split(tmp_path / "t.csv", "auto", "test") == "test"
    assert resolve_split(tmp_path / "t.csv", "all", "test") is None
    with pytest.raises(SimilarityDataError, match="split 'train'"):
        read_triplets(tmp_path / "t.csv", "train")
    # Written back, relative to the new CSV, and read again: the same triplets.
    out = write_triplets(all_, tmp_path / "sub" / "copy.csv")
    again = read_triplets(out)
    assert again.ref == all_.ref and again.b == all_.b and again.label.tolist() == all_.label.tolist()
    with open(out) as f:
        assert not Path(next(csv.DictReader(f))["ref"]).is_absolute()


def test_nights_format_votes_and_filters(tmp_path):
    for sub in ("ref/000/000.png", "distort/000/000_0.png", "distort/000/000_1.png", "ref/000/001.png"):
        _image(tmp_path / sub, len(sub))
    rows = [
        "id,left_vote,right_vote,votes,ref_path,left_path,right_path,split,is_imagenet",
        "0,0.25,0.75,8,ref/000/000.png,distort/000/000_0.png,distort/000/000_1.png,test,True",
        "1,2,6,8,ref/000/001.png,distort/000/000_0.png,distort/000/000_1.png,test,False",
        "2,1.0,0.0,5,ref/000/000.png,distort/000/000_0.png,distort/000/000_1.png,val,True",
    ]
    (tmp_path / "data.csv").write_text("\n".join(rows) + "\n")
    test = read_triplets(tmp_path / "data.csv", "test")
    assert test.label.tolist() == [0.75, 0.75]  # fractions and counts give the share for the right image
    assert test.a[0] == tmp_path / "distort/000/000_0.png" and test.b[0] == tmp_path / "distort/000/000_1.png"
    assert len(read_triplets(tmp_path / "data.csv", None, min_votes=6)) == 2
    with pytest.raises(SimilarityDataError, match="no triplet left"):
        read_triplets(tmp_path / "data.csv", "val", min_votes=6)


@pytest.mark.parametrize(
    "rows, match",
    [
        (["x,y,z", "1,2,3"], "neither columns"),
        (["ref,a,b,label", "r.jpg,a.jpg,b.jpg,2"], "row 1 has label 2"),
        (["ref,a,b,label", "r.jpg,a.jpg,b.jpg,left"], "non-numeric label"),
        (["ref,a,b,label", "r.jpg,a.jpg,missing.jpg,0"], "missing.jpg"),
    ],
)
def test_bad_triplet_files_name_the_problem(tmp_path, rows, match):
    for name in "rab":
        _image(tmp_path / f"{name}.jpg", 1)
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(SimilarityDataError, match=match):
        read_triplets(tmp_path / "t.csv")
    with pytest.raises(SimilarityDataError, match="does not exist"):
        read_triplets(tmp_path / "nope.csv")


# --------------------------------------------------------------------------------------------------
# Making triplets
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def groups_dir(tmp_path) -> Path:
    """realbench-like: 8 groups of 2-4 noisy copies of one pattern, 2 singletons, 16 distractors."""
    root = tmp_path / "bench"
    rows = []
    rng = np.random.default_rng(5)
    for g, size in enumerate([2, 2, 3, 4, 2, 3, 2, 2, 1, 1]):
        base = rng.integers(0, 256, size=(5, 6, 3)).astype(np.int16)
        for i in range(size):
            noisy = np.clip(base + rng.integers(-20, 21, size=base.shape), 0, 255).astype(np.uint8)
            key = f"g{g}_{i}"
            path = root / "images" / f"{key}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.asarray(Image.fromarray(noisy).resize((48, 40), Image.Resampling.NEAREST))).save(path)
            rows.append(f"{key},g{g},test")
    (root / "groups.csv").write_text("key,group,source\n" + "\n".join(rows) + "\n")
    files = []
    for d in range(16):
        files.append(_image(root / "distractors" / f"d{d}.jpg", 1000 + d).name)
    (root / "distractors.csv").write_text("file,source,license\n" + "\n".join(f"{f},test,none" for f in files) + "\n")
    return root


def _group_of(path: Path) -> str:
    return path.stem.split("_")[0] if path.parent.name == "images" else "distractor"


def test_made_triplets_have_known_answers_and_disjoint_splits(groups_dir, tmp_path):
    conf = TripletConfig(seed=3, max_pairs_per_group=4, random_distractors=2, other_groups=1, hard=1, hard_pool=3)
    out = make_triplets(conf, groups_dir, tmp_path / "out" / "triplets.csv")
    tr = read_triplets(out)
    info = json.loads(out.with_name("triplets.csv.json").read_text())
    assert info["triplets"] == len(tr)
    images_of = {"val": set(), "test": set()}
    groups_of = {"val": set(), "test": set()}
    for i in range(len(tr)):
        pos, neg = (tr.a[i], tr.b[i]) if tr.label[i] == 0 else (tr.b[i], tr.a[i])
        assert _group_of(tr.ref[i]) == _group_of(pos) == tr.group[i] and tr.ref[i] != pos
        assert _group_of(neg) != tr.group[i]
        if tr.kind[i] == "distractor":
            assert _group_of(neg) == "distractor"
        if tr.kind[i] == "other_group":
            assert _group_of(neg).startswith("g")
        images_of[tr.split[i]] |= {tr.ref[i], tr.a[i], tr.b[i]}
        groups_of[tr.split[i]] |= {_group_of(p) for p in (tr.ref[i], tr.a[i], tr.b[i])} - {"distractor"}
    assert not images_of["val"] & images_of["test"] and not groups_of["val"] & groups_of["test"]
    # Per pair: 2 random distractors + 1 other group + 1 hard (one miner); pairs capped at 4 per group.
    sizes = [2, 2, 3, 4, 2, 3, 2, 2]
    assert len(tr) == 4 * sum(min(s * (s - 1), 4) for s in sizes)
    assert set(tr.kind) == {"distractor", "other_group", "hard:tiny-32"}
    assert 0.2 < tr.label.mean() < 0.8  # the closer image is on either side
    # Deterministic for a seed; another seed draws other triplets.
    again = make_triplets(conf, groups_dir, tmp_path / "again.csv")
    assert read_triplets(again).b == tr.b and read_triplets(again).label.tolist() == tr.label.tolist()
    other = make_triplets(TripletConfig(seed=4, max_pairs_per_group=4), groups_dir, tmp_path / "other.csv")
    assert read_triplets(other).b != tr.b


def test_hard_b_is_the_miners_nearest_image(groups_dir, tmp_path):
    conf = TripletConfig(seed=0, random_distractors=0, other_groups=0, hard=1, hard_pool=1, val_fraction=1.0)
    tr = read_triplets(make_triplets(conf, groups_dir, tmp_path / "hard.csv"))
    groups = load_groups(groups_dir)
    pool = [p for g in sorted(groups) for p in groups[g]] + realbench_distractors(groups_dir)

    def tiny(path: Path) -> np.ndarray:  # written out again: 64 px read, 32 x 32 squash, centred, unit norm
        image = Image.fromarray(load_rgb(path, 64)).resize((32, 32), Image.Resampling.BICUBIC)
        x = np.asarray(image, np.float64).reshape(-1)
        x -= x.mean()
        return x / np.linalg.norm(x)

    x = {p: tiny(p) for p in pool}
    for i in range(len(tr)):
        neg = tr.b[i] if tr.label[i] == 0 else tr.a[i]
        candidates = [p for p in pool if _group_of(p) != tr.group[i]]
        best = max(candidates, key=lambda p: float(x[p] @ x[tr.ref[i]]))
        assert neg == best


def test_bad_triplet_configs_are_refused(groups_dir, tmp_path):
    with pytest.raises(SimilarityDataError):
        TripletConfig(val_fraction=1.5)
    with pytest.raises(SimilarityDataError):
        TripletConfig(random_distractors=0, other_groups=0, hard=0)
    with pytest.raises(SimilarityDataError, match="unknown similarity model"):
        make_triplets(TripletConfig(miners=("nope",)), groups_dir, tmp_path / "x.csv")


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


# --------------------------------------------------------------------------------------------------
# The ensemble
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def test_cli_make_train_eval_and_bad_input(groups_dir, tmp_path, capsys):
    from cli.main import main

    csv_path = tmp_path / "tr.csv"
    assert (
        main(
            [
                "similarity",
                "2afc",
                "make-triplets",
                "--groups",
                str(groups_dir),
                "--out",
                str(csv_path),
                "--max-pairs-per-group",
                "2",
                "--cache",
                str(tmp_path / "cache"),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "similarity",
                "2afc",
                "eval",
                "--triplets",
                str(csv_path),
                "--models",
                "colour-hist-8,tiny-32",
                "--split",
                "all",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["methods"]) == {"colour-hist-8", "tiny-32", "majority_vote"} and out["split"] is None
    assert out["n"] == len(read_triplets(csv_path))
    assert (
        main(
            [
                "similarity",
                "2afc",
                "train-ensemble",
                "--triplets",
                str(csv_path),
                "--out",
                str(tmp_path / "e.pt"),
                "--models",
                "colour-hist-8,tiny-32",
                "--context-model",
                "colour-hist-8",
                "--epochs",
                "10",
                "--cache",
                str(tmp_path / "cache"),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "similarity",
                "2afc",
                "eval",
                "--triplets",
                str(csv_path),
                "--ensemble",
                str(tmp_path / "e.pt"),
                "--out",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["split"] == "test" and {"ensemble", "mean_margin", "ensemble_log_odds"} <= set(report["methods"])
    assert main(["similarity", "2afc", "eval", "--triplets", str(tmp_path / "missing.csv")]) == 2
    assert main(["similarity", "2afc", "eval", "--triplets", str(csv_path), "--models", "nope"]) == 2
    assert (
        main(
            [
                "similarity",
                "2afc",
                "train-ensemble",
                "--triplets",
                str(csv_path),
                "--out",
                str(tmp_path / "x.pt"),
                "--models",
                "colour-hist-8,tiny-32",
                "--context-model",
                "lite0-chamfer-s16-typo",
            ]
        )
        == 2
    )
