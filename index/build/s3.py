"""``needle index build --out s3://...``: one task per shard builds it in a local temporary
directory (its parts one after another, then its files), uploads every file with its SHA-256 as
object metadata, then its ``shard_infos.json``, then its commit marker last. A later run keeps a
shard committed from the same files, plan and trained index whose files all match their
checksums, and builds the others again.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from core.atomic import write_atomic
from core.location import S3Location
from core.storage import MARKER_SUFFIX, download
from index.build.add import build_part
from index.build.plan import FileInfo, ShardPlan, part_task
from index.build.records import BuildFields, PartStats
from index.build.shard import finish_shard
from index.generation import Segment
from index.layout import SHARD_INFOS_FILE, TRAINED_FILE, shard_name
from ingest.descriptors import DescriptorFileError

log = logging.getLogger(__name__)

# (trained index bytes, shard specs: number, parts (lists of FileInfo, shard-local offsets), part_ids,
# dim, locals, adapt, common (BuildFields), extractor, url, endpoint_url) -> each shard's commit marker
# {"summary": its index_infos.json entry, "stats": [PartStats records]}
ShardRunner = Callable[[bytes, list[dict[str, Any]]], list[dict[str, Any]]]


def committed_shard(
    storage: S3Location, name: str, files: list[FileInfo], common: BuildFields
) -> dict[str, Any] | None:
    """The commit marker of shard ``name`` when a previous run committed it from the same files,
    plan and trained index and every file its shard_infos.json lists is there with the recorded
    size and SHA-256 (object metadata); else None (the shard is built again)."""
    marker = storage.read_json(name + MARKER_SUFFIX)
    infos = storage.read_json(f"{name}/{SHARD_INFOS_FILE}") if marker is not None else None
    if infos is None:
        return None
    recorded = [(f["shard_id"], f["rows"], f["offset"]) for f in infos.get("files", [])]
    if recorded != [(f.shard_id, f.rows, f.offset) for f in files] or any(
        infos.get(key) != common.to_json()[key] for key in ("factory", "dim", "trained_sha256", "adapt")
    ):
        log.info("%s/%s was made from other files or another plan: building it again", storage.url, name)
        return None
    for file, checksum in infos.get("checksums", {}).items():
        found = storage.stat(f"{name}/{file}")
        if found is None:
            return None
        if found.size != checksum["bytes"] or found.sha256 != checksum["sha256"]:
            log.info("%s/%s/%s does not match its checksum: building the shard again", storage.url, name, file)
            return None
    return marker


def fetch_source(f: FileInfo, directory: Path, endpoint_url: str | None) -> FileInfo:
    """``f`` where this node can read it: as it is, or downloaded from its ``s3://`` source."""
    if Path(f.path).is_file():
        return f
    if f.source is None:
        raise DescriptorFileError(
            f"{f.path} is not on this node and has no s3:// source: local descriptors need a filesystem "
            "every node sees (or give an s3:// prefix written by needle ingest)"
        )
    source = f.source
    target = directory / Path(source).name
    write_atomic(target, lambda tmp: download(source, tmp, endpoint_url))
    return replace(f, path=str(target))


def build_shard_task(trained: bytes, spec: dict[str, Any]) -> dict[str, Any]:
    """Build one shard in a local temporary directory (its parts one after another, then its
    files), upload every file, its ``shard_infos.json``, then its commit marker last; returns the
    marker. Plain function: the Ray job runs one per task (retried where a task dies)."""
    storage = S3Location(spec["url"], spec["endpoint_url"])
    name = shard_name(spec["number"])
    with tempfile.TemporaryDirectory(prefix=f"needle-{name}-") as scratch_dir:
        scratch = Path(scratch_dir)
        trained_path = scratch / TRAINED_FILE
        trained_path.write_bytes(trained)
        parts = [[fetch_source(f, scratch / "parquet", spec["endpoint_url"]) for f in part] for part in spec["parts"]]
        directory = scratch / name
        directory.mkdir()
        tasks = [
            part_task(trained_path, directory, i, part, spec["dim"], spec["locals"], spec["adapt"])
            for i, part in zip(spec["part_ids"], parts)
        ]
        stats = [build_part(*task) for task in tasks]
        files = [f for part in parts for f in part]
        summary = finish_shard(directory, spec["number"], files, tasks, stats, spec["common"], spec["extractor"])
        upload_shard(storage, directory)
    marker = {"summary": summary.to_json(with_deleted=False), "stats": [s.to_json() for s in stats]}
    storage.write_json(name + MARKER_SUFFIX, marker)
    return marker


def upload_shard(storage: S3Location, directory: Path) -> None:
    """Upload every file a finished shard directory's ``shard_infos.json`` lists (with its
    SHA-256 as object metadata), then the ``shard_infos.json``."""
    infos = json.loads((directory / SHARD_INFOS_FILE).read_text())
    for file, checksum in infos["checksums"].items():
        storage.upload(f"{directory.name}/{file}", directory / file, checksum["sha256"])
    storage.upload(f"{directory.name}/{SHARD_INFOS_FILE}", directory / SHARD_INFOS_FILE)


def run_shards_sequentially(trained: bytes, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [build_shard_task(trained, spec) for spec in specs]


def build_on_s3(
    storage: S3Location,
    trained_path: Path,
    shards: ShardPlan,
    settings: dict[str, Any],
    run_shards: ShardRunner,
) -> tuple[list[Segment], list[PartStats]]:
    """Run the shard tasks an S3 build still needs (a shard committed by an earlier run from the
    same files, plan and trained index is kept); returns the shards' summaries and their parts'
    stats. ``settings``: what every shard task takes (dim, locals, adapt, common, extractor)."""
    kept: dict[int, dict[str, Any]] = {}
    specs = []
    for number in range(len(shards.groups)):
        parts = shards.parts_of(number)
        files = [f for _, part in parts for f in part]
        marker = committed_shard(storage, shard_name(number), files, settings["common"])
        if marker is not None:
            log.info("%s/%s is committed: kept", storage.url, shard_name(number))
            kept[number] = marker
            continue
        specs.append(
            {
                **settings,
                "number": number,
                "parts": [part for _, part in parts],
                "part_ids": [i for i, _ in parts],
                "url": storage.url,
                "endpoint_url": storage.endpoint_url,
            }
        )
    markers = {**kept, **{spec["number"]: m for spec, m in zip(specs, run_shards(trained_path.read_bytes(), specs))}}
    summaries = [
        Segment.from_json(markers[n]["summary"], f"{storage.url}/{shard_name(n)}{MARKER_SUFFIX}")
        for n in range(len(shards.groups))
    ]
    return summaries, [PartStats.from_json(stat) for n in range(len(shards.groups)) for stat in markers[n]["stats"]]
