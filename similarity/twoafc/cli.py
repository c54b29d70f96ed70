"""``needle similarity 2afc ...``: make triplets from groups, train the context-sensitive ensemble,
evaluate models and ensembles, list the models. Building the parser imports no torch.

    needle similarity 2afc make-triplets --groups SRC --out triplets.csv
    needle similarity 2afc train-ensemble --triplets triplets.csv --out ens.pt      # on split val
    needle similarity 2afc eval --triplets triplets.csv --ensemble ens.pt           # on split test
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from similarity.twoafc.config import EnsembleConfig, EvalConfig
from similarity.twoafc.evaluation import evaluate
from similarity.twoafc.mining import TripletConfig, make_triplets
from similarity.twoafc.registry import DEFAULT_CONTEXT, DEFAULT_MODELS, MODELS, parse_models


def _cli_make(args: argparse.Namespace) -> int:
    conf = TripletConfig(
        seed=args.seed,
        val_fraction=args.val_fraction,
        max_pairs_per_group=args.max_pairs_per_group,
        random_distractors=args.random_distractors,
        other_groups=args.other_groups,
        hard=args.hard,
        hard_pool=args.hard_pool,
        hard_distractors=args.hard_distractors,
        miners=parse_models(args.miners),
    )
    distractors = None if args.distractors == "none" else args.distractors
    make_triplets(conf, Path(args.groups), Path(args.out), distractors, args.cache)
    return 0


def _cli_train(args: argparse.Namespace) -> int:
    from similarity.twoafc.ensemble import train_ensemble  # torch: only when training

    conf = EnsembleConfig(
        models=parse_models(args.models) if args.models else DEFAULT_MODELS,
        context_model=args.context_model,
        pca_dim=args.pca_dim,
        hidden=args.hidden,
        epochs=args.epochs,
        lr=args.lr,
        weight_decay=args.weight_decay,
        seed=args.seed,
        split=args.split,
        min_votes=args.min_votes,
    )
    train_ensemble(conf, Path(args.triplets), Path(args.out), args.cache)
    return 0


def _cli_eval(args: argparse.Namespace) -> int:
    conf = EvalConfig(
        models=parse_models(args.models) if args.models else None, split=args.split, min_votes=args.min_votes
    )
    out = evaluate(conf, Path(args.triplets), args.ensemble, args.out, args.cache)
    print(f"{'method':<24}{'2AFC %':>8}{'+-':>6}{'n':>7}")
    for method, s in out["methods"].items():
        print(f"{method:<24}{s['accuracy_pct']:>8.2f}{s['stderr_pct']:>6.2f}{s['n']:>7}")
    print(json.dumps(out))
    return 0


def _cli_models(args: argparse.Namespace) -> int:
    for name in sorted(MODELS):
        print(f"{name}{'  (default)' if name in DEFAULT_MODELS else ''}")
    return 0


def add_cli(methods: argparse._SubParsersAction) -> None:
    """The ``2afc`` subcommands of ``needle similarity``."""
    p = methods.add_parser(
        "2afc",
        help="2AFC triplets: make them from groups, evaluate similarity models, train a context-sensitive ensemble",
    )
    sub = p.add_subparsers(dest="twoafc_command", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--cache", help="directory caching each model's features per image file")

    m = sub.add_parser("make-triplets", help="triplets with a known answer from groups of images of one instance")
    m.add_argument("--groups", required=True, help="realbench-style directory (groups.csv) or folder of class folders")
    m.add_argument("--out", required=True, help="triplet CSV (ref,a,b,label,group,split,kind); a JSON lands beside it")
    m.add_argument(
        "--distractors",
        default="auto",
        help="'auto' (the source's distractors.csv if any), 'none', or a directory of distractor images",
    )
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--val-fraction", type=float, default=0.5, help="share of groups and distractors in split val")
    m.add_argument("--max-pairs-per-group", type=int, default=12)
    m.add_argument(
        "--random-distractors", type=int, default=1, help="triplets per (R, A) pair with a random distractor as B"
    )
    m.add_argument("--other-groups", type=int, default=1, help="... with a random image of another group as B")
    m.add_argument("--hard", type=int, default=1, help="... per miner, with B among the miner's nearest images to R")
    m.add_argument("--hard-pool", type=int, default=5, help="hard B's are drawn among this many nearest")
    m.add_argument("--hard-distractors", type=int, default=0, help="distractors per split the miners search (0: all)")
    m.add_argument(
        "--miners", default="tiny-32", help="comma-separated models that find hard B's (not ones you evaluate)"
    )
    common(m)
    m.set_defaults(func=_cli_make)

    t = sub.add_parser("train-ensemble", help="train the per-model regressors of the ensemble on validation triplets")
    t.add_argument("--triplets", required=True, help="triplet CSV (ours or NIGHTS' data.csv)")
    t.add_argument("--out", required=True, help="ensemble file (.pt); a JSON lands beside it")
    t.add_argument("--models", help=f"comma-separated similarity models (default: {','.join(DEFAULT_MODELS)})")
    t.add_argument("--context-model", default=DEFAULT_CONTEXT, help="model whose global descriptor of R is the context")
    t.add_argument("--pca-dim", type=int, default=64)
    t.add_argument("--hidden", type=int, default=32)
    t.add_argument("--epochs", type=int, default=300)
    t.add_argument("--lr", type=float, default=1e-2)
    t.add_argument("--weight-decay", type=float, default=1e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--split", default="auto", help="'auto' (val when the CSV has splits), 'all', or a split name")
    t.add_argument("--min-votes", type=int, default=0, help="NIGHTS: keep triplets with at least this many votes")
    common(t)
    t.set_defaults(func=_cli_train)

    e = sub.add_parser("eval", help="2AFC accuracy of each model, majority vote, and the ensemble if given")
    e.add_argument("--triplets", required=True, help="triplet CSV (ours or NIGHTS' data.csv)")
    e.add_argument("--ensemble", help="ensemble file from train-ensemble (its models are evaluated)")
    e.add_argument("--models", help=f"comma-separated similarity models (default: {','.join(DEFAULT_MODELS)})")
    e.add_argument("--split", default="auto", help="'auto' (test when the CSV has splits), 'all', or a split name")
    e.add_argument("--min-votes", type=int, default=0, help="NIGHTS: keep triplets with at least this many votes")
    e.add_argument("--out", help="write the report (JSON) here too")
    common(e)
    e.set_defaults(func=_cli_eval)

    s = sub.add_parser("models", help="list the similarity models")
    s.set_defaults(func=_cli_models)
