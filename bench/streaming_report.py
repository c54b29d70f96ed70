"""The record of bench/streaming.py: each system's entry from what its process wrote, the targets
of issue 56 checked against needle's, and the plot of recall per search step per system."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
from streaming_truth import score

log = logging.getLogger("streaming.report")


def system_entry(
    result: dict[str, Any], work: Path, truth: list[dict[str, Any]], data: np.ndarray, queries: np.ndarray, k: int
) -> dict[str, Any]:
    """One ``systems`` entry: recall@k per search step and its mean, QPS over all search steps, the
    replay's time (every kind of step; a fresh build's not counted), peak RSS, deleted rows returned."""
    name = result["system"]
    recalls, deleted = [], 0
    for j, step in enumerate(truth):
        found = np.load(work / name / f"found_{j}.npy")
        recall, wrong = score(found, step["vec"], data, queries, step["kth"], k)
        recalls.append(round(recall, 4))
        deleted += wrong
    search_s = sum(result["search_s_per_step"])
    entry = {
        "system": name,
        "recall_at_10_mean": round(float(np.mean(recalls)), 4) if recalls else None,
        "recall_at_10_per_search": recalls,
        "qps": round(len(queries) * len(truth) / search_s, 1) if search_s else None,
        "total_s": round(sum(result["seconds"].values()), 2),
        "rss_peak_mb": round(result["rss_peak_mb"], 1),
        "deleted_returned": deleted,
        "seconds": {op: round(s, 2) for op, s in result["seconds"].items()},
        "settings": result.get("settings", ""),
    }
    if name.startswith("needle"):
        fresh = [score(np.load(work / name / f"fresh_{j}.npy"), s["vec"], data, queries, s["kth"], k)[0]
                 for j, s in enumerate(truth) if (work / name / f"fresh_{j}.npy").is_file()]  # fmt: skip
        entry["fresh_recall_at_10_per_search"] = [round(r, 4) for r in fresh]
        if fresh:
            entry["fresh_recall_at_10_mean"] = round(float(np.mean(fresh)), 4)
            entry["max_gap_to_fresh"] = round(max(f - r for f, r in zip(fresh, recalls)), 4)
        keep = ("rss_server_mb", "rss_commands_mb", "changes", "compact_retrain_flag", "final_index",
                "rebuild_recommended", "drift", "fresh_s_per_step")  # fmt: skip
        entry.update({key: result[key] for key in keep if key in result})
    return entry


def targets(systems: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 56's targets for needle with its defaults, each with the value measured and whether met."""
    by = {s["system"]: s for s in systems if "recall_at_10_mean" in s}
    needle = by.get("needle")
    if needle is None:
        return {}
    peers = [s for name, s in by.items() if not name.startswith("needle")]
    hnsw = by.get("hnswlib")
    out: dict[str, Any] = {
        "recall_mean_ge_0.95": {"value": needle["recall_at_10_mean"], "met": needle["recall_at_10_mean"] >= 0.95},
        "recall_mean_ge_every_peer": {
            "value": max((p["recall_at_10_mean"] for p in peers), default=None),
            "met": all(needle["recall_at_10_mean"] >= p["recall_at_10_mean"] for p in peers),
        },
        "deleted_returned_0": {"value": needle["deleted_returned"], "met": needle["deleted_returned"] == 0},
    }
    if "max_gap_to_fresh" in needle:
        gap = needle["max_gap_to_fresh"]
        out["every_step_within_0.02_of_fresh"] = {"value": gap, "met": gap <= 0.02}
    if hnsw is not None:
        out["qps_ge_hnswlib"] = {"value": [needle["qps"], hnsw["qps"]], "met": (needle["qps"] or 0) >= hnsw["qps"]}
        out["total_s_le_hnswlib"] = {"value": [needle["total_s"], hnsw["total_s"]],
                                     "met": needle["total_s"] <= hnsw["total_s"]}  # fmt: skip
    return out


def plot(runs: list[dict[str, Any]], path: Path) -> Path:
    """Recall@10 per search step per system, one panel per runbook (needle's fresh build dashed):
    matplotlib where installed, else an SVG written by hand."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return svg(runs, path.with_suffix(".svg"))
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4.2), squeeze=False)
    for ax, run in zip(axes[0], runs):
        for system in run["systems"]:
            ys = system.get("recall_at_10_per_search") or []
            (line,) = ax.plot(range(1, len(ys) + 1), ys, marker=".", label=system["system"])
            fresh = system.get("fresh_recall_at_10_per_search")
            if fresh:  # the same colour, dashed: how far the living index is from a rebuild
                ax.plot(range(1, len(fresh) + 1), fresh, "--", lw=1, color=line.get_color(), label="  its fresh build")
        book = run["runbook"]
        ax.set_title(f"{book['name']} ({book['n']:,} x {book['dim']})", fontsize=10)
        ax.set_xlabel("search step")
        ax.set_ylabel("recall@10")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=7, loc="lower left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def svg(runs: list[dict[str, Any]], path: Path) -> Path:
    """The same plot as plain SVG polylines (no matplotlib)."""
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    width, height, parts = 420, 260, []
    for p, run in enumerate(runs):
        x0 = p * (width + 20)
        parts.append(f'<text x="{x0 + 10}" y="15" font-size="11">{run["runbook"]["name"]}</text>')
        parts.append(
            f'<rect x="{x0 + 30}" y="20" width="{width - 40}" height="{height - 40}" fill="none" stroke="#999"/>'
        )
        for c, system in enumerate(run["systems"]):
            ys = system.get("recall_at_10_per_search") or []
            if len(ys) < 1:
                continue
            step = (width - 40) / max(1, len(ys) - 1)
            points = " ".join(f"{x0 + 30 + i * step:.1f},{20 + (1 - y) * (height - 40):.1f}" for i, y in enumerate(ys))
            colour = colours[c % len(colours)]
            parts.append(f'<polyline points="{points}" fill="none" stroke="{colour}"/>')
            label = f'x="{x0 + 35}" y="{height - 25 - 11 * c}" font-size="9" fill="{colour}"'
            parts.append(f"<text {label}>{system['system']}</text>")
    body = "\n".join(parts)
    size = f'width="{len(runs) * (width + 20)}" height="{height}"'
    path.write_text(f'<svg xmlns="http://www.w3.org/2000/svg" {size}>\n{body}\n</svg>\n')
    return path
