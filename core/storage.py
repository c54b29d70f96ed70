"""The one storage layer of needle: files under a local directory or an ``s3://`` prefix, read,
copied, listed, uploaded and committed the same way by ingestion, the index build, shard staging
and the source images of thumbnails.

S3 goes through boto3 with the standard AWS credential chain (environment, config files, instance
roles; credentials are never logged) and an optional ``endpoint_url`` for S3-compatible stores.
botocore retries throttling, 5xx and connection errors with exponential backoff ("standard" mode).
Not ``pyarrow.fs``: its S3 filesystem drops user metadata on upload (``x-amz-meta-sha256``, which
an S3 index build checks to keep committed shards) and exposes no request hooks to inject faults
in tests.

Commit protocol. Local: write ``<name>.tmp`` then ``os.replace``. S3: upload the object, then
write ``<name>.committed`` (a small JSON); readers list only objects that have their marker, so a
half-finished upload of a killed worker is never read.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from core.atomic import write_json_atomic
from core.errors import NeedleDataError, NeedleInputError

log = logging.getLogger(__name__)

MARKER_SUFFIX = ".committed"
S3_MAX_ATTEMPTS = 8  # botocore attempts per request, with exponential backoff between them
MISSING_CODES = ("NoSuchKey", "404", "NoSuchBucket")  # S3 error codes of an object that is not there


class StorageError(NeedleDataError, NeedleInputError):
    """A storage location that cannot be used (bad URL, missing bucket or file, no permission): the
    user's input at the CLI, the server's fault behind HTTP (core.errors.NeedleDataError)."""


def is_s3(url: str | Path) -> bool:
    return str(url).startswith("s3://")


def split_s3(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``)."""
    if not is_s3(url):
        raise StorageError(f"not an s3:// URL: {url!r}")
    bucket, _, key = url[len("s3://") :].partition("/")
    if not bucket:
        raise StorageError(f"no bucket in {url!r}")
    return bucket, key


def s3_client(endpoint_url: str | None = None) -> Any:
    import boto3
    from botocore.config import Config

    config = Config(retries={"max_attempts": S3_MAX_ATTEMPTS, "mode": "standard"}, connect_timeout=10, read_timeout=120)
    return boto3.client("s3", endpoint_url=endpoint_url, config=config)


def s3_key(prefix: str, name: str) -> str:
    """The object key of ``name`` under a key prefix (``""``: the bucket's root)."""
    return f"{prefix}/{name}" if prefix else name


def error_code(exc: Exception) -> str:
    """The S3 error code of a botocore ClientError (``""`` for other errors)."""
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def s3_errors() -> tuple[type[Exception], ...]:
    """The exceptions a boto3 call raises for a request that failed (imported late: botocore is big)."""
    from botocore.exceptions import BotoCoreError, ClientError

    return (ClientError, BotoCoreError)


# --- one file named by a URL: a local path or s3://bucket/key -----------------------------------


def open_url(url: str, endpoint_url: str | None = None) -> IO[bytes]:
    """A readable binary stream of a local file or an S3 object (streamed, not downloaded whole);
    FileNotFoundError where the object is not there, OSError for other S3 refusals."""
    if not is_s3(url):
        return open(url, "rb")
    from botocore.exceptions import ClientError

    bucket, key = split_s3(url)
    try:
        return s3_client(endpoint_url).get_object(Bucket=bucket, Key=key)["Body"]
    except ClientError as exc:
        code = error_code(exc)
        if code in MISSING_CODES:
            raise FileNotFoundError(f"{url}: {code}") from exc
        raise OSError(f"{url}: {code or exc}") from exc


def read_range(url: str, offset: int, size: int, endpoint_url: str | None = None) -> bytes:
    """``size`` bytes at ``offset`` of a local file (a seek) or an S3 object (one ranged GET);
    OSError naming the URL and range where they cannot be read whole."""
    if not is_s3(url):
        with open(url, "rb") as stream:
            stream.seek(offset)
            return stream.read(size)
    if size == 0:
        return b""
    bucket, key = split_s3(url)
    span = f"{offset}-{offset + size - 1}"
    try:
        data = s3_client(endpoint_url).get_object(Bucket=bucket, Key=key, Range=f"bytes={span}")["Body"].read()
    except s3_errors() as exc:
        raise OSError(f"{url}: bytes {span}: {exc}") from exc
    if len(data) != size:
        raise OSError(f"{url}: {len(data)} bytes at {offset}, {size} asked for")
    return bytes(data)


def download(url: str, target: Path, endpoint_url: str | None = None) -> None:
    """Copy a local file or an S3 object to the local path ``target``, as it comes (callers that
    must never leave half a file download to a temporary name and rename)."""
    if is_s3(url):
        bucket, key = split_s3(url)
        s3_client(endpoint_url).download_file(bucket, key, str(target))
    else:
        shutil.copyfile(url, target)


def list_s3(url_pattern: str, endpoint_url: str | None = None) -> list[str]:
    """Objects matching an ``s3://bucket/prefix*.tar`` glob, sorted."""
    bucket, pattern = split_s3(url_pattern)
    prefix = pattern.split("*")[0].split("?")[0].split("[")[0]
    paginator = s3_client(endpoint_url).get_paginator("list_objects_v2")
    keys = [o["Key"] for page in paginator.paginate(Bucket=bucket, Prefix=prefix) for o in page.get("Contents", [])]
    return sorted(f"s3://{bucket}/{k}" for k in keys if fnmatch.fnmatchcase(k, pattern))


# --- a file under a root: a local directory or an s3:// prefix ----------------------------------


def url_under(root: str, relative: str) -> str:
    """The URL (or path) of ``relative`` under a local directory or an ``s3://`` prefix."""
    if is_s3(root):
        bucket, prefix = split_s3(root.rstrip("/"))
        return f"s3://{bucket}/{s3_key(prefix, relative)}"
    return str(Path(root) / relative)


def read_file_under(root: str, relative: str, endpoint_url: str | None = None) -> bytes:
    """The bytes of ``relative`` under a local directory or an ``s3://`` prefix; StorageError
    naming the file where it cannot be read."""
    url = url_under(root, relative)
    if is_s3(url):
        bucket, key = split_s3(url)
        try:
            return bytes(s3_client(endpoint_url).get_object(Bucket=bucket, Key=key)["Body"].read())
        except s3_errors() as exc:
            raise StorageError(f"cannot read {root}/{relative}: {exc}") from exc
    try:
        return Path(url).read_bytes()
    except OSError as exc:
        raise StorageError(f"cannot read {url}: {exc}") from exc


def copy_file_under(root: str, relative: str, target: Path, endpoint_url: str | None = None) -> None:
    """Copy ``relative`` under a local directory or an ``s3://`` prefix to the local path
    ``target``, as it comes (see ``download``)."""
    download(url_under(root, relative), target, endpoint_url)


# --- an output location: where parts are committed and JSON records written ---------------------


class Storage(Protocol):
    url: str

    def commit_file(self, name: str, local_file: Path, marker: dict[str, Any]) -> str: ...
    def write_json(self, name: str, obj: Any) -> str: ...
    def read_json(self, name: str) -> Any | None: ...
    def committed(self) -> dict[str, dict[str, Any]]: ...
    def local_scratch(self) -> Path: ...


@dataclass
class LocalStorage:
    root: Path

    @property
    def url(self) -> str:
        return str(self.root)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.root.mkdir(parents=True, exist_ok=True)

    def local_scratch(self) -> Path:
        return self.root  # same file system: the final rename is atomic

    def commit_file(self, name: str, local_file: Path, marker: dict[str, Any]) -> str:
        target = self.root / name
        os.replace(local_file, target)
        return str(target)

    def write_json(self, name: str, obj: Any) -> str:
        return str(write_json_atomic(obj, self.root / name))

    def read_json(self, name: str) -> Any | None:
        path = self.root / name
        return json.loads(path.read_text()) if path.is_file() else None

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


@dataclass(frozen=True)
class ObjectStat:
    size: int
    sha256: str | None  # the SHA-256 recorded as the object's metadata by ``upload``, if any


@dataclass
class S3Storage:
    url: str
    endpoint_url: str | None = None

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.bucket, self.prefix = split_s3(self.url)
        self.client = s3_client(self.endpoint_url)
        self._scratch: Path | None = None

    def _key(self, name: str) -> str:
        return s3_key(self.prefix, name)

    def local_scratch(self) -> Path:
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="needle-s3-"))
        return self._scratch

    def commit_file(self, name: str, local_file: Path, marker: dict[str, Any]) -> str:
        self.upload(name, local_file)
        self.client.put_object(
            Bucket=self.bucket, Key=self._key(name + MARKER_SUFFIX), Body=json.dumps(marker).encode()
        )
        Path(local_file).unlink(missing_ok=True)
        return f"s3://{self.bucket}/{self._key(name)}"

    def upload(self, name: str, local_file: Path, sha256: str | None = None) -> None:
        """Upload ``local_file`` as ``name``, with its SHA-256 (if given) as object metadata."""
        extra = {"Metadata": {"sha256": sha256}} if sha256 else None
        self.client.upload_file(str(local_file), self.bucket, self._key(name), ExtraArgs=extra)

    def download(self, name: str, target: Path) -> None:
        """Copy object ``name`` to the local path ``target``, as it comes."""
        self.client.download_file(self.bucket, self._key(name), str(target))

    def stat(self, name: str) -> ObjectStat | None:
        """Size and recorded SHA-256 of object ``name``, or None where it cannot be seen."""
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(name))
        except ClientError:
            return None
        return ObjectStat(int(head.get("ContentLength", -1)), head.get("Metadata", {}).get("sha256"))

    def write_json(self, name: str, obj: Any) -> str:
        body = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
        self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=body)
        return f"s3://{self.bucket}/{self._key(name)}"

    def read_json(self, name: str) -> Any | None:
        from botocore.exceptions import ClientError

        try:
            return json.loads(self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read())
        except ClientError as exc:
            if error_code(exc) in ("NoSuchKey", "404"):
                return None
            raise

    def _list(self) -> Iterator[str]:
        prefix = f"{self.prefix}/" if self.prefix else ""
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                yield item["Key"][len(prefix) :]

    def committed(self) -> dict[str, dict[str, Any]]:
        """Parquet parts that have their commit marker: name -> marker ({"rows": n, ...})."""
        names = set(self._list())
        parts = {}
        for name in sorted(n for n in names if n.endswith(".parquet")):
            if name + MARKER_SUFFIX in names:
                body = self.client.get_object(Bucket=self.bucket, Key=self._key(name + MARKER_SUFFIX))["Body"].read()
                parts[name] = json.loads(body)
        return parts

    def cleanup(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


def storage_for(url: str | Path, endpoint_url: str | None = None) -> LocalStorage | S3Storage:
    return S3Storage(str(url), endpoint_url) if is_s3(str(url)) else LocalStorage(Path(url))
