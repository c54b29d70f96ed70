"""What ``needle pack`` wrote into an output directory, so that a rerun appends instead of rewriting.

``pack_record.jsonl`` beside the tars holds one line per packed file: ``source`` (its path relative
to the source root), ``key``, ``tar``, ``bytes``, ``mtime_ns`` and ``sha256`` of the file as it was
packed. ``pack_info.json`` lists the tars (``shards``: name, samples, bytes). A rerun compares the
folder with the record: a path not in it is new (packed into new tars numbered after the last); a
path in it whose size or, when its mtime moved, content differs is *changed*: reported, never
repacked, since its tar would change under descriptors already made from it. A directory packed by
an earlier needle (``pack_info.json`` but no record) is read back from the tars' ``<key>.json``
members, hashing each image member.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.atomic import write_atomic
from core.errors import PackInputError

log = logging.getLogger(__name__)

RECORD_NAME = "pack_record.jsonl"
TAR_NAME = re.compile(r"^[0-9]{6}\.tar$")  # the tars needle pack writes


@dataclass(frozen=True)
class Skipped:
    source: str  # the file, relative to the source root
    reason: str  # why it was not packed (or, for a changed file, how it changed)


@dataclass(frozen=True)
class Packed:
    source: str  # the file, relative to the source root
    key: str  # its sample key in the tar
    tar: str  # the tar holding it (NNNNNN.tar)
    bytes: int  # its size when packed
    mtime_ns: int | None  # its modification time when packed (None: read back from an older pack's tars)
    sha256: str  # of its bytes when packed

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "key": self.key,
            "tar": self.tar,
            "bytes": self.bytes,
            "mtime_ns": self.mtime_ns,
            "sha256": self.sha256,
        }


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_record(output: Path, shards: list[dict[str, Any]]) -> list[Packed]:
    """The files packed in ``output`` (its record, else read back from the ``shards`` tars)."""
    path = output / RECORD_NAME
    if not path.is_file():
        return [entry for shard in shards for entry in read_back(output / shard["tar"])]
    entries = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
                entries.append(Packed(**row))
            except (ValueError, TypeError) as exc:
                raise PackInputError(f"{path}: line {number} is not a packed-file record ({exc})") from exc
    return entries


def write_record(output: Path, entries: list[Packed]) -> None:
    text = "".join(json.dumps(e.to_dict(), sort_keys=True) + "\n" for e in entries)
    write_atomic(output / RECORD_NAME, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def read_back(tar_path: Path) -> list[Packed]:
    """The files of a tar ``needle pack`` wrote, from its ``<key>.json`` members (source, bytes)
    and the sha256 of each image member."""
    metas: dict[str, dict[str, Any]] = {}
    digests: dict[str, str] = {}
    try:
        with tarfile.open(tar_path) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, _, suffix = member.name.rpartition(".")
                data = tar.extractfile(member).read()
                if suffix == "json":
                    metas[key] = json.loads(data)
                else:
                    digests[key] = sha256(data)
    except (OSError, tarfile.TarError, ValueError) as exc:
        raise PackInputError(f"cannot read back {tar_path}, recorded in pack_info.json: {exc}") from exc
    return [
        Packed(meta["source"], key, tar_path.name, int(meta["bytes"]), None, digests.get(key, ""))
        for key, meta in metas.items()
    ]


def changed_reason(root: Path, entry: Packed) -> tuple[str, Packed]:
    """("" if ``entry``'s file is as packed, else why not; the entry with today's mtime when only
    that moved). Size first; then the content, read only when the mtime moved."""
    path = root / entry.source
    try:
        st = path.stat()
    except OSError as exc:
        return f"cannot read: {exc.strerror or exc}", entry
    if st.st_size != entry.bytes:
        return f"size {entry.bytes} bytes when packed into {entry.tar}, {st.st_size} now", entry
    if entry.mtime_ns == st.st_mtime_ns:
        return "", entry
    try:
        digest = sha256(path.read_bytes())
    except OSError as exc:
        return f"cannot read: {exc.strerror or exc}", entry
    if digest != entry.sha256:
        return f"content differs from what was packed into {entry.tar} (same size)", entry
    return "", Packed(entry.source, entry.key, entry.tar, entry.bytes, st.st_mtime_ns, entry.sha256)


def check_tars(output: Path, shards: list[dict[str, Any]], ours: set[str]) -> None:
    """Refuse a recorded tar that is gone or whose size changed, and a ``NNNNNN.tar`` that needle
    pack did not write (not recorded, not ``ours``: left by this output's interrupted run)."""
    recorded = {s["tar"]: s for s in shards}
    for name, shard in sorted(recorded.items()):
        path = output / name
        if not path.is_file():
            raise PackInputError(
                f"{path} is recorded in {output / 'pack_info.json'} but missing: "
                "restore it, or pack into a new directory"
            )
        if "bytes" in shard and path.stat().st_size != shard["bytes"]:
            raise PackInputError(
                f"{path} has {path.stat().st_size} bytes, {shard['bytes']} when needle pack wrote it: "
                "it was replaced; restore it, or pack into a new directory"
            )
    known = recorded.keys() | ours
    foreign = sorted(p.name for p in output.iterdir() if TAR_NAME.match(p.name) and p.name not in known)
    if foreign:
        raise PackInputError(
            f"{output / foreign[0]} was not written by needle pack ({len(foreign)} such tars, not in "
            f"{output / 'pack_info.json'}): move them elsewhere (ingest them with their own --shards), "
            "or pack into a new directory"
        )


def interrupted_tars(output: Path, info: dict[str, Any]) -> set[str]:
    """Tars an interrupted run of needle pack may have left (numbered from its ``writing_from``,
    not recorded): removed by the next run."""
    if info.get("status") != "incomplete":
        return set()
    first = int(info.get("writing_from", 0))
    recorded = {s["tar"] for s in info.get("shards", [])}
    return {
        p.name
        for p in output.iterdir()
        if TAR_NAME.match(p.name) and int(p.name[:6]) >= first and p.name not in recorded
    }


def mtime_ns(path: Path) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def compare_packed(
    root: Path, found: list[str], record: list[Packed]
) -> tuple[list[str], list[Packed], list[Skipped], list[str]]:
    """The source's files against what earlier runs packed: (files not packed yet, the record with
    refreshed mtimes, files changed since packed and why, packed files gone from the source)."""
    by_source = {e.source: e for e in record}
    present = set(found)
    new = [source for source in found if source not in by_source]
    changed: list[Skipped] = []
    refreshed = []
    for entry in record:
        if entry.source not in present:
            refreshed.append(entry)
            continue
        reason, entry = changed_reason(root, entry)
        refreshed.append(entry)
        if reason:
            log.warning("pack: %s changed since it was packed (%s): not repacked", root / entry.source, reason)
            changed.append(Skipped(entry.source, reason))
    missing = sorted((s for s in by_source if s not in present), key=lambda s: s.split("/"))
    if missing:
        log.warning(
            "pack: %d packed files are gone from %s (e.g. %s); their tars keep them", len(missing), root, missing[0]
        )
    return new, refreshed, changed, missing
