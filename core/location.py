"""One storage location: a local directory or an ``s3://`` prefix (with its endpoint and, made on
first use, its S3 client), and every operation ingestion, the index build, the living index and
shard staging do on files under it. Callers name files relative to the location and never branch
on local or S3: the difference lives here.

Atomicity. Local: a durable write is a temporary file fsynced then ``os.replace``d
(core.atomic.replace_durably); an exclusive create is a hard link of such a file, which fails
where the name exists. S3: an object is written whole by one request; an exclusive create is a
``PutObject`` with ``If-None-Match: *``.

Commit protocol of parts (``commit_file``). Local: the finished file is renamed into place. S3:
the object is uploaded, then ``<name>.committed`` (a small JSON marker) is written; readers take
only objects that have their marker (``committed``), so a half-finished upload of a killed worker
is never read.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from core.atomic import fsync_directory, json_bytes, replace_durably, write_synced
from core.errors import NeedleInputError
from core.storage import (
    MARKER_SUFFIX,
    StorageError,
    error_code,
    is_s3,
    read_s3_range,
    s3_client,
    s3_errors,
    s3_key,
    split_s3,
)

log = logging.getLogger(__name__)

S3_MISSING = ("NoSuchKey", "404", "NotFound")  # error codes of an object that is not there
S3_FORBIDDEN = ("AccessDenied", "403", "Forbidden")  # also what a missing object answers without ListBucket
S3_EXISTS = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")  # If-None-Match refused


@dataclass(frozen=True)
class ObjectStat:
    size: int  # bytes
    sha256: str | None  # the SHA-256 recorded as the object's metadata by ``upload``, if any


class Location(Protocol):
    """A local directory or an ``s3://`` prefix; ``name``: a file's path relative to it."""

    url: str  # the directory's path, or the prefix's URL without a trailing ``/``
    endpoint_url: str | None  # S3-compatible endpoint (None: AWS; unused for a directory)

    @property
    def local_root(self) -> Path | None: ...  # the directory, or None where files are remote
    def url_of(self, name: str) -> str: ...
    def read_bytes(self, name: str) -> bytes | None: ...  # None: not there
    def probe(self, name: str) -> bytes | None: ...  # read_bytes, where "forbidden" also means not there
    def read_required(self, name: str) -> bytes: ...  # StorageError naming the file where unreadable
    def read_range(self, name: str, offset: int, size: int) -> bytes: ...
    def read_json(self, name: str) -> Any | None: ...  # None: not there
    def write_json(self, name: str, obj: Any) -> str: ...  # indented, sorted keys; returns the URL
    def create_exclusive(self, name: str, data: bytes) -> None: ...  # FileExistsError where it exists
    def replace(self, name: str, data: bytes) -> None: ...  # durably, whole or not at all
    def upload(self, name: str, local_file: Path, sha256: str | None = None) -> None: ...
    def download(self, name: str, target: Path) -> None: ...
    def local_copy(self, name: str, cache: Path) -> Path: ...  # a local path of ``name``
    def stat(self, name: str) -> ObjectStat | None: ...  # None: cannot be seen
    def remove(self, names: list[str]) -> None: ...  # files or whole directories
    def list(self, prefix: str) -> list[str]: ...  # names one level under ``prefix``
    def local_scratch(self) -> Path: ...  # where files are made before ``upload`` / ``commit_file``
    def commit_file(self, name: str, local_file: Path, marker: dict[str, Any]) -> str: ...
    def committed(self) -> dict[str, dict[str, Any]]: ...  # committed Parquet parts: name -> marker
    def cleanup(self) -> None: ...  # removes the scratch directory made here, if any


class LocalLocation:
    """A local directory (made by the first write into it, or by ``output_location``)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.url = str(self.root)
        self.endpoint_url: str | None = None

    @property
    def local_root(self) -> Path:
        return self.root

    def url_of(self, name: str) -> str:
        return str(self.root / name)

    def read_bytes(self, name: str) -> bytes | None:
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            return None

    def probe(self, name: str) -> bytes | None:
        return self.read_bytes(name)

    def read_required(self, name: str) -> bytes:
        try:
            return (self.root / name).read_bytes()
        except OSError as exc:
            raise StorageError(f"cannot read {self.url_of(name)}: {exc}") from exc

    def read_range(self, name: str, offset: int, size: int) -> bytes:
        with open(self.root / name, "rb") as stream:
            stream.seek(offset)
            return stream.read(size)

    def read_json(self, name: str) -> Any | None:
        path = self.root / name
        return json.loads(path.read_text()) if path.is_file() else None

    def write_json(self, name: str, obj: Any) -> str:
        return str(replace_durably(self.root / name, json_bytes(obj)))

    def create_exclusive(self, name: str, data: bytes) -> None:
        """Write ``name`` whole, or FileExistsError: a temporary file fsynced, then hard-linked to
        the name (``link`` never replaces), so no reader sees a partial file."""
        target = self.root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        write_synced(tmp, lambda stream: stream.write(data))
        try:
            os.link(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_directory(target.parent)

    def replace(self, name: str, data: bytes) -> None:
        replace_durably(self.root / name, data)

    def upload(self, name: str, local_file: Path, sha256: str | None = None) -> None:
        """Move ``local_file`` to ``name`` (nothing to do where it was made in place, under
        ``local_scratch``); a directory records no checksum, so ``sha256`` is not kept."""
        target = self.root / name
        if Path(local_file).resolve() != target.resolve():
            target.parent.mkdir(parents=True, exist_ok=True)
            move_across(Path(local_file), target)

    def download(self, name: str, target: Path) -> None:
        shutil.copyfile(self.root / name, target)

    def local_copy(self, name: str, cache: Path) -> Path:
        return self.root / name  # already local: nothing is copied into ``cache``

    def stat(self, name: str) -> ObjectStat | None:
        try:
            return ObjectStat((self.root / name).stat().st_size, None)
        except OSError:
            return None

    def remove(self, names: list[str]) -> None:
        """Remove each file or directory; a symbolic link is removed itself, never followed. A
        failure (other than the name being gone already) is raised, naming it."""
        for name in names:
            path = self.root / name
            try:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise StorageError(f"cannot remove {path}: {exc}") from exc

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix
        if not base.is_dir():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.iterdir())

    def local_scratch(self) -> Path:
        return self.root  # same file system: the final rename is atomic, and a file made here is in place

    def commit_file(self, name: str, local_file: Path, marker: dict[str, Any]) -> str:
        """Rename the finished ``local_file`` onto ``name`` (a directory needs no marker)."""
        target = self.root / name
        os.replace(local_file, target)
        return str(target)

    def committed(self) -> dict[str, dict[str, Any]]:
        """Committed Parquet parts: name -> {"rows": n} (row count from the file's footer)."""
        import pyarrow.parquet as pq

        parts = {}
        for path in sorted(self.root.glob("*.parquet")):
            try:
                parts[path.name] = {"rows": pq.ParquetFile(path).metadata.num_rows}
            except Exception as exc:  # an unreadable part counts as not committed: it will be redone
                log.warning("ignoring unreadable %s: %s", path, exc)
        return parts

    def cleanup(self) -> None:
        pass  # the scratch is the directory itself


class S3Location:
    """An ``s3://bucket/prefix`` (``""``: the bucket's root)."""

    def __init__(self, url: str, endpoint_url: str | None = None):
        self.url = url.rstrip("/")
        self.bucket, self.prefix = split_s3(self.url)
        self.endpoint_url = endpoint_url
        self._client: Any = None  # made on first use (botocore is slow to import)
        self._scratch: Path | None = None  # made on first ``local_scratch``

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = s3_client(self.endpoint_url)
        return self._client

    @property
    def local_root(self) -> None:
        return None

    def _key(self, name: str) -> str:
        return s3_key(self.prefix, name)

    def url_of(self, name: str) -> str:
        return f"s3://{self.bucket}/{self._key(name)}"

    def read_bytes(self, name: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            return bytes(self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read())
        except ClientError as exc:
            if error_code(exc) in S3_MISSING:
                return None
            raise

    def probe(self, name: str) -> bytes | None:
        """``read_bytes`` of a name that may well not exist (the next generation's manifest): without
        ``s3:ListBucket`` S3 answers a missing object with 403, not 404, so here a 403 means absent
        too. Never used for a name that must exist: there a 403 is an error naming the object."""
        from botocore.exceptions import ClientError

        try:
            return self.read_bytes(name)
        except ClientError as exc:
            if error_code(exc) in S3_FORBIDDEN:
                log.debug("%s: 403, taken as absent (no s3:ListBucket permission answers so)", self.url_of(name))
                return None
            raise

    def read_required(self, name: str) -> bytes:
        try:
            return bytes(self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read())
        except s3_errors() as exc:
            raise StorageError(f"cannot read {self.url}/{name}: {exc}") from exc

    def read_range(self, name: str, offset: int, size: int) -> bytes:
        """One ranged GET (none for ``size`` 0); OSError naming the object and range."""
        return read_s3_range(self.client, self.url_of(name), offset, size) if size else b""

    def read_json(self, name: str) -> Any | None:
        data = self.read_bytes(name)
        return None if data is None else json.loads(data)

    def write_json(self, name: str, obj: Any) -> str:
        self.replace(name, json_bytes(obj))
        return self.url_of(name)

    def create_exclusive(self, name: str, data: bytes) -> None:
        """A ``PutObject`` with ``If-None-Match: *``: written once, or FileExistsError."""
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data, IfNoneMatch="*")
        except ClientError as exc:
            if error_code(exc) in S3_EXISTS:
                raise FileExistsError(f"{self.url}/{name} exists") from exc
            raise

    def replace(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data)

    def upload(self, name: str, local_file: Path, sha256: str | None = None) -> None:
        """Upload ``local_file`` as ``name``, with its SHA-256 (if given) as object metadata."""
        extra = {"Metadata": {"sha256": sha256}} if sha256 else None
        self.client.upload_file(str(local_file), self.bucket, self._key(name), ExtraArgs=extra)

    def download(self, name: str, target: Path) -> None:
        """Copy object ``name`` to the local path ``target``, as it comes."""
        self.client.download_file(self.bucket, self._key(name), str(target))

    def local_copy(self, name: str, cache: Path) -> Path:
        """``cache / name``, downloaded the first time it is asked for."""
        target = cache / name
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            self.download(name, target)
        return target

    def stat(self, name: str) -> ObjectStat | None:
        """Size and recorded SHA-256 of object ``name``, or None where it cannot be seen."""
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(name))
        except ClientError:
            return None
        return ObjectStat(int(head.get("ContentLength", -1)), head.get("Metadata", {}).get("sha256"))

    def remove(self, names: list[str]) -> None:
        """Each name's object and every object under ``name/``, in batches of 1000."""
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

    def local_scratch(self) -> Path:
        """A temporary directory of this location (removed by ``cleanup``)."""
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="needle-s3-"))
        return self._scratch

    def commit_file(self, name: str, local_file: Path, marker: dict[str, Any]) -> str:
        """Upload ``local_file`` as ``name``, then its ``.committed`` marker; the local file is removed."""
        self.upload(name, local_file)
        self.client.put_object(
            Bucket=self.bucket, Key=self._key(name + MARKER_SUFFIX), Body=json.dumps(marker).encode()
        )
        Path(local_file).unlink(missing_ok=True)
        return self.url_of(name)

    def _names(self) -> list[str]:
        """Every object under the prefix, as a name relative to it."""
        prefix = f"{self.prefix}/" if self.prefix else ""
        names: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            names.extend(item["Key"][len(prefix) :] for item in page.get("Contents", []))
        return names

    def committed(self) -> dict[str, dict[str, Any]]:
        """Parquet parts that have their commit marker: name -> marker ({"rows": n, ...})."""
        names = set(self._names())
        parts = {}
        for name in sorted(n for n in names if n.endswith(".parquet")):
            if name + MARKER_SUFFIX in names:
                body = self.client.get_object(Bucket=self.bucket, Key=self._key(name + MARKER_SUFFIX))["Body"].read()
                parts[name] = json.loads(body)
        return parts

    def cleanup(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

    # last of the class: below it, ``list`` in an annotation would name this method, not the builtin
    def list(self, prefix: str) -> list[str]:
        """The names one level under ``prefix`` (``""``: the location's top level): objects and
        "directories", relative to the location, as LocalLocation lists them."""
        under = prefix.strip("/")
        root = f"{self.prefix}/" if self.prefix else ""  # every key of the location starts with it
        start = root + (f"{under}/" if under else "")
        names: set[str] = set()
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
            for item in page.get("Contents", []):
                head = item["Key"][len(start) :].split("/", 1)[0]
                if head:
                    names.add((f"{under}/" if under else "") + head)
        return sorted(names)


def move_across(source: Path, target: Path) -> None:
    """Rename ``source`` onto ``target``; across filesystems (``$TMPDIR`` on a tmpfs, a container's
    volume), copy it beside ``target``, fsync it and rename that instead: never half a file."""
    try:
        os.replace(source, target)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(source, "rb") as stream:
            write_synced(tmp, lambda out: shutil.copyfileobj(stream, out))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_directory(target.parent)
    source.unlink()


def location_of(url: str | Path, endpoint_url: str | None = None) -> LocalLocation | S3Location:
    """The location of a local directory or an ``s3://`` prefix (``endpoint_url``: for S3)."""
    return S3Location(str(url), endpoint_url) if is_s3(str(url)) else LocalLocation(Path(url))


def output_location(url: str | Path, endpoint_url: str | None = None) -> LocalLocation | S3Location:
    """A location to write parts into: a local directory is made at once (a prefix needs nothing)."""
    location = location_of(url, endpoint_url)
    if location.local_root is not None:
        location.local_root.mkdir(parents=True, exist_ok=True)
    return location


# "s3://b/x" as a Path is "s3:/b/x": both spellings of a URL name no local directory.
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/")


def build_output(output: Path | str, endpoint_url: str | None = None) -> LocalLocation | S3Location:
    """The location ``needle index build`` writes into: a local directory (not made here) or an
    ``s3://`` prefix; any other URL is refused rather than written to a local directory named
    ``gs:`` (or ``s3:``, for a mangled ``s3:/b/x``)."""
    text = str(output)
    if not is_s3(text) and _URL.match(text):
        raise NeedleInputError(
            f"index output {output} is a URL needle index build cannot write: give a local directory or an "
            "s3://bucket/prefix"
        )
    return location_of(output, endpoint_url)
