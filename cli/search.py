"""``needle query`` and ``needle serve``, and the flags they share with ``needle eval map``: the
re-ranking options (rerank.options.RerankOptions) and the files given in place of those an index
records (QueryFiles), both declared in cli/spec_flags.py with ``needle serve``'s spec. Handlers
import the stages; parsing imports no torch."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from cli.flags import add_config_flags, config_from_args
from cli.spec_flags import (
    FILE_FLAGS,
    RERANK_FLAGS,
    add_flags,
    add_serve_flags,
    query_files,
    rerank_options,
    serve_spec,
)
from core.multiscale import ROTATIONS
from query.config import QueryConfig

if TYPE_CHECKING:
    from rerank.options import RerankOptions

log = logging.getLogger("needle")


def add_rerank_flags(p: argparse.ArgumentParser) -> None:
    """The re-ranking flags (cli.spec_flags.RERANK_FLAGS), in their own --help group."""
    add_flags(p, RERANK_FLAGS)


def rerank_device(options: RerankOptions, ray_shards: bool = False, ray: bool = False) -> str:
    """``--device``, checked before any index loads: "cuda" without a GPU is a NeedleInputError
    naming the flag (never a silent CPU). With --ray-shards the shard actors re-rank on their own
    CPUs (this process only merges), so "cuda" is refused there and "auto" warned about."""
    device = options.device
    if ray_shards and options.method and device != "cpu":
        from core.errors import NeedleInputError

        if device == "cuda":
            raise NeedleInputError(
                "--device cuda with --ray-shards: the shard actors re-rank on their own CPUs; drop one of them"
            )
        log.warning("--device %s with --ray-shards: the shard actors re-rank on their CPUs", device)
        return device
    if not ray:  # --ray: each Serve replica checks its own
        from rerank.device import resolve_device

        resolve_device(device)
    return device


def rerank_config(args: argparse.Namespace):
    """The re-ranking flags as a RerankConfig (None without --rerank)."""
    return rerank_options(args).to_config()


def add_file_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the files given in place of those the index records (cli.spec_flags.FILE_FLAGS)."""
    add_flags(p, FILE_FLAGS)


def _query(args: argparse.Namespace) -> int:
    from cluster.serve import open_index
    from query.retrieve import read_text_queries
    from query.stage import QueryInputs, answer, main

    # Bad text-query files fail before the index loads.
    text_queries = tuple(read_text_queries(args.text_file)) if args.text_file else ()
    if (args.multiscale is not None or args.rotations != 1) and not args.image:
        log.warning("--multiscale and --rotations apply to --image queries only: ignored")
    options = rerank_options(args)
    device = rerank_device(options, args.ray_shards)
    conf = config_from_args(QueryConfig, args, files=query_files(args), rerank=options.to_config())
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
    """The web page's PageConfig from the serve flags (and --config)."""
    return serve_spec(args).page_config()


def service_limits(args: argparse.Namespace):
    """The serve flags' ServiceLimits (what one request may ask, connections), checked."""
    return serve_spec(args).service_limits()


def _serve(args: argparse.Namespace) -> int:
    spec = serve_spec(args)
    if args.print_config:
        from webapi.spec_toml import spec_to_toml

        print(spec_to_toml(spec), end="")
        return 0
    from cluster.serve_run import run

    spec.served_index()
    rerank_device(spec.rerank, spec.shards.ray, spec.listen.ray)
    spec.service_limits()  # bad limits fail before anything starts
    run(spec)
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
        QueryConfig,
        overrides={
            "qe_top": {"flag": "--qe"},
            "scales": {"flag": "--multiscale", "default": None, "metavar": "S1,S2,..."},  # None: not given
            "rotations": {"choices": ROTATIONS},
        },
    )
    add_file_flags(p)
    p.add_argument("--ray-shards", action="store_true", help="search the shards in Ray actors")
    p.add_argument("--address", help="Ray cluster for --ray-shards (default: $RAY_ADDRESS, else local)")
    p.add_argument("--s3-endpoint-url", help="S3-compatible endpoint for an s3:// --index (with --ray-shards)")
    add_rerank_flags(p)
    p.set_defaults(func=_query)

    p = sub.add_parser("serve", help="HTTP search app and its OpenAPI page at /docs (127.0.0.1 by default)")
    add_serve_flags(p)
    p.set_defaults(func=_serve)
