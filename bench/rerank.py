"""Re-ranking on real photos: ``../shared/data/realbench`` through ingestion (globals + local tokens),
the exact index and the local store, then re-ranking of each query's global top-1000.

The database holds every image (the 132 grouped ones and the 1,518 distractors) with the database
tokens of ``--locals`` (default ``aliked-n16``: ALIKED-N16 keypoints at 512 px; ``lite0-s16``:
Lite0's stride-16 stage at 512 px), 128-bit ITQ codes learned on a sample of the distractors
(``ITQ_SAMPLE``: per token kind, which distractor shards and how many tokens per image), kept up to
``--db-tokens`` per image, of which the first 100 (2,308 B) are used; the queries (every grouped
image with another image of its group) get the preset's query-side tokens (``<locals>-query``:
ALIKED 300 keypoints at 512 px; Lite0 100 tokens at each of 384/512/768 px), ingested (plain codes)
and extracted as ``needle query --image`` does (keeping the float ITQ projections that asymmetric
matching scores). One token kind per run (and per ``--workdir``): run it once per kind to compare
them.

Cross-validation over instance groups: the queries are split into ``--folds`` folds by group (every
query of a group in one fold); each fold is scored with the settings and λ chosen on the other
folds' queries, never on its own. Every variant is a row of ``variants`` (mAP@1k, ms/query,
bytes/image, what each fold chose):

* SP as before issue 21 (plain Hamming, single-match hypotheses; threshold and LO per fold);
* + two-match (rotation-aware) hypotheses; asymmetric matching; both (threshold 28/32 per fold);
* the defaults (``RerankConfig()``: asymmetric, the kind's threshold, pair hypotheses, the
  ensemble's floor and Chamfer term), λ per fold; and every SP setting of this issue chosen per
  fold, floor or none included, SP alone (``sp, all settings per fold``);
* the defaults followed by α-QE over the verified top and a second scoring of the shortlist;
* the defaults with other query-side tokens (no storage cost; ``QUERY_TOKEN_VARIANTS`` of the kind);
* Chamfer plain and asymmetric; AMES trained here on distractor pairs (``--skip-ames`` to leave out).

Held out by source (issue 37, bench/rerank_sources.py; the headline): every setting of
``HELD_OUT_GRID`` x the kind's query-token sets (λ, threshold, pair hypotheses, floor, Chamfer
term, α-QE) is
chosen on the other image sources' queries and scored on the held-out source's:
``gain_source_held_out`` (pooled per query), ``by_source_held_out`` (per source: queries,
global-only, the defaults in-sample, held out, the setting chosen), ``defaults_in_sample`` and
``consensus_setting`` (the setting most folds chose: what the defaults should be).

Prints the table and one JSON line last (also written to ``--out``): ``map_at_1k`` (global, SP as
before, the defaults, ...), ``gain`` (the defaults over global-only, λ per group fold), ``gain_nested``,
``rerank_ms_per_query`` (the defaults: 1,000 candidates x 100 binary tokens, gathering included,
timed in the same run; torch threads from OMP_NUM_THREADS), ``local_bytes_per_image``, ``variants``,
a curve of mAP against tokens per database image, and ``by_source``: global-only and the defaults'
mAP@1k per image source of realbench (where re-ranking pays and where it does not).

    OMP_NUM_THREADS=2 python bench/rerank.py [--locals lite0-s16|aliked-n16] [--workdir DIR] [--reuse]
        [--skip-ames] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# This file is named like the `rerank` package: keep its own directory off the front of the import path
# (its siblings rerank_scoring/rerank_setup are found after the root, where `rerank` is the package).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))

from rerank_scoring import (  # noqa: E402
    ASYMMETRIC_MAX_DISTANCE,
    BYTES_PER_TOKEN,
    FLOORS,
    PAIR_SEEDS,
    QUERY_TOKEN_VARIANTS,
    SHORTLIST,
    SP_LO_ITERATIONS,
    SP_MAX_HAMMING,
    TIMED_TOKENS,
    TOKEN_CURVE,
    K,
    _cv_over_settings,
    _describe,
    _sp_config,
    cross_validated_map,
    expansion_ms,
    glue_by_source,
    held_out_by_source,
    map_by_source,
    qe_cross_validated,
    validation_queries,
)
from rerank_setup import (  # noqa: E402
    Bench,
    local_scores,
    log,
    prepare,
    query_tokens_with_projections,
    realbench_sources,
    train_ames,
)

from embed.locals.presets import DEFAULT_LOCALS  # noqa: E402  (torch-free: the registry of presets)

BYTES_PER_IMAGE = TIMED_TOKENS * BYTES_PER_TOKEN + 8  # the timed setting's local bytes per image


class Defaults(NamedTuple):  # no dataclass: this file is also loaded by its path (outside sys.modules)
    """The defaults' figures that later phases read: their scoring pass (image query tokens), its
    ms/query (α-QE's included where it is a default), mAP@1k with and without per-fold choices."""

    vq: list
    rerank_ms: float
    qe_ms: float
    default_map: float
    nested_map: float
    top: int  # the kind's α-QE: results looked at (0: none)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", help="keep tars, descriptors, index and AMES here (default: a temp dir)")
    parser.add_argument(
        "--locals", default=DEFAULT_LOCALS, choices=("lite0-s16", "aliked-n16"), help="database token preset"
    )
    parser.add_argument("--db-tokens", type=int, default=max(TOKEN_CURVE), help="tokens stored per database image")
    parser.add_argument("--folds", type=int, default=5, help="cross-validation folds over the instance groups")
    parser.add_argument("--ames-epochs", type=int, default=10)
    parser.add_argument(
        "--ames-shortlist", type=int, default=100, help="AMES re-ranks this many (its CPU cost is per pair)"
    )
    parser.add_argument("--skip-ames", action="store_true")
    parser.add_argument(
        "--cpus-per-worker",
        type=int,
        default=2,
        help="ingestion: CPUs (torch threads) per Ray worker; 1 on a busy shared machine (no thread barrier "
        "stalls), the tokens are the same",
    )
    parser.add_argument(
        "--glue",
        default="",
        help="also verify the top with LightGlue, candidates' descriptors from these sources (codes,images; "
        "bench/rerank_glue.py)",
    )
    parser.add_argument("--glue-tops", default="5,10,20", help="the second stage's N: its curve's points")
    parser.add_argument(
        "--glue-keypoints",
        type=int,
        help="--glue images: re-extract this many keypoints per candidate, and as many for the query "
        "(default: the database preset's 100 and the query's 300)",
    )
    parser.add_argument("--reuse", action="store_true", help="reuse descriptors/index/AMES already in --workdir")
    parser.add_argument(
        "--shipped-itq",
        action="store_true",
        help="binarise with the shipped ITQ projection instead of one learned from the distractors",
    )
    parser.add_argument("--out", help="also write the JSON result here (e.g. bench/results/rerank_realbench.json)")
    return parser.parse_args()


def global_result(bench: Bench) -> dict:
    """The result's global-only figures (and the oracle of the top-K), logged."""
    lists = bench.lists
    oracle = 100.0 * float(np.mean([min(K, int(e["positive"].sum())) / min(K, e["n_positives"]) for e in lists]))
    log.info(
        "global mAP@1k %.2f (oracle of the top-%d: %.2f), global search %.2f ms/query",
        bench.global_map,
        K,
        oracle,
        bench.global_ms,
    )
    return {
        "map_at_1k": {"global": round(bench.global_map, 2)},
        "n_queries": len(lists),
        "oracle_top1k": round(oracle, 2),
    }


def variant_row(name: str, value: float, ms: float, chosen: list[dict]) -> dict:
    """A row of ``variants``: mAP@1k, ms/query, the timed setting's bytes/image, what each fold chose."""
    return {
        "name": name,
        "map_at_1k": round(value, 2),
        "ms_per_query": round(ms, 1),
        "bytes_per_image": BYTES_PER_IMAGE,
        "chosen_on_validation": chosen,
    }


def sp_row(bench: Bench, name: str, tokens_name: str, options: list[dict], floors=(0.0,), timed=None) -> dict:
    """A variant: SP settings (``options``) x floors, one chosen per fold with λ."""
    from rerank.rerank import with_kind_defaults

    runs = {}
    for option in options:
        vq, ms = bench.scored(tokens_name, _sp_config(option))
        for floor in floors:
            runs[f"{_describe(with_kind_defaults(_sp_config(option), bench.kind))},floor={floor}"] = (vq, ms, floor)
    value, chosen = _cv_over_settings(runs, bench.folds, bench.ensemble)
    timed_conf = _sp_config(timed if timed is not None else options[-1])
    row = variant_row(name, value, bench.scored(tokens_name, timed_conf)[1], chosen)
    log.info("%s: mAP@1k %.2f", name, value)
    return row


def sp_variants(bench: Bench) -> list[dict]:
    """The SP rows: as before issue 21, its two changes alone and together, the defaults, every setting."""
    from rerank.rerank import RerankConfig, with_kind_defaults

    # SP as before this issue: plain Hamming distances, single-match hypotheses, no floor.
    plain = {"match": {"asymmetric": False}, "spatial": {"pair_seeds": 0}}
    before = [
        {"match": {"asymmetric": False, "max_distance": d}, "spatial": {"pair_seeds": 0, "lo_iterations": lo}}
        for d in SP_MAX_HAMMING
        for lo in SP_LO_ITERATIONS
    ]
    asym = [{"match": {"max_distance": d}} for d in ASYMMETRIC_MAX_DISTANCE]
    return [
        sp_row(
            bench, "SP as before (plain Hamming, single-match hypotheses; threshold 32/40, LO 0/3)", "ingested", before
        ),
        sp_row(
            bench,
            "+ two-match (rotation-aware) hypotheses",
            "ingested",
            [{"match": plain["match"], "spatial": {"pair_seeds": PAIR_SEEDS}}],
        ),
        sp_row(
            bench,
            "asymmetric matching (float query vs 128-bit codes; threshold 28/32)",
            "image",
            [dict(o, spatial={"pair_seeds": 0}) for o in asym],
            timed={"spatial": {"pair_seeds": 0}},
        ),
        sp_row(bench, "asymmetric + two-match hypotheses (threshold 28/32)", "image", asym, timed={}),
        sp_row(
            bench,
            "defaults (RerankConfig()): asymmetric + two-match, the ensemble's (λ per fold; its floor and Chamfer "
            "term)" + (", before α-QE" if with_kind_defaults(RerankConfig(), bench.kind).expansion.top else ""),
            "image",
            [{}],
            floors=(None,),
        ),
        sp_row(
            bench,
            "SP, all settings of this issue per fold (asymmetric, threshold 28/32, pairs 0/8, floor none/99.5)",
            "image",
            [dict(o, spatial={"pair_seeds": p}) for o in asym for p in (0, PAIR_SEEDS)],
            floors=FLOORS,
            timed={},
        ),
    ]


def global_vectors(bench: Bench) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each query's global vector and its shortlist's, from the index (α-QE's input)."""
    index = bench.index
    return [
        (
            np.asarray(index.vector_of(e["key"]), np.float64),
            np.asarray(index.vectors[index.positions_of_rows(e["rows"])], np.float64),
        )
        for e in bench.lists
    ]


def defaults_with_expansion(bench: Bench, variants: list[dict], result: dict) -> Defaults:
    """The defaults' figures: SP, then α-QE where the token kind's is on (embed.locals.presets.RERANK_BY_KIND),
    their mAP per image source, and α-QE chosen per fold (a row each)."""
    from rerank.expand import ExpansionConfig
    from rerank.rerank import RerankConfig, with_kind_defaults

    lists, folds, chamfer_weight = bench.lists, bench.folds, bench.ensemble.chamfer_weight
    result["map_at_1k"]["sp"] = variants[0]["map_at_1k"]
    default_map = variants[4]["map_at_1k"]  # the defaults' SP; with α-QE below where that is a default
    result["map_at_1k"]["sp_nested"] = nested_map = variants[5]["map_at_1k"]
    default_vq, rerank_ms = bench.scored("image", RerankConfig(method="sp"))
    bench.vectors = vectors = global_vectors(bench)
    kind_qe = with_kind_defaults(RerankConfig(), bench.kind).expansion
    top, min_inliers = kind_qe.top, kind_qe.min_inliers
    qe_ms = expansion_ms(bench.index, lists, default_vq, kind_qe if top else ExpansionConfig(top=5), bench.ensemble)
    if top:
        result["map_at_1k"]["sp_default_no_qe"] = default_map
        default_map, chosen = qe_cross_validated(
            lists, default_vq, vectors, folds, [kind_qe], chamfer_weight=chamfer_weight
        )
        rerank_ms += qe_ms
        name = f"defaults (RerankConfig()): the above + α-QE, mean of the top {top} with >= {min_inliers} inliers, "
        variants.append(variant_row(name + "second scoring of the shortlist", default_map, rerank_ms, chosen))
    result["map_at_1k"]["sp_default"] = round(default_map, 2)
    by_fold = (variants[-1] if top else variants[4])["chosen_on_validation"]
    sources = realbench_sources(bench.rows)
    qe = kind_qe if top else None
    result["by_source"] = map_by_source(lists, default_vq, folds, by_fold, sources, vectors, qe, chamfer_weight)
    qe_map, qe_chosen = qe_cross_validated(lists, default_vq, vectors, folds, chamfer_weight=chamfer_weight)
    name = "the defaults' SP + α-QE chosen per fold (none, or top 1-5, >= 5-20 inliers, alpha 0/3)"
    variants.append(variant_row(name, qe_map, variants[4]["ms_per_query"] + qe_ms, qe_chosen))
    result["map_at_1k"]["sp_qe_per_fold"] = round(qe_map, 2)
    if top:  # the expansion is a default: the nested number chooses it (or none) per fold too
        nested_map = qe_map
    return Defaults(default_vq, rerank_ms, qe_ms, default_map, nested_map, top)


def held_out_and_glue(bench: Bench, result: dict) -> None:
    """Held out by source over the kind's query-token sets too; with ``--glue`` LightGlue's second stage."""
    args, lists = bench.args, bench.lists
    for name, scales, top_k in QUERY_TOKEN_VARIANTS[bench.kind]:
        bench.token_sets[name] = query_tokens_with_projections(
            bench.work, lists, bench.images, bench.itq, args.locals, scales, top_k
        )
    result.update(held_out_by_source(bench.scored, lists, bench.vectors, realbench_sources(bench.rows), bench.kind))
    if args.glue:
        glue_queries = bench.token_sets["image"]
        if args.glue_keypoints:  # the query's keypoints as many as the re-extracted candidates'
            glue_queries = query_tokens_with_projections(
                bench.work, lists, bench.images, bench.itq, args.locals, (1.0,), args.glue_keypoints
            )
        result["glue"] = glue_by_source(
            bench.scored,
            lists,
            bench.vectors,
            realbench_sources(bench.rows),
            result,
            bench.index,
            glue_queries,
            bench.itq,
            bench.work,
            args,
        )


def query_token_variants(bench: Bench, variants: list[dict]) -> None:
    """Query-side tokens cost no storage: more scales or more tokens per scale, the defaults otherwise."""
    from rerank.rerank import RerankConfig

    for name, scales, top_k in QUERY_TOKEN_VARIANTS[bench.kind]:
        bench.token_sets[name] = query_tokens_with_projections(
            bench.work, bench.lists, bench.images, bench.itq, bench.args.locals, scales, top_k
        )
        vq, ms = bench.scored(name, RerankConfig(method="sp"))
        value, chosen = cross_validated_map(vq, bench.folds, "sp", chamfer_weight=bench.ensemble.chamfer_weight)
        row_name = f"defaults, query tokens {top_k} at each of {len(scales)} scales {scales}"
        variants.append(variant_row(row_name, value, ms, chosen))


def chamfer_variants(bench: Bench, variants: list[dict], result: dict) -> None:
    """Chamfer similarity instead of SP: plain Hamming and asymmetric."""
    from rerank.matching import MatchConfig
    from rerank.rerank import RerankConfig

    for name, tokens_name, conf in (
        ("Chamfer (plain Hamming)", "ingested", RerankConfig(method="chamfer", match=MatchConfig(asymmetric=False))),
        ("Chamfer, asymmetric", "image", RerankConfig(method="chamfer")),
    ):
        vq, ms = bench.scored(tokens_name, conf)
        value, chosen = cross_validated_map(vq, bench.folds, "chamfer")
        variants.append(variant_row(name, value, ms, chosen))
    result["map_at_1k"]["chamfer"] = variants[-2]["map_at_1k"]
    result["map_at_1k"]["chamfer_asymmetric"] = variants[-1]["map_at_1k"]


def token_curve(bench: Bench, defaults: Defaults) -> list[dict]:
    """The defaults' mAP@1k against tokens per database image (up to ``--db-tokens``)."""
    from rerank.rerank import RerankConfig, Reranker

    curve = []
    default_reranker = Reranker(RerankConfig(method="sp"), bench.kind)
    for n in TOKEN_CURVE:
        if n > bench.args.db_tokens:
            continue
        if n == TIMED_TOKENS:
            vq, ms = defaults.vq, defaults.rerank_ms
        else:
            raws, ms = local_scores(bench.index, default_reranker, bench.lists, bench.proj_tokens, n)
            vq = validation_queries(bench.lists, raws, SHORTLIST)
        value, _ = cross_validated_map(vq, bench.folds, "sp", chamfer_weight=bench.ensemble.chamfer_weight)
        curve.append(
            {
                "tokens": n,
                "bytes_per_image": n * BYTES_PER_TOKEN + 8,
                "map_at_1k_sp_default": round(value, 2),
                "rerank_ms_per_query": round(ms, 1),
            }
        )
    return curve


def ames_variant(bench: Bench, variants: list[dict], result: dict) -> None:
    """AMES trained here on distractor pairs (or reused with ``--reuse``), re-ranking its shortlist."""
    from rerank.rerank import RerankConfig, Reranker

    args, index, lists = bench.args, bench.index, bench.lists
    ckpt = bench.work / "ames.pt"
    if not (args.reuse and ckpt.is_file()):
        ckpt = train_ames(bench.work, args.ames_epochs, bench.itq, args.locals)
    ames = Reranker(RerankConfig(method="ames", ames=str(ckpt), shortlist=args.ames_shortlist), bench.kind)
    # AMES was trained on single-scale database tokens: the query uses its stored ones too.
    stored = {e["key"]: index.local_store.tokens(index.position_of(e["key"])) for e in lists}
    raws, ames_ms = local_scores(index, ames, lists, stored, TIMED_TOKENS, args.ames_shortlist)
    ames_map, chosen = cross_validated_map(
        validation_queries(lists, raws, args.ames_shortlist), bench.folds, "ames", gammas=(0.1, 0.25, 0.5, 1.0, 2.0)
    )
    result["map_at_1k"]["ames"] = round(ames_map, 2)
    variants.append(
        variant_row(f"AMES trained here (distractor pairs), top {args.ames_shortlist}", ames_map, ames_ms, chosen)
    )
    result["ames_shortlist"] = args.ames_shortlist


def summary(bench: Bench, defaults: Defaults, variants: list[dict], curve: list[dict]) -> dict:
    """The result's headline fields: the defaults' gain, their cost, the setting and the rows."""
    import torch

    from rerank.rerank import RerankConfig, with_kind_defaults

    args, global_map = bench.args, bench.global_map
    query_tokens = len(next(iter(bench.proj_tokens.values())))
    return {
        # the defaults' gain (λ per fold): the number the target is about; not the best row,
        # which would be a choice made on the test folds
        "gain": round(defaults.default_map - global_map, 2),
        "gain_nested": round(defaults.nested_map - global_map, 2),
        "expansion_ms_per_query": round(defaults.qe_ms, 2),
        "rerank_ms_per_query": round(defaults.rerank_ms, 1),
        "rerank_setting": f"defaults ({_describe(with_kind_defaults(RerankConfig(method='sp'), bench.kind))}, "
        f"expansion top {defaults.top}) on "
        f"{SHORTLIST} candidates x "
        f"{TIMED_TOKENS} binary tokens, query {query_tokens} float tokens, "
        f"{torch.get_num_threads()} threads, gathering the tokens included",
        "local_bytes_per_image": BYTES_PER_IMAGE,
        "global_search_ms_per_query": round(bench.global_ms, 2),
        "folds": args.folds,
        "locals": args.locals,
        "itq": "learned on the distractors' tokens" if bench.itq else "shipped (demo photos)",
        "store_bytes_per_image": bench.index.infos["locals"]["bytes_per_image"],
        "variants": variants,
        "curve": curve,
        "targets": {"gain": 10.0, "rerank_ms_per_query": 100.0, "local_bytes_per_image": 2500},
    }


def write_result(result: dict, out: str | None) -> None:
    """The table, then the JSON line (also saved to ``out``: bench/record.py keeps the run it
    replaces in the benchmark's history)."""
    print_table(result)
    if out:
        from record import save_result

        save_result(result, out)
    print(json.dumps(result))


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="needle-rerank-")
    bench = prepare(args, Path(args.workdir or tmp.name))
    result = global_result(bench)
    variants = sp_variants(bench)
    defaults = defaults_with_expansion(bench, variants, result)
    held_out_and_glue(bench, result)
    query_token_variants(bench, variants)
    chamfer_variants(bench, variants, result)
    curve = token_curve(bench, defaults)
    if not args.skip_ames:
        ames_variant(bench, variants, result)
    result.update(summary(bench, defaults, variants, curve))
    if tmp is not None:
        tmp.cleanup()
    write_result(result, args.out)


def print_table(result: dict) -> None:
    """The variants as a Markdown table (docs/results.md's)."""
    g = result["map_at_1k"]["global"]
    print("| variant | mAP@1k | gain | ms/query | bytes/image |")
    print("|---|---|---|---|---|")
    print(f"| global only | {g:.2f} | | {result['global_search_ms_per_query']:.2f} (search) | |")
    for v in result["variants"]:
        print(
            f"| {v['name']} | {v['map_at_1k']:.2f} | {v['map_at_1k'] - g:+.2f} | {v['ms_per_query']:.0f} "
            f"| {v['bytes_per_image']:,} |"
        )


if __name__ == "__main__":
    main()
