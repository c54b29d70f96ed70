"""``needle index delete``: keys removed from an index, as a new generation.

Each key's live row is found in the newest generation (index/live/keys.py) and added to its
segment's delete set; the next generation records the grown sets (index/live/deletes.py). From then on
a search never returns the row (FAISS skips it), and key lookups, thumbnails and re-ranking treat
the key as unknown. The bytes stay in the segment's files until ``needle index compact`` rewrites
it. Keys the index does not hold (never added, or deleted already) are reported, not fatal
(``--strict``: an error, nothing deleted).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from core.errors import NeedleInputError
from core.quoting import short_repr, short_text
from index.live.config import DeleteConfig
from index.live.keys import ParentKeys
from index.live.writer import next_shards, writing

log = logging.getLogger(__name__)
REPORTED_UNKNOWN = 20  # unknown keys named in the report (all are counted)
REPORTED_KEY_WIDTH = 200  # characters of each named there (a longer one is cut, ending in "...")


class UnknownKeysError(NeedleInputError):
    """``--strict``: keys the index does not hold (never added, or deleted already)."""


def read_keys(source: str) -> list[str]:
    """Keys from a file of one key per line (``-``: standard input), as key files store them: lines
    end at ``\n`` only, one ``\r`` before it is dropped (CRLF files), and every other character is
    part of the key (``str.splitlines`` also split at ``\x85``, ``\u2028``, ``\x0b``, ``\x0c``,
    ``\x1c``-``\x1e``: keys holding one were silently never found). Empty lines are skipped, each
    key counted once."""
    try:
        # bytes, not text mode: its universal newlines would also end a line at a lone "\r"
        text = (sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise NeedleInputError(f"--keys {source}: cannot read it: {exc}") from exc
    lines = (line[:-1] if line.endswith("\r") else line for line in text.split("\n"))
    return list(dict.fromkeys(line for line in lines if line))


def main(conf: DeleteConfig, keys: list[str], index: Path | str) -> dict[str, Any]:
    """Delete ``keys`` from ``index`` as its next generation; returns what changed (the manifest's
    ``change``: ``"generation"`` None where no key was found)."""
    with writing(index, conf.s3_endpoint_url) as writer:
        parent = ParentKeys(writer)
        found = parent.find_many(keys)
        unknown = found.missing(len(keys))
        deletes = parent.deletes_of(writer, found)
        change: dict[str, Any] = {
            "command": "delete",
            "deleted": sum(len(rows) for rows, _ in deletes.values()),
            "unknown": len(unknown),
            # a few, each cut short: a huge key file must not make a huge manifest
            "unknown_keys": [short_text(keys[i], REPORTED_KEY_WIDTH) for i in unknown[:REPORTED_UNKNOWN].tolist()],
            "generation": None,
        }
        if len(unknown):
            first = short_repr(keys[unknown[0]])
            if conf.strict:
                raise UnknownKeysError(
                    f"--strict: {len(unknown)} of {len(keys)} keys are not in {index} (first: {first}); "
                    "nothing was deleted"
                )
            log.warning("%d of %d keys are not in %s (first: %s)", len(unknown), len(keys), index, first)
        if not deletes:
            return change
        change["generation"] = writer.publish(next_shards(writer, {}, deletes), change).number
        return change
