"""The ILIAS benchmark's layout, result formats and scoring, so that needle's results and the
benchmark's own evaluation script agree.

Layout (``<dataset>/image_ids/``): ``image_query_ids.txt`` (``id,...`` rows), ``text_query_ids.txt``,
``positive_ids.txt`` (rows ``id,scale,clutter``), ``distractor_ids.txt.gz``. Ids are
``<tar basename>/<__key__>`` (needle's keys); an instance's ground truth is every positive whose id
starts with ``<instance>/``, the instance being a query id's first component.

Result formats the benchmark reads: a pickle ``{"query_ids", "db_ids", "sims" (nq, k), "ranks" (nq, k)}``
(``ranks`` index ``db_ids``) and a JSON ``{query_id: {db_id: score}}``. The pickle's names are the
keywords of ``ILIAS.evaluate`` in the benchmark's current ``evaluation/src/dataset.py``, called as
``evaluate(**pickle)``, and what its own ``knn_search/search.py --save_as pickle`` writes; an older
revision of the evaluation named the scores ``similarities`` (``read_results_pickle`` reads both).

Scoring, as the benchmark computes it: a query's results sorted by descending score, cut at k;
AP = scikit-learn's average precision of that list (score ties form one threshold) times
hits / min(k, |gt|); 0 without hits; oracle = hits / len(list) * k / |gt| (the re-ranking upper
bound). Breakdowns by positive scale and clutter remove the positives outside a bin from both the
ranking and the ground truth.
"""

from __future__ import annotations

import gzip
import json
import pickle
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.atomic import write_atomic
from core.errors import NeedleInputError

# The benchmark's bins of positive scale (object area fraction) and clutter.
SCALE_GROUPS = (
    (0.0, 0.06880213760855043),
    (0.06880213760855043, 0.13526567164179104),
    (0.13526567164179104, 0.2729876723163842),
    (0.2729876723163842, float("inf")),
)
CLUTTER_GROUPS = ((0, 18), (18, 33), (33, 53), (53, float("inf")))


class ILIASDataError(NeedleInputError):
    """An ILIAS dataset directory or result file that is missing or malformed."""


def instance_of(image_id: str) -> str:
    return image_id.split("/")[0]


@dataclass
class ILIASDataset:
    image_query_ids: list[str]  # sorted
    text_query_ids: list[str]  # sorted
    positive_info: dict[str, tuple[float, int]]  # positive id -> (scale, clutter)
    distractor_ids: list[str] = field(default_factory=list)  # only when loaded

    @property
    def gt(self) -> dict[str, set[str]]:
        truth: dict[str, set[str]] = defaultdict(set)
        for image_id in self.positive_info:
            truth[instance_of(image_id)].add(image_id)
        return truth


def is_ilias_dataset(path: Path | str) -> bool:
    """A directory in the ILIAS layout (it holds ``image_ids/positive_ids.txt``)."""
    return (Path(path) / "image_ids" / "positive_ids.txt").is_file()


def text_query_texts(dataset_dir: Path | str, text_query_ids: list[str]) -> dict[str, str]:
    """The text of each text query: the ``Txxx.txt`` file the id names, relative to the dataset
    directory (``<id>`` itself, or ``<id>.txt``)."""
    texts = {}
    for query_id in text_query_ids:
        candidates = [Path(dataset_dir) / query_id, Path(dataset_dir) / f"{query_id}.txt"]
        path = next((c for c in candidates if c.is_file()), None)
        if path is None:
            raise ILIASDataError(f"text query {query_id!r}: no file {candidates[0]} or {candidates[1]}")
        text = path.read_text(errors="replace").strip()
        if not text:
            raise ILIASDataError(f"text query {query_id!r}: {path} is empty")
        texts[query_id] = text
    return texts


def _rows(path: Path) -> list[list[str]]:
    if not path.is_file():
        raise ILIASDataError(f"ILIAS file {path} does not exist")
    return [line.strip().split(",") for line in path.read_text().splitlines() if line.strip()]


def load_ilias(dataset_dir: Path | str, with_distractors: bool = False) -> ILIASDataset:
    ids = Path(dataset_dir) / "image_ids"
    positives = {}
    for row in _rows(ids / "positive_ids.txt"):
        try:
            positives[row[0]] = (float(row[1]), int(row[2]))
        except (IndexError, ValueError) as exc:
            raise ILIASDataError(f"{ids / 'positive_ids.txt'}: row {row} is not 'id,scale,clutter'") from exc
    distractors = []
    if with_distractors:
        path = ids / "distractor_ids.txt.gz"
        if not path.is_file():
            raise ILIASDataError(f"ILIAS file {path} does not exist")
        with gzip.open(path, "rt") as f:
            distractors = [line.strip() for line in f if line.strip()]
    return ILIASDataset(
        sorted(r[0] for r in _rows(ids / "image_query_ids.txt")),
        sorted(r[0] for r in _rows(ids / "text_query_ids.txt")),
        positives,
        distractors,
    )


def sklearn_average_precision(y_true: np.ndarray, y_score: np.ndarray) -> float:
    """scikit-learn's ``average_precision_score`` for binary labels: Σ (R_n − R_{n−1}) P_n over
    the distinct score thresholds (tied scores form one threshold)."""
    order = np.argsort(-y_score, kind="mergesort")
    y_true, y_score = np.asarray(y_true, bool)[order], np.asarray(y_score, np.float64)[order]
    last_of_group = np.r_[np.flatnonzero(np.diff(y_score)), len(y_score) - 1]
    tps = np.cumsum(y_true)[last_of_group]
    if tps[-1] == 0:
        return 0.0
    precision = tps / (last_of_group + 1)
    recall = tps / tps[-1]
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def score_query(result_ids: np.ndarray, scores: np.ndarray, gt: set[str], k: int) -> tuple[float, float]:
    """(AP, oracle) of one query's results, both in [0, 1], as the benchmark scores them."""
    order = np.argsort(-scores, kind="stable")
    top_ids, top_scores = result_ids[order][:k], scores[order][:k]
    y_true = np.isin(top_ids, list(gt))
    if not y_true.any():
        return 0.0, 0.0
    ap = sklearn_average_precision(y_true, top_scores) * y_true.sum() / min(k, len(gt))
    return ap, float(y_true.mean() * (k / len(gt)))


def _breakdown(bins, attribute: int, result_ids, scores, gt, info, k, out) -> None:
    for low, high in bins:
        excluded = {i for i in gt if not low <= info[i][attribute] < high}
        if gt - excluded:
            keep = ~np.isin(result_ids, list(excluded))
            out[f"{low}-{high}"].append(100 * score_query(result_ids[keep], scores[keep], gt - excluded, k)[0])


def evaluate_results(
    dataset: ILIASDataset, query_ids: list[str], db_ids: np.ndarray, sims: np.ndarray, ranks: np.ndarray, k: int = 1000
) -> dict[str, Any]:
    """mAP@k, oracle and the scale/clutter breakdowns of results in the pickle layout (the keyword
    names are the pickle's: ``evaluate_results(dataset, **read_results_pickle(path))``)."""
    db_ids = np.asarray(db_ids)
    gt = dataset.gt
    aps, oracles = [], []
    scale, clutter = defaultdict(list), defaultdict(list)
    for q, scores, rank in zip(query_ids, sims, ranks):
        truth = gt.get(instance_of(q))
        if not truth:
            raise ILIASDataError(f"query {q!r} has no positives in the dataset (instance {instance_of(q)!r})")
        result_ids, scores = db_ids[np.asarray(rank)], np.asarray(scores, np.float64)
        ap, oracle = score_query(result_ids, scores, truth, k)
        aps.append(100 * ap)
        oracles.append(100 * oracle)
        _breakdown(SCALE_GROUPS, 0, result_ids, scores, truth, dataset.positive_info, k, scale)
        _breakdown(CLUTTER_GROUPS, 1, result_ids, scores, truth, dataset.positive_info, k, clutter)
    return {
        "queries": list(query_ids),
        "map": float(np.mean(aps)),
        "aps": aps,
        "oracle": float(np.mean(oracles)),
        "scale": {b: float(np.mean(v)) for b, v in scale.items()},
        "clutter": {b: float(np.mean(v)) for b, v in clutter.items()},
    }


def results_layout(rankings: list[list[str]], scores: list[list[float]]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Per-query ranked ids and scores -> (db_ids, sims (nq, k), ranks (nq, k)). Every
    query needs the same number of results: the benchmark has no padding (a padded rank would
    point at a real image)."""
    lengths = {len(r) for r in rankings} | {len(v) for v in scores}
    if len(lengths) > 1:
        raise ILIASDataError(
            f"every query needs the same number of results for the ILIAS pickle, got lengths {sorted(lengths)}"
        )
    db_ids = sorted({i for ranking in rankings for i in ranking})
    position = {i: p for p, i in enumerate(db_ids)}
    sims = np.asarray(scores, np.float32).reshape(len(rankings), -1)
    ranks = np.asarray([[position[i] for i in ranking] for ranking in rankings], np.int64).reshape(len(rankings), -1)
    return db_ids, sims, ranks


def write_results_pickle(
    path: Path | str, query_ids: list[str], rankings: list[list[str]], scores: list[list[float]]
) -> Path:
    """The benchmark's pickle: its evaluation reads it with ``evaluate(**pickle.load(f))``."""
    db_ids, sims, ranks = results_layout(rankings, scores)
    payload = {"query_ids": list(query_ids), "db_ids": np.asarray(db_ids), "sims": sims, "ranks": ranks}
    return write_atomic(Path(path), lambda tmp: Path(tmp).write_bytes(pickle.dumps(payload)))


PICKLE_KEYS = ("query_ids", "db_ids", "sims", "ranks")
LEGACY_SCORE_KEY = "similarities"  # the scores' name in the evaluation's older revision


def read_results_pickle(path: Path | str) -> dict[str, Any]:
    """A result pickle (needle's, the benchmark's knn_search's, or one with the older ``similarities``
    name) as ``{query_ids, db_ids, sims, ranks}``; anything else is an ILIASDataError naming the file."""
    try:
        payload = pickle.loads(Path(path).read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError) as exc:
        raise ILIASDataError(f"ILIAS result pickle {path}: cannot read it ({type(exc).__name__}: {exc})") from exc
    if isinstance(payload, dict) and "sims" not in payload and LEGACY_SCORE_KEY in payload:
        payload["sims"] = payload.pop(LEGACY_SCORE_KEY)
    if not isinstance(payload, dict) or set(payload) != set(PICKLE_KEYS):
        found = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        raise ILIASDataError(f"ILIAS result pickle {path}: expected the keys {list(PICKLE_KEYS)}, found {found}")
    return payload


def write_results_json(
    path: Path | str, query_ids: list[str], rankings: list[list[str]], scores: list[list[float]]
) -> Path:
    """The benchmark's JSON: ``{query_id: {db_id: score}}`` in rank order."""
    payload = {q: {i: float(s) for i, s in zip(r, v)} for q, r, v in zip(query_ids, rankings, scores)}
    return write_atomic(Path(path), lambda tmp: Path(tmp).write_text(json.dumps(payload)))
