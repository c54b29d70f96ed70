"""``needle index build``'s settings, torch-free and FAISS-free so that ``needle index build
--help`` imports no stage: IndexConfig (index/build/stage.py builds with it), its flags the fields
(cli/flags.py), their help declared with each (core.settings)."""

from __future__ import annotations

from dataclasses import dataclass

from core.settings import setting

DEFAULT_QUANTIZER_EF = 128  # HNSW coarse quantizer depth (index/build/train.py)


@dataclass(frozen=True)
class IndexConfig:
    kind: str = setting("auto", "auto | flat | ivfpq (auto: flat below flat_threshold vectors when it fits)")
    memory_budget: str = setting(
        "8GB",
        "RAM the built index may use (codes, ids, centroids); refine vectors are memory-mapped",
    )
    factory: str | None = setting(None, 'a FAISS factory string to use as is (e.g. "IVF4096,PQ64"); None: choose')
    flat_threshold: int = setting(100_000, 'under "auto", collections smaller than this get an exact index')
    nlist: int | None = setting(None, "IVF lists; None: ~4*sqrt(N)")
    pq_bytes: int | None = setting(None, "PQ code bytes per vector; None: the largest that fits the budget")
    points_per_list: int = setting(64, "training sample = nlist * this, capped by the budget")
    s3_endpoint_url: str | None = setting(None, "S3-compatible endpoint for s3:// descriptor sources")
    shards: int = setting(1, "keep this many index shards (served by one Ray actor each) instead of one index")
    parts: int | None = setting(None, "parallel add tasks; None: shards (at least 1)")
    nprobe: int = setting(64, "default IVF lists visited per query (recorded; queries may override)")
    adapt: str | None = setting(
        None,
        "adapter file (needle adapt train, or ILIAS's): index adapted descriptors; None: as ingested",
    )
    refine_factor: int = setting(2, "IVF-PQ shortlist = refine_factor * k, re-scored exactly from float16")
    quantizer_ef: int = setting(
        DEFAULT_QUANTIZER_EF,
        "HNSW coarse quantizer: graph candidates explored per assignment (FAISS's default 16 puts some "
        "vectors in a list far from them, where no query probes: recall@1000 capped at 0.986 on 1M)",
    )
    recall_target: float | None = setting(
        0.95,
        "choose the served nprobe and refine factor as the cheapest reaching this recall@k on a sample of the "
        "index's own rows against exact answers (IVF-PQ only; None or 0, or --nprobe or --refine-factor set to "
        "other than their defaults: those served as given)",
    )
    recall_ks: tuple[int, ...] = setting((10, 1000), "the k at which --recall-target must hold (comma-separated)")
    tune_queries: int = setting(200, "rows of the index searched as queries to choose the search defaults")
    seed: int = setting(0, "training sample and k-means seed")
    locals: bool = setting(True, "build the local store when the descriptors carry local tokens (schema v2)")
