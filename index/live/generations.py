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

A reader loads one generation and answers from exactly its files (``read_view``: the build's infos
with the generation's segments, index.generation.GenerationView). What the files hold, read,
validated and written: index/generation.py.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Protocol

from core.errors import NeedleInputError
from core.kill_points import kill_point
from core.storage import error_code, is_s3, s3_client, s3_key, split_s3
from index.errors import IndexFileError
from index.generation import Generation, GenerationView, IndexInfos, parse_json_object
from index.layout import INFOS_FILE

log = logging.getLogger(__name__)

GENERATIONS_DIR = "generations"
CURRENT_FILE = "CURRENT.json"  # {"generation": n}: where readers start looking (a hint, replaced last)
DELETES_DIR = "deletes"
TRAINED_EMPTY_FILE = f"{GENERATIONS_DIR}/trained.faiss"  # the build's trained quantizer and PQ, no vectors


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


def read_infos_at(location: Location) -> IndexInfos:
    """The build's ``index_infos.json`` (generation 0), validated; or IndexFileError."""
    data = location.read_bytes(INFOS_FILE)
    if data is None:
        raise IndexFileError(f"index {location.url} has no {INFOS_FILE}")
    return IndexInfos.from_json(data, f"{location.url}/{INFOS_FILE}")


def pointed_number(location: Location) -> int:
    """The generation ``CURRENT.json`` points to (0 where there is none)."""
    data = location.read_bytes(CURRENT_FILE)
    if data is None:
        return 0
    source = f"{location.url}/{CURRENT_FILE}"
    number = parse_json_object(data, source).get("generation")
    if isinstance(number, bool) or not isinstance(number, int) or number < 0:
        raise IndexFileError(f"{source}: field 'generation' is {number!r}, not a generation number")
    return number


def latest_number(location: Location) -> int:
    """The newest published generation: from the pointer, then forward while a next manifest exists
    (a writer killed after publishing but before moving the pointer); 0 where none was published."""
    number = pointed_number(location)
    if number and location.read_bytes(manifest_name(number)) is None:
        # the pointer's manifest was removed (compact --keep): the newest one listed
        numbers = [int(Path(n).stem) for n in location.list(GENERATIONS_DIR) if Path(n).stem.isdigit()]
        number = max(numbers, default=0)
    while location.read_bytes(manifest_name(number + 1)) is not None:
        number += 1
    return number


def read_manifest(location: Location, number: int | None = None, infos: IndexInfos | None = None) -> Generation:
    """Generation ``number`` (default: the newest published); generation 0 from ``infos`` (the
    build's, read where not given)."""
    number = latest_number(location) if number is None else number
    if number == 0:
        return Generation.zero(infos if infos is not None else read_infos_at(location))
    data = location.read_bytes(manifest_name(number))
    if data is None:
        raise IndexFileError(f"index {location.url} has no generation {number} ({manifest_name(number)})")
    return Generation.from_json(data, f"{location.url}/{manifest_name(number)}", number)


def read_view(location: Location, infos: IndexInfos | None = None, number: int | None = None) -> GenerationView:
    """Generation ``number`` (default: the newest) of an index of shard directories as loaders open
    it; ``infos``: its ``index_infos.json`` where the caller read it already (read once per open)."""
    infos = infos if infos is not None else read_infos_at(location)
    return GenerationView(infos, read_manifest(location, number, infos))


def publish(location: Location, generation: Generation) -> None:
    """Publish ``generation``: the exclusive create of its manifest (GenerationConflict where
    another writer published that number first), then the pointer."""
    number = generation.number
    try:
        location.create_exclusive(manifest_name(number), generation.to_json())
    except FileExistsError as exc:
        raise GenerationConflict(
            f"index {location.url}: generation {number} was published by another writer while this one ran "
            f"(from generation {generation.parent}); nothing of this run was published: run it again"
        ) from exc
    kill_point("published")
    location.replace(CURRENT_FILE, (json.dumps({"generation": number}) + "\n").encode())
