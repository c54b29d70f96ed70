"""``needle query`` as a stage: ``main(conf, index, inputs, output)`` answers the queries of
``inputs`` from ``index`` and writes the JSON answer to ``output`` (atomically), with a small
``<output stem>.info.json`` beside it (config, index, queries, seconds), like the other stages.
:func:`answer` is the same answer as a JSON value, for printing."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from core.atomic import write_json_atomic
from index.search import load_index
from query.index_protocol import Index
from query.query_images import check_query_images
from query.retrieve import QueryConfig, load_vectors, query

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueryInputs:
    """What to query with; results come in this order: keys, images, texts, text queries, vectors."""

    keys: tuple[str, ...] = ()  # stored keys
    images: tuple[str, ...] = ()  # image files
    texts: tuple[str, ...] = ()  # text queries (open_clip models)
    text_queries: tuple[tuple[str, str], ...] = ()  # (id, text) pairs, as query.retrieve.read_text_queries reads them
    vectors: str | None = None  # .npy file of query vectors, (d,) or (n, d)


def answer(conf: QueryConfig, index: Index | str | Path, inputs: QueryInputs, device: str = "cpu") -> Any:
    """The results of ``inputs`` on ``index`` (a directory, or an open index: a SearchIndex, or a
    coordinator of shards served elsewhere): one result dict per query, or that dict alone for a
    single query. ``device``: where this process re-ranks (``--device``)."""
    check_query_images([Path(p) for p in inputs.images])  # before the index and the model load
    if isinstance(index, (str, Path)):
        index = load_index(index)
    vectors = load_vectors(Path(inputs.vectors), index.d) if inputs.vectors else None
    results = query(
        index,
        conf,
        list(inputs.keys),
        [Path(p) for p in inputs.images],
        list(inputs.texts),
        vectors,
        list(inputs.text_queries),
        device,
    )
    return results if len(results) > 1 else results[0]


def info_path(output: Path) -> Path:
    """Where the run's info goes beside ``output``: ``answers.json`` -> ``answers.info.json``."""
    return output.with_name(f"{output.stem if output.suffix == '.json' else output.name}.info.json")


def main(conf: QueryConfig, index: Index | str | Path, inputs: QueryInputs, output: Path, device: str = "cpu") -> Path:
    """Answer ``inputs`` on ``index`` (re-ranking on ``device``); write the answer to ``output``
    and its info beside it; returns ``output``."""
    start = time.perf_counter()
    output = Path(output)
    index_path = index if isinstance(index, (str, Path)) else index.path
    result = answer(conf, index, inputs, device)
    write_json_atomic(result, output)
    write_json_atomic(
        {
            "config": asdict(conf),
            "index": str(index_path),
            "inputs": asdict(inputs),
            "device": device,
            "queries": len(result) if isinstance(result, list) else 1,
            "seconds": round(time.perf_counter() - start, 3),
        },
        info_path(output),
    )
    log.info("query: %d results written to %s", len(result) if isinstance(result, list) else 1, output)
    return output
