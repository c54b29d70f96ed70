"""The settings of ``needle eval map`` and ``needle eval scaling``, torch-free so that their
``--help`` imports no stage: EvalConfig (eval/evaluate.py) and ScalingConfig (eval/scaling.py).
Their flags are these fields (cli/flags.py), their help declared with each (core.settings); the
nested re-ranking config is the stage's (rerank/rerank.py), named here for type checking only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.settings import setting
from query.recorded import QueryFiles

if TYPE_CHECKING:
    from rerank.rerank import RerankConfig

DEFAULT_SIZES = (
    0,
    100,
    300,
    1_000,
    3_000,
    10_000,
    30_000,
    100_000,
    300_000,
    1_000_000,
    3_000_000,
    10_000_000,
    30_000_000,
    100_000_000,
)


@dataclass(frozen=True)
class EvalConfig:
    k: int = setting(1000, "rank cut-off of mAP@k")
    nprobe: int | None = setting(None, "IVF lists visited; None: the index's setting")
    batch: int = setting(256, "queries searched at once")
    rerank: RerankConfig | None = None  # re-rank each shortlist with local tokens; None: global only
    query_locals: str | None = setting(None, "descriptor directory of query-side local tokens; None: the index's store")
    query_descriptors: str | None = setting(
        None,
        "descriptor directory of the query images' globals; None: the index's vectors",
    )
    text_queries: bool = setting(False, "ILIAS ground truth: also evaluate its text queries (open_clip models)")
    qe_top: int = setting(0, "query expansion with the top-n (0: off)")
    ilias_pickle: str | None = setting(None, "also write the rankings as the ILIAS benchmark's result pickle")
    ilias_json: str | None = setting(None, "... and/or its result JSON ({query: {db_id: score}})")
    files: QueryFiles = field(default_factory=QueryFiles)  # files in place of those the index records (same SHA-256)


@dataclass(frozen=True)
class ScalingConfig:
    sizes: tuple[int, ...] = setting(
        DEFAULT_SIZES,
        "distractor counts; sizes past the available distractors are dropped",
    )
    modes: tuple[str, ...] = setting(
        ("exact", "ivfpq", "ivfpq+sp"),
        "exact | ivfpq, optionally +sp/+chamfer/+ames (re-ranking)",
    )
    k: int = setting(1000, "rank cut-off of mAP@k")
    nprobe: int | None = setting(None, "IVF lists visited per query; None: the index's default")
    nlist: int | None = setting(None, "IVF lists; None: the builder's choice for each size")
    memory_budget: str = setting("8GB", "index build budget (index/build/stage.py)")
    shortlist: int = setting(1000, "global candidates re-ranked in the +rerank modes")
    rerank_lambda: float | None = setting(
        None,
        "weight of the global score in the re-ranking ensemble (None: EnsembleConfig's)",
    )
    ames: str | None = setting(None, "AMES checkpoint for +ames")
    adapt: str | None = setting(None, "adapter file applied to database and queries (needle adapt train / whiten)")
    query_descriptors: str | None = setting(
        None,
        "the query images' own descriptors (ILIAS); None: queries are indexed",
    )
    query_locals: str | None = setting(
        None,
        "the query images' local tokens (query-side preset); None: the index's store",
    )
    order: str = setting("file", "file | shuffle: the fixed order whose prefixes are the distractor subsets")
    seed: int = setting(0, 'permutation of order="shuffle"')
    label: str | None = setting(None, "the run's name in the plot; None: the model recorded at ingestion")
    keep_indexes: bool = setting(False, "keep every size's index under output/indexes (default: removed after use)")
