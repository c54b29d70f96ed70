"""Two-alternative forced choice (2AFC) on triplets, and a context-sensitive ensemble of similarity models.

A triplet (R, A, B) asks which of A and B is closer to the reference R; its label is the probability
that B is (0: A is closer, 1: B is closer). Any similarity model answers with the sign of
``s(R, A) - s(R, B)`` and is scored by 2AFC accuracy (eval/twoafc.py: ties earn half).

The ensemble follows Liao & Chen, "Image Similarity using An Ensemble of Context-Sensitive Models"
(KDD 2024), its MLP variant: for each of K similarity models a small regressor predicts, from a
PCA embedding of R alone (the *context*), the probability that the model answers R's triplets
right; it is trained on a validation split. For a new triplet the K predictions ``p_k(R)`` are
normalised to sum to one, ``w_k = p_k / sum_j p_j`` (as the paper's code does), and the ensemble
answers ``sign(sum_k w_k(R) * (s_k(R, A) - s_k(R, B)) / c_k)``. The paper sums raw cosine distances
of models that all give cosines; ours mix cosines, Chamfer similarities and histogram
intersections, whose margins differ in scale, so each model's margin is divided by ``c_k``, its
median absolute margin on the validation triplets. (The normalisation of the weights changes no
decision, since the weights are positive; it makes them readable as shares.) Majority vote, the
baseline, is the sign of the sum of the K models' votes.

Differences from the paper, on purpose: the regressors are trained with binary cross-entropy on
whether the model was right on each validation triplet (a tie or a soft label gives a soft target)
rather than regressing each reference's accuracy with a squared loss (the minimiser is the same
per-reference mean); the context descriptor is EfficientNet-Lite0's GeM descriptor (the paper: a
ViT's), reduced by a PCA fitted on every image of the validation triplets; and the K models are
frozen off-the-shelf ones with shipped weights, not models fine-tuned per context. Besides the
paper's weights, ``weighting="log_odds"`` gives ``max(0, log(p / (1 - p)))`` (normalised): with
shares, a model predicted right half of the time keeps a full share of the say; with log-odds it
gets none (the optimal weights of a vote among independent voters).

Triplets come from a CSV: ours (``ref,a,b,label`` and optional ``group,split,kind``) or NIGHTS'
``data.csv`` (``id,left_vote,right_vote,votes,ref_path,left_path,right_path,split,is_imagenet``:
A = left, B = right, label = right_vote / (left_vote + right_vote)); paths are relative to the CSV.
``make_triplets`` builds them from groups of images of one instance (realbench's ``groups.csv`` or
class folders): R and A from one group, B a random distractor, a random image of another group, or
a *hard* B, drawn among the images nearest to R under each of the ``miners``, models the evaluation
should not use (default: tiny images, 32 x 32 thumbnails, mean-subtracted, cosine). The groups
(and the distractors) are split into ``val`` and ``test`` first, so no group and no image is in
both; the closer image is put on the A or B side at random.

Similarity models follow the :class:`SimilarityModel` protocol (``name``, ``extract(paths)`` -> per-image
feature arrays, ``score(features, ref, cand)`` -> similarities, ``info()``); register your own with
:func:`register_model`. Features are cached per model and image file (:class:`FeatureStore`).

    needle similarity 2afc make-triplets --groups SRC --out triplets.csv
    needle similarity 2afc train-ensemble --triplets triplets.csv --out ens.pt      # on split val
    needle similarity 2afc eval --triplets triplets.csv --ensemble ens.pt           # on split test
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from core.checkpoint import load_torch_file
from similarity.data import IMAGE_SUFFIXES, SimilarityDataError, load_groups, load_rgb, realbench_distractors

log = logging.getLogger(__name__)

SPLITS = ("val", "test")
NEEDLE_COLUMNS = ("ref", "a", "b", "label")
NIGHTS_COLUMNS = ("ref_path", "left_path", "right_path", "right_vote")
OUTPUT_COLUMNS = ("ref", "a", "b", "label", "group", "split", "kind")
ENSEMBLE_FORMAT = "needle-2afc-ensemble-1"
WEIGHTINGS = ("share", "log_odds")  # how predicted probabilities become weights (ContextEnsemble.weights)
LITE0 = "tf_efficientnet_lite0.gem"  # embed.models' default preset (named here: importing it imports torch)


# --------------------------------------------------------------------------------------------------
# Triplets
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Triplets:
    """Triplets (R, A, B) with labels: the probability that B is closer to R than A."""

    ref: tuple[Path, ...]
    a: tuple[Path, ...]
    b: tuple[Path, ...]
    label: np.ndarray  # (n,) float64 in [0, 1]
    group: tuple[str, ...]  # R's group ("" when unknown)
    split: tuple[str, ...]  # "" when the CSV has none
    kind: tuple[str, ...]  # how B was chosen ("" when unknown)

    def __len__(self) -> int:
        return len(self.ref)

    def select(self, keep: np.ndarray) -> Triplets:
        idx = np.flatnonzero(keep)
        pick = lambda xs: tuple(xs[i] for i in idx)  # noqa: E731
        return Triplets(pick(self.ref), pick(self.a), pick(self.b), self.label[idx], pick(self.group), pick(self.split),
                        pick(self.kind))

    def images(self) -> list[Path]:
        """Every image of the triplets once, in order of first appearance."""
        return list(dict.fromkeys([*self.ref, *self.a, *self.b]))


def _resolve(csv_dir: Path, value: str, path: Path, row: int, column: str) -> Path:
    if not value:
        raise SimilarityDataError(f"{path}: row {row} has an empty {column}")
    # Normalised (".." folded) so that one image is one path whichever CSV names it.
    return Path(os.path.normpath(csv_dir / value))


def _nights_label(row: dict[str, str], path: Path, i: int) -> float:
    try:
        right = float(row["right_vote"])
        left = float(row["left_vote"]) if row.get("left_vote") not in (None, "") else None
    except ValueError:
        raise SimilarityDataError(f"{path}: row {i} has non-numeric votes {row.get('left_vote')!r}, {row['right_vote']!r}") from None
    # Fractions (NIGHTS' data.csv) and counts both work: the share of votes for the right image.
    return right / (left + right) if left is not None and left + right > 0 else right


def read_triplets(path: Path | str, split: str | None = None, min_votes: int = 0) -> Triplets:
    """Triplets of a CSV in our format or NIGHTS'; ``split`` keeps the rows of that split (None: all);
    ``min_votes`` keeps NIGHTS rows with at least that many votes (DreamSim evaluates with 6)."""
    path = Path(path)
    if not path.is_file():
        raise SimilarityDataError(f"triplet file {path} does not exist")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        columns = set(reader.fieldnames or ())
        rows = list(reader)
    if set(NEEDLE_COLUMNS) <= columns:
        fmt = "needle"
    elif set(NIGHTS_COLUMNS) <= columns:
        fmt = "nights"
    else:
        raise SimilarityDataError(f"{path}: header {sorted(columns)} has neither columns {','.join(NEEDLE_COLUMNS)} "
                                  f"nor NIGHTS' {','.join(NIGHTS_COLUMNS)}")
    if split is not None and "split" not in columns:
        raise SimilarityDataError(f"{path} has no split column, cannot select split {split!r}")
    if min_votes > 0 and "votes" not in columns:
        raise SimilarityDataError(f"{path} has no votes column, cannot keep rows with at least {min_votes} votes")
    csv_dir = path.parent
    ref, a, b, labels, groups, splits, kinds = [], [], [], [], [], [], []
    for i, row in enumerate(rows, start=1):
        if split is not None and row["split"] != split:
            continue
        if min_votes > 0 and float(row["votes"] or 0) < min_votes:
            continue
        if fmt == "needle":
            names = (row["ref"], row["a"], row["b"])
            try:
                label = float(row["label"])
            except ValueError:
                raise SimilarityDataError(f"{path}: row {i} has a non-numeric label {row['label']!r}") from None
            group = row.get("group") or ""
        else:
            names = (row["ref_path"], row["left_path"], row["right_path"])
            label = _nights_label(row, path, i)
            group = row.get("id") or ""
        if not 0.0 <= label <= 1.0:
            raise SimilarityDataError(f"{path}: row {i} has label {label!r}; labels are in [0, 1] (1: B is closer)")
        r, x, y = (_resolve(csv_dir, v, path, i, c) for v, c in zip(names, ("ref", "a", "b")))
        ref.append(r), a.append(x), b.append(y), labels.append(label)
        groups.append(group), splits.append(row.get("split") or ""), kinds.append(row.get("kind") or "")
    if not ref:
        available = sorted({row.get("split", "") for row in rows}) if "split" in columns else []
        raise SimilarityDataError(f"{path}: no triplet left" + (f" in split {split!r} (splits: {available})" if split else ""))
    triplets = Triplets(tuple(ref), tuple(a), tuple(b), np.asarray(labels, np.float64), tuple(groups), tuple(splits), tuple(kinds))
    for image in triplets.images():
        if not image.is_file():
            row = 1 + next(i for i in range(len(triplets)) if image in (triplets.ref[i], triplets.a[i], triplets.b[i]))
            raise SimilarityDataError(f"{path}: image {image} (triplet {row} of those read) does not exist")
    log.info("%d triplets from %s (%s format%s)", len(triplets), path, fmt, f", split {split}" if split else "")
    return triplets


def resolve_split(path: Path | str, split: str, default: str) -> str | None:
    """``split`` as read_triplets takes it: "all" -> None; "auto" -> ``default`` when the CSV has a
    split column, else None (every row)."""
    if split == "all":
        return None
    if split != "auto":
        return split
    if not Path(path).is_file():
        raise SimilarityDataError(f"triplet file {path} does not exist")
    with open(Path(path), newline="") as f:
        columns = next(csv.reader(f), [])
    return default if "split" in columns else None


def write_triplets(triplets: Triplets, path: Path | str) -> Path:
    """Our CSV format; image paths relative to the CSV's directory."""
    from core.atomic import write_atomic

    path = Path(path)
    base = path.parent.resolve()

    def rel(p: Path) -> str:
        return os.path.relpath(Path(p).resolve(), base)

    def write(tmp: Path) -> None:
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(OUTPUT_COLUMNS)
            for i in range(len(triplets)):
                w.writerow([rel(triplets.ref[i]), rel(triplets.a[i]), rel(triplets.b[i]), f"{triplets.label[i]:g}",
                            triplets.group[i], triplets.split[i], triplets.kind[i]])

    return write_atomic(path, write)


# --------------------------------------------------------------------------------------------------
# Making triplets from groups
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TripletConfig:
    seed: int = 0  # draws the split, the pairs, each B and the A/B order
    val_fraction: float = 0.5  # share of the groups (and of the distractors) in split "val"; the rest is "test"
    max_pairs_per_group: int = 12  # ordered (R, A) pairs kept per group, drawn at random, so big groups do not dominate
    random_distractors: int = 1  # triplets per pair whose B is a random distractor (kind "distractor")
    other_groups: int = 1  # triplets per pair whose B is a random image of another group (kind "other_group")
    hard: int = 1  # triplets per pair and miner whose B is among the miner's nearest images to R (kind "hard:<miner>")
    hard_pool: int = 5  # ... drawn among the nearest this many (other groups' images and distractors of the split)
    hard_distractors: int = 0  # distractors per split the miners search (a seeded sample; 0: all of them)
    miners: tuple[str, ...] = ("tiny-32",)  # models that find hard B's; keep them out of the models you evaluate

    def __post_init__(self) -> None:
        if not 0.0 <= self.val_fraction <= 1.0:
            raise SimilarityDataError(f"val_fraction must be in [0, 1], got {self.val_fraction}")
        for name in ("random_distractors", "other_groups", "hard", "hard_distractors"):
            if getattr(self, name) < 0:
                raise SimilarityDataError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_pairs_per_group < 1 or self.hard_pool < 1:
            raise SimilarityDataError("max_pairs_per_group and hard_pool must be >= 1")
        if self.random_distractors + self.other_groups + self.hard * len(self.miners) == 0:
            raise SimilarityDataError("ask for at least one triplet per pair (random_distractors, other_groups or hard with a miner)")


def _split_items(items: list[str], fraction: float, rng: np.random.Generator) -> dict[str, str]:
    order = rng.permutation(len(items))
    n_val = int(round(fraction * len(items)))
    return {items[j]: SPLITS[0] if rank < n_val else SPLITS[1] for rank, j in enumerate(order)}


def split_groups(groups: Mapping[str, Sequence[Path]], fraction: float, seed: int) -> dict[str, str]:
    """Group -> "val" / "test", seeded; groups with pairs and singletons are split separately, so
    each split gets its share of both."""
    rng = np.random.default_rng([seed, 0])
    multi = sorted(g for g, paths in groups.items() if len(paths) >= 2)
    single = sorted(g for g, paths in groups.items() if len(paths) < 2)
    return {**_split_items(multi, fraction, rng), **_split_items(single, fraction, rng)}


def _ordered_pairs(n: int, cap: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    if len(pairs) <= cap:
        return pairs
    return [pairs[k] for k in sorted(rng.choice(len(pairs), size=cap, replace=False))]


def list_distractors(source: Path | str) -> list[Path]:
    """realbench's distractors (a directory with distractors.csv) or the images of a folder, sorted."""
    source = Path(source)
    if (source / "distractors.csv").is_file():
        return realbench_distractors(source)
    if not source.is_dir():
        raise SimilarityDataError(f"distractor folder {source} does not exist")
    paths = sorted(p for p in source.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise SimilarityDataError(f"distractor folder {source} holds no image ({', '.join(IMAGE_SUFFIXES)})")
    return paths


def _hard_pool(r: Path, group: str, pool: list[Path], pool_group: np.ndarray, x: np.ndarray, size: int) -> np.ndarray:
    """Indices into ``pool`` of the ``size`` images nearest to ``r`` under the miner features ``x``
    (rows of ``pool``; ``r`` is one of them), never of R's own group."""
    sims = x @ x[pool.index(r)]
    sims[pool_group == group] = -np.inf
    nearest = np.argsort(-sims, kind="stable")[:size]
    return nearest[np.isfinite(sims[nearest])]


def _split_triplets(conf: TripletConfig, groups: dict[str, list[Path]], distractors: list[Path],
                    mined: list[Path], miner_features: Callable[[str, list[Path]], np.ndarray],
                    rng: np.random.Generator) -> list[tuple]:
    """(R, A, B, label, group, kind) rows of one split; ``mined``: the distractors the miners search."""
    images = [(p, g) for g in sorted(groups) for p in groups[g]]
    pool = [p for p, _ in images] + mined  # hard B candidates: other groups' images and distractors
    pool_group = np.asarray([g for _, g in images] + [""] * len(mined), dtype=object)
    pool_x = {m: miner_features(m, pool) for m in conf.miners} if conf.hard else {}
    rows = []
    for g in sorted(groups):
        members = groups[g]
        if len(members) < 2:
            continue
        others = [i for i, (_, og) in enumerate(images) if og != g]
        for i, j in _ordered_pairs(len(members), conf.max_pairs_per_group, rng):
            r, pos = members[i], members[j]
            chosen = []
            if distractors:
                chosen += [(distractors[k], "distractor") for k in rng.integers(len(distractors), size=conf.random_distractors)]
            if others:
                chosen += [(images[others[k]][0], "other_group") for k in rng.integers(len(others), size=conf.other_groups)]
            for miner, x in pool_x.items():
                nearest = _hard_pool(r, g, pool, pool_group, x, conf.hard_pool)
                if len(nearest):
                    picks = rng.choice(nearest, size=min(conf.hard, len(nearest)), replace=False)
                    chosen += [(pool[k], f"hard:{miner}") for k in picks]
            for neg, kind in chosen:
                swap = bool(rng.random() < 0.5)  # the closer image on either side, so "always A" scores 50%
                rows.append((r, neg, pos, 1.0, g, kind) if swap else (r, pos, neg, 0.0, g, kind))
    return rows


def make_triplets(conf: TripletConfig, source: Path | str, output: Path | str, distractors: Path | str | None = "auto",
                  cache: Path | str | None = None) -> Path:
    """Triplets with a known answer from the groups of ``source`` (realbench-style or class folders),
    written to ``output`` (CSV) with ``output``.json beside it.

    ``distractors``: "auto" (``source``'s distractors.csv when it has one, else none), None (none), or a
    realbench-style directory or folder of images. Without distractors every B comes from other groups.
    """
    from core.atomic import write_json_atomic

    start = time.perf_counter()
    source = Path(source)
    groups = load_groups(source)
    if not any(len(p) >= 2 for p in groups.values()):
        raise SimilarityDataError(f"{source} has no group with two images: no (R, A) pair to make triplets from")
    if distractors == "auto":
        distractors = source if (source / "distractors.csv").is_file() else None
    distractor_list = list_distractors(distractors) if distractors is not None else []
    assigned = split_groups(groups, conf.val_fraction, conf.seed)
    distractor_split = _split_items([str(p) for p in distractor_list], conf.val_fraction, np.random.default_rng([conf.seed, 1]))
    miners = {m: get_model(m) for m in conf.miners} if conf.hard else {}
    store = FeatureStore(cache)

    def miner_features(name: str, paths: list[Path]) -> np.ndarray:
        return _global_of(miners[name], store.features(miners[name], paths)).astype(np.float64)

    rng = np.random.default_rng([conf.seed, 2])
    rows = []
    for split in SPLITS:
        split_groups_ = {g: list(paths) for g, paths in groups.items() if assigned[g] == split}
        split_distractors = [p for p in distractor_list if distractor_split[str(p)] == split]
        mined = split_distractors
        if 0 < conf.hard_distractors < len(mined):
            sample = np.random.default_rng([conf.seed, 3, SPLITS.index(split)]).choice(len(mined), conf.hard_distractors, replace=False)
            mined = [mined[k] for k in sorted(sample)]
        rows += [(*row, split) for row in _split_triplets(conf, split_groups_, split_distractors, mined, miner_features, rng)]
    if not rows:
        raise SimilarityDataError(f"no triplet could be made from {source} with {conf}")
    ref, a, b, label, group, kind, split = zip(*rows)
    triplets = Triplets(ref, a, b, np.asarray(label, np.float64), group, split, kind)
    path = write_triplets(triplets, Path(output))
    counts = {s: {"triplets": sum(1 for x in split if x == s),
                  "groups": sum(1 for g, p in groups.items() if assigned[g] == s and len(p) >= 2),
                  "distractors": sum(1 for v in distractor_split.values() if v == s),
                  "kinds": dict(Counter(k for k, x in zip(kind, split) if x == s)),
                  "label_1": int(sum(1 for lab, x in zip(label, split) if x == s and lab == 1.0))} for s in SPLITS}
    write_json_atomic({"config": asdict(conf), "source": str(source), "distractors": str(distractors) if distractors else None,
                       "triplets": len(triplets), "splits": counts, "seconds": round(time.perf_counter() - start, 3)},
                      path.with_name(path.name + ".json"))
    log.info("%d triplets -> %s (%s)", len(triplets), path, ", ".join(f"{s}: {counts[s]['triplets']}" for s in SPLITS))
    return path


# --------------------------------------------------------------------------------------------------
# Similarity models
# --------------------------------------------------------------------------------------------------


class SimilarityModel(Protocol):
    """A similarity between two images, computed from per-image features (cached by FeatureStore)."""

    name: str  # registry name; also names the feature cache file

    def extract(self, paths: Sequence[Path]) -> dict[str, np.ndarray]:
        """Features of the images: arrays whose first axis is the image (same shapes for every call).
        A model with one vector per image that can serve as the ensemble's context stores it as "global"."""
        ...

    def score(self, features: Mapping[str, np.ndarray], ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
        """(n,) similarity of image ``ref[i]`` with image ``cand[i]`` (rows of ``features``); higher = closer."""
        ...

    def info(self) -> dict[str, Any]:
        """How the features are made (JSON); a change invalidates the cache."""
        ...


def _load_images(paths: Sequence[Path], longer_side: int) -> list[np.ndarray]:
    return [load_rgb(p, longer_side) for p in paths]


def _torch_ready() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ingest.torchvision_compat import ensure_torchvision_importable

    ensure_torchvision_importable()


def _weights_record(model: str) -> dict[str, Any]:
    from embed.extract import file_sha256
    from embed.registry import get_model_config, resolve_weights

    path = resolve_weights(get_model_config(model), None)
    return {"model": model, "weights_sha256": file_sha256(path) if path else None}


def dot_rows(x: np.ndarray, ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """(n,) float64 ``x[ref[i]] . x[cand[i]]``."""
    return np.einsum("nd,nd->n", x[ref].astype(np.float64), x[cand].astype(np.float64))


class GlobalCosine:
    """Cosine of a registry model's L2-normalised global descriptors (Lite0 GeM by default)."""

    def __init__(self, name: str, resolution: int, model: str = LITE0, batch_size: int = 16):
        self.name, self.resolution, self.model, self.batch_size = name, resolution, model, batch_size
        self._extractor = None
        self._info: dict[str, Any] | None = None

    def _build(self):
        if self._extractor is None:
            _torch_ready()
            from embed.extract import GlobalExtractor

            self._extractor = GlobalExtractor(self.model, resolution=self.resolution, batch_size=self.batch_size)
        return self._extractor

    def _vectors(self, images: list[np.ndarray]) -> np.ndarray:
        from embed.extract import batches_by_shape

        ex = self._build()
        out = np.zeros((len(images), ex.dim), np.float32)
        for idx in batches_by_shape(images, self.batch_size):
            out[idx] = ex.forward_uint8(np.stack([images[i] for i in idx]))
        return out

    def extract(self, paths: Sequence[Path]) -> dict[str, np.ndarray]:
        return {"global": self._vectors(_load_images(paths, self.resolution))}

    def score(self, features: Mapping[str, np.ndarray], ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
        return dot_rows(features["global"], ref, cand)

    def info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = {"class": type(self).__name__, "resolution": self.resolution, **_weights_record(self.model)}
        return self._info


class MultiStageCosine(GlobalCosine):
    """The mean over several Lite0 stages of the cosine between stage descriptors: blocks ``stages``
    (their outputs are signed, linear bottlenecks: average-pooled) and the last feature map (after
    ReLU6: GeM p=3, the global descriptor's pooling). Each stage vector is L2-normalised and scaled
    by 1/sqrt(S), so the dot product of the concatenations is the mean of the S cosines."""

    def __init__(self, name: str, resolution: int, stages: tuple[int, ...] = (4, 5), batch_size: int = 16):
        super().__init__(name, resolution, batch_size=batch_size)
        self.stages = stages

    def _build(self):
        if self._extractor is None:
            _torch_ready()
            import torch

            from embed.models import build_global_model
            from embed.registry import get_model_config

            net, _ = build_global_model(self.model)
            conf = get_model_config(self.model)
            self._extractor = (net.backbone, torch.tensor(conf.mean).view(1, 3, 1, 1), torch.tensor(conf.std).view(1, 3, 1, 1))
        return self._extractor

    def _vectors(self, images: list[np.ndarray]) -> np.ndarray:
        import torch
        import torch.nn.functional as F

        from embed.extract import batches_by_shape
        from embed.pooling import gem

        backbone, mean, std = self._build()
        rows: list[np.ndarray | None] = [None] * len(images)
        for idx in batches_by_shape(images, self.batch_size):
            x = torch.from_numpy(np.stack([images[i] for i in idx])).permute(0, 3, 1, 2).float().div_(255.0)
            with torch.inference_mode():
                h = backbone.bn1(backbone.conv_stem((x - mean) / std))
                parts = []
                for b, block in enumerate(backbone.blocks):
                    h = block(h)
                    if b in self.stages:
                        parts.append(F.normalize(h.mean(dim=(2, 3)), dim=1))
                parts.append(F.normalize(gem(backbone.bn2(backbone.conv_head(h)), 3.0), dim=1))
                out = torch.cat(parts, dim=1) / math.sqrt(len(parts))
            for j, i in enumerate(idx):
                rows[i] = out[j].numpy()
        return np.stack(rows).astype(np.float32)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "stages": list(self.stages), "head": "gem3"}


class ChamferTokens:
    """Chamfer similarity (rerank/chamfer.py) of R's local tokens with the candidate's: Lite0's
    stride-16 tokens binarised to 128 ITQ bits (embed/locals.py, preset ``lite0-s16``)."""

    def __init__(self, name: str, preset: str = "lite0-s16", resolution: int | None = None):
        self.name, self.preset, self.resolution = name, preset, resolution
        self._extractor = None

    def _build(self):
        if self._extractor is None:
            _torch_ready()
            from embed.locals import build_local_extractor

            self._extractor = build_local_extractor(self.preset, resolution=self.resolution)
        return self._extractor

    def extract(self, paths: Sequence[Path]) -> dict[str, np.ndarray]:
        from core.tokens import CODE_BYTES

        ex = self._build()
        tokens = ex.tokens_of_any_size(_load_images(paths, ex.resolution))
        T = ex.conf.max_tokens
        codes = np.zeros((len(paths), T, CODE_BYTES), np.uint8)
        count = np.zeros(len(paths), np.int32)
        for i, t in enumerate(tokens):
            count[i] = min(len(t), T)
            codes[i, : count[i]] = t.codes[:T]
        return {"codes": codes, "count": count}

    def score(self, features: Mapping[str, np.ndarray], ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
        from rerank.chamfer import chamfer_similarity
        from core.tokens import TokenBatch

        out = np.zeros(len(ref))
        for r in np.unique(ref):
            rows = np.flatnonzero(ref == r)
            batch = TokenBatch.stack([_tokens(features, c) for c in cand[rows]])
            out[rows] = chamfer_similarity(_tokens(features, r), batch)
        return out

    def info(self) -> dict[str, Any]:
        return {"class": type(self).__name__, "preset": self.preset, "resolution": self.resolution,
                **_weights_record(LITE0)}


def _tokens(features: Mapping[str, np.ndarray], i: int):
    from core.tokens import LocalTokens

    n = int(features["count"][i])
    # Chamfer reads the codes only; positions, scales and weights are placeholders.
    return LocalTokens(features["codes"][i, :n], np.zeros((n, 2), np.float32), np.ones(n, np.float32), np.ones(n, np.float32))


class ColourHistogram:
    """Histogram intersection of joint RGB histograms (``bins`` per channel, normalised to sum 1),
    after Swain & Ballard; the image is read at longer side ``side``."""

    def __init__(self, name: str, bins: int = 8, side: int = 128):
        self.name, self.bins, self.side = name, bins, side

    def extract(self, paths: Sequence[Path]) -> dict[str, np.ndarray]:
        out = np.zeros((len(paths), self.bins**3), np.float32)
        for i, image in enumerate(_load_images(paths, self.side)):
            q = (image.reshape(-1, 3).astype(np.int64) * self.bins) // 256
            cells = (q[:, 0] * self.bins + q[:, 1]) * self.bins + q[:, 2]
            out[i] = np.bincount(cells, minlength=self.bins**3) / len(cells)
        return {"global": out}

    def score(self, features: Mapping[str, np.ndarray], ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
        h = features["global"]
        return np.minimum(h[ref], h[cand]).astype(np.float64).sum(axis=1)

    def info(self) -> dict[str, Any]:
        return {"class": type(self).__name__, "bins": self.bins, "side": self.side}


class TinyImage:
    """Tiny images (Torralba et al.): the image squashed to ``side`` x ``side`` RGB, minus its mean,
    L2-normalised; cosine. Cheap and unlike every learned model: the default miner of hard B's."""

    def __init__(self, name: str, side: int = 32):
        self.name, self.side = name, side

    def extract(self, paths: Sequence[Path]) -> dict[str, np.ndarray]:
        from PIL import Image

        from ingest.images import RESAMPLE

        out = np.zeros((len(paths), self.side * self.side * 3), np.float32)
        for i, image in enumerate(_load_images(paths, 2 * self.side)):
            x = np.asarray(Image.fromarray(image).resize((self.side, self.side), RESAMPLE), np.float32).reshape(-1)
            x -= x.mean()
            out[i] = x / max(float(np.linalg.norm(x)), 1e-12)
        return {"global": out}

    def score(self, features: Mapping[str, np.ndarray], ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
        return dot_rows(features["global"], ref, cand)

    def info(self) -> dict[str, Any]:
        return {"class": type(self).__name__, "side": self.side}


MODELS: dict[str, Callable[[], SimilarityModel]] = {
    "lite0-gem-384": lambda: GlobalCosine("lite0-gem-384", 384),
    "lite0-gem-224": lambda: GlobalCosine("lite0-gem-224", 224),
    "lite0-multistage-384": lambda: MultiStageCosine("lite0-multistage-384", 384),
    "lite0-chamfer-s16": lambda: ChamferTokens("lite0-chamfer-s16", "lite0-s16"),
    "colour-hist-8": lambda: ColourHistogram("colour-hist-8", bins=8),
    "tiny-32": lambda: TinyImage("tiny-32", 32),
    # Not evaluated by default: a miner of hard B's that look alike to Lite0's GeM (so adversarial to it).
    "lite0-gem-320": lambda: GlobalCosine("lite0-gem-320", 320),
}
DEFAULT_MODELS = ("lite0-gem-384", "lite0-gem-224", "lite0-multistage-384", "lite0-chamfer-s16", "colour-hist-8")
DEFAULT_CONTEXT = "lite0-gem-384"
_INSTANCES: dict[str, SimilarityModel] = {}


def register_model(name: str, factory: Callable[[], SimilarityModel]) -> None:
    """Make ``name`` usable in --models and ensembles (factory: builds the model, called once)."""
    MODELS[name] = factory
    _INSTANCES.pop(name, None)


def get_model(name: str) -> SimilarityModel:
    if name not in MODELS:
        raise SimilarityDataError(f"unknown similarity model {name!r}; known: {sorted(MODELS)}")
    if name not in _INSTANCES:
        _INSTANCES[name] = MODELS[name]()
    return _INSTANCES[name]


def parse_models(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise SimilarityDataError(f"--models needs comma-separated model names, got {text!r}")
    for n in names:
        get_model(n)  # fail early on a typo
    if len(set(names)) != len(names):
        raise SimilarityDataError(f"--models names a model twice: {text!r}")
    return names


# --------------------------------------------------------------------------------------------------
# Feature cache
# --------------------------------------------------------------------------------------------------


def _file_key(path: Path) -> str:
    """A cache key that changes when the file does: resolved path, size, modification time."""
    try:
        st = Path(path).stat()
    except OSError as exc:
        raise SimilarityDataError(f"cannot read image {path}: {exc}") from exc
    return f"{Path(path).resolve()}|{st.st_size}|{st.st_mtime_ns}"


def _safe_name(name: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return f"{keep}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


@dataclass
class _Cached:
    info: str  # the model's info as JSON
    keys: list[str] = field(default_factory=list)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    row: dict[str, int] = field(default_factory=dict)


class FeatureStore:
    """Each model's features per image file, computed once: in memory, and on disk under
    ``directory`` (``<model>.npz`` with the rows' file keys, ``<model>.json`` with the model's info;
    a model whose info changed is recomputed)."""

    def __init__(self, directory: Path | str | None = None, chunk: int = 32):
        self.directory = Path(directory) if directory is not None else None
        self.chunk = chunk
        self._memory: dict[str, _Cached] = {}

    def _file(self, model: SimilarityModel) -> Path:
        return self.directory / f"{_safe_name(model.name)}.npz"

    def _load(self, model: SimilarityModel) -> _Cached:
        info = json.dumps(model.info(), sort_keys=True)
        cached = self._memory.get(model.name)
        if cached is not None and cached.info == info:
            return cached
        cached = _Cached(info)
        path = self._file(model) if self.directory is not None else None
        if path is not None and path.is_file() and path.with_suffix(".json").is_file():
            if json.loads(path.with_suffix(".json").read_text()).get("info") == json.loads(info):
                with np.load(path, allow_pickle=False) as data:
                    cached.keys = [str(k) for k in data["__keys__"]]
                    cached.arrays = {k: data[k] for k in data.files if k != "__keys__"}
                cached.row = {k: i for i, k in enumerate(cached.keys)}
            else:
                log.info("feature cache %s was made by another %s: recomputing", path, model.name)
        self._memory[model.name] = cached
        return cached

    def _save(self, model: SimilarityModel, cached: _Cached) -> None:
        if self.directory is None:
            return
        from core.atomic import write_atomic, write_json_atomic

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, __keys__=np.asarray(cached.keys), **cached.arrays)

        path = write_atomic(self._file(model), write)
        write_json_atomic({"model": model.name, "info": json.loads(cached.info), "images": len(cached.keys)}, path.with_suffix(".json"))

    def features(self, model: SimilarityModel, paths: Sequence[Path]) -> dict[str, np.ndarray]:
        """``model``'s features of ``paths``, rows in that order."""
        from tqdm import tqdm

        cached = self._load(model)
        keys = [_file_key(p) for p in paths]
        missing = list(dict.fromkeys(k for k in keys if k not in cached.row))
        if missing:
            path_of = dict(zip(keys, paths))
            chunks = [missing[s : s + self.chunk] for s in range(0, len(missing), self.chunk)]
            for chunk in tqdm(chunks, desc=f"features {model.name}", unit="chunk", leave=False):
                new = model.extract([path_of[k] for k in chunk])
                self._append(model, cached, chunk, new)
            self._save(model, cached)
        rows = np.asarray([cached.row[k] for k in keys], np.int64)
        return {k: v[rows] for k, v in cached.arrays.items()}

    @staticmethod
    def _append(model: SimilarityModel, cached: _Cached, keys: list[str], new: dict[str, np.ndarray]) -> None:
        if not new:
            raise SimilarityDataError(f"model {model.name} gave no feature array")
        for name, value in new.items():
            value = np.asarray(value)
            if value.shape[:1] != (len(keys),):
                raise SimilarityDataError(f"model {model.name}: feature {name!r} has shape {value.shape} for {len(keys)} images")
            old = cached.arrays.get(name)
            if old is not None and old.shape[1:] != value.shape[1:]:
                raise SimilarityDataError(f"model {model.name}: feature {name!r} changed shape {old.shape[1:]} -> {value.shape[1:]}")
            cached.arrays[name] = value if old is None else np.concatenate([old, value])
        if cached.arrays.keys() != new.keys():
            raise SimilarityDataError(f"model {model.name}: feature names changed {sorted(cached.arrays)} -> {sorted(new)}")
        for k in keys:
            cached.row[k] = len(cached.keys)
            cached.keys.append(k)


def _global_of(model: SimilarityModel, features: Mapping[str, np.ndarray]) -> np.ndarray:
    if "global" not in features or np.asarray(features["global"]).ndim != 2:
        raise SimilarityDataError(f"model {model.name} has no 'global' (n, d) feature: it cannot serve as context or miner")
    return np.asarray(features["global"])


def triplet_scores(models: Sequence[SimilarityModel], triplets: Triplets, store: FeatureStore) -> tuple[np.ndarray, np.ndarray]:
    """(n, K) similarities s_k(R, A) and s_k(R, B)."""
    images = triplets.images()
    index = {p: i for i, p in enumerate(images)}
    r, a, b = (np.asarray([index[p] for p in col], np.int64) for col in (triplets.ref, triplets.a, triplets.b))
    sa, sb = np.zeros((len(triplets), len(models))), np.zeros((len(triplets), len(models)))
    for k, model in enumerate(models):
        feats = store.features(model, images)
        for out, cand in ((sa, a), (sb, b)):
            s = np.asarray(model.score(feats, r, cand), np.float64)
            if s.shape != (len(triplets),) or not np.isfinite(s).all():
                raise SimilarityDataError(f"model {model.name} gave scores of shape {s.shape} (finite: {np.isfinite(s).all()}) "
                                          f"for {len(triplets)} pairs")
            out[:, k] = s
    return sa, sb


# --------------------------------------------------------------------------------------------------
# The context-sensitive ensemble
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnsembleConfig:
    models: tuple[str, ...] = DEFAULT_MODELS  # the K similarity models combined
    context_model: str = DEFAULT_CONTEXT  # its "global" descriptor of R, reduced by PCA, is the regressors' input
    pca_dim: int = 64  # PCA components of the context (fewer when the training images are fewer)
    hidden: int = 32  # hidden units of each regressor: pca_dim -> hidden -> 1
    epochs: int = 300  # full-batch Adam steps per regressor
    lr: float = 1e-2  # Adam learning rate
    weight_decay: float = 1e-3  # L2 on the regressors: a few hundred triplets for ~2k parameters each
    seed: int = 0  # the regressors' initialisation
    split: str = "auto"  # triplets trained on: "auto" (split "val" when the CSV has splits, else all), "all", or a name
    min_votes: int = 0  # NIGHTS: keep triplets with at least this many votes

    def __post_init__(self) -> None:
        if len(self.models) < 2:
            raise SimilarityDataError(f"an ensemble needs at least two models, got {self.models}")
        if self.pca_dim < 1 or self.hidden < 1 or self.epochs < 1 or self.lr <= 0 or self.weight_decay < 0:
            raise SimilarityDataError(f"pca_dim, hidden, epochs >= 1, lr > 0 and weight_decay >= 0 needed, got {self}")


def _ensemble_module():
    """The torch module class, defined on first use so importing this file does not import torch."""
    import torch
    from torch import nn

    class ContextEnsemble(nn.Module):
        """PCA of the context descriptor, then one regressor per model: P(model k is right | R)."""

        def __init__(self, names: Sequence[str], context_model: str, dim: int, pca_dim: int, hidden: int):
            super().__init__()
            self.names, self.context_model, self.hidden = list(names), context_model, hidden
            self.register_buffer("pca_mean", torch.zeros(dim, dtype=torch.float64))
            self.register_buffer("pca_components", torch.zeros(pca_dim, dim, dtype=torch.float64))
            self.register_buffer("pca_scale", torch.ones((), dtype=torch.float64))
            self.register_buffer("margin_scale", torch.ones(len(names), dtype=torch.float64))
            self.regressors = nn.ModuleList(
                nn.Sequential(nn.Linear(pca_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1)) for _ in names)

        def project(self, context: np.ndarray) -> torch.Tensor:
            x = torch.as_tensor(np.asarray(context, np.float64))
            if x.ndim != 2 or x.shape[1] != self.pca_mean.shape[0]:
                raise SimilarityDataError(f"context descriptors of shape {tuple(x.shape)} do not fit an ensemble "
                                          f"for d={self.pca_mean.shape[0]} ({self.context_model})")
            return ((x - self.pca_mean) @ self.pca_components.T / self.pca_scale).float()

        def logits(self, z: torch.Tensor) -> torch.Tensor:
            return torch.cat([reg(z) for reg in self.regressors], dim=1)

        @torch.no_grad()
        def probabilities(self, context: np.ndarray) -> np.ndarray:
            """(n, K) predicted probability that each model answers R's triplet right."""
            return torch.sigmoid(self.logits(self.project(context))).double().numpy()

        def weights(self, context: np.ndarray, weighting: str = "share") -> np.ndarray:
            """(n, K) per-triplet weights from the predicted probabilities p: "share", p / sum(p) (the
            paper's); "log_odds", max(0, log(p / (1 - p))), the optimal weights of a vote of independent
            voters right with probability p (Nitzan & Paroush), normalised to sum to one too."""
            p = self.probabilities(context)
            if weighting == "log_odds":
                p = np.clip(p, 1e-6, 1 - 1e-6)
                p = np.maximum(np.log(p / (1 - p)), 0.0)
            elif weighting != "share":
                raise SimilarityDataError(f"unknown weighting {weighting!r}; choose from {WEIGHTINGS}")
            total = p.sum(axis=1, keepdims=True)
            return np.divide(p, total, out=np.full_like(p, 1.0 / p.shape[1]), where=total > 0)

        def decide(self, margins: np.ndarray, context: np.ndarray, weighting: str = "share") -> np.ndarray:
            """(n,) int8: sign of sum_k w_k(R) * margin_k / c_k."""
            from eval.twoafc import weighted_decision

            return weighted_decision(np.asarray(margins) / self.margin_scale.numpy(), self.weights(context, weighting))

    return ContextEnsemble


def margin_scales(margins: np.ndarray) -> np.ndarray:
    """(K,) each model's median absolute margin over the triplets where it is not 0 (1 if none)."""
    out = np.ones(margins.shape[1])
    for k in range(margins.shape[1]):
        m = np.abs(margins[:, k])
        m = m[m > 0]
        if len(m) and np.median(m) > 0:
            out[k] = float(np.median(m))
    return out


def fit_pca(x: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(mean, (d, D) components, scale) of ``x``: d = min(dim, n - 1, D) leading components; scale =
    the standard deviation along the first, so that the regressors' inputs are of order one."""
    x = np.asarray(x, np.float64)
    if x.ndim != 2 or len(x) < 2:
        raise SimilarityDataError(f"PCA of the context needs at least two descriptors, got shape {x.shape}")
    mean = x.mean(axis=0)
    _, s, vt = np.linalg.svd(x - mean, full_matrices=False)
    d = max(1, min(dim, len(x) - 1, x.shape[1]))
    scale = float(s[0] / math.sqrt(len(x) - 1)) if s[0] > 0 else 1.0
    return mean, vt[:d], scale


def fit_ensemble(conf: EnsembleConfig, margins: np.ndarray, credits: np.ndarray, context_ref: np.ndarray,
                 context_fit: np.ndarray) -> tuple[Any, list[float]]:
    """Train the ensemble: ``margins`` and ``credits`` (n, K) of the training triplets, ``context_ref``
    (n, D) R's context descriptor, ``context_fit`` (m, D) the descriptors the PCA is fitted on.
    Returns (ensemble, final training loss per regressor)."""
    import torch
    import torch.nn.functional as F

    margins, credits = np.asarray(margins, np.float64), np.asarray(credits, np.float64)
    if margins.shape != credits.shape or margins.shape[1] != len(conf.models) or len(context_ref) != len(margins):
        raise SimilarityDataError(f"margins {margins.shape}, credits {credits.shape} and context {np.shape(context_ref)} "
                                  f"do not fit {len(conf.models)} models")
    mean, components, scale = fit_pca(context_fit, conf.pca_dim)
    torch.manual_seed(conf.seed)
    ensemble = _ensemble_module()(conf.models, conf.context_model, len(mean), len(components), conf.hidden)
    ensemble.pca_mean.copy_(torch.from_numpy(mean))
    ensemble.pca_components.copy_(torch.from_numpy(components))
    ensemble.pca_scale.fill_(scale)
    ensemble.margin_scale.copy_(torch.from_numpy(margin_scales(margins)))
    z = ensemble.project(context_ref)
    target = torch.from_numpy(credits).float()
    losses = []
    for k, regressor in enumerate(ensemble.regressors):
        optimizer = torch.optim.Adam(regressor.parameters(), lr=conf.lr, weight_decay=conf.weight_decay)
        for _ in range(conf.epochs):
            loss = F.binary_cross_entropy_with_logits(regressor(z)[:, 0], target[:, k])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        losses.append(float(loss.detach()))
        log.info("regressor %s: final BCE %.4f, mean right on training %.3f", conf.models[k], losses[-1], credits[:, k].mean())
    return ensemble.eval(), losses


def save_ensemble(ensemble: Any, path: Path | str) -> Path:
    import torch

    from core.atomic import write_atomic

    state = {"format": ENSEMBLE_FORMAT, "models": list(ensemble.names), "context_model": ensemble.context_model,
             "hidden": int(ensemble.hidden), "state": {k: v.detach().clone() for k, v in ensemble.state_dict().items()}}
    return write_atomic(Path(path), lambda tmp: torch.save(state, tmp))


def load_ensemble(path: Path | str) -> Any:

    path = Path(path)
    state = load_torch_file(path, SimilarityDataError, "ensemble")
    if not isinstance(state, dict) or state.get("format") != ENSEMBLE_FORMAT:
        raise SimilarityDataError(f"{path} is not a 2AFC ensemble (format {ENSEMBLE_FORMAT})")
    try:
        tensors = state["state"]
        pca_dim, dim = tensors["pca_components"].shape
        ensemble = _ensemble_module()(state["models"], state["context_model"], dim, pca_dim, int(state["hidden"]))
        ensemble.load_state_dict(tensors)
    except (KeyError, RuntimeError, ValueError, AttributeError) as exc:
        raise SimilarityDataError(f"ensemble {path} is malformed: {type(exc).__name__}: {exc}") from exc
    return ensemble.eval()


def _credits_of(sa: np.ndarray, sb: np.ndarray, labels: np.ndarray) -> np.ndarray:
    from eval.twoafc import credit, decisions_from_scores

    return np.stack([credit(decisions_from_scores(sa[:, k], sb[:, k]), labels) for k in range(sa.shape[1])], axis=1)


def _context(name: str, triplets: Triplets, store: FeatureStore) -> tuple[np.ndarray, np.ndarray]:
    """(R's context descriptors (n, D), every triplet image's (m, D))."""
    model = get_model(name)
    images = triplets.images()
    x = _global_of(model, store.features(model, images)).astype(np.float64)
    index = {p: i for i, p in enumerate(images)}
    return x[[index[p] for p in triplets.ref]], x


def train_ensemble(conf: EnsembleConfig, triplets: Path | str, output: Path | str, cache: Path | str | None = None,
                   store: FeatureStore | None = None) -> Path:
    """Train the ensemble on the triplets of ``conf.split``; write ``output`` (.pt) and ``output``.json."""
    from core.atomic import write_json_atomic

    start = time.perf_counter()
    split = resolve_split(triplets, conf.split, SPLITS[0])
    data = read_triplets(triplets, split, conf.min_votes)
    store = store or FeatureStore(cache)
    sa, sb = triplet_scores([get_model(n) for n in conf.models], data, store)
    credits = _credits_of(sa, sb, data.label)
    context_ref, context_fit = _context(conf.context_model, data, store)
    ensemble, losses = fit_ensemble(conf, sa - sb, credits, context_ref, context_fit)
    path = save_ensemble(ensemble, Path(output))
    probs = ensemble.probabilities(context_ref)
    write_json_atomic({"config": asdict(conf), "triplets": str(triplets), "split": split, "n": len(data),
                       "images": len(context_fit), "pca_dim": int(ensemble.pca_components.shape[0]),
                       "margin_scale": dict(zip(conf.models, ensemble.margin_scale.tolist())),
                       "train_accuracy_pct": dict(zip(conf.models, np.round(100 * credits.mean(0), 2).tolist())),
                       "mean_predicted_pct": dict(zip(conf.models, np.round(100 * probs.mean(0), 2).tolist())),
                       "final_bce": dict(zip(conf.models, losses)), "seconds": round(time.perf_counter() - start, 3)},
                      path.with_name(path.name + ".json"))
    log.info("ensemble of %s -> %s (%d triplets of split %s)", ", ".join(conf.models), path, len(data), split or "all")
    return path


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalConfig:
    models: tuple[str, ...] | None = None  # None: the ensemble's models, or DEFAULT_MODELS without one
    split: str = "auto"  # "auto" (split "test" when the CSV has splits, else all), "all", or a split name
    min_votes: int = 0  # NIGHTS: keep triplets with at least this many votes


@dataclass(frozen=True, eq=False)
class Evaluation:
    """Per-triplet decisions of every method on one set of triplets."""

    labels: np.ndarray  # (n,)
    kinds: tuple[str, ...]  # (n,) how B was chosen
    decisions: dict[str, np.ndarray]  # method -> (n,) int8: each model, majority_vote, and with an ensemble
    # mean_margin (uniform weights), ensemble (the paper's weights) and ensemble_log_odds
    models: tuple[str, ...]
    mean_weights: dict[str, float] | None = None  # the ensemble's mean weight per model

    @staticmethod
    def concatenate(parts: Sequence[Evaluation]) -> Evaluation:
        names = list(parts[0].decisions)
        if any(list(p.decisions) != names for p in parts):
            raise SimilarityDataError("evaluations of different methods cannot be pooled")
        return Evaluation(np.concatenate([p.labels for p in parts]), tuple(k for p in parts for k in p.kinds),
                          {m: np.concatenate([p.decisions[m] for p in parts]) for m in names}, parts[0].models)


def evaluate_triplets(triplets: Triplets, models: Sequence[str], ensemble: Any = None,
                      store: FeatureStore | None = None) -> Evaluation:
    """Each model's decisions, majority vote, and with an ensemble its decisions and the uniform
    average of the scaled margins (``mean_margin``: the ensemble without its context weights)."""
    from eval.twoafc import decisions_from_scores, majority_vote, weighted_decision

    store = store or FeatureStore()
    sa, sb = triplet_scores([get_model(n) for n in models], triplets, store)
    margins = sa - sb
    decisions = {n: decisions_from_scores(sa[:, k], sb[:, k]) for k, n in enumerate(models)}
    if len(models) >= 2:
        decisions["majority_vote"] = majority_vote(margins)
    mean_weights = None
    if ensemble is not None:
        scaled = margins / ensemble.margin_scale.numpy()
        decisions["mean_margin"] = weighted_decision(scaled, np.ones_like(scaled))
        context_ref, _ = _context(ensemble.context_model, triplets, store)
        decisions["ensemble"] = ensemble.decide(margins, context_ref)
        decisions["ensemble_log_odds"] = ensemble.decide(margins, context_ref, "log_odds")
        mean_weights = dict(zip(models, np.round(ensemble.weights(context_ref).mean(0), 4).tolist()))
    return Evaluation(triplets.label, triplets.kind, decisions, tuple(models), mean_weights)


def report(evaluation: Evaluation) -> dict[str, Any]:
    """Accuracy per method (overall and per kind of B), and the ensemble against the best single model."""
    from eval.twoafc import paired, summary

    ev = evaluation
    out: dict[str, Any] = {"n": len(ev.labels), "methods": {m: summary(d, ev.labels) for m, d in ev.decisions.items()}}
    kinds = sorted(set(ev.kinds) - {""})
    if kinds:
        keep = {k: np.asarray([x == k for x in ev.kinds]) for k in kinds}
        out["by_kind"] = {k: {"n": int(keep[k].sum()), **{m: summary(d[keep[k]], ev.labels[keep[k]])["accuracy_pct"]
                                                          for m, d in ev.decisions.items()}} for k in kinds}
    best = max(ev.models, key=lambda m: out["methods"][m]["accuracy_pct"])
    out["best_single"] = best
    for method in ("majority_vote", "ensemble", "ensemble_log_odds"):
        if method in ev.decisions:
            out[f"{method}_vs_best_single"] = paired(ev.decisions[method], ev.decisions[best], ev.labels)
    if ev.mean_weights is not None:
        out["ensemble_mean_weights"] = ev.mean_weights
    return out


def evaluate(conf: EvalConfig, triplets: Path | str, ensemble: Path | str | None = None, output: Path | str | None = None,
             cache: Path | str | None = None) -> dict[str, Any]:
    """The 2AFC report of ``triplets`` (the split of ``conf.split``); written to ``output`` when given."""
    from core.atomic import write_json_atomic

    start = time.perf_counter()
    model = load_ensemble(ensemble) if ensemble is not None else None
    if model is not None and conf.models is not None and tuple(conf.models) != tuple(model.names):
        raise SimilarityDataError(f"ensemble {ensemble} combines {model.names}; --models {list(conf.models)} differs")
    models = tuple(model.names) if model is not None else (conf.models or DEFAULT_MODELS)
    split = resolve_split(triplets, conf.split, SPLITS[1])
    data = read_triplets(triplets, split, conf.min_votes)
    out = {"triplets": str(triplets), "split": split, "ensemble": str(ensemble) if ensemble else None,
           **report(evaluate_triplets(data, models, model, FeatureStore(cache)))}
    out["seconds"] = round(time.perf_counter() - start, 3)
    if output is not None:
        write_json_atomic(out, Path(output))
    return out


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def _cli_make(args: argparse.Namespace) -> int:
    conf = TripletConfig(seed=args.seed, val_fraction=args.val_fraction, max_pairs_per_group=args.max_pairs_per_group,
                         random_distractors=args.random_distractors, other_groups=args.other_groups, hard=args.hard,
                         hard_pool=args.hard_pool, hard_distractors=args.hard_distractors, miners=parse_models(args.miners))
    distractors = None if args.distractors == "none" else args.distractors
    make_triplets(conf, Path(args.groups), Path(args.out), distractors, args.cache)
    return 0


def _cli_train(args: argparse.Namespace) -> int:
    conf = EnsembleConfig(models=parse_models(args.models) if args.models else DEFAULT_MODELS,
                          context_model=args.context_model, pca_dim=args.pca_dim, hidden=args.hidden, epochs=args.epochs,
                          lr=args.lr, weight_decay=args.weight_decay, seed=args.seed, split=args.split, min_votes=args.min_votes)
    train_ensemble(conf, Path(args.triplets), Path(args.out), args.cache)
    return 0


def _cli_eval(args: argparse.Namespace) -> int:
    conf = EvalConfig(models=parse_models(args.models) if args.models else None, split=args.split, min_votes=args.min_votes)
    out = evaluate(conf, Path(args.triplets), args.ensemble, args.out, args.cache)
    print(f"{'method':<24}{'2AFC %':>8}{'+-':>6}{'n':>7}")
    for method, s in out["methods"].items():
        print(f"{method:<24}{s['accuracy_pct']:>8.2f}{s['stderr_pct']:>6.2f}{s['n']:>7}")
    print(json.dumps(out))
    return 0


def _cli_models(args: argparse.Namespace) -> int:
    for name in sorted(MODELS):
        print(f"{name}{'  (default)' if name in DEFAULT_MODELS else ''}")
    return 0


def add_cli(methods: argparse._SubParsersAction) -> None:
    p = methods.add_parser("2afc", help="2AFC triplets: make them from groups, evaluate similarity models, "
                                        "train a context-sensitive ensemble")
    sub = p.add_subparsers(dest="twoafc_command", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--cache", help="directory caching each model's features per image file")

    m = sub.add_parser("make-triplets", help="triplets with a known answer from groups of images of one instance")
    m.add_argument("--groups", required=True, help="realbench-style directory (groups.csv) or folder of class folders")
    m.add_argument("--out", required=True, help="triplet CSV (ref,a,b,label,group,split,kind); a JSON lands beside it")
    m.add_argument("--distractors", default="auto",
                   help="'auto' (the source's distractors.csv if any), 'none', or a directory of distractor images")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--val-fraction", type=float, default=0.5, help="share of groups and distractors in split val")
    m.add_argument("--max-pairs-per-group", type=int, default=12)
    m.add_argument("--random-distractors", type=int, default=1, help="triplets per (R, A) pair with a random distractor as B")
    m.add_argument("--other-groups", type=int, default=1, help="... with a random image of another group as B")
    m.add_argument("--hard", type=int, default=1, help="... per miner, with B among the miner's nearest images to R")
    m.add_argument("--hard-pool", type=int, default=5, help="hard B's are drawn among this many nearest")
    m.add_argument("--hard-distractors", type=int, default=0, help="distractors per split the miners search (0: all)")
    m.add_argument("--miners", default="tiny-32", help="comma-separated models that find hard B's (not ones you evaluate)")
    common(m)
    m.set_defaults(func=_cli_make)

    t = sub.add_parser("train-ensemble", help="train the per-model regressors of the ensemble on validation triplets")
    t.add_argument("--triplets", required=True, help="triplet CSV (ours or NIGHTS' data.csv)")
    t.add_argument("--out", required=True, help="ensemble file (.pt); a JSON lands beside it")
    t.add_argument("--models", help=f"comma-separated similarity models (default: {','.join(DEFAULT_MODELS)})")
    t.add_argument("--context-model", default=DEFAULT_CONTEXT, help="model whose global descriptor of R is the context")
    t.add_argument("--pca-dim", type=int, default=64)
    t.add_argument("--hidden", type=int, default=32)
    t.add_argument("--epochs", type=int, default=300)
    t.add_argument("--lr", type=float, default=1e-2)
    t.add_argument("--weight-decay", type=float, default=1e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--split", default="auto", help="'auto' (val when the CSV has splits), 'all', or a split name")
    t.add_argument("--min-votes", type=int, default=0, help="NIGHTS: keep triplets with at least this many votes")
    common(t)
    t.set_defaults(func=_cli_train)

    e = sub.add_parser("eval", help="2AFC accuracy of each model, majority vote, and the ensemble if given")
    e.add_argument("--triplets", required=True, help="triplet CSV (ours or NIGHTS' data.csv)")
    e.add_argument("--ensemble", help="ensemble file from train-ensemble (its models are evaluated)")
    e.add_argument("--models", help=f"comma-separated similarity models (default: {','.join(DEFAULT_MODELS)})")
    e.add_argument("--split", default="auto", help="'auto' (test when the CSV has splits), 'all', or a split name")
    e.add_argument("--min-votes", type=int, default=0, help="NIGHTS: keep triplets with at least this many votes")
    e.add_argument("--out", help="write the report (JSON) here too")
    common(e)
    e.set_defaults(func=_cli_eval)

    s = sub.add_parser("models", help="list the similarity models")
    s.set_defaults(func=_cli_models)
