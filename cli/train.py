"""``needle adapt`` (train, whiten, make-classes) and ``needle ames train``: the commands that learn
something from descriptors or images. Handlers import the stages (torch); parsing does not."""

from __future__ import annotations

import argparse
from pathlib import Path

from cli.flags import add_config_flags, config_from_args
from embed import WHITEN_METHODS, AdaptConfig, AugmentConfig, WhitenConfig
from rerank.config import TrainConfig


def _adapt_train(args: argparse.Namespace) -> int:
    from embed.adapt import main

    main(config_from_args(AdaptConfig, args), Path(args.descriptors), Path(args.labels), Path(args.out))
    return 0


def _adapt_whiten(args: argparse.Namespace) -> int:
    from embed.whiten import main

    main(
        config_from_args(WhitenConfig, args),
        Path(args.descriptors),
        Path(args.labels) if args.labels else None,
        Path(args.out),
    )
    return 0


def _adapt_make_classes(args: argparse.Namespace) -> int:
    from embed.augment import main

    main(config_from_args(AugmentConfig, args), Path(args.images), Path(args.out))
    return 0


def _ames_train(args: argparse.Namespace) -> int:
    from cluster.ingest_job import make_local_extractor
    from ingest.config import IngestConfig
    from rerank.ames_train import main

    extractor = make_local_extractor(IngestConfig(locals=args.locals, local_itq=args.local_itq))
    main(
        config_from_args(TrainConfig, args),
        Path(args.images),
        Path(args.out),
        describe=extractor.tokens_of_any_size,
        projection=extractor.itq.proj,
    )
    return 0


def add_train_parsers(sub: argparse._SubParsersAction) -> None:
    """adapt {train, whiten, make-classes}, ames {train}."""
    p = sub.add_parser("adapt", help="adaptation of global descriptors")
    dsub = p.add_subparsers(dest="adapt_command", required=True)
    t = dsub.add_parser(
        "train", help="the ILIAS linear adaptation: Linear + L2 trained with a normalised softmax over labels"
    )
    t.add_argument("--descriptors", required=True, help="descriptor directory (Parquet)")
    t.add_argument("--labels", required=True, help="CSV or Parquet with columns key,label[,domain]")
    t.add_argument("--out", required=True, help="adapter file to write (state dict weight, bias)")
    add_config_flags(t, AdaptConfig, only=("out_dim", "epochs", "seed"), overrides={"out_dim": {"flag": "--dim"}})
    t.set_defaults(func=_adapt_train)

    t = dsub.add_parser(
        "whiten", help="PCA whitening (unsupervised) or whitening learned from same-label pairs (Radenović et al.)"
    )
    t.add_argument("--descriptors", required=True, help="descriptor directory (Parquet)")
    t.add_argument(
        "--labels",
        help="CSV or Parquet key,label: required for learned; for pca, fit on these rows only (default: every ok row)",
    )
    t.add_argument(
        "--out", required=True, help="adapter file to write (state dict weight, bias), usable by index build --adapt"
    )
    add_config_flags(
        t,
        WhitenConfig,
        overrides={
            "method": {"choices": WHITEN_METHODS},
            "out_dim": {"flag": "--dim"},
        },
    )
    t.set_defaults(func=_adapt_whiten)

    t = dsub.add_parser(
        "make-classes",
        help="training classes from unlabelled images: each image a class of augmented "
        "views (WebDataset tars and labels.csv for ingest and adapt train/whiten)",
    )
    t.add_argument(
        "--images",
        required=True,
        help="directory of images (e.g. distractors; never the benchmark's queries or positives)",
    )
    t.add_argument("--out", required=True, help="output directory: classes-*.tar, labels.csv, augment_info.json")
    add_config_flags(t, AugmentConfig, only=("views", "max_side", "seed"))
    t.set_defaults(func=_adapt_make_classes)

    p = sub.add_parser("ames", help="AMES re-ranking model commands")
    asub = p.add_subparsers(dest="ames_command", required=True)
    t = asub.add_parser(
        "train", help="train AMES on pairs made from unlabelled images (random homographies, photometric changes)"
    )
    t.add_argument("--images", required=True, help="directory of images (e.g. distractors; never your test queries)")
    t.add_argument("--out", required=True, help="checkpoint file (.pt) or directory")
    # The images are described as the index's were: a local-token preset (IngestConfig.locals), here with a default.
    t.add_argument("--locals", default="lite0-s16", help="local-token preset describing the images (the index's)")
    t.add_argument("--local-itq", help="ITQ projection (default: the preset's)")
    add_config_flags(t, TrainConfig, only=("pairs", "epochs", "layers", "seed"))
    t.set_defaults(func=_ames_train)
