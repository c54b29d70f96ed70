"""The one short form in which error messages quote values a user sent (torch-free).

An error names the bad input, but never echoes it whole: a 2.5M-character key once came back as a
12.5 MB 400 body. ``short_repr`` is ``repr`` cut to at most ``SHORT_REPR_WIDTH`` characters, and
a list or dict is described by its type and length instead of printed.
"""

from __future__ import annotations

from typing import Any

SHORT_REPR_WIDTH = 80


def short_repr(value: Any, width: int = SHORT_REPR_WIDTH) -> str:
    """``repr(value)`` in at most ``width`` characters (a longer one cut, ending in ``...``)."""
    if isinstance(value, (list, dict, tuple, set)):
        text = f"a {type(value).__name__} of {len(value)}"
    elif isinstance(value, (str, bytes)) and len(value) > width:
        text = repr(value[:width])  # never build the whole repr of a huge value
    else:
        text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def short_text(text: str, width: int = SHORT_REPR_WIDTH) -> str:
    """``text`` itself (no quotes) in at most ``width`` characters: a field's name as an answer names it."""
    return text if len(text) <= width else text[: width - 3] + "..."
