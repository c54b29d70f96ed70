"""``needle ingest``, ``pack``, ``locals``, ``index``, ``models`` and ``demo``: the commands that
build a collection (tars, descriptors, local-token projections, indexes). Each parses its flags
into the stage's frozen config (cli.flags) and calls the stage's ``main``; stage modules
are imported inside the handlers, so that parsing imports no torch."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from cli.flags import add_config_flags, config_from_args
from cli.live import add_live_parsers
from cluster.demo import DemoRunConfig
from core.errors import NeedleInputError
from core.multiscale import ROTATIONS
from core.storage import path_or_url
from embed import TrainITQConfig
from index.build.config import IndexConfig
from ingest.config import DECODERS, PRECISIONS, IngestConfig, PackConfig

log = logging.getLogger("needle")


def _ingest(args: argparse.Namespace) -> int:
    from cluster.ingest_job import IngestFailed, main

    # The published weights, fetched through timm/open_clip, or a seeded random initialisation
    # (embed.registry.PRETRAINED, RANDOM).
    asked = [
        flag
        for flag, on in (
            ("--weights", args.weights),
            ("--pretrained", args.pretrained),
            ("--random-init", args.random_init),
        )
        if on
    ]
    if len(asked) > 1:
        print(f"error: give one of {', '.join(asked)}, not several", file=sys.stderr)
        return 2
    weights = "pretrained" if args.pretrained else "random" if args.random_init else args.weights
    conf = config_from_args(IngestConfig, args, weights=weights, overwrite=args.overwrite and not args.resume)
    if args.submit:  # the flags are checked here (above) before the cluster runs them
        return _submit_ingest(args.submit, sys.argv[1:])
    try:
        main(conf, args.shards, Path(args.out))
    except IngestFailed as exc:
        log.error("%s", exc)
        return 1
    return 0


def submitted_command(argv: list[str]) -> list[str]:
    """The command ``needle <argv>`` less its ``--submit ADDRESS``: what a ``needle ingest
    --submit`` job runs on the cluster, every other flag as given."""
    command, rest = ["needle"], iter(argv)
    for arg in rest:
        option = arg.split("=", 1)[0]
        # argparse also takes an unambiguous prefix of the flag ("--sub"; "--s" could be --shards)
        if option.startswith("--su") and "--submit".startswith(option):
            if "=" not in arg:
                next(rest, None)  # its ADDRESS
            continue
        command.append(arg)
    return command


def _submit_ingest(address: str, argv: list[str]) -> int:
    """Run ``needle <argv>`` less ``--submit`` as a Ray job at ``address``, its logs on stdout;
    0 when it succeeds."""
    from cluster.local_ray import JobSubmitError, RayHeadError, submit_job

    command = submitted_command(argv)
    if len(command) == len(argv) + 1:
        # Called in-process (cli.main.main(argv)) with another command line than this process's.
        raise NeedleInputError(f"--submit {address}: this process's arguments {argv} hold no --submit to remove")
    try:
        outcome = submit_job(address, command)
    except (JobSubmitError, RayHeadError) as exc:
        log.error("%s", exc)
        return 1
    if not outcome.ok:
        log.error("ingest job %s at %s ended %s: %s", outcome.submission_id, address, outcome.status, outcome.message)
        return 1
    log.info("ingest job %s at %s succeeded", outcome.submission_id, address)
    return 0


def _pack(args: argparse.Namespace) -> int:
    from ingest.pack import main

    main(config_from_args(PackConfig, args), Path(args.source), Path(args.out))
    return 0


def _train_itq(args: argparse.Namespace) -> int:
    from embed.train_itq import main

    main(config_from_args(TrainITQConfig, args), Path(args.descriptors), Path(args.out))
    return 0


def _local_presets(args: argparse.Namespace) -> int:
    from embed.locals.presets import LOCAL_PRESETS

    for name, conf in sorted(LOCAL_PRESETS.items()):
        scales = "/".join(f"{s:g}" for s in conf.scales)
        print(
            f"{name:20s} {conf.kind:9s} {conf.resolution:4d}px scales {scales:14s} top-{conf.top_k}"
            f"{' per scale' if conf.per_scale else '':10s} itq {conf.itq or '(give --local-itq)'}"
        )
    return 0


def _index_build(args: argparse.Namespace) -> int:
    conf = config_from_args(IndexConfig, args, **({"kind": "flat"} if args.exact else {}))
    if args.ray:
        from cluster.index_job import main

        main(conf, args.descriptors, path_or_url(args.out), args.address)
    else:
        from index.build.stage import main

        main(conf, args.descriptors, path_or_url(args.out))
    return 0


def _models(args: argparse.Namespace) -> int:
    from embed.registry import MODELS, describe

    print(f"{'name':34s} {'library':9s} {'train':>5s} {'test':>5s} {'pooling':7s} {'dim':>5s}  description")
    for name in sorted(MODELS):
        record = describe(name)
        dim = str(record["dim"]) if record.get("dim") else "?"
        print(
            f"{name:34s} {record['library']:9s} {record['train_resolution']:5d} {record['resolution']:5d} "
            f"{record['pooling']:7s} {dim:>5s}  {record['description']}"
        )
    print("\nAny other model: 'timm:<name>[@gem|cls|head]' or 'open_clip:<arch>[/<tag>]'.")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from cluster.demo import main

    main(config_from_args(DemoRunConfig, args), Path(args.workdir))
    return 0


def add_build_parsers(sub: argparse._SubParsersAction) -> None:
    """ingest, pack, locals {train-itq, presets}, index build."""
    p = sub.add_parser("ingest", help="describe the images of WebDataset tars (Ray job), one Parquet per tar")
    p.add_argument("--shards", nargs="+", required=True, help="tar paths, globs or brace patterns, local or s3://")
    p.add_argument("--out", required=True, help="output directory or s3:// prefix of Parquet files")
    add_config_flags(
        p,
        IngestConfig,
        overrides={
            "precision": {"choices": PRECISIONS},
            "num_workers": {"flag": "--workers"},
            "decoder": {"choices": DECODERS},
            "query_scales": {"flag": "--multiscale", "metavar": "S1,S2,..."},
            "query_rotations": {"flag": "--rotations", "choices": ROTATIONS},
        },
    )
    p.add_argument(
        "--pretrained",
        action="store_true",
        help="fetch the model's published weights through timm/open_clip (needs the network or their cache)",
    )
    p.add_argument(
        "--random-init",
        action="store_true",
        help="a seeded random initialisation of every model (tests and timing only; recorded, queries rebuild it)",
    )
    p.add_argument("--resume", action="store_true", help="skip committed shards (the default; overrides --overwrite)")
    p.add_argument(
        "--submit",
        metavar="ADDRESS",
        help="run this command as a Ray job on the cluster whose dashboard is ADDRESS (e.g. http://127.0.0.1:8265) "
        "instead of here: the same flags less --submit, its logs followed here; exit 0 when the job succeeds, "
        "1 naming its id and status otherwise. Paths are read on the cluster (give absolute paths or s3://); "
        "its token: $RAY_AUTH_TOKEN",
    )
    p.set_defaults(func=_ingest)

    p = sub.add_parser(
        "pack", help="a folder of images (or a list of image files) as WebDataset tars for needle ingest"
    )
    p.add_argument("source", help="directory of images (walked recursively), or a text file of image paths, one a line")
    p.add_argument("--out", required=True, help="output directory: 000000.tar, 000001.tar, ... and pack_info.json")
    add_config_flags(p, PackConfig)
    p.set_defaults(func=_pack)

    p = sub.add_parser("locals", help="local-descriptor commands")
    lsub = p.add_subparsers(dest="locals_command", required=True)
    t = lsub.add_parser(
        "train-itq", help="learn the 128-bit ITQ projection from descriptors kept with --keep-local-desc"
    )
    t.add_argument("--descriptors", required=True, help="descriptor directory or Parquet file")
    t.add_argument("--out", required=True, help=".npz file to write (keys proj, mean)")
    add_config_flags(t, TrainITQConfig)
    t.set_defaults(func=_train_itq)
    t = lsub.add_parser("presets", help="list the local-token presets")
    t.set_defaults(func=_local_presets)

    p = sub.add_parser("index", help="index commands")
    isub = p.add_subparsers(dest="index_command", required=True)
    b = isub.add_parser("build", help="build a FAISS index over descriptor Parquet files, within a memory budget")
    b.add_argument(
        "--descriptors", required=True, nargs="+", help="directories, files or s3:// prefixes of descriptor Parquet"
    )
    b.add_argument(
        "--out", required=True, help="index directory to write, or an s3:// prefix (one task per shard uploads it)"
    )
    add_config_flags(
        b,
        IndexConfig,
        skip=("flat_threshold", "seed", "locals"),
        overrides={"kind": {"choices": ("auto", "flat", "ivfpq")}},
    )
    b.add_argument("--exact", action="store_true", help="an exact flat index (the ILIAS baseline)")
    b.add_argument("--ray", action="store_true", help="run the add parts as Ray tasks")
    b.add_argument("--address", help="Ray cluster (default: $RAY_ADDRESS, else a local instance)")
    b.set_defaults(func=_index_build)
    add_live_parsers(isub)  # add, delete, compact


def add_tool_parsers(sub: argparse._SubParsersAction) -> None:
    """demo, models."""
    p = sub.add_parser("demo", help="the whole pipeline on the built-in demo collection (local Ray)")
    p.add_argument("--workdir", default="demo_run", help="where the demo data and outputs go")
    add_config_flags(p, DemoRunConfig, only=("num_cpus", "address"))
    p.set_defaults(func=_demo)

    p = sub.add_parser("models", help="list the model presets (train/test resolution, pooling, dim)")
    p.set_defaults(func=_models)
