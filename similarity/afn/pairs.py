"""Pairs for the adaptation function: a realbench-style directory or a folder of class folders (the
first two images of every group with at least two, one pair per group, so that no split shares an
instance between train and test and the identity target has no second positive in a batch); the
TLL layout (``left/`` and ``right/`` with matching file names); or a CSV with columns ``left,right``
(paths relative to the CSV's folder unless absolute). Distractors (a realbench directory's
``distractors/``, or a folder of images) are added to both directions' galleries."""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from pathlib import Path

from similarity.data import IMAGE_SUFFIXES, SimilarityDataError, load_groups, realbench_distractors

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PairSet:
    left: tuple[Path, ...]  # left image of pair i
    right: tuple[Path, ...]  # right image of pair i
    names: tuple[str, ...]  # a name per pair (group, file name or CSV row)

    def __len__(self) -> int:
        return len(self.left)


def pairs_from_groups(groups: dict[str, list[Path]]) -> PairSet:
    """One pair per group of at least two images: its first two (groups keep their file order)."""
    chosen = [(name, paths) for name, paths in groups.items() if len(paths) >= 2]
    skipped = len(groups) - len(chosen)
    if skipped:
        log.info("%d group(s) with a single image give no pair", skipped)
    return PairSet(tuple(p[0] for _, p in chosen), tuple(p[1] for _, p in chosen), tuple(n for n, _ in chosen))


def tll_pairs(root: Path) -> PairSet:
    """Totally-Looks-Like layout: ``root/left/<name>`` pairs with ``root/right/<name>``."""
    sides = {}
    for side in ("left", "right"):
        folder = root / side
        sides[side] = {p.name: p for p in sorted(folder.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES}
    only_left = sorted(set(sides["left"]) - set(sides["right"]))
    only_right = sorted(set(sides["right"]) - set(sides["left"]))
    if only_left or only_right:
        raise SimilarityDataError(
            f"{root}: left/ and right/ must hold the same file names; only in left/: {only_left[:3]}, "
            f"only in right/: {only_right[:3]}"
        )
    names = sorted(sides["left"])
    return PairSet(tuple(sides["left"][n] for n in names), tuple(sides["right"][n] for n in names), tuple(names))


def csv_pairs(path: Path) -> PairSet:
    """A CSV with a header holding ``left,right`` (optionally ``name``); relative paths are taken
    from the CSV's folder."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or not {"left", "right"} <= set(reader.fieldnames):
            raise SimilarityDataError(f"{path}: needs a header with columns left,right, got {reader.fieldnames}")
        rows = list(reader)
    left, right, names = [], [], []
    for i, row in enumerate(rows, start=2):  # line numbers as an editor shows them (header = 1)
        pair = []
        for side in ("left", "right"):
            value = (row.get(side) or "").strip()
            image = Path(value) if Path(value).is_absolute() else path.parent / value
            if not value or not image.is_file():
                raise SimilarityDataError(f"{path}: line {i} column {side} names {value!r}, which is not a file")
            pair.append(image)
        left.append(pair[0])
        right.append(pair[1])
        names.append(row.get("name") or f"row{i}")
    return PairSet(tuple(left), tuple(right), tuple(names))


def load_pairs(source: Path | str) -> PairSet:
    """Pairs of a pairs CSV, a TLL-layout folder, a realbench-style directory or class folders."""
    source = Path(source)
    if source.is_file() and source.suffix.lower() == ".csv":
        pairs = csv_pairs(source)
    elif (source / "left").is_dir() and (source / "right").is_dir():
        pairs = tll_pairs(source)
    elif source.is_dir():
        pairs = pairs_from_groups(load_groups(source, min_size=1))
    else:
        raise SimilarityDataError(
            f"pairs source {source} is neither a .csv, a folder with left/ and right/, "
            "a realbench-style directory nor a folder of class folders"
        )
    if len(pairs) < 2:
        raise SimilarityDataError(f"{source} gives {len(pairs)} pair(s); at least 2 are needed")
    return pairs


def load_distractor_paths(source: Path | str) -> list[Path]:
    """Distractor images: a realbench directory's ``distractors.csv`` or every image in a folder."""
    source = Path(source)
    if (source / "distractors.csv").is_file():
        return realbench_distractors(source)
    if source.is_dir():
        paths = sorted(p for p in source.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if paths:
            return paths
    raise SimilarityDataError(f"distractor source {source} is neither a realbench directory nor a folder of images")
