"""An index as a sequence of immutable generations (docs/live_index.md; formats in docs/schema.md).

Generation 0 is what ``needle index build`` wrote: ``index_infos.json`` and its shard directories,
unchanged (indexes built before generations open as generation 0). Each ``needle index add``,
``delete`` or ``compact`` publishes the next generation: a manifest
``generations/NNNNNN.json`` naming, for every shard, its segments (directories in the shard
directory format: ``shard_000/`` from the build, ``seg_NNNNNN_sSSS_<token>/`` from later writers)
and each segment's delete set (``deletes/*.npy``), with the generation's number and what changed.

Publishing is one exclusive create of the manifest: a local hard link that fails where the name
exists, or on S3 a ``PutObject`` with ``If-None-Match: *`` (written once, never overwritten). So
of two writers that start from the same generation only one publishes its successor; the other
gets ``GenerationConflict`` and publishes nothing (its change is not lost: it re-runs on top of
the winner's). ``CURRENT.json`` (the pointer) is replaced after the manifest, as a hint: readers
start there and step forward while a next manifest exists, so a writer killed between the two
leaves its generation published, and one killed before the manifest leaves nothing visible.

A reader loads one generation and answers from exactly its files (``view_infos``: the manifest as
the ``index_infos.json`` the loaders know, one entry per segment).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Protocol

from core.errors import NeedleInputError
from core.kill_points import kill_point
from core.storage import error_code, is_s3, s3_client, s3_key, split_s3
from index.errors import IndexFileError
from index.layout import INFOS_FILE, LAYOUT_SHARDS

log = logging.getLogger(__name__)

GENERATIONS_DIR = "generations"
CURRENT_FILE = "CURRENT.json"  # {"generation": n}: where readers start looking (a hint, replaced last)
DELETES_DIR = "deletes"
TRAINED_EMPTY_FILE = f"{GENERATIONS_DIR}/trained.faiss"  # the build's trained quantizer and PQ, no vectors
MANIFEST_FORMAT = 1


class GenerationConflict(NeedleInputError):
    """Another writer published the generation this one meant to publish: nothing of this run was
    published; run the command again (it starts from the newer generation)."""


def manifest_name(number: int) -> str:
    return f"{GENERATIONS_DIR}/{number:06d}.json"


class Location(Protocol):
    """Where an index lies (a directory, or an ``s3://`` prefix): the few operations generations need."""

    url: str

    def read_bytes(self, name: str) -> bytes | None: ...  # None: not there
    def create_exclusive(self, name: str, data: bytes) -> None: ...  # FileExistsError where it exists
    def replace(self, name: str, data: bytes) -> None: ...
    def upload(self, name: str, local_file: Path) -> None: ...
    def download(self, name: str, target: Path) -> None: ...
    def remove(self, names: list[str]) -> None: ...
    def list(self, prefix: str) -> list[str]: ...  # names under ``prefix`` (relative to the index)


class LocalLocation:
    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.url = str(self.root)

    def read_bytes(self, name: str) -> bytes | None:
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            return None

    def create_exclusive(self, name: str, data: bytes) -> None:
        """Write ``name`` whole, or FileExistsError: a temporary file fsynced, then hard-linked to
        the name (``link`` never replaces), so no reader sees a partial manifest."""
        target = self.root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_directory(target.parent)

    def replace(self, name: str, data: bytes) -> None:
        target = self.root / name
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        fsync_directory(target.parent)

    def upload(self, name: str, local_file: Path) -> None:
        target = self.root / name
        if Path(local_file).resolve() != target.resolve():
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(local_file, target)

    def download(self, name: str, target: Path) -> None:
        import shutil

        shutil.copyfile(self.root / name, target)

    def remove(self, names: list[str]) -> None:
        import shutil

        for name in names:
            path = self.root / name
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix
        if not base.is_dir():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.iterdir())


class S3Location:
    def __init__(self, url: str, endpoint_url: str | None = None):
        self.url = url.rstrip("/")
        self.bucket, self.prefix = split_s3(self.url)
        self.endpoint_url = endpoint_url
        self.client = s3_client(endpoint_url)

    def _key(self, name: str) -> str:
        return s3_key(self.prefix, name)

    def read_bytes(self, name: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            return bytes(self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read())
        except ClientError as exc:
            if error_code(exc) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise

    def create_exclusive(self, name: str, data: bytes) -> None:
        """A ``PutObject`` with ``If-None-Match: *``: written once, or FileExistsError."""
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data, IfNoneMatch="*")
        except ClientError as exc:
            if error_code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                raise FileExistsError(f"{self.url}/{name} exists") from exc
            raise

    def replace(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data)

    def upload(self, name: str, local_file: Path) -> None:
        self.client.upload_file(str(local_file), self.bucket, self._key(name))

    def download(self, name: str, target: Path) -> None:
        self.client.download_file(self.bucket, self._key(name), str(target))

    def remove(self, names: list[str]) -> None:
        keys: list[str] = []
        for name in names:
            keys.extend(self._list_keys(name + "/"))
            keys.append(self._key(name))
        for start in range(0, len(keys), 1000):
            chunk = [{"Key": key} for key in keys[start : start + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": chunk, "Quiet": True})

    def _list_keys(self, prefix: str) -> list[str]:
        keys: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix)):
            keys.extend(item["Key"] for item in page.get("Contents", []))
        return keys

    def list(self, prefix: str) -> list[str]:
        """The names one level under ``prefix``: objects and "directories"."""
        base = self._key(prefix.rstrip("/") + "/")
        strip = len(self._key(""))
        names = set()
        for key in self._list_keys(prefix.rstrip("/") + "/"):
            head = key[len(base) :].split("/", 1)[0]
            names.add(base[strip:] + head)
        return sorted(names)


def location_of(index: str | Path, endpoint_url: str | None = None) -> LocalLocation | S3Location:
    return S3Location(str(index), endpoint_url) if is_s3(str(index)) else LocalLocation(Path(index))


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


def read_json_at(location: Location, name: str) -> dict[str, Any] | None:
    data = location.read_bytes(name)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError as exc:
        raise IndexFileError(f"{location.url}/{name} is not JSON: {exc}") from exc


def base_infos(location: Location) -> dict[str, Any]:
    """The build's ``index_infos.json`` (generation 0), or IndexFileError."""
    infos = read_json_at(location, INFOS_FILE)
    if infos is None:
        raise IndexFileError(f"index {location.url} has no {INFOS_FILE}")
    return infos


def generation_zero(infos: dict[str, Any]) -> dict[str, Any]:
    """The manifest of what ``needle index build`` wrote: each shard directory its one segment."""
    if infos.get("layout") != LAYOUT_SHARDS:
        raise IndexFileError(
            "an index built before shard directories has one generation only: rebuild it to add, delete or compact"
        )
    shards = [{"shard": i, "segments": [{**entry, "deleted": None}]} for i, entry in enumerate(infos["shards"])]
    return {
        "format": MANIFEST_FORMAT,
        "generation": 0,
        "parent": None,
        "change": {"command": "build"},
        "shards": shards,
    }


def latest_number(location: Location) -> int:
    """The newest published generation: from the pointer, then forward while a next manifest exists
    (a writer killed after publishing but before moving the pointer); 0 where none was published."""
    pointer = read_json_at(location, CURRENT_FILE)
    number = int(pointer["generation"]) if pointer else 0
    if number and location.read_bytes(manifest_name(number)) is None:
        # the pointer's manifest was removed (compact --keep): the newest one listed
        numbers = [int(Path(n).stem) for n in location.list(GENERATIONS_DIR) if Path(n).stem.isdigit()]
        number = max(numbers, default=0)
    while location.read_bytes(manifest_name(number + 1)) is not None:
        number += 1
    return number


def read_manifest(location: Location, number: int | None = None) -> dict[str, Any]:
    """Generation ``number`` (default: the newest published) as a manifest."""
    number = latest_number(location) if number is None else number
    if number == 0:
        return generation_zero(base_infos(location))
    manifest = read_json_at(location, manifest_name(number))
    if manifest is None:
        raise IndexFileError(f"index {location.url} has no generation {number} ({manifest_name(number)})")
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("generation") != number:
        raise IndexFileError(f"{location.url}/{manifest_name(number)} is not a generation-{number} manifest")
    return manifest


def segments_of(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every segment of a generation, shard by shard, in order (each with its ``"shard"``)."""
    return [{**segment, "shard": shard["shard"]} for shard in manifest["shards"] for segment in shard["segments"]]


def manifest_totals(manifest: dict[str, Any]) -> dict[str, int]:
    """rows, ntotal (in the segments' files) and what its delete sets take away from them."""
    segments = segments_of(manifest)
    deleted = [s["deleted"] or {} for s in segments]
    rows = sum(int(s["rows"]) for s in segments)
    ntotal = sum(int(s["ntotal"]) for s in segments)
    deleted_rows = sum(int(d.get("rows", 0)) for d in deleted)
    deleted_indexed = sum(int(d.get("indexed", 0)) for d in deleted)
    return {
        "rows": rows,
        "ntotal": ntotal,
        "deleted_rows": deleted_rows,
        "live_rows": rows - deleted_rows,
        "live_ntotal": ntotal - deleted_indexed,
    }


def view_infos(infos: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
    """A generation as the ``index_infos.json`` the loaders read: the build's infos with one
    ``shards`` entry per segment (its delete set in ``"deleted"``), ``"generation"``, the segments
    of each shard (``"shard_segments"``) and the live counts."""
    segments = segments_of(manifest)
    groups: list[list[int]] = [[] for _ in manifest["shards"]]
    for position, segment in enumerate(segments):
        groups[int(segment["shard"])].append(position)
    totals = manifest_totals(manifest)
    view = {**infos, "shards": segments, "shard_segments": groups, "generation": int(manifest["generation"])}
    if manifest["generation"]:  # generation 0 keeps the build's own totals (checked against its shards)
        view.update(rows=totals["rows"], ntotal=totals["ntotal"])
    view.update(live_ntotal=totals["live_ntotal"], deleted_rows=totals["deleted_rows"])
    return view


def read_view(index: str | Path, endpoint_url: str | None = None, number: int | None = None) -> dict[str, Any]:
    """The newest generation (or ``number``) of the index at ``index`` as the infos loaders read."""
    location = location_of(index, endpoint_url)
    infos = base_infos(location)
    if infos.get("layout") != LAYOUT_SHARDS and number in (None, 0) and latest_number(location) == 0:
        return infos  # an index built before shard directories: one generation, as it is
    return view_infos(infos, read_manifest(location, number))


def publish(location: Location, manifest: dict[str, Any]) -> None:
    """Publish ``manifest`` as its generation: the exclusive create (GenerationConflict where
    another writer published that number first), then the pointer."""
    number = int(manifest["generation"])
    data = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    try:
        location.create_exclusive(manifest_name(number), data)
    except FileExistsError as exc:
        raise GenerationConflict(
            f"index {location.url}: generation {number} was published by another writer while this one ran "
            f"(from generation {manifest.get('parent')}); nothing of this run was published: run it again"
        ) from exc
    kill_point("published")
    location.replace(CURRENT_FILE, (json.dumps({"generation": number}) + "\n").encode())
