"""The settings of ingest's commands, torch-free so that ``needle ingest --help`` and ``needle pack
--help`` import no stage: the ingestion job's (cluster/ingest_job.py runs it over Ray actor
workers; the worker's own code is ingest.pipeline) and ``needle pack``'s (ingest/pack/). Their
flags are these fields (cli/flags.py), their help declared with each (core.settings). Also the
demo collection's (ingest/demo_data.py builds it), which ``needle demo``'s config holds."""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import NeedleInputError
from core.multiscale import check_scales_rotations
from core.settings import setting

DECODERS = ("auto", "pil", "pil-processes", "nvjpeg")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # the extractor's precisions (embed.extract)
# Member suffixes holding the image, in order of preference (img2dataset writes ``jpg``; ingest.reader).
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff")


@dataclass(frozen=True)
class IngestConfig:
    model: str = setting("tf_efficientnet_lite0.gem", "registry name (see `needle models`)")
    weights: str | None = setting(
        None,
        "Local weights file; None: the preset's packaged weights (an error where it has none); "
        '"pretrained": the published weights via timm/open_clip; "random": a seeded random initialisation '
        "of every model of the run, the local-token model too (tests and timing only).",
    )
    resolution: int | None = setting(None, "longer side of the resized images; None: the model's test resolution")
    batch_size: int = setting(32, "images per forward pass (same-size images are batched together)")
    precision: str = setting("auto", "auto | fp32 | bf16 | fp16 (auto: fp16 on GPU, the preset's choice on CPU)")
    num_workers: int | None = setting(None, "actors; None: one per GPU, else cluster CPUs // cpus_per_worker")
    cpus_per_worker: int = setting(2, "CPUs reserved by each CPU actor (its torch threads)")
    cpus_per_gpu_worker: int | None = setting(
        None,
        "CPUs reserved by each GPU actor, all decoding; None: its node's CPUs / GPUs",
    )
    decode_threads: int | None = setting(
        None,
        "decoding threads per worker; None: all its CPUs (on CPU they take turns with the model)",
    )
    chunk_size: int | None = setting(None, "images batched together per extractor call; None: 512 on GPU, 64 on CPU")
    decoder: str = setting(
        "auto",
        "auto: nvjpeg on GPU workers (measured 0.96-1.07 of the model's pace where PIL made 0.40-0.58, "
        "docs/gpu.md), PIL on CPU workers; pil: PIL on the decode threads; pil-processes: PIL in as many "
        "processes (each its own GIL); nvjpeg: JPEGs decoded on the GPU (GPU workers only; else PIL).",
    )
    shape_grid: int | None = setting(
        None,
        "Snap input sides to multiples of this many pixels, so a GPU sees a bounded set of shapes "
        "(embed/shape_plan.py); 0: exact shapes; None: the model's default (32; 0 for square towers).",
    )
    overwrite: bool = setting(False, "redo shards whose Parquet part is already committed")
    max_retries: int = setting(3, "times a shard is re-queued after its worker died or its read failed transiently")
    address: str | None = setting(
        None,
        "Ray cluster; None: $RAY_ADDRESS (set by `ray job submit`), else a new local instance",
    )
    s3_endpoint_url: str | None = setting(None, "S3-compatible endpoint for s3:// shards and outputs")
    locals: str | None = setting(
        None,
        "local-token preset (see `needle locals presets`, e.g. lite0-s16); None: globals only",
    )
    local_itq: str | None = setting(None, "ITQ projection .npz for the local codes; None: the preset's")
    local_top_k: int | None = setting(None, "tokens per image; None: the preset's (100 for database presets)")
    keep_local_desc: bool = setting(False, "also store float16 local descriptors (for train-itq, quality-first)")
    query_scales: tuple[float, ...] | None = setting(
        None,
        "Query-side multi-scale (ILIAS: (0.707, 1, 1.414)): the global descriptor is the mean over the "
        "scales; None: single scale. For ingesting query images only, never the database.",
    )
    query_rotations: int = setting(
        1,
        "query-side rotations averaged likewise: 1 (none), 2 or 4 quarter turns; query images only",
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


@dataclass(frozen=True)
class PackConfig:
    shard_size: int = setting(1000, "samples per tar")
    recursive: bool = setting(True, "walk sub-directories (False: only the directory's own files)")
    extensions: tuple[str, ...] = setting(
        IMAGE_SUFFIXES,
        "file extensions packed (case-insensitive); each one the reader takes",
    )
    follow_symlinks: bool = setting(
        False,
        "walk symlinked directories and read symlinked files (off: skipped, reported)",
    )
    full_check: bool = setting(
        False,
        "decode every image (JPEGs at 1/8 scale) to catch truncated files; off: headers only",
    )


@dataclass(frozen=True)
class DemoConfig:
    instances: tuple[str, ...] = (  # scikit-image photos that become instances (several views each)
        "astronaut",
        "chelsea",
        "coffee",
        "rocket",
        "stereo_motorcycle",
        "hubble_deep_field",
        "immunohistochemistry",
        "retina",
        "camera",
        "coins",
        "moon",
        "clock",
    )
    distractors: tuple[str, ...] = (  # photos whose views only ever appear as distractors
        "brick",
        "grass",
        "gravel",
        "page",
        "text",
        "colorwheel",
        "logo",
    )
    views_per_instance: int = 5  # views of each instance photo (each is a query in the demo eval)
    views_per_distractor: int = 4  # views of each distractor photo
    num_shards: int = 3  # tars the views are spread over
    longer_side: tuple[int, int] = (320, 560)  # range of the views' longer side in pixels
    jpeg_quality: int = 90
    seed: int = 0  # everything (views, order) is reproducible from this
