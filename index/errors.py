"""The errors of reading and searching an index, each naming the bad input (a file, a key)."""

from __future__ import annotations

from core.errors import NeedleInputError


class IndexFileError(NeedleInputError):
    """An index directory that is missing a file, or whose files disagree with each other."""


class UnknownKeyError(NeedleInputError):
    """A key that is not in the index."""
