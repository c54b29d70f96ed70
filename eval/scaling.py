"""``needle eval scaling``: mAP@k as the database grows with distractors (ILIAS's scaling study).

The database at size n is the *core* (every image that is not a distractor: positives, and the
queries where they are indexed with the database) plus the first n distractors of a fixed order,
so the subsets are nested and the same on every run:

- ``order="file"``: the distractors in the order of the descriptor files and their rows (for an
  ILIAS dataset, its ``distractor_ids.txt.gz`` order); the first n then fill whole files, as
  ILIAS's scaling runs take the first distractor files;
- ``order="shuffle"``: a permutation drawn once from ``seed``.

Distractors are the rows of an ILIAS dataset's distractor list, or, with a JSON ground truth, every
row that is neither a query nor a positive (or the JSON's ``"distractors"`` list when it has one).

For every size, each base index kind of ``modes`` is built with the production builder (index/)
over that subset, and every mode is evaluated (eval/evaluate.py): ``exact`` (flat) and ``ivfpq``
(IVF-PQ with exact refine) search the global descriptors; ``<kind>+sp``, ``+chamfer`` or ``+ames``
re-rank the shortlist with local tokens, and are skipped (with a warning) when the descriptors
carry none. Each point records mAP@k, recall@k, the oracle, the search (and re-ranking) time per
query, and the memory per image: FAISS index bytes, refine-vector bytes and local-store bytes.

Outputs, in the ``output`` directory: ``scaling.json`` (the points and how they were made) and
``scaling.png`` (mAP@k against database size, log x, one line per model and mode). ``plot_runs``
overlays several runs (models) in one figure (``needle eval plot``).

The subset of a descriptor file that the size cuts through is written as a copy whose left-out
rows have status ``excluded`` (their row ids stay consecutive, as the index requires); whole files
are linked, not copied.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core.atomic import write_atomic, write_json_atomic
from core.errors import NeedleInputError
from eval.config import ScalingConfig
from eval.evaluate import EvalConfig, GroundTruth, evaluate, load_truth
from eval.ilias import is_ilias_dataset
from ingest.descriptors import STATUS_OK, list_descriptor_files

log = logging.getLogger(__name__)

STATUS_EXCLUDED = "excluded"  # rows left out of a distractor subset (never written by ingestion)
BASE_KINDS = {"exact": "flat", "ivfpq": "ivfpq"}
RERANK_METHODS = ("sp", "chamfer", "ames")


def parse_modes(modes: tuple[str, ...]) -> list[tuple[str, str | None]]:
    """Each mode as (base kind, re-ranking method or None)."""
    parsed = []
    for mode in modes:
        base, _, method = mode.partition("+")
        if base not in BASE_KINDS or (method and method not in RERANK_METHODS):
            raise NeedleInputError(
                f"unknown scaling mode {mode!r}: use exact or ivfpq, optionally with +{'/+'.join(RERANK_METHODS)}"
            )
        parsed.append((base, method or None))
    return parsed


def scan_keys(files: list[Path]) -> list[tuple[Path, list[str], np.ndarray]]:
    """(file, keys, ok mask) of every descriptor file, in order."""
    out = []
    for path in files:
        table = pq.read_table(path, columns=["key", "status"])
        out.append(
            (path, table["key"].to_pylist(), pc.equal(table["status"], STATUS_OK).to_numpy(zero_copy_only=False))
        )
    return out


def distractor_order(
    scanned: list[tuple[Path, list[str], np.ndarray]], truth: GroundTruth, ground_truth: Path, conf: ScalingConfig
) -> list[str]:
    """The distractors present in the descriptors, in the order whose prefixes are the subsets."""
    present = [k for _, keys, ok in scanned for k, good in zip(keys, ok) if good]
    listed = _listed_distractors(ground_truth)
    if listed is not None:
        available = set(present)
        order = [k for k in listed if k in available]
        if len(order) < len(listed):
            log.warning("%d of %d listed distractors are not in the descriptors", len(listed) - len(order), len(listed))
    else:
        core = {q["key"] for q in truth.queries} | {p for q in truth.queries for p in q["positives"]}
        order = [k for k in present if k not in core]
    if conf.order == "shuffle":
        order = [order[i] for i in np.random.default_rng(conf.seed).permutation(len(order))]
    elif conf.order != "file":
        raise NeedleInputError(f"unknown distractor order {conf.order!r}: use file or shuffle")
    return order


def _listed_distractors(ground_truth: Path) -> list[str] | None:
    if is_ilias_dataset(ground_truth):
        path = Path(ground_truth) / "image_ids" / "distractor_ids.txt.gz"
        if not path.is_file():
            raise NeedleInputError(
                f"ILIAS dataset {ground_truth} has no {path.name}: the scaling study needs the distractor list"
            )
        with gzip.open(path, "rt") as f:
            return [line.strip().split(",")[0] for line in f if line.strip()]
    data = json.loads(Path(ground_truth).read_text())
    return list(data["distractors"]) if "distractors" in data else None


def _excluded_copy(path: Path, keep: np.ndarray, out: Path) -> None:
    """``path`` with the rows outside ``keep`` marked excluded and their local tokens emptied."""
    table = pq.read_table(path)
    mask = pa.array(~keep)
    status = pc.if_else(mask, pa.scalar(STATUS_EXCLUDED), table["status"])
    table = table.set_column(table.schema.get_field_index("status"), table.schema.field("status"), status)
    for name in table.schema.names:
        if name.startswith("local_"):
            column = table[name]
            empty = pa.scalar([], type=column.type)
            table = table.set_column(
                table.schema.get_field_index(name), table.schema.field(name), pc.if_else(mask, empty, column)
            )
    write_atomic(out, lambda tmp: pq.write_table(table, tmp))


def write_subset(
    scanned: list[tuple[Path, list[str], np.ndarray]], chosen: set[str], distractors: set[str], directory: Path
) -> Path:
    """A descriptor directory of the core plus ``chosen`` distractors: whole files linked, cut
    files copied with their left-out rows excluded, files without a kept row left out."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    info = scanned[0][0].parent / "ingest_info.json"
    if info.is_file():
        shutil.copyfile(info, directory / info.name)
    for path, keys, _ in scanned:
        keep = np.fromiter((k not in distractors or k in chosen for k in keys), bool, len(keys))
        if not keep.any():
            continue
        target = directory / path.name
        if target.exists():
            raise NeedleInputError(f"two descriptor files are named {path.name}: give the scaling study distinct names")
        if keep.all():
            os.symlink(path.resolve(), target)
        else:
            _excluded_copy(path, keep, target)
    return directory


def memory_per_image(index_dir: Path, infos: dict[str, Any]) -> dict[str, float]:
    """Bytes per indexed image of a built index: its FAISS files, refine vectors and local store."""
    from index.shard_files import index_file_paths

    n = max(1, infos["ntotal"])
    index_bytes = sum(path.stat().st_size for path in index_file_paths(index_dir, infos))
    locals_infos = infos.get("locals") or {}
    return {
        "index_bytes_per_image": round(index_bytes / n, 1),  # FAISS codes, ids and (amortised) centroids
        "vectors_bytes_per_image": infos["dim"] * 2,  # float16 refine vectors, memory-mapped
        "local_bytes_per_image": round(locals_infos.get("bytes", 0) / n, 1),  # local-token store
    }


def run_size(
    conf: ScalingConfig, subset: Path, truth: GroundTruth, n_distractors: int, work: Path, with_locals: bool
) -> list[dict[str, Any]]:
    """Build each base index over one subset and evaluate every mode on it."""
    from index.build.stage import IndexConfig
    from index.build.stage import main as build_index
    from index.search import load_index
    from rerank.ensemble import EnsembleConfig
    from rerank.rerank import RerankConfig

    points = []
    modes = parse_modes(conf.modes)
    for base in dict.fromkeys(b for b, _ in modes):
        index_dir = work / f"{base}_{n_distractors}"
        index_conf = IndexConfig(
            kind=BASE_KINDS[base],
            memory_budget=conf.memory_budget,
            nlist=conf.nlist,
            adapt=conf.adapt,
            locals=with_locals,
            **({"nprobe": conf.nprobe} if conf.nprobe else {}),
        )
        build_index(index_conf, subset, index_dir)
        index = load_index(index_dir)
        memory = memory_per_image(index_dir, index.infos)
        for mode_base, method in modes:
            if mode_base != base:
                continue
            rerank = (
                RerankConfig(
                    method=method,
                    shortlist=conf.shortlist,
                    ensemble=EnsembleConfig() if conf.rerank_lambda is None else EnsembleConfig(lam=conf.rerank_lambda),
                    ames=conf.ames,
                )
                if method
                else None
            )
            eval_conf = EvalConfig(
                k=conf.k,
                nprobe=conf.nprobe,
                rerank=rerank,
                query_descriptors=conf.query_descriptors,
                query_locals=conf.query_locals if method else None,
            )
            report = evaluate(index_dir, truth, eval_conf, index=index)
            points.append(
                {
                    "mode": f"{base}+{method}" if method else base,
                    "distractors": n_distractors,
                    "database_size": index.ntotal,
                    "map": report[f"map_at_{conf.k}"],
                    "recall": report[f"recall_at_{conf.k}"],
                    "oracle": report[f"oracle_at_{conf.k}"],
                    "search_ms_per_query": report["search_ms_per_query"],
                    "n_queries": report["n_queries"],
                    "factory": index.infos["factory"],
                    "build_s": index.infos["build_s"],
                    **memory,
                    "local_bytes_per_image": memory["local_bytes_per_image"] if method else 0.0,
                }
            )
            log.info(
                "%s at %d distractors (database %d): mAP@%d %.2f, %.2f ms/query",
                points[-1]["mode"],
                n_distractors,
                index.ntotal,
                conf.k,
                points[-1]["map"],
                points[-1]["search_ms_per_query"],
            )
        del index
        if not conf.keep_indexes:
            shutil.rmtree(index_dir, ignore_errors=True)
    return points


def _has_locals(files: list[Path]) -> bool:
    from ingest.descriptors import has_locals

    return all(has_locals(f) for f in files)


def _model_label(files: list[Path], conf: ScalingConfig) -> str:
    if conf.label:
        return conf.label
    info = files[0].parent / "ingest_info.json"
    extractors = json.loads(info.read_text()).get("extractors", []) if info.is_file() else []
    name = next((e["model"]["name"] for e in extractors if e.get("extractor") == "global"), "descriptors")
    return name + (" +adapt" if conf.adapt else "")


def sizes_to_run(requested: tuple[int, ...], available: int) -> list[int]:
    bad = [s for s in requested if s < 0]
    if bad or not requested:
        raise NeedleInputError(f"distractor sizes must be >= 0, got {list(requested)}")
    sizes = sorted({s for s in requested if s <= available})
    dropped = sorted({s for s in requested if s > available})
    if dropped:
        log.warning("only %d distractors available: sizes %s dropped", available, dropped)
    return sizes


def main(conf: ScalingConfig, descriptors: Path | list[Path], ground_truth: Path, output: Path) -> Path:
    """Run the scaling study; writes ``output/scaling.json`` and ``output/scaling.png``; returns the JSON path."""
    start = time.perf_counter()
    sources = [descriptors] if isinstance(descriptors, (str, Path)) else list(descriptors)
    files = [f for s in sources for f in ([Path(s)] if Path(s).is_file() else list_descriptor_files(Path(s)))]
    parse_modes(conf.modes)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    truth = load_truth(ground_truth)
    scanned = scan_keys(files)
    order = distractor_order(scanned, truth, Path(ground_truth), conf)
    sizes = sizes_to_run(conf.sizes, len(order))
    with_locals = _has_locals(files)
    if not with_locals and any("+" in m for m in conf.modes):
        log.warning(
            "the descriptors carry no local tokens: re-ranking modes %s skipped", [m for m in conf.modes if "+" in m]
        )
        conf = replace(conf, modes=tuple(m for m in conf.modes if "+" not in m))
    distractor_set = set(order)
    points = []
    work = output / "indexes"
    for n in sizes:
        subset = write_subset(scanned, set(order[:n]), distractor_set, output / "subsets" / f"distractors_{n}")
        points += run_size(conf, subset, truth, n, work, with_locals)
        shutil.rmtree(subset, ignore_errors=True)
    shutil.rmtree(output / "subsets", ignore_errors=True)
    if not conf.keep_indexes:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "label": _model_label(files, conf),
        "k": conf.k,
        "core_size": len({k for _, keys, ok in scanned for k, good in zip(keys, ok) if good} - distractor_set),
        "distractors_available": len(order),
        "sizes": sizes,
        "points": points,
        "descriptors": [str(s) for s in sources],
        "ground_truth": str(ground_truth),
        "config": asdict(conf),
        "elapsed_s": round(time.perf_counter() - start, 1),
    }
    json_path = write_json_atomic(result, output / "scaling.json")
    plot_runs([result], output / "scaling.png")
    return json_path


def plot_runs(runs: list[dict[str, Any]], path: Path) -> Path:
    """mAP@k against database size (log x), one line per run (model) and mode; written atomically."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    if not runs:
        raise NeedleInputError("no scaling run to plot")
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for run in runs:
        for mode in dict.fromkeys(p["mode"] for p in run["points"]):
            pts = sorted((p for p in run["points"] if p["mode"] == mode), key=lambda p: p["database_size"])
            ax.plot(
                [p["database_size"] for p in pts], [p["map"] for p in pts], marker="o", label=f"{run['label']} · {mode}"
            )
    ax.set_xscale("log")
    ax.set_xlabel("database size (images, log scale)")
    ks = sorted({run["k"] for run in runs})
    ax.set_ylabel(f"mAP@{ks[0] if len(ks) == 1 else 'k'}")
    ax.set_title("Retrieval as distractors grow")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
    return path


def load_runs(paths: list[Path]) -> list[dict[str, Any]]:
    runs = []
    for path in paths:
        try:
            run = json.loads(Path(path).read_text())
            run["points"], run["label"], run["k"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise NeedleInputError(f"{path}: not a scaling.json of needle eval scaling ({exc})") from exc
        runs.append(run)
    return runs
