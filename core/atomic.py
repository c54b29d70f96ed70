"""Atomic file writes: a reader sees the old file or the whole new one, never a partial one; the
durable ones (``replace_durably``, ``write_synced``) also survive a crash right after them."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


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


def json_bytes(obj: Any) -> bytes:
    """The form needle writes its JSON records in: indented, keys sorted, a newline at the end."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def write_json_atomic(obj: Any, path: Path | str) -> Path:
    """``obj`` as ``json_bytes``, written atomically."""
    return write_atomic(path, lambda tmp: Path(tmp).write_bytes(json_bytes(obj)))


def fsync_directory(path: Path) -> None:
    """Make a rename or link in ``path`` durable (a crash after it does not undo it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_synced(path: Path, write: Callable[[IO[bytes]], Any]) -> Path:
    """Create ``path`` with ``write(stream)``, then flush and fsync it: its bytes are on disk before
    the caller renames or links it into place."""
    with open(path, "wb") as stream:
        write(stream)
        stream.flush()
        os.fsync(stream.fileno())
    return path


def replace_durably(path: Path, data: bytes) -> Path:
    """The one durable write: ``data`` into a hidden temporary file beside ``path`` (its name holds
    the pid, so two processes never share one), fsynced, renamed onto ``path`` with ``os.replace``,
    then the directory fsynced. Readers see the old file or the whole new one, and a crash after
    the call keeps the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write_synced(tmp, lambda stream: stream.write(data))
    os.replace(tmp, path)
    fsync_directory(path.parent)
    return path
