"""The ``needle`` command: one subcommand per stage. Each parses its flags into the stage's frozen
config and calls the stage's ``main``; no logic lives here."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from core.errors import NeedleInputError, ShardReadError

log = logging.getLogger("needle")


def _ingest(args: argparse.Namespace) -> int:
    from cluster.ingest_job import IngestConfig, IngestFailed, main

    query_scales = None
    if args.multiscale:  # imports torch: only when asked for
        from embed.extract import parse_scales

        query_scales = parse_scales(args.multiscale)
    weights = args.weights
    # The published weights, fetched through timm/open_clip, or a seeded random initialisation
    # (embed.registry.PRETRAINED, RANDOM).
    asked = [flag for flag, on in (("--weights", weights), ("--pretrained", args.pretrained), ("--random-init", args.random_init)) if on]
    if len(asked) > 1:
        print(f"error: give one of {', '.join(asked)}, not several", file=sys.stderr)
        return 2
    if args.pretrained:
        weights = "pretrained"
    elif args.random_init:
        weights = "random"
    conf = IngestConfig(
        model=args.model, weights=weights, resolution=args.resolution, batch_size=args.batch_size,
        precision=args.precision, num_workers=args.workers, cpus_per_worker=args.cpus_per_worker,
        cpus_per_gpu_worker=args.cpus_per_gpu_worker, chunk_size=args.chunk_size, decode_threads=args.decode_threads,
        decoder=args.decoder, overwrite=args.overwrite and not args.resume, address=args.address,
        max_retries=args.max_retries, s3_endpoint_url=args.s3_endpoint_url, locals=args.locals,
        local_itq=args.local_itq, local_top_k=args.local_top_k, keep_local_desc=args.keep_local_desc,
        query_scales=query_scales, query_rotations=args.rotations,
    )
    try:
        main(conf, args.shards, Path(args.out))
    except IngestFailed as exc:
        log.error("%s", exc)
        return 1
    return 0


def _pack(args: argparse.Namespace) -> int:
    from ingest.pack import PackConfig, main

    extensions = tuple(e.strip() for e in (args.extensions or "").split(",") if e.strip())
    conf = PackConfig(shard_size=args.shard_size, recursive=not args.no_recursive,
                      extensions=extensions or PackConfig.extensions, follow_symlinks=args.follow_symlinks,
                      full_check=args.full_check)
    main(conf, Path(args.source), Path(args.out))
    return 0


def _index_build(args: argparse.Namespace) -> int:
    from index.build import IndexConfig

    conf = IndexConfig(
        kind="flat" if args.exact else args.kind, memory_budget=args.memory_budget, factory=args.factory,
        nlist=args.nlist, pq_bytes=args.pq_bytes, shards=args.shards, parts=args.parts, nprobe=args.nprobe,
        refine_factor=args.refine_factor, quantizer_ef=args.quantizer_ef, points_per_list=args.points_per_list,
        s3_endpoint_url=args.s3_endpoint_url, adapt=args.adapt,
    )
    if args.ray:
        from cluster.index_job import main

        main(conf, args.descriptors, Path(args.out), args.address)
    else:
        from index.build import main

        main(conf, args.descriptors, Path(args.out))
    return 0


def _open_index(args: argparse.Namespace):
    """The index to search: shards in Ray actors with --ray-shards, else loaded in this process."""
    if args.ray_shards:
        from cluster.ingest_job import connect_ray
        from cluster.serve import serve_sharded

        connect_ray(args.address)
        return serve_sharded(args.index)
    from index.search import load_index

    return load_index(args.index)


def _rerank_config(args: argparse.Namespace):
    """The --rerank flags as a RerankConfig (None without --rerank)."""
    if not args.rerank:
        return None
    from rerank.ensemble import EnsembleConfig
    from rerank.matching import MatchConfig
    from rerank.rerank import RerankConfig

    return RerankConfig(
        method=args.rerank, shortlist=args.shortlist, ames=args.ames,
        ensemble=EnsembleConfig(lam=args.rerank_lambda, gamma=args.rerank_gamma),
        match=MatchConfig(max_distance=args.max_hamming, mutual=not args.no_mutual),
    )


def _add_rerank_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("re-ranking with local tokens (index built from --locals descriptors)")
    g.add_argument("--rerank", choices=["sp", "chamfer", "ames"], help="re-rank the global shortlist: spatial verification, Chamfer or AMES")
    g.add_argument("--shortlist", type=int, default=1000, help="global candidates re-ranked")
    g.add_argument("--rerank-lambda", type=float, default=0.5, help="weight of the global score in the ensemble")
    g.add_argument("--rerank-gamma", type=float, default=1.0, help="AMES: sigmoid temperature of its logit")
    g.add_argument("--max-hamming", type=int, default=32, help="tentative matches within this many bits (of 128)")
    g.add_argument("--no-mutual", action="store_true", help="do not require mutual nearest neighbours")
    g.add_argument("--ames", help="AMES checkpoint (--rerank ames)")


def _add_file_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("files the index was built with, when not at their recorded paths (same SHA-256 required)")
    g.add_argument("--weights", help="the global model's weights file")
    g.add_argument("--local-weights", help="the local-token model's weights file")
    g.add_argument("--itq", help="the local tokens' ITQ projection (.npz)")
    g.add_argument("--detector-weights", help="the AMES detector of vit_ames local tokens")
    g.add_argument("--adapter", help="the adapter of an index built with --adapt")


def _query_files(args: argparse.Namespace):
    from query.recorded import QueryFiles

    return QueryFiles(weights=args.weights, local_weights=args.local_weights, itq=args.itq,
                      detector_weights=args.detector_weights, adapter=args.adapter)


def _add_qe_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--qe", type=int, default=0, help="query expansion: average each query with its similarity-weighted top-N, search again")


def _query(args: argparse.Namespace) -> int:
    from query.retrieve import QueryConfig, load_vectors, query, read_text_queries

    text_queries = read_text_queries(args.text_file) if args.text_file else []  # bad files fail before the index loads
    scales = (1.0,)
    if args.multiscale:
        from embed.extract import parse_scales

        scales = parse_scales(args.multiscale)
    if (args.multiscale or args.rotations != 1) and not args.image:
        log.warning("--multiscale and --rotations apply to --image queries only: ignored")
    index = _open_index(args)
    vectors = load_vectors(Path(args.vectors), index.d) if args.vectors else None
    conf = QueryConfig(k=args.k, nprobe=args.nprobe, refine_factor=args.refine_factor, files=_query_files(args),
                       rerank=_rerank_config(args), qe_top=args.qe,
                       scales=scales, rotations=args.rotations)
    results = query(index, conf, args.key or [], [Path(p) for p in args.image or []], args.text or [], vectors,
                    text_queries)
    print(json.dumps(results if len(results) > 1 else results[0], indent=2))
    return 0


def _page_config(args: argparse.Namespace):
    """The web page's PageConfig from the serve flags."""
    from cluster.webpage import PageConfig

    return PageConfig(report=args.report, scaling_plot=args.scaling_plot, shard_dirs=tuple(args.shard_dir or ()),
                      max_upload_bytes=args.max_upload_mb << 20)


def _serve(args: argparse.Namespace) -> int:
    if args.ray:
        return _serve_ray(args)
    import uvicorn

    from cluster.serve import QueryService
    from cluster.webapp import create_app

    index = _open_index(args)
    app = create_app(QueryService(index, _query_files(args), _rerank_config(args)), _page_config(args))
    log.info("serving %s on http://%s:%d (%d vectors; API docs at /docs)", args.index, args.host, args.port, index.ntotal)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def _serve_ray(args: argparse.Namespace) -> int:
    """The same app as a Ray Serve deployment of --replicas replicas, behind Serve's HTTP proxy on
    --host:--port (in front of one set of shard actors with --ray-shards)."""
    import os
    import signal
    import time

    import ray
    from ray import serve

    from cluster.ingest_job import connect_ray
    from cluster.webapp import ray_app

    if args.replicas < 1:
        raise NeedleInputError(f"--replicas must be at least 1, got {args.replicas}")
    shared_cluster = bool(args.address or os.environ.get("RAY_ADDRESS"))
    connect_ray(args.address)
    actors = None
    if args.ray_shards:
        from cluster.serve import serve_sharded

        actors = serve_sharded(args.index).actors
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(ray_app(str(Path(args.index).resolve()), _query_files(args), _rerank_config(args), _page_config(args),
                      actors, args.replicas), name="needle", route_prefix="/")
    log.info("serving %s with Ray Serve (%d replicas) on http://%s:%d (API docs at /docs)", args.index, args.replicas,
             args.host, args.port)

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # after Ray's own handler: stop Serve, then Ray, in order
    signal.signal(signal.SIGINT, stop)  # also where a non-interactive shell started us with SIGINT ignored
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        if shared_cluster:  # leave the cluster's other Serve applications alone
            serve.delete("needle")
        else:
            serve.shutdown()
        ray.shutdown()
    return 0


def _eval(args: argparse.Namespace) -> int:
    from eval.evaluate import EvalConfig, main

    missing = [flag for flag, value in (("--index", args.index), ("--ground-truth", args.ground_truth), ("--out", args.out)) if not value]
    if missing:
        raise NeedleInputError(f"needle eval needs {', '.join(missing)} (or a subcommand: scaling, plot)")
    conf = EvalConfig(k=args.k, nprobe=args.nprobe, rerank=_rerank_config(args), query_locals=args.query_locals,
                      query_descriptors=args.query_descriptors, text_queries=args.text_queries,
                      ilias_pickle=args.ilias_pickle, ilias_json=args.ilias_json, qe_top=args.qe, files=_query_files(args))
    out = main(conf, Path(args.index), Path(args.ground_truth), Path(args.out))
    report = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in report.items() if k != "per_query"}, indent=2))
    return 0


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise NeedleInputError(f"{flag} takes comma-separated integers, got {text!r}") from exc


def _eval_scaling(args: argparse.Namespace) -> int:
    from eval.scaling import ScalingConfig, main

    conf = ScalingConfig(
        sizes=_int_list(args.sizes, "--sizes"), modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        k=args.scaling_k, nprobe=args.scaling_nprobe, nlist=args.nlist, memory_budget=args.memory_budget,
        shortlist=args.scaling_shortlist, rerank_lambda=args.scaling_lambda, ames=args.scaling_ames, adapt=args.adapt,
        query_descriptors=args.scaling_query_descriptors, query_locals=args.scaling_query_locals, order=args.order,
        seed=args.seed, label=args.label, keep_indexes=args.keep_indexes)
    out = main(conf, [Path(d) for d in args.descriptors], Path(args.scaling_ground_truth), Path(args.scaling_out))
    result = json.loads(out.read_text())
    for p in result["points"]:
        print(json.dumps({k: p[k] for k in ("mode", "distractors", "database_size", "map", "search_ms_per_query")}))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def _eval_plot(args: argparse.Namespace) -> int:
    from eval.scaling import load_runs, plot_runs

    print(plot_runs(load_runs([Path(r) for r in args.runs]), Path(args.plot_out)))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from cluster.demo import DemoRunConfig, main

    main(DemoRunConfig(num_cpus=args.num_cpus, address=args.address), Path(args.workdir))
    return 0


def _train_itq(args: argparse.Namespace) -> int:
    from embed.train_itq import TrainITQConfig, main

    main(TrainITQConfig(sample=args.sample, iterations=args.iterations, seed=args.seed), Path(args.descriptors), Path(args.out))
    return 0


def _local_presets(args: argparse.Namespace) -> int:
    from embed.registry import LOCAL_PRESETS

    for name, conf in sorted(LOCAL_PRESETS.items()):
        scales = "/".join(f"{s:g}" for s in conf.scales)
        print(f"{name:20s} {conf.kind:9s} {conf.resolution:4d}px scales {scales:14s} top-{conf.top_k}"
              f"{' per scale' if conf.per_scale else '':10s} itq {conf.itq or '(give --local-itq)'}")
    return 0


def _adapt_train(args: argparse.Namespace) -> int:
    from embed.adapt import AdaptConfig, main

    main(AdaptConfig(out_dim=args.dim, epochs=args.epochs, seed=args.seed), Path(args.descriptors), Path(args.labels), Path(args.out))
    return 0


def _adapt_whiten(args: argparse.Namespace) -> int:
    from embed.whiten import WhitenConfig, main

    conf = WhitenConfig(method=args.method, out_dim=args.dim, eps=args.eps, max_pairs=args.max_pairs, seed=args.seed)
    main(conf, Path(args.descriptors), Path(args.labels) if args.labels else None, Path(args.out))
    return 0


def _adapt_make_classes(args: argparse.Namespace) -> int:
    from embed.augment import AugmentConfig, main

    main(AugmentConfig(views=args.views, seed=args.seed, max_side=args.max_side), Path(args.images), Path(args.out))
    return 0


def _ames_train(args: argparse.Namespace) -> int:
    from cluster.ingest_job import IngestConfig, make_local_extractor
    from rerank.ames_train import TrainConfig, main

    extractor = make_local_extractor(IngestConfig(locals=args.locals, local_itq=args.local_itq))
    conf = TrainConfig(pairs=args.pairs, epochs=args.epochs, layers=args.layers, seed=args.seed)
    main(conf, Path(args.images), Path(args.out), describe=extractor.tokens_of_any_size, projection=extractor.itq.proj)
    return 0


def _models(args: argparse.Namespace) -> int:
    from embed.registry import MODELS, describe

    print(f"{'name':34s} {'library':9s} {'train':>5s} {'test':>5s} {'pooling':7s} {'dim':>5s}  description")
    for name in sorted(MODELS):
        record = describe(name)
        dim = str(record["dim"]) if record.get("dim") else "?"
        print(f"{name:34s} {record['library']:9s} {record['train_resolution']:5d} {record['resolution']:5d} "
              f"{record['pooling']:7s} {dim:>5s}  {record['description']}")
    print("\nAny other model: 'timm:<name>[@gem|cls|head]' or 'open_clip:<arch>[/<tag>]'.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="needle", description="Instance-level image retrieval at scale.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("ingest", help="describe the images of WebDataset tars (Ray job), one Parquet per tar")
    p.add_argument("--shards", nargs="+", required=True, help="tar paths, globs or brace patterns, local or s3://")
    p.add_argument("--out", required=True, help="output directory or s3:// prefix of Parquet files")
    p.add_argument("--model", default="tf_efficientnet_lite0.gem", help="registry model (see `needle models`)")
    p.add_argument("--weights", help="local weights file (default: the model's packaged weights)")
    p.add_argument("--pretrained", action="store_true",
                   help="fetch the model's published weights through timm/open_clip (needs the network or their cache)")
    p.add_argument("--random-init", action="store_true",
                   help="a seeded random initialisation of every model (tests and timing only; recorded, queries rebuild it)")
    p.add_argument("--resolution", type=int, help="longer side in pixels (default: the model's test resolution)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--workers", type=int, help="worker actors (default: one per GPU, else CPUs / --cpus-per-worker)")
    p.add_argument("--cpus-per-worker", type=int, default=2, help="CPUs of each CPU worker (its torch threads)")
    p.add_argument("--cpus-per-gpu-worker", type=int, help="CPUs of each GPU worker, all decoding (default: node CPUs / GPUs)")
    p.add_argument("--decoder", choices=("pil", "nvjpeg"), default="pil",
                   help="JPEG decoding: PIL on the worker's CPUs, or nvjpeg on its GPU (GPU workers only)")
    p.add_argument("--chunk-size", type=int, help="images batched together per extractor call (default: 512 on GPU, 64 on CPU)")
    p.add_argument("--decode-threads", type=int, help="decoding threads per worker (default: all its CPUs; on CPU they take turns with the model)")
    p.add_argument("--overwrite", action="store_true", help="redo shards already committed")
    p.add_argument("--resume", action="store_true", help="skip committed shards (the default; overrides --overwrite)")
    p.add_argument("--max-retries", type=int, default=3, help="times a shard is re-queued after its worker died")
    p.add_argument("--s3-endpoint-url", help="S3-compatible endpoint for s3:// shards and --out")
    p.add_argument("--address", help="Ray cluster to join ('auto': the running one; default: $RAY_ADDRESS, "
                   "set by `ray job submit`, else a new local instance)")
    p.add_argument("--locals", help="also write local tokens with this preset (see `needle locals presets`, e.g. lite0-s16)")
    p.add_argument("--local-itq", help="ITQ projection .npz for the local codes (default: the preset's; 'none': no codes)")
    p.add_argument("--local-top-k", type=int, help="local tokens per image (default: the preset's)")
    p.add_argument("--keep-local-desc", action="store_true", help="also store float16 local descriptors")
    p.add_argument("--multiscale", metavar="S1,S2,...", help="for query images only (never the database): average "
                   "the global descriptor over these scales of --resolution, e.g. 0.707,1,1.414 (ILIAS)")
    p.add_argument("--rotations", type=int, default=1, choices=[1, 2, 4], help="for query images only (never the "
                   "database): average the global descriptor over 1, 2 or 4 quarter turns (ILIAS: 4)")
    p.set_defaults(func=_ingest)

    p = sub.add_parser("pack", help="a folder of images (or a list of image files) as WebDataset tars for needle ingest")
    p.add_argument("source", help="directory of images (walked recursively), or a text file of image paths, one a line")
    p.add_argument("--out", required=True, help="output directory: 000000.tar, 000001.tar, ... and pack_info.json")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per tar")
    p.add_argument("--extensions", help="comma-separated file extensions to pack (default: every image suffix ingest "
                   "reads: jpg,jpeg,png,webp,bmp,tif,tiff; case-insensitive)")
    p.add_argument("--no-recursive", action="store_true", help="only the directory's own files, not its sub-directories")
    p.add_argument("--follow-symlinks", action="store_true", help="walk symlinked directories and read symlinked files "
                   "(default: skip them and report them)")
    p.add_argument("--full-check", action="store_true", help="decode every image (JPEGs at 1/8 scale) to skip truncated "
                   "files too (default: PIL's header check)")
    p.set_defaults(func=_pack)

    p = sub.add_parser("locals", help="local-descriptor commands")
    lsub = p.add_subparsers(dest="locals_command", required=True)
    t = lsub.add_parser("train-itq", help="learn the 128-bit ITQ projection from descriptors kept with --keep-local-desc")
    t.add_argument("--descriptors", required=True, help="descriptor directory or Parquet file")
    t.add_argument("--out", required=True, help=".npz file to write (keys proj, mean)")
    t.add_argument("--sample", type=int, default=200_000, help="descriptors to learn from")
    t.add_argument("--iterations", type=int, default=50)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_train_itq)
    t = lsub.add_parser("presets", help="list the local-token presets")
    t.set_defaults(func=_local_presets)

    p = sub.add_parser("index", help="index commands")
    isub = p.add_subparsers(dest="index_command", required=True)
    b = isub.add_parser("build", help="build a FAISS index over descriptor Parquet files, within a memory budget")
    b.add_argument("--descriptors", required=True, nargs="+", help="directories, files or s3:// prefixes of descriptor Parquet")
    b.add_argument("--s3-endpoint-url", help="S3-compatible endpoint for s3:// descriptors")
    b.add_argument("--out", required=True, help="index directory to write")
    b.add_argument("--memory-budget", default="8GB", help="RAM the index may use, e.g. 8GB, 512MiB")
    b.add_argument("--factory", help="FAISS factory string to use as is (default: chosen from N, d and the budget)")
    b.add_argument("--kind", default="auto", choices=["auto", "flat", "ivfpq"])
    b.add_argument("--exact", action="store_true", help="an exact flat index (the ILIAS baseline)")
    b.add_argument("--shards", type=int, default=1, help="keep N index shards (one Ray actor each when served)")
    b.add_argument("--parts", type=int, help="parallel add tasks (default: shards, or the cluster's CPUs with --ray)")
    b.add_argument("--nlist", type=int, help="IVF lists")
    b.add_argument("--pq-bytes", type=int, help="PQ code bytes per vector")
    b.add_argument("--points-per-list", type=int, default=64, help="training sample = lists * this (capped by the budget)")
    b.add_argument("--nprobe", type=int, default=64, help="default IVF lists visited per query")
    b.add_argument("--refine-factor", type=int, default=2, help="shortlist = factor * k, re-scored exactly")
    b.add_argument("--quantizer-ef", type=int, default=128, help="HNSW coarse quantizer search depth (large IVF)")
    b.add_argument("--ray", action="store_true", help="run the add parts as Ray tasks")
    b.add_argument("--adapt", help="adapter file (needle adapt train, or ILIAS's): index the adapted descriptors")
    b.add_argument("--address", help="Ray cluster (default: $RAY_ADDRESS, else a local instance)")
    b.set_defaults(func=_index_build)

    p = sub.add_parser("query", help="top-k keys and scores for images or stored keys, as JSON")
    p.add_argument("--index", required=True, help="index directory")
    p.add_argument("--image", nargs="+", help="query image files")
    p.add_argument("--key", nargs="+", help="stored keys to query with")
    p.add_argument("--text", nargs="+", help="text queries (open_clip models)")
    p.add_argument("--text-file", nargs="+", help="text-query files, or directories of ILIAS-style <instance>/.../T*.txt "
                   "files (open_clip models); results carry each query's id")
    p.add_argument("--multiscale", metavar="S1,S2,...", help="--image queries: average the global descriptor over "
                   "these scales, e.g. 0.707,1,1.414 (ILIAS's query side)")
    p.add_argument("--rotations", type=int, default=1, choices=[1, 2, 4], help="--image queries: average the global "
                   "descriptor over 1, 2 or 4 quarter turns (ILIAS's query side: 4)")
    p.add_argument("--vectors", help=".npy file of query vectors, (d,) or (n, d)")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--nprobe", type=int)
    p.add_argument("--refine-factor", type=int, help="shortlist = factor * k, re-scored exactly (default: the index's)")
    _add_file_flags(p)
    p.add_argument("--ray-shards", action="store_true", help="search the shards in Ray actors")
    p.add_argument("--address", help="Ray cluster for --ray-shards (default: $RAY_ADDRESS, else local)")
    _add_rerank_flags(p)
    _add_qe_flag(p)
    p.set_defaults(func=_query)

    p = sub.add_parser("serve", help="HTTP search app and its OpenAPI page at /docs (127.0.0.1 by default)")
    p.add_argument("--index", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    _add_file_flags(p)
    p.add_argument("--ray-shards", action="store_true", help="serve the shards from Ray actors")
    p.add_argument("--ray", action="store_true", help="run the app as a Ray Serve deployment (Serve's HTTP proxy on --host:--port)")
    p.add_argument("--replicas", type=int, default=1, help="--ray: replicas of the app")
    p.add_argument("--address", help="Ray cluster for --ray / --ray-shards (default: $RAY_ADDRESS, else local)")
    g = p.add_argument_group("web page (/)")
    g.add_argument("--report", help="a needle eval JSON report to show: per-query AP, missed positives")
    g.add_argument("--scaling-plot", help="a scaling PNG (needle eval scaling / plot) to show")
    g.add_argument("--shard-dir", action="append", help="directory holding the tars, for thumbnails when ingestion "
                   "recorded no shard URL (repeatable)")
    g.add_argument("--max-upload-mb", type=int, default=16, help="largest query image accepted")
    _add_rerank_flags(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("eval", help="mAP@k (ILIAS protocol) of an index against a ground truth; `eval scaling`: "
                       "the distractor-scaling study; `eval plot`: overlay scaling runs")
    p.add_argument("--index", help="index directory")
    p.add_argument("--ground-truth", help="ground-truth JSON, or an ILIAS dataset directory (image_ids/...)")
    p.add_argument("--k", type=int, default=1000)
    p.add_argument("--nprobe", type=int)
    p.add_argument("--out", help="JSON report to write")
    p.add_argument("--ilias-pickle", help="also write the rankings as the ILIAS benchmark's result pickle")
    p.add_argument("--ilias-json", help="also write the rankings as the ILIAS benchmark's result JSON")
    _add_file_flags(p)
    p.add_argument("--query-descriptors", help="descriptor directory of the query images' own ingest (ILIAS: queries "
                   "are not in the database); default: the queries' vectors in the index")
    p.add_argument("--text-queries", action="store_true", help="ILIAS dataset: also evaluate its text queries (Txxx.txt) "
                   "through the model's text tower (open_clip models)")
    p.add_argument("--query-locals", help="descriptor directory of the queries' local tokens (a query-side preset); "
                   "default: the index's stored tokens")
    _add_rerank_flags(p)
    _add_qe_flag(p)
    p.set_defaults(func=_eval)
    esub = p.add_subparsers(dest="eval_command")
    t = esub.add_parser("scaling", help="mAP@k as distractors grow: nested subsets, exact / IVF-PQ / re-ranked; JSON + PNG")
    t.add_argument("--descriptors", required=True, nargs="+", help="descriptor directories of the database (core and distractors)")
    t.add_argument("--ground-truth", dest="scaling_ground_truth", required=True,
                   help="ground-truth JSON (optionally with a 'distractors' list) or an ILIAS dataset directory")
    t.add_argument("--out", dest="scaling_out", required=True, help="directory for scaling.json and scaling.png")
    t.add_argument("--sizes", default="0,100,300,1000,3000,10000,30000,100000,300000,1000000",
                   help="distractor counts, comma-separated (sizes past the available distractors are dropped)")
    t.add_argument("--modes", default="exact,ivfpq,ivfpq+sp", help="exact | ivfpq, optionally +sp/+chamfer/+ames; comma-separated")
    t.add_argument("--k", dest="scaling_k", type=int, default=1000)
    t.add_argument("--nprobe", dest="scaling_nprobe", type=int, help="IVF lists visited (default: the index's)")
    t.add_argument("--nlist", type=int, help="IVF lists (default: chosen per size)")
    t.add_argument("--memory-budget", default="8GB")
    t.add_argument("--shortlist", dest="scaling_shortlist", type=int, default=1000, help="candidates re-ranked in +rerank modes")
    t.add_argument("--rerank-lambda", dest="scaling_lambda", type=float, default=0.5)
    t.add_argument("--ames", dest="scaling_ames", help="AMES checkpoint for +ames")
    t.add_argument("--adapt", help="adapter applied to database and queries")
    t.add_argument("--query-descriptors", dest="scaling_query_descriptors", help="the query images' own descriptors (ILIAS)")
    t.add_argument("--query-locals", dest="scaling_query_locals", help="the query images' local tokens (query-side preset)")
    t.add_argument("--order", choices=["file", "shuffle"], default="file", help="distractor order whose prefixes are the subsets")
    t.add_argument("--seed", type=int, default=0, help="permutation seed of --order shuffle")
    t.add_argument("--label", help="the run's name in the plot (default: the model)")
    t.add_argument("--keep-indexes", action="store_true", help="keep every size's index")
    t.set_defaults(func=_eval_scaling)
    t = esub.add_parser("plot", help="overlay scaling runs (one line per model and mode) in one PNG")
    t.add_argument("runs", nargs="+", help="scaling.json files")
    t.add_argument("--out", dest="plot_out", required=True, help="PNG to write")
    t.set_defaults(func=_eval_plot)

    p = sub.add_parser("adapt", help="adaptation of global descriptors")
    dsub = p.add_subparsers(dest="adapt_command", required=True)
    t = dsub.add_parser("train", help="the ILIAS linear adaptation: Linear + L2 trained with a normalised softmax over labels")
    t.add_argument("--descriptors", required=True, help="descriptor directory (Parquet)")
    t.add_argument("--labels", required=True, help="CSV or Parquet with columns key,label[,domain]")
    t.add_argument("--out", required=True, help="adapter file to write (state dict weight, bias)")
    t.add_argument("--dim", type=int, default=512, help="adapted dimension")
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_adapt_train)
    t = dsub.add_parser("whiten", help="PCA whitening (unsupervised) or whitening learned from same-label pairs (Radenović et al.)")
    t.add_argument("--method", choices=("pca", "learned"), default="pca")
    t.add_argument("--descriptors", required=True, help="descriptor directory (Parquet)")
    t.add_argument("--labels", help="CSV or Parquet key,label: required for learned; for pca, fit on these rows only (default: every ok row)")
    t.add_argument("--out", required=True, help="adapter file to write (state dict weight, bias), usable by index build --adapt")
    t.add_argument("--dim", type=int, default=512, help="whitened dimension")
    t.add_argument("--eps", type=float, default=1e-3, help="regulariser added to the eigenvalues, a fraction of their mean")
    t.add_argument("--max-pairs", type=int, help="learned: a seeded sample of this many pairs (default: all pairs)")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_adapt_whiten)
    t = dsub.add_parser("make-classes", help="training classes from unlabelled images: each image a class of augmented views "
                        "(WebDataset tars and labels.csv for ingest and adapt train/whiten)")
    t.add_argument("--images", required=True, help="directory of images (e.g. distractors; never the benchmark's queries or positives)")
    t.add_argument("--out", required=True, help="output directory: classes-*.tar, labels.csv, augment_info.json")
    t.add_argument("--views", type=int, default=5, help="views per image (the first is the original, resized)")
    t.add_argument("--max-side", type=int, default=500, help="longer side of the written JPEGs at most")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_adapt_make_classes)

    p = sub.add_parser("ames", help="AMES re-ranking model commands")
    asub = p.add_subparsers(dest="ames_command", required=True)
    t = asub.add_parser("train", help="train AMES on pairs made from unlabelled images (random homographies, photometric changes)")
    t.add_argument("--images", required=True, help="directory of images (e.g. distractors; never your test queries)")
    t.add_argument("--out", required=True, help="checkpoint file (.pt) or directory")
    t.add_argument("--locals", default="lite0-s16", help="local-token preset describing the images (the index's)")
    t.add_argument("--local-itq", help="ITQ projection (default: the preset's)")
    t.add_argument("--pairs", type=int, default=2000)
    t.add_argument("--epochs", type=int, default=20)
    t.add_argument("--layers", type=int, default=5)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_ames_train)

    from similarity.cli import add_similarity_parser

    add_similarity_parser(sub)

    p = sub.add_parser("demo", help="the whole pipeline on the built-in demo collection (local Ray)")
    p.add_argument("--workdir", default="demo_run", help="where the demo data and outputs go")
    p.add_argument("--num-cpus", type=int, help="CPUs of the local Ray head (default: all)")
    p.add_argument("--address", help="dashboard URL of a running Ray cluster (default: start a local head)")
    p.set_defaults(func=_demo)

    p = sub.add_parser("models", help="list the model presets (train/test resolution, pooling, dim)")
    p.set_defaults(func=_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:  # FAISS's loader reports at INFO which CPU builds it tried: a failed AVX2 try reads like an error
        logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except (NeedleInputError, ShardReadError) as exc:
        log.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
