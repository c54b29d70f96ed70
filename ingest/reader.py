"""Streaming samples out of WebDataset tar shards.

Samples are dicts carrying ``__key__`` and ``__url__`` plus one entry per member suffix
(``jpg``, ``json``, ...), grouped the way webdataset groups them. Tar-level problems (missing file,
truncated or corrupt archive) raise ShardReadError: the shard cannot be trusted and is reported as
failed. Sample-level problems are the caller's to turn into error rows.
"""

from __future__ import annotations

import tarfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from webdataset import tariterators

from core.errors import ShardReadError
from ingest.config import IMAGE_SUFFIXES  # member suffixes holding the image, in order of preference


@contextmanager
def open_shard(url: str, opener: Callable[[str], IO[bytes]] | None = None) -> Iterator[IO[bytes]]:
    """Open a shard for streaming; ``opener`` handles remote URLs (local files by default)."""
    try:
        stream = opener(url) if opener is not None else open(url, "rb")  # noqa: SIM115 (closed below)
    except FileNotFoundError as exc:
        raise ShardReadError(url, "file not found") from exc
    except Exception as exc:  # S3 client errors are not all OSErrors
        raise ShardReadError(
            url, f"{type(exc).__name__}: {exc}", transient=is_transient(exc) or isinstance(exc, OSError)
        ) from exc
    try:
        yield stream
    finally:
        stream.close()


def _reraise(exc: Exception) -> bool:
    raise exc


def is_transient(exc: BaseException) -> bool:
    """Network trouble worth a second read (connection reset, timeout, an S3 stream cut)."""
    return isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__module__.split(".")[0] in (
        "botocore",
        "urllib3",
    )


def iter_samples(url: str, opener: Callable[[str], IO[bytes]] | None = None) -> Iterator[dict[str, Any]]:
    """Yield the samples of one tar shard, in archive order."""
    with open_shard(url, opener) as stream:
        try:
            members = tariterators.tar_file_iterator(stream, handler=_reraise)
            tagged = ({**m, "__url__": url} for m in members)
            yield from tariterators.group_by_keys(tagged, handler=_reraise)
        except ShardReadError:
            raise
        except (tarfile.TarError, EOFError, OSError, ValueError) as exc:  # ValueError: duplicate member names
            raise ShardReadError(url, f"{type(exc).__name__}: {exc}", transient=is_transient(exc)) from exc
        except Exception as exc:
            if is_transient(exc):
                raise ShardReadError(url, f"{type(exc).__name__}: {exc}", transient=True) from exc
            raise


def image_bytes(sample: dict[str, Any]) -> bytes | None:
    """The sample's image member, or None when it has none."""
    for suffix in IMAGE_SUFFIXES:
        if suffix in sample:
            return sample[suffix]
    return None
