"""Query image files (``needle query --image``, ``needle eval map`` image queries): read and
decoded as ingestion decodes, a file that is no image refused with one line naming it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from core.errors import ImageDecodeError, NeedleInputError


class QueryImageError(NeedleInputError):
    """A query image file that cannot be read or is not an image: names the file."""


def read_query_image(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise QueryImageError(f"cannot read query image {path}: {exc}") from exc


def decode_query_image(path: Path, longer_side: int) -> np.ndarray:
    """RGB uint8 (H, W, 3) of ``path`` with its longer side at ``longer_side``, as ingestion made the
    database's; QueryImageError naming ``path`` for bytes that are no image."""
    from ingest.images import decode_resized

    try:
        return decode_resized(read_query_image(path), longer_side, str(path))[0]
    except ImageDecodeError as exc:
        raise QueryImageError(f"query image {path}: {exc.reason}") from exc


def check_query_images(paths: Sequence[Path]) -> None:
    """Each file's header read (nothing decoded), before any model is loaded: a file that is no
    image is refused in a second, not after the model's load."""
    from ingest.images import open_image

    for path in paths:
        try:
            with open_image(read_query_image(path), str(path)):
                pass
        except ImageDecodeError as exc:
            raise QueryImageError(f"query image {path}: {exc.reason}") from exc
