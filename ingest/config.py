"""The ingestion job's settings (cluster/ingest_job.py runs it over Ray actor workers; the
worker's own code is ingest.pipeline). ``needle ingest``'s flags are these fields."""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import NeedleInputError
from core.multiscale import check_scales_rotations

DECODERS = ("auto", "pil", "pil-processes", "nvjpeg")


@dataclass(frozen=True)
class IngestConfig:
    model: str = "tf_efficientnet_lite0.gem"  # registry name (see `needle models`)
    # Local weights file; None: the preset's packaged weights (an error where it has none); "pretrained":
    # the published weights via timm/open_clip; "random": a seeded random initialisation of every model
    # of the run, the local-token model too (tests and timing only).
    weights: str | None = None
    resolution: int | None = None  # longer side of the resized images; None: the model's test resolution
    batch_size: int = 32  # images per forward pass (same-size images are batched together)
    precision: str = "auto"  # auto | fp32 | bf16 | fp16 (auto: fp16 on GPU, the preset's choice on CPU)
    num_workers: int | None = None  # actors; None: one per GPU, else cluster CPUs // cpus_per_worker
    cpus_per_worker: int = 2  # CPUs reserved by each CPU actor (its torch threads)
    cpus_per_gpu_worker: int | None = (
        None  # CPUs reserved by each GPU actor, all decoding; None: its node's CPUs / GPUs
    )
    decode_threads: int | None = (
        None  # decoding threads per worker; None: all its CPUs (on CPU they take turns with the model)
    )
    chunk_size: int | None = None  # images batched together per extractor call; None: 512 on GPU, 64 on CPU
    # auto: nvjpeg on GPU workers (measured 0.96-1.07 of the model's pace where PIL made 0.40-0.58,
    # docs/gpu.md), PIL on CPU workers; pil: PIL on the decode threads; pil-processes: PIL in as many
    # processes (each its own GIL); nvjpeg: JPEGs decoded on the GPU (GPU workers only; else PIL).
    decoder: str = "auto"
    # Snap input sides to multiples of this many pixels, so a GPU sees a bounded set of shapes
    # (embed/shape_plan.py); 0: exact shapes; None: the model's default (32; 0 for square towers).
    shape_grid: int | None = None
    overwrite: bool = False  # redo shards whose Parquet part is already committed
    max_retries: int = 3  # times a shard is re-queued after its worker died or its read failed transiently
    address: str | None = None  # Ray cluster; None: $RAY_ADDRESS (set by `ray job submit`), else a new local instance
    s3_endpoint_url: str | None = None  # S3-compatible endpoint for s3:// shards and outputs
    locals: str | None = None  # local-token preset (see `needle locals presets`, e.g. lite0-s16); None: globals only
    local_itq: str | None = None  # ITQ projection .npz for the local codes; None: the preset's
    local_top_k: int | None = None  # tokens per image; None: the preset's (100 for database presets)
    keep_local_desc: bool = False  # also store float16 local descriptors (for train-itq, quality-first)
    # Query-side multi-scale (ILIAS: (0.707, 1, 1.414)): the global descriptor is the mean over the
    # scales; None: single scale. For ingesting query images only, never the database.
    query_scales: tuple[float, ...] | None = None
    query_rotations: int = (
        1  # query-side rotations averaged likewise: 1 (none), 2 or 4 quarter turns; query images only
    )

    def __post_init__(self) -> None:
        grid = self.shape_grid
        if grid is not None and (isinstance(grid, bool) or not isinstance(grid, int) or grid < 0):
            raise NeedleInputError(f"shape_grid must be 0 (exact shapes) or a positive number of pixels, got {grid!r}")
        if self.decoder not in DECODERS:
            raise NeedleInputError(f"unknown decoder {self.decoder!r}; choose from {DECODERS}")
        # Refuse bad query-side options here, in the driver: raised inside a Ray actor they would
        # look like a dead worker and be retried.
        if self.query_scales is not None or self.query_rotations != 1:
            scales, rotations = check_scales_rotations(
                (1.0,) if self.query_scales is None else self.query_scales, self.query_rotations
            )
            # A list (from JSON, say) as a tuple of floats: asdict() and resume checks see one form.
            object.__setattr__(self, "query_scales", None if self.query_scales is None else scales)
            object.__setattr__(self, "query_rotations", rotations)
