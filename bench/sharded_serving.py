"""Serving across nodes: a synthetic IVF-PQ index in 8 shards served by Ray actors on 3 simulated
nodes (``ray.cluster_utils.Cluster`` on this machine, each node its own shard cache), against the
single-process ``load_index`` of the same directory. Prints one JSON line last.

For each ``--n``: seeded clustered unit vectors (d=128 by default) are written as Parquet parts
(with random local tokens where ``n <= --tokens-max``) and built with ``needle index build``'s
code into ``--shards`` shard directories. The single index answers ``--queries`` queries one at
a time (k=100); then a child process (the coordinator alone, so that its memory is its own)
joins the cluster, starts the shard actors (each stages its shard to its node's cache), answers
the same queries and reports:

- ``p50_ms`` / ``p99_ms``: one query at a time, global k=100 (and re-ranked key queries with
  spatial verification where the index has local tokens), the sharded service and the single
  index (opened in the same process after the coordinator's memory is taken) taking turns on
  each query, so that both see the same load;
- ``coordinator_rss_mb``: the coordinator process's RSS after the queries (it holds the top-level
  infos and the actor handles only); ``coordinator_rss_growth`` compares the smallest and largest n;
- ``bytes_per_query``: pickled arguments and results between coordinator and shards (Ray's own
  serialisation is of the same order), per global query;
- ``keys_ms_1000``: the keys of a 1,000-row answer, routed to the owning shards (no cache),
  asked 50 times one after another after 5 warm-up lookups; ``keys_ms_1000_between_searches``:
  the same lookup, each right after a k=1000 search; ``keys_ms_1000_after_search``: the keys of
  that search's answer within the request that searched (a search's own answer gets its keys
  with the candidates: what ``/search`` pays); ``keys_ms_1000_in_shards``: the shards' own work
  for them (their key files, O(k)), without the transport;
- ``fanout_floor_p50_ms``: one call to every shard doing nothing (the transport alone);
- ``transport``: how the coordinator called the actors (``--transport``: ``direct``, the default,
  over each actor's TCP channel, shards/direct.py; ``ray``: Ray actor calls only), with the
  calls sent (``calls``) and how many of them went through Ray (``ray_calls``);
- ``identical_to_single``: D and I of every query sample equal to the single index's (and the
  re-ranked ones where measured).

    OMP_NUM_THREADS=1 python bench/sharded_serving.py --n 1000000 4000000 [--workdir DIR]
    OMP_NUM_THREADS=1 python bench/sharded_serving.py --n 20000 80000   # a quick run
    OMP_NUM_THREADS=1 python bench/sharded_serving.py --transport ray direct   # both transports, one run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARTS_PER_SHARD = 2


def write_part(directory: Path, shard_id: int, xb: np.ndarray, rng: np.random.Generator, tokens: bool) -> None:
    import pyarrow as pa

    from core.tokens import CODE_BYTES
    from ingest.descriptors import (
        descriptor_schema,
        fixed_size_list,
        list_column,
        local_fields,
        make_row_id,
        write_parquet_atomic,
    )

    n, d = xb.shape
    name = f"{shard_id:06d}"
    columns = {
        "key": [f"{name}/{i:07d}" for i in range(n)],
        "shard": [name] * n,
        "row": pa.array([make_row_id(shard_id, i) for i in range(n)], pa.int64()),
        "global": fixed_size_list(xb, pa.float16()),
        "width": pa.array(np.full(n, 100, np.int32)),
        "height": pa.array(np.full(n, 80, np.int32)),
        "status": ["ok"] * n,
        "error": [""] * n,
    }
    fields = []
    if tokens:
        counts = rng.integers(5, 30, n)
        pool = rng.integers(0, 256, (4096, CODE_BYTES), dtype=np.uint8)
        fields = local_fields(True, None)
        columns["local_codes"] = list_column([pool[rng.integers(0, 4096, t)] for t in counts], fields[0].type)
        columns["local_x"] = list_column([rng.integers(0, 99, t) for t in counts], fields[1].type)
        columns["local_y"] = list_column([rng.integers(0, 79, t) for t in counts], fields[2].type)
        columns["local_scale"] = list_column([rng.integers(0, 2, t) for t in counts], fields[3].type)
        columns["local_weight"] = list_column([rng.random(t) for t in counts], fields[4].type)
    write_parquet_atomic(pa.table(columns, schema=descriptor_schema(d, fields)), directory / f"{name}.parquet")


def generate(directory: Path, n: int, d: int, parts: int, tokens: bool, seed: int = 0) -> np.ndarray:
    """Parquet parts of n clustered unit vectors; returns queries from the same distribution."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((max(64, n // 2000), d)).astype(np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, n, parts + 1).astype(int)
    for p in range(parts):
        size = int(bounds[p + 1] - bounds[p])
        x = centers[rng.integers(0, len(centers), size)] + 0.6 * rng.standard_normal((size, d), dtype=np.float32)
        write_part(directory, p, (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16), rng, tokens)
    if tokens:
        (directory / "ingest_info.json").write_text(
            json.dumps({"extractors": [{"extractor": "local", "scales": [1.0, 0.5]}]})
        )
    xq = centers[rng.integers(0, len(centers), 1000)] + 0.6 * rng.standard_normal((1000, d), dtype=np.float32)
    return (xq / np.linalg.norm(xq, axis=1, keepdims=True)).astype(np.float32)


def build(work: Path, n: int, args: argparse.Namespace) -> tuple[Path, np.ndarray, float]:
    """(index directory, queries, build seconds), reused from ``work`` when there."""
    from index.build.stage import IndexConfig, main

    tokens = n <= args.tokens_max
    out, desc = work / "index", work / "desc"
    if not (out / "index_infos.json").is_file() or not (work / "queries.npy").is_file():
        xq = generate(desc, n, args.d, args.shards * PARTS_PER_SHARD, tokens)
        np.save(work / "queries.npy", xq)
        start = time.perf_counter()
        conf = IndexConfig(
            kind="ivfpq",
            nlist=args.nlist,
            pq_bytes=args.pq_bytes,
            nprobe=args.nprobe,
            refine_factor=2,
            shards=args.shards,
        )
        main(replace(conf, points_per_list=min(39, max(4, 50_000 // args.nlist))), desc, out)
        (work / "build_s.txt").write_text(f"{time.perf_counter() - start:.1f}")
    built = json.loads((out / "index_infos.json").read_text()).get("nlist")
    if built is not None and int(built) != args.nlist:  # a reused workdir must measure what the flags say
        raise SystemExit(f"{out} was built with nlist {built}, not --nlist {args.nlist}: use another --workdir")
    return out, np.load(work / "queries.npy"), float((work / "build_s.txt").read_text())


def remove_node_caches(work: Path) -> None:
    """The shard caches of this run's simulated nodes (named by node id: a later run's are new)."""
    for cache in work.glob("cache-*"):
        shutil.rmtree(cache, ignore_errors=True)


def percentiles(times: list[float]) -> dict[str, float]:
    ms = np.array(times) * 1000
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3)}


def rerank_keys(index, count: int) -> list[str]:
    rows = index.search(np.zeros((1, index.d), np.float32) + 1 / np.sqrt(index.d), count)[1][0]
    return [k for k in index.keys_of(rows[None])[0] if k is not None][:count]


def timed_queries(
    indexes: list, xq: np.ndarray, k: int, nprobe: int
) -> list[tuple[list[float], np.ndarray, np.ndarray]]:
    """Per index (times, D, I) of the queries one at a time, the indexes taking turns on each
    query (so that both see the same load on a shared machine)."""
    for index in indexes:
        index.search(xq[:5], k, nprobe)  # warm
    runs = [([], [], []) for _ in indexes]
    for q in range(len(xq)):
        for index, (times, Ds, Is) in zip(indexes, runs):
            start = time.perf_counter()
            D, I = index.search(xq[q : q + 1], k, nprobe)
            times.append(time.perf_counter() - start)
            Ds.append(D)
            Is.append(I)
    return [(times, np.concatenate(Ds), np.concatenate(Is)) for times, Ds, Is in runs]


def timed_reranks(indexes: list, keys: list[str], k: int, nprobe: int) -> list[tuple[list[float], list]]:
    """Per index (times, [(D, I)]) of re-ranked key queries (spatial verification, shortlist 100),
    one at a time, the indexes taking turns, each query as one request of the service."""
    from query.retrieve import QueryConfig, search, stored_tokens
    from rerank.rerank import RerankConfig

    conf = QueryConfig(k=k, nprobe=nprobe, rerank=RerankConfig(method="sp", shortlist=100))
    runs = [([], []) for _ in indexes]
    for key in keys:
        for index, (times, answers) in zip(indexes, runs):
            start = time.perf_counter()
            with index.request():
                index.prefetch_keys([key], with_tokens=True)  # as the service does: key and tokens in one lookup
                D, I, _ = search(index, index.vector_of(key)[None], conf, stored_tokens(index, [key]))
            times.append(time.perf_counter() - start)
            answers.append((D, I))
    return runs


def keys_in_shards(single, out: Path, xq: np.ndarray, nprobe: int) -> float:
    """Milliseconds the shards spend on the keys of a 1,000-row answer (each its own rows, from its
    own key files: O(k), whatever n), without the transport."""
    from index.shard import open_shard
    from index.shard_files import shard_names
    from ingest.descriptors import ROW_SHARD_SHIFT

    _, I = single.search(xq, 1000, nprobe)
    shards = [open_shard(out, name) for name in shard_names(single.infos)]
    owned = [I[:, np.isin(I[0] >> ROW_SHARD_SHIFT, [int(p) for p in s.files.infos["shard_offsets"]])] for s in shards]
    times = []
    for _ in range(30):
        t = time.perf_counter()
        for shard, rows in zip(shards, owned):
            shard.keys_of(rows)
        times.append(time.perf_counter() - t)
    return round(float(np.median(times)) * 1000, 3)


def coordinator_child(args: argparse.Namespace) -> None:
    """The coordinator alone in this process (its RSS is taken before the single index is
    opened here for the comparison): serve, query, report (JSON to --result)."""
    import ray

    from cluster.ray_shards import ShardPlacement
    from cluster.serve import ShardServing, serve_sharded
    from index.memory import process_memory
    from index.search import load_index
    from shards.staging import StageConfig

    ray.init(address=args.address, log_to_driver=False)
    start = time.perf_counter()
    placement = ShardPlacement(cpus=0.01, concurrency=2, shards_per_actor=args.group)
    serving = ShardServing(placement, StageConfig(args.cache_dir), timeout=60.0, transport=args.transport)
    index = serve_sharded(args.index, serving)
    ready_s = time.perf_counter() - start
    xq = np.load(args.queries)[: args.queries_n]
    floor = []
    for _ in range(100):  # the cost of one fan-out alone: every shard's cheapest call, in parallel
        t = time.perf_counter()
        index.call("info", index.every_shard())
        floor.append(time.perf_counter() - t)
    index.traffic.count = True
    for q in range(min(50, len(xq))):
        index.search(xq[q : q + 1], args.k, args.nprobe)
    per_query = (index.traffic.sent + index.traffic.received) / min(50, len(xq))
    index.traffic.count = False
    _, I1000 = index.search(xq[:1], 1000, args.nprobe)
    keys_times, keys_between, keys_in_request = [], [], []
    for _ in range(5):  # warm-up: the shards' key file pages
        index.keys_of(I1000)
    for _ in range(50):  # a fresh lookup on its own, one after another
        t = time.perf_counter()
        index.keys_of(I1000)
        keys_times.append(time.perf_counter() - t)
    for _ in range(30):
        t = time.perf_counter()
        index.keys_of(I1000)  # the same, each right after a k=1000 search (the shards busier)
        keys_between.append(time.perf_counter() - t)
        with index.request():  # as /search answers: the keys came with the candidates
            index.search(xq[:1], 1000, args.nprobe)
            t = time.perf_counter()
            index.keys_of(I1000)
            keys_in_request.append(time.perf_counter() - t)
    if index.has_locals:  # the re-ranking path's modules loaded before the memory is taken
        keys = json.loads(Path(args.rerank_keys).read_text())
        timed_reranks([index], keys[:3], args.k, args.nprobe)
    timed_queries([index], xq, args.k, args.nprobe)
    rss = process_memory().get("rss", 0)
    single = load_index(args.index)
    (times, D, I), (single_times, D1, I1) = timed_queries([index, single], xq, args.k, args.nprobe)
    out = {
        "ready_s": round(ready_s, 1),
        "coordinator_rss_mb": round(rss / 2**20, 1),
        "fanout_floor_p50_ms": round(float(np.median(floor)) * 1000, 3),
        "shards_per_actor": args.group,
        "transport": args.transport,
        "direct_channels": index.backend.channels_open(),
        "ray_calls": index.backend.ray_calls,
        "calls": index.backend.calls,
        "actors": len(index.backend.actors),
        "single": percentiles(single_times),
        "sharded": percentiles(times),
        "bytes_per_query": int(per_query),
        "keys_ms_1000": round(float(np.median(keys_times)) * 1000, 3),
        "keys_ms_1000_between_searches": round(float(np.median(keys_between)) * 1000, 3),
        "keys_ms_1000_after_search": round(float(np.median(keys_in_request)) * 1000, 3),
        "nodes": len({r["node"] for r in index.health()["replicas"]}),
        "identical_to_single": bool(np.array_equal(I, I1) and np.array_equal(D, D1)),
    }
    if index.has_locals:
        (rtimes, answers), (single_rtimes, single_answers) = timed_reranks([index, single], keys, args.k, args.nprobe)
        out["sharded"].update({"rerank_" + name: value for name, value in percentiles(rtimes).items()})
        out["single"].update({"rerank_" + name: value for name, value in percentiles(single_rtimes).items()})
        out["identical_to_single"] = out["identical_to_single"] and all(
            np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(answers, single_answers)
        )
    else:
        out["rerank"] = "not measured: no local tokens at this n (generating them here takes too long)"
    Path(args.result).write_text(json.dumps(out))
    ray.shutdown()


def run_size(n: int, args: argparse.Namespace, address: str, work: Path) -> dict:
    from index.search import load_index

    work.mkdir(parents=True, exist_ok=True)
    out, xq, build_s = build(work, n, args)
    single = load_index(out)
    if single.has_locals:
        (work / "rerank_keys.json").write_text(json.dumps(rerank_keys(single, args.rerank_queries)))
    result = {"n": n, "build_s": build_s, "keys_ms_1000_in_shards": keys_in_shards(single, out, xq[:1], args.nprobe)}
    del single
    for transport, group in [(t, g) for t in args.transport for g in args.shards_per_actor]:
        report = work / f"coordinator_{transport}_g{group}.json"
        command = [sys.executable, __file__, "--child", "--address", address, "--index", str(out)]
        command += ["--queries-file", str(work / "queries.npy"), "--queries-n", str(args.queries)]
        command += ["--result", str(report), "--group", str(group), "--transport", transport]
        command += ["--k", str(args.k), "--nprobe", str(args.nprobe), "--cache-dir", str(work / "cache-{node}")]
        command += ["--rerank-keys", str(work / "rerank_keys.json")]
        remove_node_caches(work)
        subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        remove_node_caches(work)
        deployment = json.loads(report.read_text())
        deployment["p50_ratio_vs_single"] = round(deployment["sharded"]["p50_ms"] / deployment["single"]["p50_ms"], 2)
        result.setdefault("deployments", []).append(deployment)
    # the headline figures: the last deployment (direct channels, shards grouped one actor per node by default)
    result.update(result["deployments"][-1])
    return result


def main() -> None:
    from webapi.spec import TRANSPORTS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, nargs="+", default=[1_000_000, 4_000_000])
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument(
        "--shards-per-actor",
        type=int,
        nargs="+",
        help="deployments measured, each one child (default: 1, then ceil(shards / nodes): one actor per node)",
    )
    p.add_argument("--group", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument(
        "--transport",
        nargs="+",
        choices=TRANSPORTS,
        default=["direct"],
        help="how the coordinator calls the shard actors: deployments measured with each (default: direct)",
    )
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--nlist", type=int, default=1024)
    p.add_argument("--pq-bytes", type=int, default=16)
    p.add_argument("--nprobe", type=int, default=16)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--rerank-queries", type=int, default=50)
    p.add_argument("--tokens-max", type=int, default=200_000, help="local tokens (and re-ranking) up to this n")
    p.add_argument("--workdir", help="keep the data and indexes here (reused by later runs)")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--index", help=argparse.SUPPRESS)
    p.add_argument("--queries-file", dest="queries_path", help=argparse.SUPPRESS)
    p.add_argument("--queries-n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    p.add_argument("--rerank-keys", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.queries = args.queries_path
        args.transport = args.transport[0]
        coordinator_child(args)
        return

    import ray
    from ray.cluster_utils import Cluster

    args.shards_per_actor = args.shards_per_actor or [1, -(-args.shards // args.nodes)]
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="needle-sharded-"))
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_0": 1}})
    for i in range(1, args.nodes):
        nodes.add_node(num_cpus=1, resources={f"node_{i}": 1})
    ray.init(address=nodes.address, log_to_driver=False)
    nodes.wait_for_nodes()
    try:
        sizes = [run_size(n, args, nodes.address, work / f"n{n}_d{args.d}_s{args.shards}") for n in args.n]
    finally:
        ray.shutdown()
        nodes.shutdown()
    small, large = sizes[0]["coordinator_rss_mb"], sizes[-1]["coordinator_rss_mb"]
    summary = {
        "benchmark": "sharded_serving",
        "setup": {
            "nodes": args.nodes,
            "shards": args.shards,
            "d": args.d,
            "index": f"IVF{args.nlist},PQ{args.pq_bytes} refine_factor=2, nprobe={args.nprobe}",
            "k": args.k,
            "queries": args.queries,
            "cores": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        },
        "sizes": sizes,
        "coordinator_rss_growth": round((large - small) / small, 4),
        "keys_ms_1000": sizes[-1]["keys_ms_1000"],
        "keys_ms_1000_in_shards": sizes[-1]["keys_ms_1000_in_shards"],
        "keys_ms_1000_between_searches": sizes[-1]["keys_ms_1000_between_searches"],
        "keys_ms_1000_after_search": sizes[-1]["keys_ms_1000_after_search"],
        "identical_to_single": all(s["identical_to_single"] for s in sizes),
        "p50_ratio_vs_single": sizes[-1]["p50_ratio_vs_single"],  # the last deployment's (grouped by default)
        "p50_ratio_vs_single_by_deployment": {  # "transport/shards per actor"
            f"{d['transport']}/{d['shards_per_actor']}": d["p50_ratio_vs_single"] for d in sizes[-1]["deployments"]
        },
    }
    line = json.dumps(summary)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(line)


if __name__ == "__main__":
    main()
