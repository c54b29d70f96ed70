"""Triplets for two-alternative forced choice (2AFC), and their CSV files.

A triplet (R, A, B) asks which of A and B is closer to the reference R; its label is the probability
that B is (0: A is closer, 1: B is closer). Any similarity model answers with the sign of
``s(R, A) - s(R, B)`` and is scored by 2AFC accuracy (eval/twoafc.py: ties earn half).

Triplets come from a CSV: ours (``ref,a,b,label`` and optional ``group,split,kind``) or NIGHTS'
``data.csv`` (``id,left_vote,right_vote,votes,ref_path,left_path,right_path,split,is_imagenet``:
A = left, B = right, label = right_vote / (left_vote + right_vote)); paths are relative to the CSV.
"""

from __future__ import annotations

import csv
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from similarity.data import SimilarityDataError

log = logging.getLogger(__name__)

SPLITS = ("val", "test")
NEEDLE_COLUMNS = ("ref", "a", "b", "label")
NIGHTS_COLUMNS = ("ref_path", "left_path", "right_path", "right_vote")
OUTPUT_COLUMNS = ("ref", "a", "b", "label", "group", "split", "kind")


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
        return Triplets(
            pick(self.ref),
            pick(self.a),
            pick(self.b),
            self.label[idx],
            pick(self.group),
            pick(self.split),
            pick(self.kind),
        )

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
        raise SimilarityDataError(
            f"{path}: row {i} has non-numeric votes {row.get('left_vote')!r}, {row['right_vote']!r}"
        ) from None
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
        raise SimilarityDataError(
            f"{path}: header {sorted(columns)} has neither columns {','.join(NEEDLE_COLUMNS)} "
            f"nor NIGHTS' {','.join(NIGHTS_COLUMNS)}"
        )
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
        raise SimilarityDataError(
            f"{path}: no triplet left" + (f" in split {split!r} (splits: {available})" if split else "")
        )
    triplets = Triplets(
        tuple(ref), tuple(a), tuple(b), np.asarray(labels, np.float64), tuple(groups), tuple(splits), tuple(kinds)
    )
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
                w.writerow(
                    [
                        rel(triplets.ref[i]),
                        rel(triplets.a[i]),
                        rel(triplets.b[i]),
                        f"{triplets.label[i]:g}",
                        triplets.group[i],
                        triplets.split[i],
                        triplets.kind[i],
                    ]
                )

    return write_atomic(path, write)
