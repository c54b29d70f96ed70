"""The errors of reading and searching an index, each naming the bad input (a file, a key)."""

from __future__ import annotations

from core.errors import NeedleDataError, NeedleInputError


class IndexFileError(NeedleDataError, NeedleInputError):
    """An index directory that is missing a file, or whose files disagree with each other: the
    user's input at the CLI, the server's fault behind HTTP (core.errors.NeedleDataError)."""


class UnknownKeyError(NeedleInputError):
    """A key that is not in the index."""


class OldIndexLayoutError(IndexFileError):
    """An index directory built before shard directories (files at the top, no ``"layout":
    "shard-directories"`` in its index_infos.json): no longer read; ``needle index build`` rebuilds it."""
