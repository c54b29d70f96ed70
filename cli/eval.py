"""``needle eval map`` (mAP@k of an index against a ground truth), ``needle eval scaling`` (the
distractor-scaling study) and ``needle eval plot`` (scaling runs overlaid). Handlers import the
stages; parsing imports no torch."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cli.flags import add_config_flags, config_from_args
from cli.search import add_file_flags, add_rerank_flags, rerank_device
from cli.spec_flags import query_files, rerank_options
from eval.config import EvalConfig, ScalingConfig

# `needle eval scaling`'s --sizes: up to a million distractors (ScalingConfig's own default goes on to 100M).
CLI_SCALING_SIZES = (0, 100, 300, 1_000, 3_000, 10_000, 30_000, 100_000, 300_000, 1_000_000)


def _eval_map(args: argparse.Namespace) -> int:
    from eval.evaluate import main

    options = rerank_options(args)
    conf = config_from_args(EvalConfig, args, rerank=options.to_config(), files=query_files(args))
    out = main(conf, Path(args.index), Path(args.ground_truth), Path(args.out), rerank_device(options))
    report = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in report.items() if k != "per_query"}, indent=2))
    return 0


def _eval_scaling(args: argparse.Namespace) -> int:
    from eval.scaling import main

    out = main(
        config_from_args(ScalingConfig, args),
        [Path(d) for d in args.descriptors],
        Path(args.ground_truth),
        Path(args.out),
    )
    result = json.loads(out.read_text())
    for p in result["points"]:
        print(json.dumps({k: p[k] for k in ("mode", "distractors", "database_size", "map", "search_ms_per_query")}))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def _eval_plot(args: argparse.Namespace) -> int:
    from eval.scaling import load_runs, plot_runs

    print(plot_runs(load_runs([Path(r) for r in args.runs]), Path(args.out)))
    return 0


def add_eval_parsers(sub: argparse._SubParsersAction) -> None:
    """eval {map, scaling, plot}."""
    p = sub.add_parser(
        "eval",
        help="evaluation: `eval map`: mAP@k (ILIAS protocol) of an index against a ground "
        "truth; `eval scaling`: the distractor-scaling study; `eval plot`: overlay scaling runs",
    )
    esub = p.add_subparsers(dest="eval_command", metavar="{map,scaling,plot}", required=True)

    t = esub.add_parser("map", help="mAP@k (ILIAS protocol) of an index against a ground truth: a JSON report")
    t.add_argument("--index", required=True, help="index directory")
    t.add_argument(
        "--ground-truth", required=True, help="ground-truth JSON, or an ILIAS dataset directory (image_ids/...)"
    )
    t.add_argument("--out", required=True, help="JSON report to write")
    add_config_flags(t, EvalConfig, skip=("batch",), overrides={"qe_top": {"flag": "--qe"}})
    add_file_flags(t)
    add_rerank_flags(t)
    t.set_defaults(func=_eval_map)

    t = esub.add_parser(
        "scaling", help="mAP@k as distractors grow: nested subsets, exact / IVF-PQ / re-ranked; JSON + PNG"
    )
    t.add_argument(
        "--descriptors", required=True, nargs="+", help="descriptor directories of the database (core and distractors)"
    )
    t.add_argument(
        "--ground-truth",
        required=True,
        help="ground-truth JSON (optionally with a 'distractors' list) or an ILIAS dataset directory",
    )
    t.add_argument("--out", required=True, help="directory for scaling.json and scaling.png")
    add_config_flags(
        t,
        ScalingConfig,
        overrides={
            "sizes": {"default": CLI_SCALING_SIZES},
            "order": {"choices": ("file", "shuffle")},
        },
    )
    t.set_defaults(func=_eval_scaling)

    t = esub.add_parser("plot", help="overlay scaling runs (one line per model and mode) in one PNG")
    t.add_argument("runs", nargs="+", help="scaling.json files")
    t.add_argument("--out", required=True, help="PNG to write")
    t.set_defaults(func=_eval_plot)
