"""Files named by URL (a local path or ``s3://bucket/key``): open, read a range, download, list a
glob, and the S3 helpers (client, URL parts, error codes) under core.location, the storage
location (a local directory or an ``s3://`` prefix) that ingestion, the index build, the living
index and shard staging write and read through.

S3 goes through boto3 with the standard AWS credential chain (environment, config files, instance
roles; credentials are never logged) and an optional ``endpoint_url`` for S3-compatible stores.
botocore retries throttling, 5xx and connection errors with exponential backoff ("standard" mode).
Not ``pyarrow.fs``: its S3 filesystem drops user metadata on upload (``x-amz-meta-sha256``, which
an S3 index build checks to keep committed shards) and exposes no request hooks to inject faults
in tests.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from core.errors import NeedleDataError, NeedleInputError

MARKER_SUFFIX = ".committed"  # beside an S3 object: the upload is whole (core.location)
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
    return read_s3_range(s3_client(endpoint_url), url, offset, size)


def read_s3_range(client: Any, url: str, offset: int, size: int) -> bytes:
    """``size`` (> 0) bytes at ``offset`` of the S3 object ``url``, in one ranged GET with ``client``;
    OSError naming the URL and range where they cannot be read whole."""
    bucket, key = split_s3(url)
    span = f"{offset}-{offset + size - 1}"
    try:
        data = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={span}")["Body"].read()
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


# --- the local/S3 decisions callers ask of a URL (no caller tests the scheme itself) -------------

GLOB_CHARS = re.compile(r"[*?\[]")  # a pattern with one of these is a glob


def canonical_url(source: str | Path) -> str:
    """A location as every node names it: an ``s3://`` URL as given (no trailing slash), a path
    made absolute."""
    text = str(source)
    return text.rstrip("/") if is_s3(text) else str(Path(text).resolve())


def path_or_url(text: str) -> Path | str:
    """An ``s3://`` URL as given (a Path would fold its ``//``); a local path as a Path."""
    return text if is_s3(text) else Path(text)


def may_exist(url: str) -> bool:
    """Whether ``url`` is worth reading here: an ``s3://`` URL (not checked: the read names it if
    it is not there) or a local path that exists."""
    return is_s3(url) or Path(url).exists()


def local_directory(url: str) -> Path | None:
    """``url`` as a Path where it is an existing local directory, else None (an ``s3://`` URL, a file)."""
    return None if is_s3(url) or not Path(url).is_dir() else Path(url)


def s3_matches(pattern: str, endpoint_url: str | None = None) -> list[str] | None:
    """The ``s3://`` objects a pattern names, sorted: those matching a glob (maybe none), or the
    pattern itself where it has no glob character; None for a local pattern (not looked at)."""
    if not is_s3(pattern):
        return None
    return list_s3(pattern, endpoint_url) if GLOB_CHARS.search(pattern) else [pattern]


def tar_headers(url: str, endpoint_url: str | None = None) -> Iterator[tarfile.TarInfo]:
    """The members of the tar at ``url``, their data skipped, not kept: an S3 object in one
    streamed pass (mode ``r|``), a local file by its headers, seeking past the data (``r:``)."""
    if is_s3(url):
        with open_url(url, endpoint_url) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            yield from tar
    else:
        with tarfile.open(url, "r:") as tar:
            yield from tar
