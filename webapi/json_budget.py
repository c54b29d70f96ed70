"""A JSON body's size in Python objects, counted before any object is built.

Why: ``json.loads`` builds the whole document before a field can be checked, and what it builds
can be many times the body: 14 MiB of ``{},`` (5M empty objects) took the server from 300 to
674 MB for one request. The byte cap (``--max-json-mb``) does not bound that; this does. The
body's strings are blanked out (their brackets and commas are not structure), then its
structure is counted at C speed (``bytes.count``, numpy over the brackets):

- items: every value, an object's key and value counting once (the parser shares repeated keys),
  a container twice (an empty dict is 64 bytes, a float with its slot 32);
- depth: how deep arrays and objects nest.

A body past ``max_items`` or ``max_depth`` is refused before ``json.loads`` runs; within them the
parse costs at most about 64 bytes per item (~130 MB at the default 2M items, measured in
tests/webapi/test_service_limits.py) whatever the body holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

# A JSON string, escapes included (unrolled: no backtracking per character); an unterminated one
# is left in place, over-counting its commas: the parse refuses it anyway.
STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
STRUCTURE = b"[]{}"
NOT_STRUCTURE = bytes(b for b in range(256) if b not in STRUCTURE)
OPENS = np.zeros(256, np.int8)
OPENS[[ord("["), ord("{")]] = 1
OPENS[[ord("]"), ord("}")]] = -1


@dataclass(frozen=True)
class JsonShape:
    """What parsing a body would build, counted from its bytes."""

    items: int  # values (an object's member counts once), containers twice
    depth: int  # deepest nesting of arrays and objects


def json_shape(data: bytes) -> JsonShape:
    """The ``JsonShape`` of ``data`` (an upper bound for malformed bodies, which the parse refuses)."""
    blanked = STRING.sub(b"0", data)
    containers = blanked.count(b"[") + blanked.count(b"{")
    values = blanked.count(b",") + containers + 1
    brackets = np.frombuffer(blanked.translate(None, NOT_STRUCTURE), np.uint8)
    depth = int(np.cumsum(OPENS[brackets], dtype=np.int64).max(initial=0))
    return JsonShape(values + containers, depth)
