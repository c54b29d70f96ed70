"""The re-ranking options a user sets (``--rerank``, ``--shortlist`` ... ``--device``, or the
``[rerank]`` section of ``needle serve --config``): one flat, torch-free dataclass shared by
``needle query``, ``needle serve`` and ``needle eval map``, turned into the stage's nested
RerankConfig (rerank/rerank.py) only when a command runs. Its defaults are the stage configs'
own (tests/webapi/test_serve_spec.py checks that they agree)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.errors import NeedleInputError
from core.settings import setting

_LAM_HELP = (
    "weight of the global score (1 - lam for the local one); realbench held out by source: every fold chose 0.45 for SP"
)
_CHAMFER_HELP = (
    "SP: weight w_c of the candidate's Chamfer similarity added to the ensemble (0: none); None: the token "
    "kind's own (embed.locals.presets.RERANK_BY_KIND: ALIKED 0.3, which every held-out fold chose on "
    "realbench; the other kinds, not measured with it, none), none where no kind is known"
)
_HAMMING_HELP = (
    "Keep a match only within this many differing bits (of 128), 0..128; None: the token kind's own where "
    "the re-ranking knows it (embed.locals.presets.RERANK_BY_KIND: Lite0 32, ALIKED 28), else 32."
)
_ASYMMETRIC_HELP = (
    "Score the query's float ITQ projections (where its tokens carry them: image queries) against the "
    "database's binary codes: bits weigh by the query's confidence in them (weighted Hamming distance, in "
    "bits); the database side stays 128 bits. Stored-key queries have no projections and match with plain "
    "Hamming distances. realbench: SP 52.5 -> 56.5 mAP@1k (cross-validated)."
)
_QE_HELP = (
    "α-QE after SP: average the query with the re-ranked top TOP results that have --rerank-qe-min-inliers "
    "inliers, then score the shortlist again (0: none; default: the index's token kind's own, "
    "embed.locals.presets.RERANK_BY_KIND)"
)
_GLUE_HELP = (
    "verify the top N of the re-ranked order again with LightGlue (its ALIKED weights, descriptors rebuilt "
    "from the stored codes; rerank/glue.py) and order them among themselves; 0: no second stage"
)
_DEVICE_HELP = (
    "where this process re-ranks (the AMES model, Hamming matching, spatial verification's tables): cpu "
    "(default), cuda (an error without a CUDA GPU), auto (cuda where torch sees one)"
)


@dataclass(frozen=True)
class RerankOptions:
    """Re-ranking the global shortlist with local tokens; ``method`` None: no re-ranking. A None
    below leaves the value to the index's token kind (or to the stage config's default)."""

    method: str | None = setting(None, "re-rank the global shortlist: spatial verification, Chamfer or AMES")
    shortlist: int = setting(1000, "global top candidates re-ranked")
    ames: str | None = setting(None, "AMES checkpoint (method ames)")
    lam: float = setting(0.45, _LAM_HELP)
    gamma: float = setting(1.0, "AMES: sigmoid temperature over its logit")
    chamfer_weight: float | None = setting(None, _CHAMFER_HELP)
    max_hamming: int | None = setting(None, _HAMMING_HELP)
    mutual: bool = setting(True, "also require the candidate token's nearest query token to be this query token")
    asymmetric: bool = setting(True, _ASYMMETRIC_HELP)
    qe_top: int | None = setting(None, _QE_HELP)
    qe_min_inliers: int | None = setting(None, "of those, only results with at least this many inliers are averaged in")
    qe_alpha: float | None = setting(
        None, "each averaged result weighs max(0, its global similarity) ** alpha (0: plain mean)"
    )
    glue_top: int = setting(0, _GLUE_HELP)
    glue_weight: float = setting(0.1, "added to a verified candidate's score at ``cap`` matches or more")
    glue_cap: int = setting(50, "expected matches at which the bonus saturates")
    device: str = setting("cpu", _DEVICE_HELP)

    def to_config(self) -> Any:
        """The stage's RerankConfig (None without a ``method``); QE's details without ``qe_top``
        are a NeedleInputError, not ignored."""
        if self.method is None:
            return None
        from rerank.ensemble import EnsembleConfig
        from rerank.expand import ExpansionConfig
        from rerank.glue import GlueConfig
        from rerank.matching import MatchConfig
        from rerank.rerank import RerankConfig

        expansion = None  # the token kind's own
        if self.qe_top is not None:
            given: dict[str, Any] = {"min_inliers": self.qe_min_inliers, "alpha": self.qe_alpha}
            expansion = ExpansionConfig(top=self.qe_top, **{k: v for k, v in given.items() if v is not None})
        elif self.qe_min_inliers is not None or self.qe_alpha is not None:
            raise NeedleInputError("--rerank-qe-min-inliers and --rerank-qe-alpha need --rerank-qe TOP")
        return RerankConfig(
            method=self.method,
            shortlist=self.shortlist,
            ensemble=EnsembleConfig(lam=self.lam, gamma=self.gamma, chamfer_weight=self.chamfer_weight),
            match=MatchConfig(max_distance=self.max_hamming, mutual=self.mutual, asymmetric=self.asymmetric),
            ames=self.ames,
            expansion=expansion,
            glue=GlueConfig(top=self.glue_top, weight=self.glue_weight, cap=self.glue_cap),
        )
