"""What a build records beside its files, typed: the build's fields every shard directory (and every
later segment) repeats in its ``shard_infos.json`` (``BuildFields``), and what adding one part did
(``PartStats``, kept in an S3 shard's commit marker). Formats: docs/schema.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from index.locals import SegmentInfo


@dataclass(frozen=True)
class BuildFields:
    """What every segment's ``shard_infos.json`` records of the build: a new segment (``needle index
    add``, ``compact``) is encoded with the same trained index and searched alike."""

    kind: str  # "flat" or "ivfpq"
    factory: str  # the FAISS factory string
    metric: str  # "inner_product"
    dim: int  # the indexed vectors' dimension (an adapter's out_dim where one is used)
    nprobe: int  # default lists probed per query
    refine_factor: int | None  # shortlist = refine_factor * k, re-scored exactly
    quantizer_ef: int | None  # HNSW coarse quantizer search depth (None: not HNSW)
    adapt: Mapping[str, Any] | None  # the adapter the vectors went through (file, sha256, in_dim, out_dim)
    faiss_version: str  # the FAISS that built the trained index
    trained_sha256: str  # the trained index every part was added to

    @staticmethod
    def of(shard_infos: Mapping[str, Any]) -> BuildFields:
        """The fields as one segment's ``shard_infos.json`` records them."""
        get: Callable[[str], Any] = shard_infos.get  # None where a field is not recorded
        return BuildFields(
            get("kind"), get("factory"), get("metric"), get("dim"), get("nprobe"), get("refine_factor"),
            get("quantizer_ef"), get("adapt"), get("faiss_version"), get("trained_sha256"),
        )  # fmt: skip

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class PartStats:
    """What adding one build part did (an S3 shard's commit marker lists them: index/build/s3.py)."""

    added: int  # vectors added to the part's index
    rejected_non_finite: int  # rows left out for NaN/inf descriptors
    rss_bytes: int  # the process's RSS once the part's codes were in memory (0: not recorded)
    locals: SegmentInfo | None = None  # the part's local-token segment (None: no tokens)

    @staticmethod
    def from_json(record: Mapping[str, Any]) -> PartStats:
        tokens = record.get("locals")
        return PartStats(
            int(record["added"]),
            int(record["rejected_non_finite"]),
            int(record.get("rss_bytes", 0)),
            SegmentInfo(**tokens) if tokens is not None else None,
        )

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "added": self.added,
            "rejected_non_finite": self.rejected_non_finite,
            "rss_bytes": self.rss_bytes,
        }
        if self.locals is not None:
            out["locals"] = self.locals.to_dict()
        return out
