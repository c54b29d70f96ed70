"""``needle similarity afn features|train|eval``: the adaptation function's stages (features of a
pairs source to a file; a model fitted on every pair; aR@k of a model or of the split protocol) and
their command line. Building the parser imports no torch.

    needle similarity afn features --pairs SRC --out feats.npz [--distractors SRC]
    needle similarity afn train --pairs SRC --out model.pt [--sigma 15] [--epochs 150]
    needle similarity afn eval --pairs SRC [--model model.pt] [--splits 20] [--sigma 1 1.5 15]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from core.atomic import write_json_atomic
from similarity.afn.config import KS, AdaptationFunctionError, AfnConfig, EvalConfig, FeatureConfig
from similarity.afn.evaluation import evaluate_model, evaluate_splits
from similarity.afn.model import fit_afn, load_model, save_model
from similarity.afn.pair_features import pair_features_for, save_pair_features

log = logging.getLogger(__name__)


def features_main(
    conf: FeatureConfig, pairs: Path, output: Path, distractors: Path | None = None, device: str = "cpu"
) -> Path:
    """Extract the frozen features of a pairs source (and distractors) to ``output`` (.npz) + .json."""
    start = time.perf_counter()
    if Path(pairs).suffix == ".npz":
        raise AdaptationFunctionError(f"{pairs} already holds features; give the images' pairs source")
    feats = pair_features_for(pairs, conf, distractors, device)
    path = save_pair_features(feats, Path(output))
    write_json_atomic(
        {
            "stage": "afn features",
            "features": conf.record(),
            **feats.sources,
            "pairs_count": len(feats),
            "distractors_count": 0 if feats.distractors is None else len(feats.distractors),
            "dim": int(feats.left.shape[1]),
            "seconds": round(time.perf_counter() - start, 2),
        },
        path.with_name(path.name + ".json"),
    )
    log.info("afn features of %d pairs (D=%d) -> %s", len(feats), feats.left.shape[1], path)
    return path


def train_main(
    conf: AfnConfig, pairs: Path, output: Path, feature_conf: FeatureConfig | None = None, device: str = "cpu"
) -> Path:
    """Fit PCA + adaptation on every pair of ``pairs``; write the model ``output`` (.pt) + .json."""
    start = time.perf_counter()
    feats = pair_features_for(pairs, feature_conf, None, device)
    model, history = fit_afn(feats, conf)
    path = save_model(model, Path(output))
    write_json_atomic(
        {
            "stage": "afn train",
            "config": dataclasses.asdict(conf),
            "features": feats.feature_config,
            "pairs": str(pairs),
            "pairs_count": len(feats),
            "pca_dim": model.pca.dim,
            "hidden_dim": int(model.weight.shape[0]),
            "loss_history": [round(v, 5) for v in history],
            "seconds": round(time.perf_counter() - start, 2),
        },
        path.with_name(path.name + ".json"),
    )
    log.info(
        "afn model (PCA %d -> %d, sigma %g) from %d pairs -> %s",
        model.pca.dim,
        model.weight.shape[0],
        conf.sigma,
        len(feats),
        path,
    )
    return path


def eval_main(
    pairs: Path,
    output: Path | None = None,
    model_path: Path | None = None,
    conf: AfnConfig | None = None,
    eval_conf: EvalConfig | None = None,
    sigmas: tuple[float, ...] | None = None,
    feature_conf: FeatureConfig | None = None,
    distractors: Path | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """With ``model_path``: aR@k of that model on every pair. Without: the split protocol. The
    result is returned and, with ``output``, written as JSON. ``conf`` and ``eval_conf``: the
    defaults when None."""
    conf, eval_conf = conf or AfnConfig(), eval_conf or EvalConfig()
    model = load_model(model_path) if model_path is not None else None
    if model is not None and feature_conf is None and model.feature_config:
        rec = model.feature_config
        feature_conf = FeatureConfig(
            backbone=rec["backbone"], layers=tuple(rec["layers"]), resolution=int(rec["resolution"])
        )
    feats = pair_features_for(pairs, feature_conf, distractors, device)
    if model is not None:
        result = evaluate_model(model, feats, eval_conf.ks)
        result["protocol"]["model"] = str(model_path)
    else:
        result = evaluate_splits(feats, conf, eval_conf, sigmas)
    result["protocol"]["pairs_source"] = str(pairs)
    if output is not None:
        write_json_atomic(result, Path(output))
    return result


def _add_feature_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backbone", help=f"registry preset of the frozen backbone (default {FeatureConfig.backbone})")
    p.add_argument("--layers", nargs="+", help=f"stage outputs to pool (default {' '.join(FeatureConfig.layers)})")
    p.add_argument("--resolution", type=int, help=f"longer side of the images (default {FeatureConfig.resolution})")
    p.add_argument(
        "--extract-batch-size", type=int, help=f"images per forward pass (default {FeatureConfig.batch_size})"
    )
    p.add_argument("--device", default="cpu", help="torch device of the backbone")


def _add_train_args(p: argparse.ArgumentParser, sigma_many: bool = False) -> None:
    if sigma_many:
        p.add_argument(
            "--sigma",
            type=float,
            nargs="+",
            default=[AfnConfig.sigma],
            help="one or more sigmas: logits = sigma * cosine",
        )
    else:
        p.add_argument("--sigma", type=float, default=AfnConfig.sigma, help="logits = sigma * cosine")
    p.add_argument("--epochs", type=int, default=AfnConfig.epochs)
    p.add_argument("--lr", type=float, default=AfnConfig.lr)
    p.add_argument("--weight-decay", type=float, default=AfnConfig.weight_decay)
    p.add_argument("--pca-dim", type=int, default=AfnConfig.pca_dim)
    p.add_argument("--hidden-dim", type=int, default=AfnConfig.hidden_dim)
    p.add_argument("--batch-size", type=int, default=AfnConfig.batch_size, help="pairs per step; 0: full batch")
    p.add_argument("--seed", type=int, default=AfnConfig.seed)


def _feature_conf(args: argparse.Namespace) -> FeatureConfig | None:
    """The FeatureConfig the flags ask for, or None when no feature flag was given (then a feature
    file's or a model's own extraction settings apply, else the defaults)."""
    overrides = {
        "backbone": args.backbone,
        "layers": tuple(args.layers) if args.layers else None,
        "resolution": args.resolution,
        "batch_size": args.extract_batch_size,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return FeatureConfig(**overrides) if overrides else None


def _afn_conf(args: argparse.Namespace, sigma: float) -> AfnConfig:
    return AfnConfig(
        pca_dim=args.pca_dim,
        hidden_dim=args.hidden_dim,
        sigma=sigma,
        epochs=args.epochs,
        lr=args.lr,
        weight_decay=args.weight_decay,
        batch_size=args.batch_size,
        seed=args.seed,
    )


def _features(args: argparse.Namespace) -> int:
    features_main(
        _feature_conf(args) or FeatureConfig(),
        Path(args.pairs),
        Path(args.out),
        Path(args.distractors) if args.distractors else None,
        args.device,
    )
    return 0


def _train(args: argparse.Namespace) -> int:
    train_main(_afn_conf(args, args.sigma), Path(args.pairs), Path(args.out), _feature_conf(args), args.device)
    return 0


def _strip_values(obj: Any) -> Any:
    """The result without per-split value lists (for the terminal)."""
    if isinstance(obj, dict):
        return {k: _strip_values(v) for k, v in obj.items() if k != "values"}
    return obj


def _eval(args: argparse.Namespace) -> int:
    sigmas = tuple(args.sigma)
    result = eval_main(
        Path(args.pairs),
        Path(args.out) if args.out else None,
        Path(args.model) if args.model else None,
        _afn_conf(args, sigmas[0]),
        EvalConfig(splits=args.splits, test_fraction=args.test_fraction, ks=tuple(args.k), seed=args.seed),
        sigmas,
        _feature_conf(args),
        Path(args.distractors) if args.distractors else None,
        args.device,
    )
    print(json.dumps(_strip_values(result), indent=2))
    return 0


def add_cli(methods: argparse._SubParsersAction) -> None:
    """The ``afn`` subcommands of ``needle similarity``."""
    p = methods.add_parser("afn", help="adaptation function ReLU(W PCA(x)) on frozen multi-layer features (TLL pairs)")
    sub = p.add_subparsers(dest="afn_command", required=True)

    f = sub.add_parser("features", help="extract the frozen features of a pairs source to a .npz")
    f.add_argument(
        "--pairs",
        required=True,
        help="pairs CSV (left,right), TLL folder (left/, right/), realbench dir or class folders",
    )
    f.add_argument("--out", required=True, help="output .npz")
    f.add_argument("--distractors", help="realbench dir or folder of images added to both galleries at evaluation")
    _add_feature_args(f)
    f.set_defaults(func=_features)

    t = sub.add_parser("train", help="fit PCA + adaptation on every pair of a source")
    t.add_argument("--pairs", required=True, help="pairs source or a .npz from `afn features`")
    t.add_argument("--out", required=True, help="output model .pt")
    _add_train_args(t)
    _add_feature_args(t)
    t.set_defaults(func=_train)

    e = sub.add_parser("eval", help="aR@k: a trained model on every pair (--model), or the split protocol")
    e.add_argument("--pairs", required=True, help="pairs source or a .npz from `afn features`")
    e.add_argument("--model", help="a model from `afn train` (else: train and test on random splits)")
    e.add_argument("--splits", type=int, default=EvalConfig.splits, help="random splits (without --model)")
    e.add_argument("--test-fraction", type=float, default=EvalConfig.test_fraction)
    e.add_argument("--k", type=int, nargs="+", default=list(KS), help="aR@k cut-offs")
    e.add_argument("--distractors", help="realbench dir or folder of images added to both galleries")
    e.add_argument("--out", help="write the full result (with per-split values) to this JSON")
    _add_train_args(e, sigma_many=True)
    _add_feature_args(e)
    e.set_defaults(func=_eval)
