"""2AFC: the accuracy and ensemble decisions against plain loops, triplet files (ours and NIGHTS'),
triplets made from groups, and the CLI end to end."""

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
from similarity.twoafc.mining import TripletConfig, make_triplets
from similarity.twoafc.triplets import read_triplets, resolve_split, write_triplets
from tests.support.twoafc import _image, _one_thread  # noqa: F401  (_one_thread: an autouse fixture)

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
