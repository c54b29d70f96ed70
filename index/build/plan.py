"""The plan step of ``needle index build``: where the descriptors are (the committed parts of
``s3://`` sources staged on local disk), what they hold (dimension, row ids, valid rows: a scan of
footers and id columns, never the vectors), and how their rows are cut into add tasks ("parts",
contiguous ranges of files) grouped into shards.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core.atomic import write_atomic, write_json_atomic
from core.hashing import file_sha256
from core.location import S3Location, location_of
from ingest.descriptors import (
    ROW_SHARD_SHIFT,
    STATUS_OK,
    DescriptorFileError,
    global_dim,
    has_locals,
    list_descriptor_files,
    read_global,
    valid_descriptors,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileInfo:
    path: str
    rows: int
    shard_id: int
    offset: int  # position of the file's first row in its shard's ids.arrow / vectors.f16.npy
    source: str | None = None  # the s3:// object it was staged from (a task on another node fetches it)
    tar: str | None = None  # the tar ingestion read its rows from (thumbnails); None: not recorded


# (trained index, files, descriptor d, vectors file, part file, local segment name or None, adapter file or None)
PartTask = tuple[str, list[FileInfo], int, str, str, str | None, str | None]


def descriptor_files(
    descriptors: Path | str | Sequence[Path | str],
    staging: Path | None = None,
    s3_endpoint_url: str | None = None,
    origins: dict[str, str] | None = None,
) -> list[Path]:
    """Parquet files of one or several sources: descriptor directories, single files, or
    ``s3://`` prefixes, whose committed parts (those with their marker) are staged one by one
    into ``staging`` on local disk, with their ``ingest_info.json``; ``origins`` (if given)
    receives each staged file's ``s3://`` object."""
    sources = [descriptors] if isinstance(descriptors, (str, Path)) else list(descriptors)
    files: list[Path] = []
    for i, source in enumerate(sources):
        if location_of(source).local_root is None:
            if staging is None:
                raise DescriptorFileError(f"{source}: s3:// sources need a staging directory")
            staged = stage_s3_parts(str(source), staging / f"source_{i:03d}", s3_endpoint_url)
            if origins is not None:
                origins.update({str(path): f"{str(source).rstrip('/')}/{path.name}" for path in staged})
            files.extend(staged)
        else:
            source = Path(source)
            files.extend([source] if source.is_file() else list_descriptor_files(source))
    return files


def stage_s3_parts(url: str, directory: Path, endpoint_url: str | None) -> list[Path]:
    """Download the committed Parquet parts under an ``s3://`` prefix (never the unmarked ones)."""
    storage = S3Location(url, endpoint_url)
    committed = storage.committed()
    if not committed:
        raise DescriptorFileError(f"{url} holds no committed .parquet part")
    directory.mkdir(parents=True, exist_ok=True)
    info = storage.read_json("ingest_info.json")
    if info is not None:
        write_json_atomic(info, directory / "ingest_info.json")
    files = []
    for name in sorted(committed):
        target = directory / name
        write_atomic(target, functools.partial(storage.download, name))
        files.append(target)
    log.info("staged %d parts of %s in %s", len(files), url, directory)
    return files


def scan(files: list[Path]) -> tuple[list[FileInfo], int, int]:
    """Check every file (dimension, row ids); returns (files with their positions in file order,
    d, ok rows)."""
    dim = None
    infos, offset, n_ok = [], 0, 0
    seen_shards: dict[int, Path] = {}
    for path in files:
        file_dim = global_dim(path)
        if dim is None:
            dim = file_dim
        elif file_dim != dim:
            raise DescriptorFileError(f"{path}: descriptor dimension {file_dim} differs from {dim} of {files[0]}")
        table = pq.read_table(path, columns=["row", "status"])
        shard_id = _shard_of_rows(path, table["row"].to_numpy())
        if shard_id in seen_shards:
            raise DescriptorFileError(f"{path} and {seen_shards[shard_id]} hold the same shard id {shard_id}")
        seen_shards[shard_id] = path
        n_ok += int(pc.sum(pc.equal(table["status"], STATUS_OK)).as_py() or 0)
        infos.append(FileInfo(str(path), table.num_rows, shard_id, offset))
        offset += table.num_rows
    if offset == 0 or dim is None:
        raise DescriptorFileError(f"no rows in {files[0].parent}")
    return infos, int(dim), n_ok


def _shard_of_rows(path: Path, rows: np.ndarray) -> int:
    """The Parquet shard id of a file's row ids (-1: no rows), which must be that shard's
    consecutive ids from 0 (schema v1)."""
    shard_id = int(rows[0] >> ROW_SHARD_SHIFT) if len(rows) else -1
    expected = (np.int64(shard_id) << ROW_SHARD_SHIFT) + np.arange(len(rows), dtype=np.int64)
    if len(rows) and not np.array_equal(rows, expected):
        raise DescriptorFileError(f"{path}: row ids are not one shard's consecutive ids (schema v1)")
    return shard_id


def tars_of_files(paths: list[str]) -> dict[str, str]:
    """Parquet file -> the tar ingestion read it from, as recorded beside it (``ingest_info.json``,
    copied with staged S3 parts), for the files whose tar is recorded."""
    from ingest.source_images import tar_urls_of_files

    urls = tar_urls_of_files([{"path": str(Path(path).absolute())} for path in paths])  # shard name -> tar
    names = {path: Path(path).name.removesuffix(".parquet") for path in paths}
    return {path: urls[name] for path, name in names.items() if name in urls}


@dataclass(frozen=True)
class Sources:
    files: list[FileInfo]  # in file order, with their staged-from object and tar where known
    dim: int  # descriptor dimension
    n_ok: int  # rows with status ok
    ingest: dict[str, Any]  # the ingestion's record (ingest_info.json) beside the first file, or {}


def read_sources(descriptors: Path | str | Sequence[Path | str], staging: Path, s3_endpoint_url: str | None) -> Sources:
    """Stage, list and scan the descriptor files of ``descriptors`` (see ``descriptor_files``)."""
    origins: dict[str, str] = {}
    paths = descriptor_files(descriptors, staging, s3_endpoint_url, origins)
    info_path = paths[0].parent / "ingest_info.json"  # how the descriptors were made
    ingest = json.loads(info_path.read_text()) if info_path.is_file() else {}
    infos, dim, n_ok = scan(paths)
    tars = tars_of_files([f.path for f in infos])
    infos = [replace(f, source=origins.get(f.path), tar=tars.get(f.path)) for f in infos]
    return Sources(infos, dim, n_ok, ingest)


def read_valid(path: str, dim: int, adapter: Any = None) -> tuple[np.ndarray, np.ndarray, int]:
    """(row ids, float16 (n, d) descriptors) of a file's ok, finite rows, and how many were
    rejected; with ``adapter`` (embed.adapt.LinearAdapter) the adapted descriptors."""
    table, xb = read_global(Path(path), ("row", "status"))
    if xb.shape[1] != dim:
        raise DescriptorFileError(
            f"{path}: descriptor dimension {xb.shape[1]} differs from {dim} (file changed during the build?)"
        )
    ok = pc.equal(table["status"], STATUS_OK).to_numpy(zero_copy_only=False)
    finite = np.isfinite(xb).all(axis=1)
    rejected = int((ok & ~finite).sum())
    if rejected:
        log.warning("%s: %d descriptors with NaN/inf rejected", path, rejected)
    # the rows an index holds: ingest.descriptors.valid_descriptors, the one definition delete and compact
    # count by (an all-zero ok row was indexed here but not counted there: ntotal drifted by one)
    keep = valid_descriptors(xb, table["status"].to_numpy(zero_copy_only=False))
    zeros = int((ok & finite & ~keep).sum())
    if zeros:
        log.warning("%s: %d all-zero descriptors not indexed", path, zeros)
    xb = xb[keep] if adapter is None else adapter.apply(xb[keep]).astype(np.float16)
    return table["row"].to_numpy()[keep], xb, rejected


def load_adapter(path: str | None, dim: int | None = None) -> Any:
    """The adapter of file ``path`` (None: no adapter); with ``dim``, checked to take descriptors
    of that dimension."""
    if path is None:
        return None
    from embed.adapt import load_adapter as load

    adapter = load(path)
    if dim is not None and adapter.in_dim != dim:
        raise DescriptorFileError(f"adapter {path} takes d={adapter.in_dim}, the descriptors have d={dim}")
    return adapter


def adapt_infos(path: str | None, adapter: Any) -> dict[str, Any] | None:
    """How the indexed descriptors were adapted (None: they were not)."""
    if path is None or adapter is None:
        return None
    return {
        "file": str(Path(path).resolve()),
        "sha256": file_sha256(Path(path)),
        "in_dim": adapter.in_dim,
        "out_dim": adapter.out_dim,
    }


def local_extractor(ingest: dict[str, Any]) -> dict[str, Any] | None:
    """The local extractor's info recorded by the ingestion, if any."""
    return next((e for e in ingest.get("extractors", []) if e.get("extractor") == "local"), None)


def builds_locals(wanted: bool, files: list[FileInfo]) -> bool:
    """Whether the build writes a local store: wanted, and every file carries local tokens (a
    mix of files with and without is refused)."""
    if not wanted:
        return False
    carrying = [has_locals(Path(f.path)) for f in files]
    if any(carrying) and not all(carrying):
        raise DescriptorFileError(
            "some descriptor files carry local tokens and others do not: ingest them alike, or build with locals off"
        )
    return all(carrying)


def split_ranges(files: list[FileInfo], parts: int) -> list[list[FileInfo]]:
    """Contiguous ranges of files with about equal row counts (each file goes to the part its
    middle row falls in); never fewer ranges than ``min(parts, len(files))``."""
    parts = max(1, min(parts, len(files)))
    total = sum(f.rows for f in files)
    ranges: list[list[FileInfo]] = [[] for _ in range(parts)]
    done = 0
    for f in files:
        ranges[min(parts - 1, int((done + f.rows / 2) * parts // max(1, total)))].append(f)
        done += f.rows
    ranges = [r for r in ranges if r]
    if len(ranges) < parts:  # very uneven files: split by file count instead
        ranges = [list(r) for r in np.array_split(np.array(files, dtype=object), parts)]
    return ranges


@dataclass(frozen=True)
class ShardPlan:
    ranges: list[list[FileInfo]]  # the parts: contiguous ranges of files, positions counted over all files
    groups: list[list[int]]  # the parts of each shard (contiguous part ids)

    def parts_of(self, number: int) -> list[tuple[int, list[FileInfo]]]:
        """(part id, its files) of shard ``number``, positions counted from the shard's first row."""
        group = self.groups[number]
        base = self.ranges[group[0]][0].offset
        return [(i, [replace(f, offset=f.offset - base) for f in self.ranges[i]]) for i in group]


def plan_shards(files: list[FileInfo], shards: int, parts: int | None) -> ShardPlan:
    """``parts`` ranges of files (at least one per shard; None: one per shard) grouped into
    ``shards`` shards of contiguous ranges."""
    shards = max(1, shards)
    ranges = split_ranges(files, max(shards, parts or shards))
    if shards > 1 and len(ranges) < shards:
        raise DescriptorFileError(f"--shards {shards} needs at least {shards} descriptor files, found {len(files)}")
    return ShardPlan(ranges, [[int(i) for i in g] for g in np.array_split(np.arange(len(ranges)), shards)])


def part_task(
    trained_path: Path,
    directory: Path,
    part_id: int,
    files: list[FileInfo],
    dim: int,
    with_locals: bool,
    adapt: str | None,
) -> PartTask:
    """The add task of part ``part_id``, writing its files inside its shard's ``directory``."""
    return (
        str(trained_path),
        files,
        dim,
        str(directory / f"part_{part_id:03d}.vectors.f16.npy"),
        str(directory / f"part_{part_id:03d}.faiss"),
        f"locals_{part_id:03d}" if with_locals else None,
        adapt,
    )
