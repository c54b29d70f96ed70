"""Image collections the similarity methods train and evaluate on.

``groups``: named groups of images that show the same instance (realbench's ``groups.csv``, or a
folder of class folders, the layout the published datasets use). The methods derive from them
what they need: pairs (two images of a group), classes (the groups), groups, and triplets with a
known answer (R and A from one group, B from another group or a distractor).
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import numpy as np

from core.errors import NeedleInputError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


class SimilarityDataError(NeedleInputError):
    """A dataset file or folder for the similarity methods that is missing or malformed."""


def realbench_groups(root: Path | str, min_size: int = 1) -> dict[str, list[Path]]:
    """Group name -> image paths (in ``groups.csv`` order) of a realbench-style directory
    (``groups.csv`` with ``key,group``; images at ``images/<key>.jpg``)."""
    root = Path(root)
    path = root / "groups.csv"
    if not path.is_file():
        raise SimilarityDataError(f"{path} does not exist (expected a realbench-style directory)")
    groups: dict[str, list[Path]] = defaultdict(list)
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if "key" not in row or "group" not in row:
                raise SimilarityDataError(f"{path}: row {i + 1} needs columns key,group")
            image = root / "images" / f"{row['key']}.jpg"
            if not image.is_file():
                raise SimilarityDataError(f"{path}: row {i + 1} names {image}, which does not exist")
            groups[row["group"]].append(image)
    return {g: paths for g, paths in groups.items() if len(paths) >= min_size}


def folder_groups(root: Path | str, min_size: int = 1) -> dict[str, list[Path]]:
    """Class folders (``root/<class>/<image>``), the layout of the published class datasets."""
    root = Path(root)
    if not root.is_dir():
        raise SimilarityDataError(f"class folder root {root} does not exist")
    groups = {
        d.name: sorted(p for p in d.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        for d in sorted(root.iterdir())
        if d.is_dir()
    }
    groups = {g: paths for g, paths in groups.items() if len(paths) >= min_size}
    if not groups:
        raise SimilarityDataError(f"{root} holds no class folder with at least {min_size} images")
    return groups


def load_groups(source: Path | str, min_size: int = 1) -> dict[str, list[Path]]:
    """A realbench-style directory (with ``groups.csv``) or a folder of class folders."""
    source = Path(source)
    return realbench_groups(source, min_size) if (source / "groups.csv").is_file() else folder_groups(source, min_size)


def realbench_distractors(root: Path | str) -> list[Path]:
    """realbench's distractor images (``distractors.csv`` order)."""
    root = Path(root)
    path = root / "distractors.csv"
    if not path.is_file():
        raise SimilarityDataError(f"{path} does not exist")
    with open(path, newline="") as f:
        return [root / "distractors" / row["file"] for row in csv.DictReader(f)]


def load_rgb(path: Path | str, longer_side: int) -> np.ndarray:
    """(H, W, 3) uint8 of an image file, resized isotropically so the longer side is
    ``longer_side`` (the ingestion convention); a typed error naming the file otherwise."""
    from core.errors import ImageDecodeError
    from ingest.images import decode_resized

    try:
        data = Path(path).read_bytes()
        return decode_resized(data, longer_side, str(path))[0]
    except OSError as exc:
        raise SimilarityDataError(f"cannot read image {path}: {exc}") from exc
    except ImageDecodeError as exc:
        raise SimilarityDataError(f"cannot decode image {path}: {exc}") from exc
