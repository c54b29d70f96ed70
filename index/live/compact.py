"""``needle index compact``: segments rewritten without their deleted rows, small ones merged.

In each shard, the segments that hold deleted rows and those much smaller than the shard's largest
(``merge_below``) are rewritten together as one segment of their live rows, in ascending row id
order (``"row_order": "sorted"``: index/live/row_map.py). The new segment's FAISS index is the build's
trained index with those rows' stored vectors added (the codes an add would give them), its
vectors, ids, keys and local tokens are gathered from the old segments, and no byte of a deleted
row is copied. Every answer stays the same: the live rows, their vectors and codes are unchanged.

The next generation names the new segments. Older generations stay readable (a server may still
answer from one) until ``keep`` says how many of the newest to keep: then the files no kept
generation names are removed, with the older manifests. Files that no manifest names (a writer
killed before it published) are removed on every run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from core.errors import NeedleInputError
from index.generation import Segment, ShardSegments
from index.live.config import CompactConfig
from index.live.retrain import ShardRunner, retrain, retrain_reason
from index.live.rewrite import (  # re-exported: compaction's steps, where tests and benches name them
    CHUNK_ROWS,
    Rewritten,
    remove_unreferenced,
    rewrite,
    rewrite_rows,
)
from index.live.writer import writing

log = logging.getLogger(__name__)
__all__ = ["CHUNK_ROWS", "CompactConfig", "Rewritten", "main", "remove_unreferenced", "rewrite", "rewrite_rows"]


def main(conf: CompactConfig, index: Path | str, run_shards: ShardRunner | None = None) -> dict[str, Any]:
    """Compact ``index`` as its next generation (where anything is to rewrite), then remove what
    ``conf.keep`` leaves behind; returns what changed. A retrain re-encodes its shards with
    ``run_shards`` (default: one after another in this process; ``--ray``: Ray tasks)."""
    if conf.keep is not None and conf.keep < 1:
        raise NeedleInputError(f"--keep must be at least 1 (the newest generation), got {conf.keep}")
    reason = retrain_reason(conf, index)
    if reason is not None:  # the index re-encoded with a new training: compaction's work is part of it
        return retrain(conf, index, reason, run_shards)
    with writing(index, conf.s3_endpoint_url) as writer:
        change: dict[str, Any] = {
            "command": "compact",
            "generation": None,
            "retrained": False,
            "rewritten": [],
            "removed": [],
        }
        shards, rewritten = [], []
        for shard in writer.parent.shards:
            chosen = chosen_segments(shard.segments, conf.merge_below)
            if not chosen:
                shards.append(shard)
                continue
            name = writer.segment_name(shard.shard)
            entry = rewrite(writer, [shard.segments[i] for i in chosen], name, shard.shard)
            writer.commit_segment(name)
            kept = [s for i, s in enumerate(shard.segments) if i not in chosen]
            shards.append(ShardSegments(shard.shard, (*kept, entry)))
            rewritten.append({"shard": shard.shard, "from": [shard.segments[i].name for i in chosen], "to": name})
        if rewritten:
            removed_rows = writer.parent.totals.deleted_rows
            change.update(rewritten=rewritten, removed_rows=removed_rows)
            change["generation"] = writer.publish(shards, change).number
        change["removed"] = remove_unreferenced(writer, conf.keep)
        return change


def chosen_segments(segments: tuple[Segment, ...], merge_below: float) -> list[int]:
    """The segments of one shard to rewrite together: those with deleted rows and the small ones
    (under ``merge_below`` of the largest); nothing where that is one segment without deletes."""
    largest = max(s.rows for s in segments)
    chosen = [i for i, s in enumerate(segments) if s.deleted_rows or s.rows < merge_below * largest]
    if len(chosen) == 1 and not segments[chosen[0]].deleted_rows:
        return []
    return chosen
