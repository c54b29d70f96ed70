"""``needle similarity ffa eval|embed``: the grouped measures of FFA descriptors of a source, or the
descriptors themselves. Building the parser imports no torch."""

from __future__ import annotations

import argparse

from similarity.ffa.config import MASKS, MODES, POOLINGS, FFAConfig
from similarity.ffa.stages import embed_main, eval_main


def _ffa_config(args: argparse.Namespace) -> FFAConfig:
    return FFAConfig(
        model=args.model,
        resolution=args.resolution,
        feature_stage=args.stage,
        mask=args.mask,
        mode=args.mode,
        pooling=args.pooling,
        gem_p=args.gem_p,
        norm_fraction=args.norm_fraction,
        pca_threshold=args.pca_threshold,
        min_tokens=args.min_tokens,
        crop_margin=args.crop_margin,
    )


def _eval(args: argparse.Namespace) -> int:
    from eval.groups import GroupEvalConfig

    eval_conf = GroupEvalConfig(seed=args.seed, max_pairs=args.max_pairs, odd_trials=args.odd_trials)
    eval_main(_ffa_config(args), eval_conf, args.groups, args.out, args.distractors, args.weights)
    return 0


def _embed(args: argparse.Namespace) -> int:
    embed_main(_ffa_config(args), args.groups, args.out, args.distractors, args.seed, args.weights)
    return 0


def _add_common(p: argparse.ArgumentParser) -> None:
    d = FFAConfig()
    p.add_argument(
        "--groups", required=True, help="realbench-style directory (groups.csv) or a folder of class folders"
    )
    p.add_argument("--out", required=True, help="output file")
    p.add_argument("--mask", choices=MASKS, default=d.mask, help="foreground signal (none: the whole-image baseline)")
    p.add_argument(
        "--mode", choices=MODES, default=d.mode, help="pool foreground tokens, or crop to the foreground and re-extract"
    )
    p.add_argument("--pooling", choices=POOLINGS, default=d.pooling)
    p.add_argument("--gem-p", type=float, default=d.gem_p)
    p.add_argument("--model", default=d.model, help="registry model (a timm CNN)")
    p.add_argument("--weights", help="local weights file (default: the preset's)")
    p.add_argument("--resolution", type=int, default=d.resolution, help="longer side of images and crops")
    p.add_argument(
        "--stage", type=int, default=None, help="tokens from this block's output (default: the last feature map)"
    )
    p.add_argument("--norm-fraction", type=float, default=d.norm_fraction, help="mask norm: share of tokens kept")
    p.add_argument(
        "--pca-threshold", type=float, default=d.pca_threshold, help="mask pca: threshold in std above the mean"
    )
    p.add_argument("--min-tokens", type=int, default=d.min_tokens, help="smaller masks fall back to every token")
    p.add_argument("--crop-margin", type=int, default=d.crop_margin, help="crop-img: cells added around the box")
    p.add_argument(
        "--distractors", type=int, default=0, help="add this many realbench distractors (seeded), each its own group"
    )
    p.add_argument("--seed", type=int, default=0)


def add_cli(methods: argparse._SubParsersAction) -> None:
    """The ``ffa`` subcommands of ``needle similarity``."""
    p = methods.add_parser(
        "ffa", help="foreground feature averaging: pool only foreground tokens of a frozen feature map"
    )
    sub = p.add_subparsers(dest="ffa_command", required=True)
    e = sub.add_parser("eval", help="top-1 / mAP within groups, K=2 k-means ARI, odd-one-out of FFA descriptors")
    _add_common(e)
    e.add_argument(
        "--max-pairs", type=int, default=2000, help="group pairs clustered for the ARI (seeded sample beyond)"
    )
    e.add_argument("--odd-trials", type=int, default=1000, help="odd-one-out trials")
    e.set_defaults(func=_eval)
    m = sub.add_parser("embed", help="write FFA descriptors (.npz with descriptors, paths, labels)")
    _add_common(m)
    m.set_defaults(func=_embed)
