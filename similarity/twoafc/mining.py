"""Making 2AFC triplets with a known answer from groups of images of one instance (realbench's
``groups.csv`` or class folders).

R and A come from one group; B is a random distractor, a random image of another group, or a *hard*
B, drawn among the images nearest to R under each of the ``miners``, models the evaluation should
not use (default: tiny images, 32 x 32 thumbnails, mean-subtracted, cosine). The groups (and the
distractors) are split into ``val`` and ``test`` first, so no group and no image is in both; the
closer image is put on the A or B side at random.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from similarity.data import IMAGE_SUFFIXES, SimilarityDataError, load_groups, realbench_distractors
from similarity.twoafc.features import FeatureStore, global_features
from similarity.twoafc.registry import get_model
from similarity.twoafc.triplets import SPLITS, Triplets, write_triplets

log = logging.getLogger(__name__)


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
            raise SimilarityDataError(
                "ask for at least one triplet per pair (random_distractors, other_groups or hard with a miner)"
            )


def _split_items(items: list[str], fraction: float, rng: np.random.Generator) -> dict[str, str]:
    order = rng.permutation(len(items))
    n_val = round(fraction * len(items))
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


def _split_triplets(
    conf: TripletConfig,
    groups: dict[str, list[Path]],
    distractors: list[Path],
    mined: list[Path],
    miner_features: Callable[[str, list[Path]], np.ndarray],
    rng: np.random.Generator,
) -> list[tuple]:
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
                chosen += [
                    (distractors[k], "distractor") for k in rng.integers(len(distractors), size=conf.random_distractors)
                ]
            if others:
                chosen += [
                    (images[others[k]][0], "other_group") for k in rng.integers(len(others), size=conf.other_groups)
                ]
            for miner, x in pool_x.items():
                nearest = _hard_pool(r, g, pool, pool_group, x, conf.hard_pool)
                if len(nearest):
                    picks = rng.choice(nearest, size=min(conf.hard, len(nearest)), replace=False)
                    chosen += [(pool[k], f"hard:{miner}") for k in picks]
            for neg, kind in chosen:
                swap = bool(rng.random() < 0.5)  # the closer image on either side, so "always A" scores 50%
                rows.append((r, neg, pos, 1.0, g, kind) if swap else (r, pos, neg, 0.0, g, kind))
    return rows


def make_triplets(
    conf: TripletConfig,
    source: Path | str,
    output: Path | str,
    distractors: Path | str | None = "auto",
    cache: Path | str | None = None,
) -> Path:
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
    distractor_split = _split_items(
        [str(p) for p in distractor_list], conf.val_fraction, np.random.default_rng([conf.seed, 1])
    )
    miners = {m: get_model(m) for m in conf.miners} if conf.hard else {}
    store = FeatureStore(cache)

    def miner_features(name: str, paths: list[Path]) -> np.ndarray:
        return global_features(miners[name], store.features(miners[name], paths)).astype(np.float64)

    rng = np.random.default_rng([conf.seed, 2])
    rows = []
    for split in SPLITS:
        split_groups_ = {g: list(paths) for g, paths in groups.items() if assigned[g] == split}
        split_distractors = [p for p in distractor_list if distractor_split[str(p)] == split]
        mined = split_distractors
        if 0 < conf.hard_distractors < len(mined):
            sample = np.random.default_rng([conf.seed, 3, SPLITS.index(split)]).choice(
                len(mined), conf.hard_distractors, replace=False
            )
            mined = [mined[k] for k in sorted(sample)]
        rows += [
            (*row, split) for row in _split_triplets(conf, split_groups_, split_distractors, mined, miner_features, rng)
        ]
    if not rows:
        raise SimilarityDataError(f"no triplet could be made from {source} with {conf}")
    ref, a, b, label, group, kind, split = zip(*rows)
    triplets = Triplets(ref, a, b, np.asarray(label, np.float64), group, split, kind)
    path = write_triplets(triplets, Path(output))
    counts = {
        s: {
            "triplets": sum(1 for x in split if x == s),
            "groups": sum(1 for g, p in groups.items() if assigned[g] == s and len(p) >= 2),
            "distractors": sum(1 for v in distractor_split.values() if v == s),
            "kinds": dict(Counter(k for k, x in zip(kind, split) if x == s)),
            "label_1": int(sum(1 for lab, x in zip(label, split) if x == s and lab == 1.0)),
        }
        for s in SPLITS
    }
    write_json_atomic(
        {
            "config": asdict(conf),
            "source": str(source),
            "distractors": str(distractors) if distractors else None,
            "triplets": len(triplets),
            "splits": counts,
            "seconds": round(time.perf_counter() - start, 3),
        },
        path.with_name(path.name + ".json"),
    )
    log.info("%d triplets -> %s (%s)", len(triplets), path, ", ".join(f"{s}: {counts[s]['triplets']}" for s in SPLITS))
    return path
