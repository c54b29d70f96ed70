"""The second verification with LightGlue (issue 37, item 2), held out by source, for bench/rerank.py.

For every held-out source s the first stage is the setting chosen without s (bench/rerank_sources.py's
``by_source_held_out[s]["chosen_fields"]``); LightGlue then verifies the top N of that stage's order
(rerank/glue.py: s2 = s1 + weight * min(matches / cap, 1) on the top N), and (N, weight, cap) are
again chosen on the other sources' queries and scored on s's. The curve of mAP against N chooses
(weight, cap) the same way for each N.

The candidates' float descriptors come from one of ``DESCRIPTOR_SOURCES``:

* ``codes``: rebuilt from the stored 128-bit codes (embed.itq.ITQ.reconstruct): no bytes, no reads;
* ``images``: re-extracted from the candidate's image in its shard (the database preset: 100 ALIKED
  keypoints at 512 px, float descriptors). Float tokens stored at ingestion (``--keep-local-desc``,
  float16: 100 x 128 x 2 = 25,600 B per image) are these same descriptors, so their mAP is this
  row's; they cost bytes instead of the re-extraction's time.

Pair match counts are cached in the work directory (``glue_counts_<source>.json``) so that a rerun
only scores new pairs. Times are measured in the same run: LightGlue per pair (the query's 300
keypoints against a candidate's 100, torch threads from OMP_NUM_THREADS) and re-extraction per image.
"""

from __future__ import annotations

import json
import logging
import tarfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

log = logging.getLogger("bench.rerank")

DESCRIPTOR_SOURCES = ("codes", "images")
GLUE_TOPS = (5, 10, 20)  # N: the curve's points; the largest is every pair scored
GLUE_WEIGHTS = (0.05, 0.1, 0.2, 0.4, 0.8)
GLUE_CAPS = (5, 10, 25, 50)


def glue_grid(tops: Sequence[int] = GLUE_TOPS) -> list[dict]:
    """Every second-stage setting, N = 0 (no second stage) first: ties go to doing nothing."""
    out = [{"top": 0, "weight": 0.0, "cap": 1}]
    out += [{"top": n, "weight": w, "cap": c} for n in tops for w in GLUE_WEIGHTS for c in GLUE_CAPS]
    return out


class CandidateDescriptors:
    """Float descriptors, keypoints and masks of index rows from one source (see the module doc)."""

    def __init__(
        self, source: str, index, itq_path: str | None, work: Path, locals_preset: str, keypoints: int | None = None
    ):
        from embed.locals.extract import build_local_extractor

        self.source, self.index, self.work = source, index, work
        self.extract_seconds, self.extracted = 0.0, 0
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # The database side's extractor: its ITQ (the one the codes were made with) and, for
        # ``images``, its network.
        self._extractor = build_local_extractor(locals_preset, itq=itq_path, top_k=keypoints)
        self.keypoints = keypoints
        self.itq = self._extractor.itq

    def batch(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(xy (B, T, 2), unit descriptors (B, T, 128), mask (B, T))."""
        per_row = [self._one(int(r)) for r in rows]
        width = max((len(xy) for xy, _ in per_row), default=0)
        xy = np.zeros((len(rows), width, 2), np.float32)
        desc = np.zeros((len(rows), width, 128), np.float32)
        mask = np.zeros((len(rows), width), bool)
        for b, (x, d) in enumerate(per_row):
            xy[b, : len(x)], desc[b, : len(x)], mask[b, : len(x)] = x, d, True
        return xy, desc, mask

    def _one(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        if row not in self._cache:
            self._cache[row] = self._from_codes(row) if self.source == "codes" else self._from_image(row)
        return self._cache[row]

    def _from_codes(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = self.index.local_store.batch(self.index.positions_of_rows(np.array([row])), 100)
        n = int(tokens.mask[0].sum())
        return tokens.xy[0, :n], self.itq.reconstruct(tokens.codes[0, :n])

    def _from_image(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        from ingest.images import decode_resized

        key = self.index.keys_of(np.array([[row]]))[0][0]
        shard, sample = key.split("/")
        start = time.perf_counter()
        with tarfile.open(self.work / "shards" / f"{shard}.tar") as tar:
            data = tar.extractfile(f"{sample}.jpg").read()
        image = decode_resized(data, self._extractor.resolution, key)[0]
        tokens = self._extractor.tokens([image])[0]
        self.extract_seconds += time.perf_counter() - start
        self.extracted += 1
        return tokens.xy, tokens.desc


def _load_counts(path: Path) -> dict[str, float]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _save_counts(path: Path, counts: dict[str, float]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(counts))
    tmp.replace(path)


def glue_counts(
    verifier, conf, queries: list, keys: list[str], tops: list[np.ndarray], candidates: CandidateDescriptors, path: Path
) -> tuple[list[np.ndarray], float]:
    """Each query's expected matches with its ``tops[q]`` rows (cached by "query|row" in ``path``), and
    the measured LightGlue ms per pair (nan when every pair came from the cache)."""
    cache = _load_counts(path)
    seconds, pairs = 0.0, 0
    out = []
    for q, (query, key, rows) in enumerate(zip(queries, keys, tops)):
        todo = [r for r in rows if f"{key}|{r}" not in cache]
        if todo:
            xy, desc, mask = candidates.batch(np.asarray(todo))
            start = time.perf_counter()
            counts = verifier.matches(query, xy, desc, mask, conf)
            seconds += time.perf_counter() - start
            pairs += len(todo)
            cache.update({f"{key}|{r}": round(float(c), 4) for r, c in zip(todo, counts)})
        out.append(np.array([cache[f"{key}|{r}"] for r in rows], np.float64))
        if todo and q % 10 == 9:
            _save_counts(path, cache)
            log.info("glue %s: %d/%d queries, %d new pairs", candidates.source, q + 1, len(queries), pairs)
    _save_counts(path, cache)
    return out, (1000.0 * seconds / pairs if pairs else float("nan"))


def _pct(values: np.ndarray) -> float:
    return round(100.0 * float(np.mean(values)), 2)


def _ap_rows(q, scores: np.ndarray, top: np.ndarray, counts: np.ndarray, grid: list[dict]) -> np.ndarray:
    """One query's AP@1k under every second-stage setting of ``grid``."""
    from rerank.ensemble import ap_of_order, rerank_order
    from rerank.glue import GlueConfig, glue_scores

    out = np.zeros(len(grid))
    for j, g in enumerate(grid):
        s2 = scores if g["top"] == 0 else glue_scores(scores, top[: g["top"]], counts[: g["top"]], GlueConfig(**g))
        out[j] = ap_of_order(q.positive[rerank_order(s2, q.rows)], q.n_positives, 1000)
    return out


def _sources_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_rerank_sources", Path(__file__).with_name("rerank_sources.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def first_stages(vq_of: Callable[[dict], list], vectors: list, chosen: dict[str, dict]) -> dict[str, tuple]:
    """Each distinct held-out first-stage setting (by name) -> (its validation queries, final
    scores per query)."""
    sources_module = _sources_module()
    out = {}
    for setting in chosen.values():
        name = sources_module.setting_name(setting)
        if name not in out:
            vq = vq_of(setting)
            out[name] = (vq, [sources_module.final_scores(q, v, setting) for q, v in zip(vq, vectors)])
    return out


def held_out_tables(
    tables: dict[str, np.ndarray], chosen: dict[str, dict], names: dict[str, str], sources: np.ndarray, grid: list[dict]
) -> tuple[np.ndarray, dict]:
    """Per held-out source: the first stage chosen without it, then the second-stage setting of best
    mAP on the other sources' queries under that first stage, scored on its own."""
    per_query = np.zeros(len(sources))
    by_source = {}
    for s in sorted(chosen):
        table, inside = tables[names[s]], sources == s
        means = table[:, ~inside].mean(axis=1)
        row = int(np.flatnonzero(means >= means.max() - 1e-12)[0])
        per_query[inside] = table[row, inside]
        by_source[s] = {
            "queries": int(inside.sum()),
            "first_stage_held_out": _pct(table[0, inside]),
            "held_out": _pct(table[row, inside]),
            "chosen": grid[row],
        }
    return per_query, by_source


def glue_report(
    vq_of: Callable[[dict], list],
    vectors: list,
    lists: list[dict],
    source_of: dict[str, str],
    held_out_report: dict,
    index,
    query_tokens: dict,
    itq_path: str | None,
    work: Path,
    locals_preset: str,
    descriptor_sources: Sequence[str] = DESCRIPTOR_SOURCES,
    tops: Sequence[int] = GLUE_TOPS,
    keypoints: int | None = None,
) -> dict:
    """The JSON ``glue`` field: per descriptor source, the held-out mAP@1k with the second stage, by
    source, the curve against N and the times (see the module doc)."""
    from rerank.ensemble import ap_of_order, rerank_order
    from rerank.glue import GlueConfig, GlueVerifier

    chosen = {s: v["chosen_fields"] for s, v in held_out_report["by_source_held_out"].items()}
    stages = first_stages(vq_of, vectors, chosen)
    names = {s: _sources_module().setting_name(setting) for s, setting in chosen.items()}
    sources = np.array([source_of[e["key"]] for e in lists])
    keys = [e["key"] for e in lists]
    queries = [query_tokens[k] for k in keys]
    global_aps = np.array([ap_of_order(e["positive"], e["n_positives"], 1000) for e in lists])
    verifier, grid, n_max = GlueVerifier(), glue_grid(tops), max(tops)
    out: dict = {
        "grid": {"tops": list(tops), "weights": list(GLUE_WEIGHTS), "caps": list(GLUE_CAPS)},
        "keypoints": keypoints or 100,
        "query_keypoints": len(next(iter(query_tokens.values()))) if query_tokens else None,
    }
    for source in descriptor_sources:
        candidates = CandidateDescriptors(source, index, itq_path, work, locals_preset, keypoints)
        tables, ms_pair = {}, []
        for name, (vq, scores) in stages.items():
            tops = [rerank_order(s, q.rows)[:n_max] for q, s in zip(vq, scores)]
            counts, ms = glue_counts(
                verifier,
                GlueConfig(),
                queries,
                keys,
                [q.rows[t] for q, t in zip(vq, tops)],
                candidates,
                work / f"glue_counts_{source}{'' if keypoints is None else f'_{keypoints}'}.json",
            )
            ms_pair.append(ms)
            tables[name] = np.stack([_ap_rows(q, s, t, c, grid) for q, s, t, c in zip(vq, scores, tops, counts)], 1)
        per_query, by_source = held_out_tables(tables, chosen, names, sources, grid)
        for s, v in by_source.items():
            v["global"] = _pct(global_aps[sources == s])
        curve = {}
        for n in tops:
            keep = [j for j, g in enumerate(grid) if g["top"] == n]
            sub = {name: t[keep] for name, t in tables.items()}
            curve[n] = _pct(held_out_tables(sub, chosen, names, sources, [grid[j] for j in keep])[0])
        first = _pct(held_out_tables({n: t[:1] for n, t in tables.items()}, chosen, names, sources, grid[:1])[0])
        timed = [m for m in ms_pair if np.isfinite(m)]
        out[source] = {
            "map_at_1k_source_held_out": _pct(per_query),
            "gain_source_held_out": round(_pct(per_query) - _pct(global_aps), 2),
            "first_stage_source_held_out": first,
            "gain_over_first_stage": round(_pct(per_query) - first, 2),
            "worst_source_gain_over_global": min(round(v["held_out"] - v["global"], 2) for v in by_source.values()),
            "by_source_held_out": by_source,
            "curve_map_against_top": curve,
            "lightglue_ms_per_pair": round(float(np.mean(timed)), 1) if timed else None,
            "extract_ms_per_image": (
                round(1000.0 * candidates.extract_seconds / candidates.extracted, 1) if candidates.extracted else None
            ),
        }
        log.info("glue %s: %s", source, json.dumps({k: v for k, v in out[source].items() if k != "by_source_held_out"}))
    return out
