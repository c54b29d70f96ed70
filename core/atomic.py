"""Atomic file writes: a reader sees the old file or the whole new one, never a partial one."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def temporary_path(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place (same directory, so the rename is
    atomic on a POSIX filesystem)."""
    return path.with_name(path.name + ".tmp")


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on a clean exit it is renamed onto ``path``, on an
    error it is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_atomic(path: Path | str, write: Callable[[Path], Any]) -> Path:
    """Call ``write(tmp_path)`` then rename onto ``path``: readers never see a partial file."""
    with atomic_path(path) as tmp:
        write(tmp)
    return Path(path)


def write_json_atomic(obj: Any, path: Path | str) -> Path:
    """``obj`` as indented JSON with sorted keys, written atomically."""
    return write_atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n"))
