"""FFA on a source of groups: its images (plus seeded distractors), their FFA descriptors, and the
grouped evaluation of eval/groups.py or the descriptors written to a file. Importing this module
stays light."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from core.atomic import write_atomic, write_json_atomic
from similarity.data import SimilarityDataError, load_groups, load_rgb, realbench_distractors
from similarity.ffa.config import FFAConfig
from similarity.ffa.descriptors import ffa_descriptors

if TYPE_CHECKING:  # heavy imports stay out of CLI start-up
    from eval.groups import GroupEvalConfig

log = logging.getLogger(__name__)


def load_items(
    source: Path | str, distractors: int = 0, seed: int = 0, min_size: int = 1
) -> tuple[list[Path], list[str]]:
    """(image paths, group labels) of a realbench-style directory or class folders, plus
    ``distractors`` seeded realbench distractors, each a group of its own."""
    groups = load_groups(source, min_size)
    paths = [p for g in groups for p in groups[g]]
    labels = [g for g in groups for _ in groups[g]]
    if distractors:
        pool = realbench_distractors(source)
        if distractors > len(pool):
            raise SimilarityDataError(f"{source} has {len(pool)} distractors, {distractors} asked for")
        pick = np.sort(np.random.default_rng(seed).choice(len(pool), size=distractors, replace=False))
        paths += [pool[i] for i in pick]
        labels += [f"distractor:{pool[i].name}" for i in pick]
    return paths, labels


def load_images(paths: Sequence[Path], resolution: int) -> list[np.ndarray]:
    """The images of ``paths`` at longer side ``resolution``, decoded once (every mode reuses them)."""
    return [load_rgb(p, resolution) for p in tqdm(paths, desc="decode", disable=len(paths) < 50)]


def evaluate(
    conf: FFAConfig,
    eval_conf: GroupEvalConfig,
    source: Path | str,
    distractors: int = 0,
    weights: str | Path | None = None,
) -> dict[str, Any]:
    """The grouped measures (eval/groups.py) of FFA descriptors of the images of ``source``."""
    from eval.groups import evaluate_groups
    from similarity.ffa.tokens import TokenMaps  # torch: only when extracting

    start = time.perf_counter()
    paths, labels = load_items(source, distractors, eval_conf.seed)
    images = load_images(paths, conf.resolution)
    tokens = TokenMaps(conf.model, conf.feature_stage, weights, conf.batch_size)
    desc, stats = ffa_descriptors(conf, images, tokens)
    report = evaluate_groups(desc, labels, eval_conf)
    return {
        "method": "ffa",
        "source": str(source),
        "distractors": distractors,
        "ffa": asdict(conf),
        **report,
        "masks": stats,
        "extractor": tokens.info(),
        "seconds": round(time.perf_counter() - start, 3),
    }


def eval_main(
    conf: FFAConfig,
    eval_conf: GroupEvalConfig,
    source: Path | str,
    output: Path | str,
    distractors: int = 0,
    weights: str | Path | None = None,
) -> Path:
    """Evaluate FFA descriptors of ``source`` by groups; write the JSON report to ``output``."""
    report = evaluate(conf, eval_conf, source, distractors, weights)
    write_json_atomic(report, Path(output))
    log.info(
        "ffa %s/%s: top-1 %.1f, mAP %.1f, ARI %s, odd-one-out %s",
        conf.mask,
        conf.mode,
        report["top1"],
        report["map"],
        report["ari"],
        report["odd_one_out"],
    )
    return Path(output)


def embed_main(
    conf: FFAConfig,
    source: Path | str,
    output: Path | str,
    distractors: int = 0,
    seed: int = 0,
    weights: str | Path | None = None,
) -> Path:
    """Write FFA descriptors of ``source`` to ``output`` (.npz: descriptors, paths, labels) and
    ``output``.json (how they were made)."""
    from similarity.ffa.tokens import TokenMaps  # torch: only when extracting

    start = time.perf_counter()
    paths, labels = load_items(source, distractors, seed)
    images = load_images(paths, conf.resolution)
    tokens = TokenMaps(conf.model, conf.feature_stage, weights, conf.batch_size)
    desc, stats = ffa_descriptors(conf, images, tokens)
    output = Path(output)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object, so numpy does not append .npz to the temp name
            np.savez(f, descriptors=desc, paths=np.asarray([str(p) for p in paths]), labels=np.asarray(labels))

    write_atomic(output, write)
    write_json_atomic(
        {
            "method": "ffa",
            "source": str(source),
            "distractors": distractors,
            "seed": seed,
            "ffa": asdict(conf),
            "images": len(paths),
            "dim": int(desc.shape[1]),
            "masks": stats,
            "extractor": tokens.info(),
            "seconds": round(time.perf_counter() - start, 3),
        },
        output.with_name(output.name + ".json"),
    )
    return output
