"""The query path: ``needle query``, ``needle serve`` and ``needle eval`` embed queries with the
model the index was built with, search the index, and re-rank the shortlist with local tokens.

Without re-ranking a search is the index's (D, I). With ``QueryConfig.rerank`` the index returns
the global top ``shortlist``; each query's local tokens (extracted at the query-side scales for an
image, read from the local store or a query-descriptor directory for a stored key) re-score that
shortlist (rerank/), which is re-ordered by the ensemble score; candidates past the shortlist
follow in global order.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import NeedleInputError
from core.tokens import LocalTokens
from query.config import QueryConfig
from query.index_protocol import Index
from query.query_images import decode_query_image
from query.recorded import QueryFiles, adapter_file, local_files, model_weights
from query.verify_top import make_reranker, second_verification
from rerank.expand import ExpansionConfig, expand, verified_top
from rerank.rerank import RerankConfig, Reranker, with_kind_defaults

log = logging.getLogger(__name__)


def results_json(index: Index, D: np.ndarray, I: np.ndarray) -> list[list[dict[str, Any]]]:
    """(D, I) -> per query a list of {key, row, score}, padding (-1) dropped."""
    keys = index.keys_of(I)
    return [
        [{"key": key, "row": int(i), "score": float(s)} for key, i, s in zip(krow, irow, drow) if i >= 0]
        for krow, irow, drow in zip(keys, I, D)
    ]


def recorded_extractor(index: Index, files: QueryFiles | None = None) -> tuple[dict[str, Any], str | Path]:
    """(the global extractor's info recorded at ingestion, the weights to build it with: the recorded
    file verified by its SHA-256, or ``files.weights`` of the same bytes; "pretrained" or "random"
    where ingestion used those). A missing or changed file is a RecordedFileError, never a fallback."""
    extractors = [e for e in index.infos.get("extractors", []) if e.get("extractor") == "global"]
    if not extractors:
        raise NeedleInputError(f"index {index.path} does not record its model: query by --key or --vectors instead")
    info = extractors[0]
    given = (files or QueryFiles()).weights
    return info, model_weights(info, info["model"]["name"], given, "--weights", index.path)


def query_extractor(
    index: Index, files: QueryFiles | None = None, *, scales: tuple[float, ...] = (1.0,), rotations: int = 1
):
    """The global extractor the index's descriptors were made with (same model, weights and resolution),
    averaging over ``scales`` x ``rotations`` variants when asked (query side only: whatever the
    index's own extractor info records about scales is not carried over)."""
    from embed.extract import GlobalExtractor

    info, weights = recorded_extractor(index, files)
    return GlobalExtractor(
        info["model"]["name"],
        weights,
        resolution=info["resolution"],
        precision=info.get("precision", "auto"),
        # The grid the database's inputs were snapped to; an index made before the grid: exact shapes.
        shape_grid=info.get("shape_grid", 0),
        scales=scales,
        rotations=rotations,
    )


def embed_image_files(
    index: Index,
    paths: list[Path],
    files: QueryFiles | None = None,
    *,
    scales: tuple[float, ...] = (1.0,),
    rotations: int = 1,
) -> np.ndarray:
    """(n, d) float32 descriptors of image files, made as during ingestion (and, with ``scales`` or
    ``rotations``, averaged over the query-side variants)."""
    extractor = query_extractor(index, files, scales=scales, rotations=rotations)
    images = [decode_query_image(path, extractor.resolution) for path in paths]
    return adapt_queries(index, extractor(images)["global"].astype(np.float32), files)


def index_adapter(index: Index, files: QueryFiles | None = None):
    """The adapter the index was built with (verified by its SHA-256), or None."""
    info = index.infos.get("adapt")
    if not info:
        return None
    from embed.adapt import load_adapter

    return load_adapter(adapter_file(info, (files or QueryFiles()).adapter))


def adapt_queries(index: Index, xq: np.ndarray, files: QueryFiles | None = None) -> np.ndarray:
    """Embedded queries through the adapter the index was built with (unchanged without one)."""
    adapter = index_adapter(index, files)
    return xq if adapter is None else adapter.apply(xq)


def embed_texts(index: Index, texts: list[str], files: QueryFiles | None = None) -> np.ndarray:
    """(n, d) descriptors of text queries, from the text tower of the index's (CLIP-like) model."""
    import torch

    from embed.models import build_global_model
    from embed.pooling import l2_normalize
    from ingest.torchvision_compat import ensure_torchvision_importable

    if not texts or not all(t.strip() for t in texts):
        raise NeedleInputError("empty text query")
    info, weights = recorded_extractor(index, files)
    model = info["model"]
    if model.get("library") != "open_clip":
        raise NeedleInputError(
            f"the index's model {model.get('name')!r} has no text tower: text queries need an index built with an "
            "open_clip preset and its weights (needle ingest --model clip_B16_openai.head --weights FILE; "
            "docs/models.md#text-search)"
        )
    ensure_torchvision_importable()
    import open_clip

    net, _ = build_global_model(model["name"], weights)
    tokens = open_clip.get_tokenizer(model["architecture"])(texts)
    with torch.inference_mode():
        backbone: Any = net.backbone  # an open_clip model (torch types a module's attributes as Module | Tensor)
        return adapt_queries(index, l2_normalize(backbone.encode_text(tokens)).numpy().astype(np.float32), files)


def read_text_queries(paths_or_dir: str | Path | Sequence[str | Path]) -> list[tuple[str, str]]:
    """(query id, text) pairs of text-query files.

    A directory stands for every ``T*.txt`` file below it, sorted, with the path relative to it as
    the id: ILIAS keeps each instance's text query as ``<instance>/.../Txxx.txt``, so the id's first
    component names the instance. A file's id is its path as given. The text is the file's content,
    stripped; a missing, unreadable or empty file raises NeedleInputError naming it.
    """
    sources = [paths_or_dir] if isinstance(paths_or_dir, (str, Path)) else list(paths_or_dir)
    if not sources:
        raise NeedleInputError("no text-query files given")
    files: list[tuple[str, Path]] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            found = sorted((p.relative_to(path).as_posix(), p) for p in path.glob("**/T*.txt") if p.is_file())
            if not found:
                raise NeedleInputError(f"no T*.txt text-query files below directory {path}")
            files += found
        elif path.is_file():
            files.append((str(source), path))
        else:
            raise NeedleInputError(f"text-query file {path} does not exist")
    queries = []
    for query_id, path in files:
        try:
            text = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise NeedleInputError(f"cannot read text-query file {path}: {exc}") from exc
        if not text:
            raise NeedleInputError(f"text-query file {path} is empty")
        queries.append((query_id, text))
    return queries


def load_vectors(path: Path, d: int) -> np.ndarray:
    """Query vectors from a .npy file: (d,) or (n, d)."""
    try:
        xq = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise NeedleInputError(f"cannot read query vectors {path}: {exc}") from exc
    xq = np.atleast_2d(xq).astype(np.float32)
    if xq.ndim != 2 or xq.shape[1] != d:
        raise NeedleInputError(f"query vectors {path} have shape {xq.shape}, the index expects (n, {d})")
    return xq


def query(
    index: Index,
    conf: QueryConfig,
    keys: Sequence[str] = (),
    images: Sequence[Path] = (),
    texts: Sequence[str] = (),
    vectors: np.ndarray | None = None,
    text_queries: Sequence[tuple[str, str]] = (),
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Search for every stored key, image file, text, (id, text) query (:func:`read_text_queries`)
    and vector; one result dict per query, in input order (texts before text queries). ``device``:
    where this process re-ranks (``--device``; rerank.device.resolve_device)."""
    if not keys and not images and not texts and not text_queries and vectors is None:
        raise NeedleInputError("nothing to query: give --key, --image, --text, --text-file or --vectors")
    blocks: list[np.ndarray] = []
    labels: list[dict[str, Any]] = []
    if keys:
        blocks.append(np.stack([index.vector_of(k) for k in keys]))
        labels += [{"key": k} for k in keys]
    if images:
        blocks.append(embed_image_files(index, list(images), conf.files, scales=conf.scales, rotations=conf.rotations))
        labels += [{"image": str(p)} for p in images]
    if texts or text_queries:  # one text-tower load for both
        blocks.append(embed_texts(index, list(texts) + [t for _, t in text_queries], conf.files))
        labels += [{"text": t} for t in texts] + [{"id": i, "text": t} for i, t in text_queries]
    if vectors is not None:
        blocks.append(vectors)
        labels += [{"vector": i} for i in range(len(vectors))]
    tokens: list[LocalTokens | None] | None = None
    if (
        conf.rerank is not None
    ):  # keys use their stored tokens, images their query-side tokens; texts and vectors have none
        tokens = (
            (stored_tokens(index, list(keys)) if keys else [])
            + (query_tokens_of_images(index, list(images), conf.rerank, conf.files) if images else [])
            + [None] * (len(texts) + len(text_queries) + (0 if vectors is None else len(vectors)))
        )
    reranker = make_reranker(conf.rerank, index, token_kind(index), device, conf.files) if conf.rerank else None
    D, I, details = search(index, np.concatenate(blocks), conf, tokens, reranker)
    results = results_json(index, D, I)
    return [query_json(label, conf.k, res, detail) for label, res, detail in zip(labels, results, details)]


def query_json(label: Any, k: int, results: list[dict[str, Any]], detail: dict[str, Any]) -> dict[str, Any]:
    """One query's answer: its label, k and results, with the re-ranking details where re-ranked
    (each result's scores and evidence; ``expanded_with``: the verified results α-QE averaged in)."""
    add_rerank_details(results, detail)
    answer = {"query": label, "k": k, "results": results}
    if detail:
        answer["expanded_with"] = int(detail.get("expanded_with", 0))
    return answer


def add_rerank_details(results: list[dict[str, Any]], detail: dict[str, Any]) -> None:
    """Put each re-ranked result's global and local scores (and inlier evidence) beside its score."""
    if not detail:
        return
    n = len(detail["global_score"])
    for i, result in enumerate(results[:n]):
        result["global_score"] = float(detail["global_score"][i])
        result["local_score"] = float(detail["local_score"][i])
        if detail.get("inliers") is not None:
            result["inliers"] = int(detail["inliers"][i])
        if detail.get("chamfer") is not None:
            result["chamfer"] = round(float(detail["chamfer"][i]), 4)
        if detail.get("evidence") is not None:
            result["matches"] = {"query_xy": detail["evidence"][i]["query_xy"], "db_xy": detail["evidence"][i]["db_xy"]}
        if detail.get("glue_matches") is not None and np.isfinite(detail["glue_matches"][i]):
            result["glue_matches"] = round(float(detail["glue_matches"][i]), 2)


# --- local tokens and re-ranking ---------------------------------------------------------------
def recorded_local_extractor(index: Index) -> dict[str, Any]:
    """The local extractor's info recorded at ingestion (and copied into the index infos)."""
    info = (index.infos.get("locals") or {}).get("extractor")
    if not info:
        raise NeedleInputError(
            f"index {index.path} has no local tokens: ingest with --locals and rebuild it to re-rank"
        )
    return info


def token_kind(index: Index) -> str | None:
    """The local-token kind the index was built with (None: no tokens, or not recorded)."""
    info = (index.infos.get("locals") or {}).get("extractor") or {}
    return (info.get("config") or {}).get("kind")


def query_local_extractor(index: Index, conf: RerankConfig, files: QueryFiles | None = None):
    """The index's local extractor (its recorded files, verified) at the query-side scales and token
    count (the asymmetric setting)."""
    from embed.locals.extract import build_local_extractor
    from embed.locals.presets import LocalConfig

    info = recorded_local_extractor(index)
    found = local_files(info, files or QueryFiles(), index.path)
    recorded = LocalConfig(**dict(info["config"], scales=tuple(info["config"]["scales"])))
    conf = with_kind_defaults(conf, recorded.kind)
    return build_local_extractor(
        recorded,
        found["weights"],
        scales=conf.query_scales,
        per_scale=True,
        top_k=conf.query_top_k,
        keep_desc=False,
        itq=found["itq"],
        detector_weights=found["detector_weights"],
    )


def query_tokens_of_images(
    index: Index, paths: list[Path], conf: RerankConfig, files: QueryFiles | None = None
) -> list[LocalTokens]:
    """Query-side local tokens of image files."""
    extractor = query_local_extractor(index, conf, files)
    images = [decode_query_image(path, extractor.resolution) for path in paths]
    return extractor.tokens(images)


def stored_tokens(index: Index, keys: list[str]) -> list[LocalTokens]:
    """Database-side tokens of stored keys, from the index's local store (or the shard that owns
    each key, for a coordinator of shard actors)."""
    return [index.tokens_of_key(key) for key in keys]


def expanded_global_scores(
    index: Index,
    xq: np.ndarray,
    shortlists: dict[int, np.ndarray],
    s_global: dict[int, np.ndarray],
    inliers: dict[int, np.ndarray],
    orders: dict[int, np.ndarray],
    conf: ExpansionConfig,
) -> dict[int, tuple[np.ndarray, int]]:
    """α-QE after re-ranking, for the queries ``q`` whose re-ranked shortlist (rows
    ``shortlists[q]`` in ``orders[q]``) has verified results at its top: {q: (the shortlist's
    global scores against the expanded query, results averaged in)}. Two batched calls whatever the
    number of queries: the averaged results' vectors, and the second scoring, each done where the
    rows live (the shards of a coordinator). A member no shard scored keeps its first score."""
    picked = {q: verified_top(orders[q], inliers[q], conf) for q in inliers} if conf.top else {}
    picked = {q: p for q, p in picked.items() if len(p)}
    if not picked:
        return {}
    asked = sorted(picked)
    neighbour_rows = np.full((len(asked), max(len(p) for p in picked.values())), -1, np.int64)
    for i, q in enumerate(asked):
        neighbour_rows[i, : len(picked[q])] = shortlists[q][picked[q]]
    neighbours = index.vectors_of_rows(neighbour_rows)
    found = {q: expand(xq[q], neighbours[i, : len(picked[q])], conf) for i, q in enumerate(asked)}
    expanded = {q: query for q, query in found.items() if query is not None}
    asked = [q for q in asked if q in expanded]
    if not asked:
        return {}
    rows = np.full((len(asked), max(len(shortlists[q]) for q in asked)), -1, np.int64)
    for i, q in enumerate(asked):
        rows[i, : len(shortlists[q])] = shortlists[q]
    D2 = index.rescore(np.stack([expanded[q] for q in asked]).astype(np.float32), rows)
    out = {}
    for i, q in enumerate(asked):
        second = D2[i, : len(shortlists[q])].astype(np.float64)
        out[q] = (np.where(np.isfinite(second), second, s_global[q]), len(picked[q]))
    return out


def expand_queries(index: Index, xq: np.ndarray, conf: QueryConfig) -> np.ndarray:
    """Average query expansion: each query plus its top ``qe_top`` database vectors weighted by
    their similarity to it, L2-normalised (the ILIAS query-side option)."""
    if conf.qe_top < 0:
        raise NeedleInputError(f"qe_top must be >= 0, got {conf.qe_top}")
    xq = index.check_queries(xq, 1)
    D, I = index.search(xq, min(conf.qe_top, index.ntotal), conf.nprobe, refine_factor=conf.refine_factor)
    neighbours = index.vectors_of_rows(I)
    weights = np.where(I >= 0, np.maximum(D, 0.0), 0.0)[..., None]
    expanded = xq + (weights * neighbours).sum(1)
    return (expanded / np.linalg.norm(expanded, axis=1, keepdims=True)).astype(np.float32)


def search(
    index: Index,
    xq: np.ndarray,
    conf: QueryConfig,
    tokens: list[LocalTokens | None] | None = None,
    reranker: Reranker | None = None,
    evidence: bool = False,
) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """(D, I, per-query re-ranking details) for (nq, d) queries; re-ranked where ``conf.rerank``
    is set and the query has tokens (``tokens[q]``)."""
    if conf.qe_top:
        xq = expand_queries(index, xq, conf)
    if conf.rerank is None:
        D, I = index.search(xq, conf.k, conf.nprobe, refine_factor=conf.refine_factor)
        return D, I, [{} for _ in range(len(D))]
    if tokens is None or len(tokens) != len(xq):
        raise NeedleInputError(f"re-ranking needs the local tokens of each of the {len(xq)} queries")
    if not index.has_locals:
        raise NeedleInputError(
            f"index {index.path} has no local tokens: ingest with --locals and rebuild it to re-rank"
        )
    reranker = reranker or make_reranker(conf.rerank, index, token_kind(index))
    k = min(conf.k, index.ntotal)
    D, I = index.search(xq, max(k, conf.rerank.shortlist), conf.nprobe, refine_factor=conf.refine_factor)
    D = D.astype(np.float64)
    asked = [q for q in range(len(xq)) if tokens[q] is not None]
    sizes = {q: min(conf.rerank.shortlist, int((I[q] >= 0).sum())) for q in asked}
    scored = index.score_shortlists(
        reranker,
        [I[q, : sizes[q]] for q in asked],
        [D[q, : sizes[q]] for q in asked],
        [token for token in tokens if token is not None],  # the tokens of the queries asked, in order
        k,
        evidence,
    )
    local_of = dict(zip(asked, scored))
    # copies: the rows are written back below in their new order
    shortlists = {q: I[q, : sizes[q]].copy() for q in asked}
    s_first = {q: D[q, : sizes[q]].copy() for q in asked}
    firsts = {q: reranker.order(shortlists[q], s_first[q], local_of[q]) for q in asked}  # (order, scores)
    orders = {q: order for q, (order, _) in firsts.items()}
    with_inliers = {q: inliers for q in asked if (inliers := local_of[q].inliers) is not None}
    # α-QE needs inliers: SP only; the reranker's settings have the token kind's filled in
    expansion = (reranker.conf.expansion or ExpansionConfig()) if conf.rerank.method == "sp" else ExpansionConfig()
    second = expanded_global_scores(index, xq, shortlists, s_first, with_inliers, orders, expansion)
    details: list[dict[str, Any]] = []
    for q in range(len(xq)):
        query = tokens[q]
        if query is None:
            details.append({})
            continue
        rows, local = shortlists[q], local_of[q]
        s_global, averaged = second.get(q, (s_first[q], 0))
        # an expanded query is ordered again by its second global scores; any other keeps its first order
        order, scores = reranker.order(rows, s_global, local) if q in second else firsts[q]
        order, scores, glued = second_verification(index, reranker, rows, order, scores, query)
        I[q, : sizes[q]], D[q, : sizes[q]] = rows[order], scores[order]
        details.append(
            {
                "global_score": s_global[order],
                "local_score": local.raw[order],
                "inliers": None if local.inliers is None else local.inliers[order],
                "chamfer": None if local.chamfer is None else local.chamfer[order],
                "expanded_with": averaged,
                "glue_matches": None if glued is None else glued[order],
                "evidence": [local.evidence(i) for i in order[:k]] if evidence and local.evidence else None,
            }
        )
    return D[:, :k], I[:, :k], details
