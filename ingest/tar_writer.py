"""Writing samples into numbered WebDataset tars, each renamed into place only when complete."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

from core.atomic import temporary_path

TAR_FORMAT = tarfile.GNU_FORMAT  # plain ustar headers for short names; GNU long names beyond 100 bytes


def tar_member(name: str, size: int) -> tarfile.TarInfo:
    """A regular-file header with no time or owner, so the same samples give identical tar bytes."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.type = size, 0, 0o644, tarfile.REGTYPE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


class TarShardWriter:
    """Samples into ``<prefix>000000.tar``, ``<prefix>000001.tar``, ... (from ``first``) of ``shard_size`` each.

    Each tar is written as ``<name>.tmp`` and renamed when full or when the writer closes cleanly,
    so a reader never sees a partial tar; on an error the open tar's temporary file is removed."""

    def __init__(self, out_dir: Path, shard_size: int, prefix: str = "", tar_format: int = TAR_FORMAT, first: int = 0):
        self.out_dir, self.shard_size, self.prefix, self.tar_format = Path(out_dir), shard_size, prefix, tar_format
        self.first = first  # the number of the first tar (an append continues after the last one)
        self.shards: list[dict[str, Any]] = []  # per written tar: name, samples, bytes, first and last key
        self.written: list[Path] = []  # the tars written, in order
        self._tar: tarfile.TarFile | None = None
        self._keys: list[str] = []

    def __enter__(self) -> TarShardWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def add(self, key: str, members: list[tuple[str, bytes]]) -> str:
        """Add one sample, its members (suffix, bytes) in this order; returns its key as ingestion
        names it, ``<tar name without .tar>/<key>``."""
        if self._tar is None:
            self._path = self.out_dir / f"{self.prefix}{self.first + len(self.shards):06d}.tar"
            self._tmp = temporary_path(self._path)
            self._tar = tarfile.open(self._tmp, "w", format=self.tar_format)  # noqa: SIM115 (open across add calls)
        for suffix, data in members:
            self._tar.addfile(tar_member(f"{key}.{suffix}", len(data)), io.BytesIO(data))
        self._keys.append(key)
        full_key = f"{self._path.name[: -len('.tar')]}/{key}"
        if len(self._keys) == self.shard_size:
            self.close()
        return full_key

    def close(self) -> None:
        """Finish the open tar (if any) and rename it into place."""
        if self._tar is None:
            return
        self._tar.close()
        self._tmp.replace(self._path)
        self.shards.append(
            {
                "tar": self._path.name,
                "samples": len(self._keys),
                "bytes": self._path.stat().st_size,
                "first_key": self._keys[0],
                "last_key": self._keys[-1],
            }
        )
        self.written.append(self._path)
        self._tar, self._keys = None, []

    def abort(self) -> None:
        """Drop the open tar's temporary file; tars already renamed stay."""
        if self._tar is not None:
            self._tar.close()
            self._tmp.unlink(missing_ok=True)
            self._tar, self._keys = None, []
