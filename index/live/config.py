"""The settings of the living index's commands, torch-free and FAISS-free so that ``needle index
add --help`` (and ``delete``, ``compact``) imports no stage: AddConfig (index/live/add_rows.py),
DeleteConfig (index/live/delete_rows.py), CompactConfig (index/live/compact.py), InspectConfig
(index/live/inspect.py). Their flags are these fields (cli/flags.py), their help declared with each
(core.settings)."""

from __future__ import annotations

from dataclasses import dataclass

from core.settings import setting


@dataclass(frozen=True)
class AddConfig:
    replace: bool = setting(
        False,
        "a key the index already holds: delete its old row, index the new one (else an error)",
    )
    s3_endpoint_url: str | None = setting(None, "S3-compatible endpoint for s3:// indexes and descriptors")
    drift_error_ratio: float = setting(
        1.25,
        "recommend a rebuild past this ratio of mean quantisation errors (new/trained)",
    )
    drift_top_share_ratio: float = setting(
        2.0,
        "... or past this ratio of the fullest 1 % of lists' shares (new/trained)",
    )


@dataclass(frozen=True)
class DeleteConfig:
    s3_endpoint_url: str | None = setting(None, "S3-compatible endpoint for an s3:// index")
    # off by default: a takedown list run again after a failure holds keys deleted by the first run,
    # which are unknown by then; the re-run must still delete the rest and succeed
    strict: bool = setting(
        False,
        "a key the index does not hold (never added, or deleted already) is an error: nothing is deleted",
    )


@dataclass(frozen=True)
class CompactConfig:
    keep: int | None = setting(None, "keep the files of the newest N generations, remove older ones (None: keep all)")
    merge_below: float = setting(0.25, "also rewrite segments under this share of their shard's largest segment")
    s3_endpoint_url: str | None = setting(None, "S3-compatible endpoint for an s3:// index")
    retrain: str = setting(
        "auto",
        "auto | always | never: retrain the quantizer and PQ on the live rows and re-encode them all (auto: when "
        "an add's drift report recommended it, past --retrain-share added rows, or when the rows outgrew the plan)",
    )
    # past ~30 % the sample the quantizer was trained on no longer represents the index (docs/live_index.md)
    retrain_share: float = setting(0.3, "--retrain auto retrains once rows added since training pass this share")
    memory_budget: str | None = setting(None, "a retrain's plan within this RAM (None: the build's --memory-budget)")
    recall_target: float | None = setting(
        0.95,
        "a retrain chooses the served nprobe and refine factor as the cheapest reaching this recall@k on a "
        "sample of the index's rows (None or 0: the build's)",
    )
    recall_ks: tuple[int, ...] = setting((10, 1000), "the k at which --recall-target must hold (comma-separated)")
    tune_queries: int = setting(200, "rows searched as queries to choose the search defaults")


@dataclass(frozen=True)
class InspectConfig:
    """``needle index info`` and ``needle index keys`` (index/live/inspect.py): they only read."""

    s3_endpoint_url: str | None = setting(None, "S3-compatible endpoint for an s3:// index")
