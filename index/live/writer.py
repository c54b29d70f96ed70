"""What ``needle index add``, ``delete`` and ``compact`` share: one writer's session over an index
(a directory or an ``s3://`` prefix), from the generation it starts on to the one it publishes.

A writer reads the newest generation (its *parent*), writes new files under names no other writer
uses (``seg_<generation>_s<shard>_<token>/`` segments, ``deletes/<generation>_<segment>_<token>.npy``),
then publishes the next generation's manifest (index.live.generations.publish). Nothing it writes is
visible before that, and nothing published is ever changed. A local index also takes an advisory
lock (``generations/writer.lock``, released by the kernel even on ``kill -9``), so a second local
writer fails at once with the first one's pid; on S3 (no locks) the exclusive create of the
manifest is what refuses the second. A writer that fails removes what it wrote, only that, and
only while it is certain its manifest was not published: from the moment the exclusive create may
have succeeded nothing it wrote is removed (docs/live_index.md's failure table). One that was
killed leaves unreferenced files, which ``needle index compact`` removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from core.atomic import write_synced
from core.errors import NeedleInputError
from core.kill_points import kill_point
from core.location import Location, location_of
from index.errors import IndexFileError
from index.generation import (
    DeleteFile,
    Generation,
    IndexInfos,
    Segment,
    ShardSegments,
    Training,
    WriterStamp,
    parse_json_object,
)
from index.keys import KEY_FILES
from index.layout import IDS_FILE, INDEX_FILE, SHARD_INFOS_FILE, VECTORS_FILE, listed_files
from index.live.deletes import merge_rows, segment_deletes
from index.live.generations import (
    CURRENT_FILE,
    DELETES_DIR,
    GENERATIONS_DIR,
    TRAINED_EMPTY_FILE,
    GenerationConflict,
    PublishOutcomeUnknown,
    latest_number,
    move_pointer,
    publish,
    read_infos_at,
    read_manifest,
)

log = logging.getLogger(__name__)
LOCK_FILE = f"{GENERATIONS_DIR}/writer.lock"
SCRATCH_DIR = ".writer-scratch"  # a local index's writer scratch (removed at the end, or by the next writer)
SCRATCH_PREFIX = "needle-writer-"  # an S3 index's writer scratch under the temporary directory: + "<pid>-"
# ``Writer.vectors_at`` on S3: rows closer than this share one ranged read (a GET's latency costs
# about what reading a megabyte does)
VECTORS_MERGE_GAP = 1 << 20


class WriterBusy(NeedleInputError):
    """Another writer holds the index's writer lock."""


@dataclass
class Writer:
    """One writer's session: the parent generation, where new files go, what it created."""

    location: Location
    infos: IndexInfos  # the build's index_infos.json
    parent: Generation  # the generation this writer starts from
    scratch: Path  # this session's scratch directory (removed at the end)
    token: str = field(default_factory=lambda: secrets.token_hex(4))  # in every name this writer writes
    created: list[str] = field(default_factory=list)  # names under the index it wrote (removed on failure)
    maps: dict[str, np.ndarray] = field(default_factory=dict)  # published segments' vectors, memory-mapped

    @property
    def local(self) -> bool:
        """Whether the index is a local directory (its files read in place, memory-mapped)."""
        return self.location.local_root is not None

    @property
    def number(self) -> int:
        """The generation this writer publishes."""
        return self.parent.number + 1

    @property
    def root(self) -> Path:
        """Where new segments are built: the index directory itself, or (S3) this writer's scratch
        (uploaded from there by ``commit_segment``)."""
        root = self.location.local_root
        return root if root is not None else self.scratch / "segments"

    def segment_name(self, shard: int) -> str:
        return f"seg_{self.number:06d}_s{shard:03d}_{self.token}"

    def new_segment_dir(self, name: str) -> Path:
        directory = self.root / name
        directory.mkdir(parents=True)
        self.created.append(name)
        return directory

    def commit_segment(self, name: str) -> None:
        """Make a built segment part of the index's storage: every file its ``shard_infos.json``
        lists, then that file last (S3 uploads them; a local segment was built in place, so each
        upload is nothing to do)."""
        directory = self.root / name
        infos = json.loads((directory / SHARD_INFOS_FILE).read_text())
        for file in listed_files(infos, str(directory / SHARD_INFOS_FILE)):
            self.location.upload(f"{name}/{file}", directory / file)
        self.location.upload(f"{name}/{SHARD_INFOS_FILE}", directory / SHARD_INFOS_FILE)
        kill_point("segment_written")

    def segment_file(self, segment: str, file: str) -> Path:
        """A local path of one file of a published segment (S3: fetched once into the scratch)."""
        return self.location.local_copy(f"{segment}/{file}", self.scratch / "fetched")

    def segment_dir(self, segment: str, files: list[str]) -> Path:
        """A local directory holding ``files`` of a published segment (and its ``shard_infos.json``)."""
        for file in [SHARD_INFOS_FILE, *files]:
            path = self.segment_file(segment, file)
        return path.parent

    def segment_infos(self, segment: str) -> dict[str, Any]:
        """A published segment's ``shard_infos.json``, its file names checked (they are joined to paths)."""
        source = self.location.url_of(f"{segment}/{SHARD_INFOS_FILE}")
        infos = parse_json_object(self.segment_file(segment, SHARD_INFOS_FILE).read_bytes(), source)
        listed_files(infos, source)
        return dict(infos)

    def deleted_rows(self, segment: Segment) -> np.ndarray:
        """The rows a segment's delete set in the parent holds (empty where none)."""
        return segment_deletes(self.location, segment).rows

    def write_deletes(self, segment: str, rows: np.ndarray, indexed: int) -> DeleteFile:
        """A segment's delete set for the generation this writer publishes; its manifest entry."""
        name = f"{DELETES_DIR}/{self.number:06d}_{segment}_{self.token}.npy"
        local = self.scratch / name  # moved into the index (local) or uploaded (S3)
        local.parent.mkdir(parents=True, exist_ok=True)
        write_synced(local, lambda stream: np.save(stream, np.asarray(rows, np.int64)))
        self.created.append(name)
        self.location.upload(name, local)
        kill_point("deletes_written")
        return DeleteFile(name, len(rows), int(indexed))

    def row_vectors(self, segment: str, start: int, count: int) -> np.ndarray:
        """The float16 vectors of rows ``start:start + count`` of a published segment (S3: one
        ranged read after the ``.npy`` header's)."""
        if self.local:
            return np.asarray(self.vectors_map(segment)[start : start + count])
        name = f"{segment}/{VECTORS_FILE}"
        rows, dim, dtype, data_at = self.vectors_header(name)
        count = max(0, min(count, rows - start))
        size = dim * dtype.itemsize
        data = self.location.read_range(name, data_at + start * size, size * count)
        return np.frombuffer(data, dtype).reshape(count, dim)

    def vectors_at(self, segment: str, positions: np.ndarray) -> np.ndarray:
        """The float16 vectors of the rows at ``positions`` (any order) of a published segment, in
        that order. Locally one gather from the memory map; on S3 the positions, sorted, are read
        in runs (rows closer than VECTORS_MERGE_GAP bytes share one ranged read), or the whole file
        is fetched once where the runs would cover most of it (a delete of many keys)."""
        positions = np.asarray(positions, np.int64)
        if not len(positions):
            return np.zeros((0, self.infos.dim), np.float16)
        if self.local:
            return np.asarray(self.vectors_map(segment)[positions])
        name = f"{segment}/{VECTORS_FILE}"
        rows, dim, dtype, data_at = self.vectors_header(name)
        size = dim * dtype.itemsize
        order = np.argsort(positions, kind="stable")
        ranked = positions[order]
        breaks = np.flatnonzero(np.diff(ranked) * size > VECTORS_MERGE_GAP) + 1
        starts, stops = ranked[np.r_[0, breaks]], ranked[np.r_[breaks - 1, len(ranked) - 1]] + 1
        if int((stops - starts).sum()) * 2 > rows:  # most of the file: fetch it once, whole
            return np.asarray(np.load(self.segment_file(segment, VECTORS_FILE), mmap_mode="r")[positions])
        out = np.empty((len(positions), dim), dtype)
        at = 0
        for start, stop in zip(starts.tolist(), stops.tolist()):
            data = self.location.read_range(name, data_at + start * size, (stop - start) * size)
            block = np.frombuffer(data, dtype).reshape(stop - start, dim)
            take = ranked[at : at + np.searchsorted(ranked[at:], stop)]
            out[order[at : at + len(take)]] = block[take - start]
            at += len(take)
        return out

    def vectors_map(self, segment: str) -> np.ndarray:
        """A local published segment's vectors, memory-mapped once."""
        if segment not in self.maps:
            self.maps[segment] = np.load(self.segment_file(segment, VECTORS_FILE), mmap_mode="r")
        return self.maps[segment]

    def vectors_header(self, name: str) -> tuple[int, int, np.dtype, int]:
        """(rows, dim, dtype, where the data starts) of a ``.npy`` vectors file at the location."""
        head = io.BytesIO(self.location.read_range(name, 0, 128))  # np.save pads its header to 128 bytes
        np.lib.format.read_magic(head)
        shape, _, dtype = np.lib.format.read_array_header_1_0(head)
        return int(shape[0]), int(shape[1]), dtype, head.tell()

    def trained_empty(self) -> Path:
        """The build's trained index with no vectors (its coarse quantizer and PQ): written once
        beside the generations from a segment's index, then reused by every add."""
        import faiss

        target = self.scratch / "trained.faiss"
        training = self.parent.training
        if training is not None and training.index is not None:  # a retrain's (index/live/retrain.py)
            self.location.download(training.index, target)
            return target
        if self.location.read_bytes(TRAINED_EMPTY_FILE) is not None:
            self.location.download(TRAINED_EMPTY_FILE, target)
            return target
        first = self.parent.segments[0].name
        index = faiss.read_index(str(self.segment_file(first, INDEX_FILE)))
        index.reset()
        faiss.write_index(index, str(target))
        with contextlib.suppress(FileExistsError):  # another writer wrote the same file first
            self.location.create_exclusive(TRAINED_EMPTY_FILE, target.read_bytes())
        return target

    def training(self) -> Training:
        """What the parent's segments were encoded with: its manifest's record, or for an index
        written before retraining existed the build's, its added rows estimated as the rows grown since."""
        if self.parent.training is not None:
            return self.parent.training
        built = int(self.infos.fields.get("rows", 0))
        return Training(0, None, None, built, max(0, self.parent.totals.rows - built), False)

    def publish(
        self, shards: list[ShardSegments], change: Mapping[str, object], training: Training | None = None
    ) -> Generation:
        """Publish the next generation with ``shards`` (each shard's segments) and ``change``;
        ``training``: what its segments are encoded with (None: the parent's, carried)."""
        stamp = WriterStamp(os.uname().nodename, os.getpid(), self.token)
        training = training if training is not None else self.parent.training
        manifest = Generation(
            self.number, self.parent.number, tuple(shards), dict(change), round(time.time(), 3), stamp, training
        )
        kill_point("before_publish")
        latest = latest_number(self.location)
        if latest != self.parent.number:  # checked here and, atomically, by the exclusive create
            raise GenerationConflict(
                f"index {self.location.url}: generation {latest} was published by another writer while this one "
                f"ran (from generation {self.parent.number}); nothing of this run was published: run it again"
            )
        try:
            publish(self.location, manifest)
        except PublishOutcomeUnknown:
            self.created.clear()  # perhaps published: its files stay (compaction removes them if not)
            raise
        self.created.clear()  # published: nothing a manifest names is ever removed by this writer
        kill_point("published")
        move_pointer(self.location, self.number)
        log.info("published generation %d of %s: %s", self.number, self.location.url, change.get("command"))
        return manifest

    def discard(self) -> None:
        """Remove what this writer wrote for a generation it did not publish (only its own names:
        each holds its token). A failure to remove is logged, not raised over the error that made
        the writer stop: the files are unreferenced, and ``needle index compact`` removes them."""
        if not self.created:
            return
        names, self.created = list(self.created), []
        log.info("removing the unpublished files of this writer: %s", ", ".join(names))
        try:
            self.location.remove(names)
        except Exception as exc:
            log.warning(
                "could not remove %s (%s: %s); `needle index compact` removes them", names, type(exc).__name__, exc
            )


class writing:
    """``with writing(index, endpoint) as writer``: a writer session on the newest generation;
    the lock (local) taken first; on any failure what the writer wrote is removed."""

    def __init__(self, index: str | Path, endpoint_url: str | None = None):
        self.location: Location = location_of(index, endpoint_url)
        self.lock: Any = None
        self.writer: Writer | None = None

    def __enter__(self) -> Writer:
        infos = read_infos_at(self.location)  # no index, or one built before shard directories: refused here
        root = self.location.local_root
        try:
            if root is not None:  # a directory takes the writer lock; S3 has none (see the module's doc)
                refuse_links(root)
                self.lock = take_lock(root / LOCK_FILE)
            parent = read_manifest(self.location, infos=infos)
            scratch = make_scratch(root)
        except BaseException:
            self.release()
            raise
        self.writer = Writer(self.location, infos, parent, scratch)
        return self.writer

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        try:
            if self.writer is not None:
                if kind is not None:
                    self.writer.discard()
                shutil.rmtree(self.writer.scratch, ignore_errors=True)
        finally:
            self.location.cleanup()
            self.release()

    def release(self) -> None:
        if self.lock is not None:
            fcntl.flock(self.lock, fcntl.LOCK_UN)
            self.lock.close()
            self.lock = None


LINKS_REFUSED = (GENERATIONS_DIR, DELETES_DIR, LOCK_FILE, CURRENT_FILE, SCRATCH_DIR)


def refuse_links(root: Path) -> None:
    """IndexFileError where an entry a writer writes or removes under is a symbolic link: a writer
    or compaction following one would write (truncate the lock's target) or remove (empty a
    linked ``deletes/``) outside the index."""
    for name in LINKS_REFUSED:
        if (root / name).is_symlink():
            raise IndexFileError(
                f"index {root}: {name} is a symbolic link; needle never follows links inside an index "
                "(replace it with the directory or file itself)"
            )


def make_scratch(root: Path | None) -> Path:
    """This writer's scratch directory. A local index's is inside it (``.writer-scratch``: on the
    index's filesystem, so files made there are renamed into place, never copied across devices;
    one writer at a time holds the lock, so one left by a killed writer is removed first). An S3
    index's is a private temporary directory named with this pid; those of writers no longer
    running on this host are removed first (a killed writer's may hold copies of deleted keys)."""
    if root is not None:
        scratch = root / SCRATCH_DIR
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        return scratch
    base = Path(tempfile.gettempdir())
    for stale in base.glob(f"{SCRATCH_PREFIX}*"):
        pid = stale.name[len(SCRATCH_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)) and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def take_lock(path: Path) -> Any:
    """The writer lock (flock, non-blocking), or WriterBusy naming the holder's pid. Opened
    without following a link (``O_NOFOLLOW``): a linked lock file would have its target truncated."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise IndexFileError(f"cannot open the writer lock {path}: {exc}") from exc
    handle = os.fdopen(fd, "r+")  # held open for the session: the lock lives with it
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise WriterBusy(
            f"another writer (pid {holder}) is changing {path.parent.parent}: wait for it to finish, then run "
            "this command again"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


@dataclass(frozen=True)
class HeldFile:
    """A Parquet file the parent generation holds, as its segment's ``shard_infos.json`` lists it."""

    segment: str  # the segment holding its rows
    shard: int  # that segment's shard
    path: str  # where it was read from (its ``s3://`` object where staged)
    rows: int  # its rows


def parent_files(writer: Writer) -> dict[int, HeldFile]:
    """Parquet shard id -> the file of that id the parent holds, for every file it holds."""
    held = {}
    for shard in writer.parent.shards:
        for segment in shard.segments:
            for f in writer.segment_infos(segment.name)["files"]:
                held[int(f["shard_id"])] = HeldFile(segment.name, shard.shard, f["path"], int(f["rows"]))
    return held


def next_shards(
    writer: Writer, entries: dict[int, Segment], deletes: dict[int, tuple[np.ndarray, int]]
) -> list[ShardSegments]:
    """The parent's shards with the new segments (shard -> segment) appended and the delete sets
    grown by ``deletes`` (parent segment number -> rows, of them indexed)."""
    shards, number = [], 0
    for shard in writer.parent.shards:
        segments = []
        for segment in shard.segments:
            if number in deletes:
                rows, indexed = deletes[number]
                segment = grown_deletes(writer, segment, rows, indexed)
            segments.append(segment)
            number += 1
        if shard.shard in entries:
            segments.append(replace(entries[shard.shard], deleted=None))
        shards.append(ShardSegments(shard.shard, tuple(segments)))
    return shards


def grown_deletes(writer: Writer, segment: Segment, rows: np.ndarray, indexed: int) -> Segment:
    """``segment`` with ``rows`` (``indexed`` of them with vectors) added to its delete set."""
    old = writer.deleted_rows(segment)
    rows = np.setdiff1d(np.asarray(rows, np.int64), old)
    merged = merge_rows(old, rows)
    grown = writer.write_deletes(segment.name, merged, segment.deleted_indexed + indexed)
    return replace(segment, deleted=grown)


ID_FILES = [IDS_FILE, *KEY_FILES]  # what key lookups in a segment read
