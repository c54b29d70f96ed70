"""What an ingestion job records and checks beside its Parquet files, apart from running the
workers: each tar's fingerprint when its shard is committed (a tar that changed since is refused,
never skipped), the images a run has to do (its progress bar counts images, read from the tars'
headers), the failed images of a run by key, tar and reason, the settings that differ from the ones
the descriptors were made with, and ``ingest_info.json`` merged across runs."""

from __future__ import annotations

import hashlib
import logging
import os
import tarfile
from typing import Any

from core.errors import NeedleInputError
from core.storage import is_s3, read_range, tar_headers

log = logging.getLogger(__name__)

FINGERPRINT_SPAN = 65536  # bytes hashed at each end of a tar: its first members' headers and its end
FAILED_IMAGES_SHOWN = 50  # failed images named in ingest_info.json (the count covers them all)


class TarChangedError(NeedleInputError):
    """A tar whose bytes changed since its shard's Parquet file was committed."""

    def __init__(self, url: str, shard: str, reason: str):
        super().__init__(
            f"{url} changed since its shard {shard} was committed ({reason}): its descriptors would no longer "
            "match it. Pack new images into new tars (`needle pack` run again appends them), or redo it with "
            "--overwrite"
        )
        self.url, self.shard = url, shard


def tar_size(url: str, endpoint_url: str | None = None) -> int:
    if is_s3(url):
        from core.location import location_of

        directory, _, name = url.rpartition("/")
        stat = location_of(directory, endpoint_url).stat(name)
        if stat is None:
            raise FileNotFoundError(url)
        return stat.size
    return os.stat(url).st_size


def tar_fingerprint(url: str, endpoint_url: str | None = None) -> dict[str, Any] | None:
    """{"tar_bytes", "tar_sha256_ends"} of the tar at ``url`` (None where it cannot be read): its
    size, and the SHA-256 of its first and last ``FINGERPRINT_SPAN`` bytes (the first members'
    names and sizes, the end). Cheap for any tar size; a repacked tar differs in one of them."""
    try:
        size = tar_size(url, endpoint_url)
        span = min(FINGERPRINT_SPAN, size)
        ends = read_range(url, 0, span, endpoint_url) + read_range(url, size - span, span, endpoint_url)
    except (OSError, NeedleInputError) as exc:
        log.debug("no fingerprint of %s: %s", url, exc)
        return None
    return {"tar_bytes": size, "tar_sha256_ends": hashlib.sha256(ends).hexdigest()}


def check_unchanged(kept: dict[str, dict[str, Any]], endpoint_url: str | None = None) -> None:
    """TarChangedError for the first committed shard (manifest entries ``kept``) whose tar's
    fingerprint differs from the one recorded at its commit (entries without one: not checked)."""
    for shard, entry in sorted(kept.items()):
        if "tar_bytes" not in entry:
            continue
        now = tar_fingerprint(entry["url"], endpoint_url)
        if now is None:
            continue  # a tar gone is no change of content: its descriptors stay as they are
        if now["tar_bytes"] != entry["tar_bytes"]:
            raise TarChangedError(entry["url"], shard, f"{entry['tar_bytes']} bytes then, {now['tar_bytes']} now")
        if now["tar_sha256_ends"] != entry.get("tar_sha256_ends"):
            raise TarChangedError(entry["url"], shard, "same size, other bytes")


def count_samples(urls: list[str]) -> int | None:
    """Samples (WebDataset keys) in the local tars ``urls``, from their headers (seeking past the
    data); None where one is on S3 (counting would stream it whole) or unreadable."""
    from ingest.source_images import WDS_KEY

    total = 0
    for url in urls:
        if is_s3(url):
            return None
        keys = set()
        try:
            for info in tar_headers(url):
                match = WDS_KEY.match(info.name) if info.isfile() else None
                if match and not match.group(1).rsplit("/", 1)[-1].startswith("__"):
                    keys.add(match.group(1))
        except (OSError, tarfile.TarError, EOFError) as exc:  # a bad tar fails in its worker, with its reason
            log.debug("cannot count the samples of %s: %s", url, exc)
            continue
        total += len(keys)
    return total


def settings_diff(before: dict[str, Any], now: dict[str, Any]) -> str:
    """``name: old → new`` for each setting that differs, joined by ``; ``."""
    return "; ".join(f"{k}: {before.get(k)!r} → {now.get(k)!r}" for k in sorted(now) if before.get(k) != now.get(k))


def failed_images(results: list[dict[str, Any]]) -> tuple[list[dict[str, str]], int]:
    """(the first FAILED_IMAGES_SHOWN failed images as {key, tar, reason}, how many in all)."""
    named = [
        {"key": f"{r['shard']}/{f['key']}", "tar": r["url"], "reason": f["reason"]}
        for r in results
        for f in r.get("failed_images", [])
    ]
    total = sum(r.get("error_rows", 0) for r in results if r.get("status") == "ok")
    return named[:FAILED_IMAGES_SHOWN], total


def merge_report(previous: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """``report`` (this run's summary) with the shards' results of earlier runs kept (a shard's
    latest result wins) and each earlier run's summary in ``runs``: a run never erases what an
    earlier one recorded (the tar URLs that thumbnails and re-ranking read come from ``results``)."""
    if not previous:
        return {**report, "runs": [run_summary(report)]}
    results = {r["shard"]: r for r in previous.get("results", []) if isinstance(r, dict) and "shard" in r}
    results.update({r["shard"]: r for r in report["results"]})
    runs = previous.get("runs") or [run_summary(previous)]
    return {**report, "results": [results[s] for s in sorted(results)], "runs": [*runs, run_summary(report)]}


def run_summary(report: dict[str, Any]) -> dict[str, Any]:
    keys = ("shards_processed", "shards_ok", "shards_failed", "images", "error_rows", "seconds", "images_per_s")
    return {k: report.get(k) for k in keys}
