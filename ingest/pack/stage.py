"""``needle pack``: a folder of images (or a list of image files) as WebDataset tars for ``needle ingest``.

**Input.** Every file under a directory whose extension is one of ``PackConfig.extensions``
(``ingest.config.IMAGE_SUFFIXES`` by default, case-insensitive), walked recursively; or the files of
a list: a text file of paths, one a line (blank lines ignored, relative paths resolved against the
list file's directory), or a Python sequence of paths. Files are packed in the sorted order of their
path components (code-point order: the same on every machine and file system). A directory's
files are named relative to it; a list's files relative to the deepest directory holding them all,
so that listing every image of ``photos/`` gives the keys packing ``photos/`` gives.

**Output**, in the output directory: ``000000.tar``, ``000001.tar``, ... (six digits, the img2dataset
layout) of ``shard_size`` samples each, and ``pack_info.json``. Each sample is two members, in this
order: ``<key>.<suffix>``, the file's bytes as they are (never re-encoded; the suffix is the
extension lower-cased with ``jpeg`` -> ``jpg`` and ``tiff`` -> ``tif``, all suffixes the reader
takes), and ``<key>.json``: ``{"key", "source", "bytes", "width", "height", "format"}``.

**Keys** (:func:`sample_key`, :func:`unique_keys`): the path relative to the root without its
extension; ``/`` is kept between directories and every other character outside ``[A-Za-z0-9_-]``
becomes ``_``. So ``a/b/photo.01.JPG`` -> ``a/b/photo_01``, which needle names
``000000/a/b/photo_01``. No key holds a ``.``: webdataset splits a member name into key and suffix
at the first dot of its base name, so ``photo.01.jpg`` would be a sample ``photo`` with a member
``01.jpg`` that the reader does not take for an image. A ``/`` is safe: webdataset's grouping keeps
it in the key, and needle splits ``<shard>/<key>`` at the first ``/`` only (thumbnails in
``webapi/webpage.py``, ILIAS ids in ``eval/ilias.py``). A first directory named like ``__x__`` gets
its first ``_`` turned into ``-``: webdataset skips members under such a directory as metadata.
Keys that clash after this (``x.jpg`` and ``x.png``, ``a.b.jpg`` and ``a_b.jpg``) are made unique
by the sorted order: the first keeps the key, the next ones get ``~1``, ``~2``, ... (``~`` never
appears otherwise). Keys depend only on the list of image file names, never on their contents.

**Unreadable files** (permission denied, vanished, zero bytes, bytes PIL cannot identify or
verify) are skipped, each with a warning naming it, and listed with the reason in
``pack_info.json``. PIL's ``verify`` reads headers only: a truncated JPEG passes it and becomes an
``error`` row at ingestion, unless ``full_check`` decodes every image (JPEGs at 1/8 scale).

**Determinism.** Tars are written as ``NNNNNN.tar.tmp`` and renamed into place; members carry
mtime 0, uid/gid 0, no owner names, mode 0644, GNU tar format (long names): the same files packed
into an empty directory give byte-identical tars.

**Appending.** ``pack_info.json`` (the tars) and ``pack_record.jsonl`` (each packed file:
ingest/pack/record.py) mark the directory as ``needle pack``'s. Run again into it, pack never
rewrites a tar: it packs the files not packed yet (by relative path) into new tars numbered after
the last, their keys clear of the keys packed before; a packed file whose size or content changed
is reported (``changed_sources``), not repacked; one that is gone stays in its tar
(``missing_sources``). Refused (nothing written): a directory holding ``NNNNNN.tar`` files but no
``pack_info.json``; in one of its own, a tar it did not record (a renamed or copied tar), or a
recorded tar that is missing or whose size changed. Tars of an interrupted run (from its
``writing_from``, not recorded) are removed, each with a warning, and listed in ``pack_info.json``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from core.atomic import write_json_atomic
from core.errors import PackInputError
from ingest.config import IMAGE_SUFFIXES, PackConfig
from ingest.images import open_image
from ingest.pack.record import (
    TAR_NAME,
    Packed,
    Skipped,
    check_tars,
    compare_packed,
    interrupted_tars,
    mtime_ns,
    read_record,
    sha256,
    write_record,
)
from ingest.tar_writer import TarShardWriter

log = logging.getLogger(__name__)

INFO_NAME = "pack_info.json"
TMP_NAME = re.compile(r"^[0-9]{6}\.tar\.tmp$")  # a tar being written
MEMBER_SUFFIX = {"jpeg": "jpg", "tiff": "tif"}  # extension -> member suffix where they differ
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_WDS_META = re.compile(r"^__.*__$")  # a first directory webdataset's reader skips (tar_file_iterator's skip_meta)


class _Unreadable(Exception):
    """A file that is not packed; the message is the reason."""


# --- keys ----------------------------------------------------------------------------------------


def member_suffix(extension: str) -> str:
    """The tar member suffix of a file extension (``.JPEG`` -> ``jpg``, ``.PNG`` -> ``png``)."""
    ext = extension.lower().lstrip(".")
    return MEMBER_SUFFIX.get(ext, ext)


def sample_key(source: str) -> str:
    """The sanitised key of a relative POSIX path (``a/b/photo.01.JPG`` -> ``a/b/photo_01``)."""
    stem = source.rsplit(".", 1)[0] if "." in source.rsplit("/", 1)[-1] else source
    parts = [_UNSAFE.sub("_", part) for part in stem.split("/")]
    if len(parts) > 1 and _WDS_META.match(parts[0]):
        parts[0] = "-" + parts[0][1:]
    return "/".join(parts)


def unique_keys(sources: Sequence[str], taken: frozenset[str] = frozenset()) -> list[str]:
    """One key per source, in order: the first of clashing keys keeps it, the next get ``~1``, ``~2``, ...;
    ``taken``: keys already packed (an append), which the new keys skip."""
    seen: dict[str, int] = {}  # key -> the next suffix to try for it
    keys = []
    for source in sources:
        base = sample_key(source)
        n = seen.get(base, 0)
        while (f"{base}~{n}" if n else base) in taken:
            n += 1
        seen[base] = n + 1
        keys.append(f"{base}~{n}" if n else base)  # no sanitised key holds "~": suffixed keys never clash
    return keys


# --- inputs --------------------------------------------------------------------------------------


def check_config(conf: PackConfig) -> None:
    """Raise PackInputError naming the first setting out of range."""
    if isinstance(conf.shard_size, bool) or not isinstance(conf.shard_size, int) or conf.shard_size < 1:
        raise PackInputError(f"shard_size must be an integer >= 1, got {conf.shard_size!r}")
    if not conf.extensions:
        raise PackInputError("extensions is empty: no file would be packed")
    bad = [e for e in conf.extensions if member_suffix(e) not in IMAGE_SUFFIXES]
    if bad:
        raise PackInputError(f"extensions {bad} are not image suffixes ingestion reads ({', '.join(IMAGE_SUFFIXES)})")


def image_extensions(conf: PackConfig) -> frozenset[str]:
    """The configured extensions, lower-cased, without the dot."""
    return frozenset(e.lower().lstrip(".") for e in conf.extensions)


def _is_image(name: str, extensions: frozenset[str]) -> bool:
    suffix = Path(name).suffix  # "" for ".jpg" alone (a hidden file without extension)
    return bool(suffix) and suffix[1:].lower() in extensions


def _path_order(source: str) -> list[str]:
    return source.split("/")


def _scan(directory: Path) -> list[os.DirEntry]:
    with os.scandir(directory) as entries:
        return sorted(entries, key=lambda e: e.name)


def walk_images(root: Path, conf: PackConfig) -> tuple[list[str], list[Skipped], int]:
    """The image files under ``root`` as sorted POSIX paths relative to it, the entries skipped
    (symlinks not followed, unlistable directories, directories reached twice) and the number of
    other files ignored. Directories are walked depth first in name order."""
    extensions = image_extensions(conf)
    found: list[str] = []
    skipped: list[Skipped] = []
    ignored = 0
    walked: set[tuple[int, int]] = set()
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        try:
            st = (root / rel_dir).stat()
            if (st.st_dev, st.st_ino) in walked:
                skipped.append(Skipped(rel_dir, "directory already walked (a symlink loop or a second link to it)"))
                continue
            walked.add((st.st_dev, st.st_ino))
            entries = _scan(root / rel_dir)
        except OSError as exc:
            skipped.append(Skipped(rel_dir or ".", f"cannot list directory: {_os_reason(exc)}"))
            continue
        subdirs = []
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            image = _is_image(entry.name, extensions)
            if entry.is_symlink() and not conf.follow_symlinks:
                if image or entry.is_dir():
                    skipped.append(Skipped(rel, "symlink not followed (follow_symlinks is off)"))
            elif entry.is_dir():
                if conf.recursive:
                    subdirs.append(rel)
            elif image and entry.is_file():
                found.append(rel)
            elif image:
                skipped.append(Skipped(rel, "broken symlink" if entry.is_symlink() else "not a regular file"))
            else:
                ignored += 1
        stack.extend(reversed(subdirs))  # popped in name order
    found.sort(key=_path_order)
    skipped.sort(key=lambda s: _path_order(s.source))
    return found, skipped, ignored


def _os_reason(exc: OSError) -> str:
    return f"{type(exc).__name__}: {exc.strerror or exc}"


def read_list_file(path: Path) -> list[Path]:
    """The paths listed in a text file, one a line; relative ones resolved against its directory."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise PackInputError(f"list file {path} is not UTF-8 text (give a directory or a list of image paths)") from exc
    except OSError as exc:
        raise PackInputError(f"cannot read list file {path}: {_os_reason(exc)}") from exc
    return [path.parent / line.strip() for line in lines if line.strip()]


def listed_images(paths: Sequence[Path], conf: PackConfig) -> tuple[Path, list[str], list[Skipped]]:
    """A list of image files as (root, sorted paths relative to root, entries skipped): the root is
    the deepest directory holding them all; repeated entries and other extensions are skipped."""
    extensions = image_extensions(conf)
    absolute = [Path(os.path.abspath(p)) for p in paths]
    if not absolute:
        raise PackInputError("the list of images is empty")
    root = Path(os.path.commonpath([str(p.parent) for p in absolute]))
    seen: set[str] = set()
    found: list[str] = []
    skipped: list[Skipped] = []
    for path in absolute:
        rel = path.relative_to(root).as_posix()
        if rel in seen:
            skipped.append(Skipped(rel, "listed more than once"))
        elif not _is_image(path.name, extensions):
            skipped.append(Skipped(rel, f"extension not one of {', '.join(conf.extensions)}"))
        else:
            found.append(rel)
        seen.add(rel)
    found.sort(key=_path_order)
    return root, found, skipped


def collect(conf: PackConfig, inputs: str | Path | Sequence[str | Path]) -> tuple[Path, list[str], list[Skipped], int]:
    """(root, image paths relative to it in packing order, entries skipped, other files ignored)."""
    if isinstance(inputs, (str, Path)):
        source = Path(inputs)
        if source.is_dir():
            found, skipped, ignored = walk_images(source, conf)
            root = Path(os.path.abspath(source))
        elif source.is_file():
            paths = [source] if _is_image(source.name, image_extensions(conf)) else read_list_file(source)
            root, found, skipped = listed_images(paths, conf)
            ignored = 0
        else:
            raise PackInputError(f"source {source} is neither a directory nor a list file (it does not exist)")
    else:
        root, found, skipped = listed_images([Path(p) for p in inputs], conf)
        ignored = 0
    if not found:
        where = inputs if isinstance(inputs, (str, Path)) else "the list of paths"
        why = f" ({len(skipped)} skipped, e.g. {skipped[0].source}: {skipped[0].reason})" if skipped else ""
        raise PackInputError(f"no image files ({', '.join(conf.extensions)}) in {where}{why}")
    return root, found, skipped, ignored


def read_image(path: Path, full_check: bool = False) -> tuple[bytes, dict[str, Any]]:
    """The file's bytes and {width, height, format}; raises _Unreadable with the reason."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _Unreadable(f"cannot read: {_os_reason(exc)}") from exc
    if not data:
        raise _Unreadable("empty file (0 bytes)")
    try:  # the formats and scan cap ingestion decodes (ingest.images.open_image): what it would refuse, pack skips
        with open_image(data, str(path)) as img:
            info = {"width": int(img.width), "height": int(img.height), "format": img.format}
            if full_check:
                if img.format == "JPEG":
                    img.draft("RGB", (1, 1))  # the smallest scale libjpeg decodes at (1/8)
                img.load()
            else:
                img.verify()
    except Exception as exc:  # PIL raises many kinds on malformed files
        raise _Unreadable(f"not a decodable image: {type(exc).__name__}: {exc}") from exc
    return data, info


# --- output --------------------------------------------------------------------------------------


def prepare_output(output: Path) -> dict[str, Any]:
    """Create the output directory; refuse a file, or a directory holding tars needle pack did not
    write. Returns the earlier run's ``pack_info.json`` ({} where there is none)."""
    if output.exists() and not output.is_dir():
        raise PackInputError(f"output {output} is a file, not a directory")
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PackInputError(f"cannot create output directory {output}: {_os_reason(exc)}") from exc
    foreign = sorted(p.name for p in output.iterdir() if TAR_NAME.match(p.name))
    if not (output / INFO_NAME).is_file():
        if foreign:
            raise PackInputError(
                f"output directory {output} holds tars needle pack did not write ({foreign[0]}, ... "
                f"{len(foreign)} in all; no {INFO_NAME}): choose an empty directory or remove them"
            )
        return {}
    try:
        info = json.loads((output / INFO_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PackInputError(f"cannot read {output / INFO_NAME}: {exc}") from exc
    if not isinstance(info, dict) or not isinstance(info.get("shards", []), list):
        raise PackInputError(f"{output / INFO_NAME} is not needle pack's record (no list of shards)")
    return info


def remove_stale(output: Path, names: set[str]) -> list[str]:
    """Remove ``names`` (tars an interrupted run left) and every ``NNNNNN.tar.tmp``."""
    stale = sorted(p.name for p in output.iterdir() if p.name in names or TMP_NAME.match(p.name))
    for name in stale:
        log.warning("pack: removing %s, left by an interrupted run", output / name)
        (output / name).unlink()
    return stale


def _needle_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("needle-retrieval")
    except PackageNotFoundError:
        return None


@dataclass
class _Run:
    """What one run of needle pack found and did (the parts of ``pack_info.json`` about it)."""

    found: list[str]  # image files of the source, relative to its root
    ignored: int  # other files under the source
    skipped: list[Skipped]  # files not packed (unreadable, symlinks, ...)
    added: list[dict[str, Any]]  # the tars this run wrote
    changed: list[Skipped]  # files packed earlier that differ now (reported, not repacked)
    missing: list[str]  # files packed earlier that are gone from the source
    removed: list[str]  # tars of an interrupted run removed


def _info(
    conf: PackConfig,
    inputs: Any,
    root: Path,
    output: Path,
    shards: list[dict[str, Any]],
    record: list[Packed],
    run: _Run,
    status: str,
    writing_from: int,
) -> dict[str, Any]:
    n = len(shards)
    output = Path(os.path.abspath(output))
    first, last = (shards[0]["tar"][:6], shards[-1]["tar"][:6]) if shards else ("000000", "000000")
    return {
        "status": status,  # "incomplete" while tars are being written, "complete" at the end
        "writing_from": writing_from,  # the number of the first tar this run writes
        "config": asdict(conf),
        "input": str(inputs) if isinstance(inputs, (str, Path)) else f"a list of {len(inputs)} paths",
        "source": str(root),
        "output": str(output),
        "candidates": len(run.found),
        "images": sum(s["samples"] for s in shards),
        "ignored_files": run.ignored,
        "num_shards": n,
        "shards": shards,
        "added_shards": [s["tar"] for s in run.added],
        "added_images": sum(s["samples"] for s in run.added),
        "ingest_shards": str(output / (f"{{{first}..{last}}}.tar" if n > 1 else f"{first}.tar")),
        "skipped": [asdict(s) for s in run.skipped],
        "changed_sources": [asdict(s) for s in run.changed],
        "missing_sources": run.missing,
        "renamed_keys": [{"source": e.source, "key": e.key} for e in record if e.key != sample_key(e.source)],
        "removed_stale_tars": run.removed,
        "needle_version": _needle_version(),
    }


# --- the stage -----------------------------------------------------------------------------------


def pack_files(
    conf: PackConfig, root: Path, found: list[str], writer: TarShardWriter, taken: frozenset[str] = frozenset()
) -> tuple[list[Skipped], list[Packed]]:
    """Pack ``found`` (relative to ``root``) in order, their keys clear of ``taken``; returns the
    unreadable files and what was packed."""
    skipped: list[Skipped] = []
    packed: list[Packed] = []
    keys = unique_keys(found, taken)
    for source, key in tqdm(zip(found, keys), total=len(found), desc="pack", unit="img", disable=None):
        stamp = mtime_ns(root / source)  # before reading: a file changed while read looks changed next run
        try:
            data, meta = read_image(root / source, conf.full_check)
        except _Unreadable as exc:
            log.warning("pack: skipping %s: %s", root / source, exc)
            skipped.append(Skipped(source, str(exc)))
            continue
        meta = {"key": key, "source": source, "bytes": len(data), **meta}
        suffix = member_suffix(Path(source).suffix)
        full_key = writer.add(key, [(suffix, data), ("json", json.dumps(meta, sort_keys=True).encode())])
        packed.append(Packed(source, key, f"{full_key.split('/', 1)[0]}.tar", len(data), stamp, sha256(data)))
    return skipped, packed


def main(conf: PackConfig, inputs: str | Path | Sequence[str | Path], output: Path) -> Path:
    """Pack the images of ``inputs`` (a directory, a list file, or a sequence of paths) into
    WebDataset tars in ``output``, with ``pack_info.json``; returns ``output``. Into a directory
    it packed before, only files not packed yet, into new tars numbered after the last."""
    check_config(conf)
    output = Path(output)
    root, found, skipped, ignored = collect(conf, inputs)
    created = not output.exists()
    previous = prepare_output(output)
    try:
        return _pack(conf, inputs, root, found, skipped, ignored, output, previous)
    except BaseException:
        if created and not any(output.glob("*.tar")):  # leave nothing behind a failed first run
            for path in output.iterdir():
                path.unlink()
            output.rmdir()
        raise


def _pack(
    conf: PackConfig,
    inputs: Any,
    root: Path,
    found: list[str],
    skipped: list[Skipped],
    ignored: int,
    output: Path,
    previous: dict[str, Any],
) -> Path:
    leftovers = interrupted_tars(output, previous)
    shards = [s for s in previous.get("shards", []) if s["tar"] not in leftovers]
    check_tars(output, shards, leftovers)
    record = read_record(output, shards) if shards else []
    if previous.get("source") and shards and previous["source"] != str(root):
        log.warning("pack: %s was packed from %s; now from %s (files are matched by relative path)",
                    output, previous["source"], root)  # fmt: skip
    new, record, changed, missing = compare_packed(root, found, record)
    run = _Run(found, ignored, [], [], changed, missing, remove_stale(output, leftovers))
    for entry in skipped:
        log.warning("pack: skipping %s: %s", root / entry.source, entry.reason)
    first = int(shards[-1]["tar"][:6]) + 1 if shards else 0
    write_json_atomic(_info(conf, inputs, root, output, shards, record, run, "incomplete", first), output / INFO_NAME)
    with TarShardWriter(output, conf.shard_size, first=first) as writer:
        unreadable, packed = pack_files(conf, root, new, writer, frozenset(e.key for e in record))
    run.skipped = sorted(skipped + unreadable, key=lambda s: _path_order(s.source))
    if new and not writer.shards and not shards:
        raise PackInputError(
            f"no readable image among the {len(found)} image files of {root} "
            f"(e.g. {run.skipped[0].source}: {run.skipped[0].reason})"
        )
    run.added = writer.shards
    record += packed
    write_record(output, record)
    info = _info(conf, inputs, root, output, shards + writer.shards, record, run, "complete", first)
    write_json_atomic(info, output / INFO_NAME)
    log.info(
        "pack: %d new images from %s in %d new tars (%d in all) at %s (%d skipped, %d changed since packed)",
        info["added_images"],
        root,
        len(writer.shards),
        info["num_shards"],
        output,
        len(run.skipped),
        len(run.changed),
    )
    return output
