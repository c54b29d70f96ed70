"""``needle query`` and ``needle serve``, and the flags they share with ``needle eval map``: the
re-ranking settings (RerankConfig, EnsembleConfig, MatchConfig) and the files given in place of
those an index records (QueryFiles). Handlers import the stages; parsing imports no torch."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from cli.flags import add_config_flags, config_from_args, source_constant

log = logging.getLogger("needle")


def add_rerank_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("re-ranking with local tokens (index built from --locals descriptors)")
    add_config_flags(
        g,
        "rerank.rerank:RerankConfig",
        only=("method", "shortlist", "ames"),
        overrides={
            "method": {
                "flag": "--rerank",
                "default": None,
                "choices": source_constant("rerank.ensemble:METHODS"),
                "help": "re-rank the global shortlist: spatial verification, Chamfer or AMES",
            },
        },
    )
    add_config_flags(
        g,
        "rerank.ensemble:EnsembleConfig",
        only=("lam", "gamma", "chamfer_weight"),
        overrides={
            "lam": {"flag": "--rerank-lambda"},
            "gamma": {"flag": "--rerank-gamma"},
            "chamfer_weight": {"flag": "--rerank-chamfer"},
        },
    )
    add_config_flags(g, "rerank.matching:MatchConfig", overrides={"max_distance": {"flag": "--max-hamming"}})
    add_config_flags(
        g,
        "rerank.expand:ExpansionConfig",
        overrides={
            "top": {
                "flag": "--rerank-qe",
                "default": None,
                "metavar": "TOP",
                "help": "α-QE after SP: average the query with the re-ranked top TOP results that have "
                "--rerank-qe-min-inliers inliers, then score the shortlist again (0: none; default: the "
                "index's token kind's own, embed.locals.presets.RERANK_BY_KIND)",
            },
            "min_inliers": {"flag": "--rerank-qe-min-inliers", "default": None},
            "alpha": {"flag": "--rerank-qe-alpha", "default": None},
        },
    )
    add_config_flags(
        g,
        "rerank.glue:GlueConfig",
        only=("top", "weight", "cap"),
        overrides={
            "top": {
                "flag": "--glue-top",
                "metavar": "N",
                "help": "verify the top N of the re-ranked order again with LightGlue (its ALIKED weights, "
                "descriptors rebuilt from the stored codes; rerank/glue.py) and order them among themselves; "
                "0: no second stage",
            },
            "weight": {"flag": "--glue-weight"},
            "cap": {"flag": "--glue-cap"},
        },
    )
    g.add_argument(
        "--device",
        choices=source_constant("rerank.device:DEVICES"),
        default="cpu",
        help="where this process re-ranks (the AMES model, Hamming matching, spatial verification's "
        "tables): cpu (default), cuda (an error without a CUDA GPU), auto (cuda where torch sees one)",
    )


def rerank_device(args: argparse.Namespace) -> str:
    """``--device``, checked before any index loads: "cuda" without a GPU is a NeedleInputError
    naming the flag (never a silent CPU). With --ray-shards the shard actors re-rank on their own
    CPUs (this process only merges), so "cuda" is refused there and "auto" warned about."""
    device = args.device
    if getattr(args, "ray_shards", False) and args.rerank and device != "cpu":
        from core.errors import NeedleInputError

        if device == "cuda":
            raise NeedleInputError(
                "--device cuda with --ray-shards: the shard actors re-rank on their own CPUs; drop one of them"
            )
        log.warning("--device %s with --ray-shards: the shard actors re-rank on their CPUs", device)
        return device
    if not getattr(args, "ray", False):  # --ray: each Serve replica checks its own
        from rerank.device import resolve_device

        resolve_device(device)
    return device


def rerank_config(args: argparse.Namespace):
    """The re-ranking flags as a RerankConfig (None without --rerank)."""
    if not args.rerank:
        return None
    from core.errors import NeedleInputError
    from rerank.ensemble import EnsembleConfig
    from rerank.expand import ExpansionConfig
    from rerank.glue import GlueConfig
    from rerank.matching import MatchConfig
    from rerank.rerank import RerankConfig

    expansion = None  # the token kind's own
    if args.rerank_qe is not None:
        expansion = config_from_args(ExpansionConfig, args)
    elif args.rerank_qe_min_inliers is not None or args.rerank_qe_alpha is not None:
        raise NeedleInputError("--rerank-qe-min-inliers and --rerank-qe-alpha need --rerank-qe TOP")
    return config_from_args(
        RerankConfig,
        args,
        ensemble=config_from_args(EnsembleConfig, args),
        match=config_from_args(MatchConfig, args),
        expansion=expansion,
        glue=config_from_args(GlueConfig, args),
    )


def add_file_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("files the index was built with, when not at their recorded paths (same SHA-256 required)")
    add_config_flags(g, "query.recorded:QueryFiles")


def query_files(args: argparse.Namespace):
    from query.recorded import QueryFiles

    return config_from_args(QueryFiles, args)


def _query(args: argparse.Namespace) -> int:
    from cluster.serve import open_index
    from query.retrieve import QueryConfig, read_text_queries
    from query.stage import QueryInputs, answer, main

    # Bad text-query files fail before the index loads.
    text_queries = tuple(read_text_queries(args.text_file)) if args.text_file else ()
    if (args.multiscale is not None or args.rotations != 1) and not args.image:
        log.warning("--multiscale and --rotations apply to --image queries only: ignored")
    device = rerank_device(args)
    conf = config_from_args(QueryConfig, args, files=query_files(args), rerank=rerank_config(args))
    inputs = QueryInputs(
        keys=tuple(args.key or ()),
        images=tuple(args.image or ()),
        texts=tuple(args.text or ()),
        text_queries=text_queries,
        vectors=args.vectors,
    )
    serving = None
    if args.ray_shards and args.s3_endpoint_url:
        from cluster.serve import ShardServing
        from shards.staging import StageConfig

        serving = ShardServing(stage=StageConfig(endpoint_url=args.s3_endpoint_url))
    index = open_index(args.index, args.ray_shards, args.address, serving)
    if args.out:
        main(conf, index, inputs, Path(args.out), device)
    else:
        print(json.dumps(answer(conf, index, inputs, device), indent=2))
    return 0


def page_config(args: argparse.Namespace):
    """The web page's PageConfig from the serve flags."""
    from webapi.webpage import PageConfig

    return config_from_args(PageConfig, args, max_upload_bytes=args.max_upload_mb << 20)


def service_limits(args: argparse.Namespace):
    """The serve flags' ServiceLimits (what one request may ask, connections), checked."""
    from webapi.limits import ServiceLimits

    return config_from_args(ServiceLimits, args).check()


def _serve(args: argparse.Namespace) -> int:
    from cluster.serve_run import ServeConfig, run

    conf = config_from_args(ServeConfig, args)
    device = rerank_device(args)
    limits = service_limits(args)
    run(conf, args.index, query_files(args), rerank_config(args), page_config(args), device, limits)
    return 0


def add_search_parsers(sub: argparse._SubParsersAction) -> None:
    """query, serve."""
    p = sub.add_parser("query", help="top-k keys and scores for images or stored keys, as JSON")
    p.add_argument("--index", required=True, help="index directory (with --ray-shards also an s3://bucket/prefix)")
    p.add_argument("--image", nargs="+", help="query image files")
    p.add_argument("--key", nargs="+", help="stored keys to query with")
    p.add_argument("--text", nargs="+", help="text queries (open_clip models)")
    p.add_argument(
        "--text-file",
        nargs="+",
        help="text-query files, or directories of ILIAS-style <instance>/.../T*.txt "
        "files (open_clip models); results carry each query's id",
    )
    p.add_argument("--vectors", help=".npy file of query vectors, (d,) or (n, d)")
    p.add_argument("--out", help="JSON file to write the results to (and its .info.json beside it); default: stdout")
    add_config_flags(
        p,
        "query.retrieve:QueryConfig",
        overrides={
            "qe_top": {"flag": "--qe"},
            "scales": {"flag": "--multiscale", "default": None, "metavar": "S1,S2,..."},  # None: not given
            "rotations": {"choices": source_constant("core.multiscale:ROTATIONS")},
        },
    )
    add_file_flags(p)
    p.add_argument("--ray-shards", action="store_true", help="search the shards in Ray actors")
    p.add_argument("--address", help="Ray cluster for --ray-shards (default: $RAY_ADDRESS, else local)")
    p.add_argument("--s3-endpoint-url", help="S3-compatible endpoint for an s3:// --index (with --ray-shards)")
    add_rerank_flags(p)
    p.set_defaults(func=_query)

    p = sub.add_parser("serve", help="HTTP search app and its OpenAPI page at /docs (127.0.0.1 by default)")
    p.add_argument("--index", required=True, help="index directory (with --ray-shards also an s3://bucket/prefix)")
    add_config_flags(
        p,
        "cluster.serve_run:ServeConfig",
        overrides={"shard_transport": {"choices": source_constant("cluster.serve_run:TRANSPORTS")}},
    )
    add_file_flags(p)
    g = p.add_argument_group("web page (/)")
    add_config_flags(
        g,
        "webapi.webpage:PageConfig",
        only=("report", "scaling_plot", "shard_dirs"),
        overrides={
            "shard_dirs": {"flag": "--shard-dir", "action": "append", "default": [], "type": str, "metavar": None}
        },
    )
    g.add_argument("--max-upload-mb", type=int, default=16, help="largest query image accepted")
    g = p.add_argument_group("limits: what one request may ask, slow and many clients (docs/serving.md)")
    add_config_flags(
        g,
        "webapi.limits:ServiceLimits",
        overrides={
            "allow_hosts": {"flag": "--allow-host", "action": "append", "default": [], "type": str, "metavar": "NAME"}
        },
    )
    add_rerank_flags(p)
    p.set_defaults(func=_serve)
