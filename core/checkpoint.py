"""Reading torch checkpoint files safely (``weights_only=True``) with errors that name the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_torch_file(path: Path | str, error: type[Exception], what: str, map_location: Any = "cpu") -> Any:
    """The object saved in ``path`` (tensors and plain containers only: ``weights_only=True``).
    A missing or unreadable file raises ``error`` naming ``what`` and the file."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise error(f"{what} {path} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file; name the file in one
        raise error(f"cannot load {what} {path}: {type(exc).__name__}: {exc}") from exc
