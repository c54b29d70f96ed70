"""Typed errors of the ingestion stage; each names the input it is about."""

from __future__ import annotations

from core.quoting import short_repr


class NeedleInputError(ValueError):
    """Base class for bad user input (a path, a key, a shape) in any needle stage."""


class NeedleDataError(Exception):
    """Stored data a needle process reads (an index file, a storage location) that is missing,
    corrupt or refused. Why a class of its own: who is at fault depends on who named the data. At
    the command line the user named it, so the concrete classes (IndexFileError, StorageError) are
    also NeedleInputErrors and the CLI reports them as bad input (exit 2). Behind an HTTP service
    the operator named it, never the client: the service answers them as its own fault (500/503,
    webapi.http_errors), never a 4xx. Wherever the two are told apart, test NeedleDataError first."""


class ShardSpecError(NeedleInputError):
    """A shard pattern that matches nothing or cannot be parsed."""


class PackInputError(NeedleInputError):
    """``needle pack``: a source, output directory or setting that cannot be used."""


class ShardReadError(RuntimeError):
    """A tar shard that cannot be read to the end (missing, truncated, not a tar)."""

    def __init__(self, url: str, reason: str, transient: bool = False):
        super().__init__(f"cannot read shard {url}: {reason}")
        self.url = url
        self.reason = reason
        self.transient = transient  # worth reading again (a network stream cut), not a bad file


class ImageDecodeError(ValueError):
    """A sample whose image bytes cannot be decoded."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"cannot decode image of sample {short_repr(key)}: {reason}")
        self.key = key
        self.reason = reason


class SettingsFileError(NeedleInputError):
    """A settings file (``needle serve --config``) that cannot be read, or one of its keys that is
    unknown or holds a value of the wrong type: names the file and the key."""

    def __init__(self, source: str, key: str, reason: str):
        super().__init__(f"{source}: {key}: {reason}" if key else f"{source}: {reason}")
        self.source, self.key = source, key
