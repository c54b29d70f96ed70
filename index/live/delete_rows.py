"""``needle index delete``: keys removed from an index, as a new generation.

Each key's live row is found in the newest generation (index/live/keys.py) and added to its
segment's delete set; the next generation records the grown sets (index/live/deletes.py). From then on
a search never returns the row (FAISS skips it), and key lookups, thumbnails and re-ranking treat
the key as unknown. The bytes stay in the segment's files until ``needle index compact`` rewrites
it. Keys the index does not hold (never added, or deleted already) are reported, not fatal.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from core.errors import NeedleInputError
from index.live.config import DeleteConfig
from index.live.keys import ParentKeys
from index.live.writer import next_shards, writing

log = logging.getLogger(__name__)
REPORTED_UNKNOWN = 20  # unknown keys named in the report (all are counted)


def read_keys(source: str) -> list[str]:
    """Keys from a file of one key per line (``-``: standard input); blank lines are skipped,
    each key counted once."""
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise NeedleInputError(f"--keys {source}: cannot read it: {exc}") from exc
    return list(dict.fromkeys(line.rstrip("\r\n") for line in text.splitlines() if line.strip()))


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
            "unknown_keys": [keys[i] for i in unknown[:REPORTED_UNKNOWN].tolist()],
            "generation": None,
        }
        if len(unknown):
            log.warning("%d of %d keys are not in %s (first: %r)", len(unknown), len(keys), index, keys[unknown[0]])
        if not deletes:
            return change
        change["generation"] = writer.publish(next_shards(writer, {}, deletes), change).number
        return change
