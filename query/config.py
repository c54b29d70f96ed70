"""``needle query``'s settings, torch-free so that ``needle query --help`` imports no stage:
QueryConfig (query/retrieve.py searches with it; ``needle eval`` and ``needle serve`` too). Its
flags are these fields (cli/flags.py), their help declared with each (core.settings); the nested
re-ranking config is the stage's (rerank/rerank.py), named here for type checking only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.settings import setting
from query.recorded import QueryFiles

if TYPE_CHECKING:
    from rerank.rerank import RerankConfig


@dataclass(frozen=True)
class QueryConfig:
    k: int = setting(10, "results per query")
    nprobe: int | None = setting(None, "IVF lists visited (IVF indexes only); None: the index's setting")
    refine_factor: int | None = setting(
        None,
        "IVF-PQ shortlist = this * k, re-scored exactly; None: the index's setting",
    )
    files: QueryFiles = field(default_factory=QueryFiles)  # files in place of those the index records (same SHA-256)
    rerank: RerankConfig | None = None  # re-rank the global shortlist with local tokens; None: global only
    qe_top: int = setting(
        0,
        "query expansion: average the query with its similarity-weighted top-n, search again (0: off)",
    )
    scales: tuple[float, ...] = setting(
        (1.0,),
        "Query-side multi-scale for image queries (ILIAS: (0.707, 1, 1.414)): the global descriptor is "
        "the L2-normalised mean over the scales; (1.0,): single scale, exactly as ingestion.",
    )
    rotations: int = setting(1, "image queries averaged over 1 (none), 2 or 4 quarter turns likewise (ILIAS: 4)")

    def __post_init__(self) -> None:
        if self.scales != (1.0,) or self.rotations != 1:
            from core.multiscale import check_scales_rotations  # imports torch: only when asked for

            scales, _ = check_scales_rotations(self.scales, self.rotations)
            object.__setattr__(self, "scales", scales)  # a list (from JSON, say) as a tuple of floats
