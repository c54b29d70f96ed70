"""``needle similarity adaptors train|eval``: train adaptors and their fusion on unlabelled images,
evaluate them on labelled classes. Building the parser imports no torch."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from similarity.adaptors.config import DEFAULT_BACKBONE, AdaptorsConfig, parse_ints


def _train(args: argparse.Namespace) -> int:
    from similarity.adaptors.training import train_main  # torch: only when training

    conf = AdaptorsConfig(
        backbone=args.backbone,
        weights=args.weights,
        stages=parse_ints(args.stages, "--stages") if args.stages else None,
        granularities=parse_ints(args.granularities, "--granularities"),
        reduction=args.reduction,
        resolution=args.resolution,
        epochs=args.epochs,
        fusion_epochs=args.fusion_epochs,
        batch_size=args.batch_size,
        max_images=args.max_images,
        seed=args.seed,
    )
    train_main(conf, Path(args.images), Path(args.out))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from core.atomic import write_json_atomic
    from similarity.adaptors.evaluation import evaluate  # torch: only when evaluating

    result = evaluate(
        Path(args.classes),
        Path(args.model) if args.model else None,
        args.backbone,
        args.weights,
        args.resolution,
        args.min_size,
    )
    if args.out:
        write_json_atomic(result, Path(args.out))
    print(json.dumps(result, indent=2))
    return 0


def add_cli(methods: argparse._SubParsersAction) -> None:
    """The ``adaptors`` subcommands of ``needle similarity``."""
    p = methods.add_parser(
        "adaptors", help="granularity-aware adaptors with attention fusion on a frozen backbone (GrAPPA)"
    )
    sub = p.add_subparsers(dest="adaptors_command", required=True)
    t = sub.add_parser(
        "train", help="train one adaptor set per pseudo-granularity (k-means of frozen features), then their fusion"
    )
    t.add_argument(
        "--images",
        required=True,
        help="unlabelled images: a directory, or a realbench directory (its distractors only)",
    )
    t.add_argument("--out", required=True, help="adaptors file to write (.pt), with a .json beside it")
    t.add_argument("--granularities", default="8,32,128", help="k-means cluster counts, one adaptor set each")
    t.add_argument("--backbone", default=DEFAULT_BACKBONE, help="registry model kept frozen (needle models)")
    t.add_argument("--weights", help="local weights file for the backbone (default: the preset's)")
    t.add_argument(
        "--stages", help="backbone block indices followed by adaptors, e.g. 5,6 (default: ViT all, CNN the last two)"
    )
    t.add_argument("--reduction", type=int, default=4, help="adaptor bottleneck = channels // reduction")
    t.add_argument("--resolution", type=int, default=224, help="side of the square training crops")
    t.add_argument("--epochs", type=int, default=4, help="epochs per adaptor set")
    t.add_argument("--fusion-epochs", type=int, default=4, help="epochs of fusion training")
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--max-images", type=int, help="train on a seeded sample of this many images")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_train)
    e = sub.add_parser("eval", help="MAP@R and R-Precision on labelled classes: frozen, each single adaptor, fused")
    e.add_argument("--classes", required=True, help="realbench directory (groups.csv) or a folder of class folders")
    e.add_argument("--model", help="adaptors file from 'train' (default: the frozen backbone only)")
    e.add_argument("--backbone", default=DEFAULT_BACKBONE, help="without --model: the registry model to evaluate")
    e.add_argument("--weights", help="without --model: local weights file for the backbone")
    e.add_argument("--resolution", type=int, default=224, help="longer side of the evaluation images")
    e.add_argument("--min-size", type=int, default=2, help="classes with fewer images are left out")
    e.add_argument("--out", help="also write the metrics JSON here")
    e.set_defaults(func=_eval)
