"""An index as a sequence of immutable generations (docs/live_index.md; formats in docs/schema.md).

Generation 0 is what ``needle index build`` wrote: ``index_infos.json`` and its shard directories,
unchanged (indexes built before generations open as generation 0). Each ``needle index add``,
``delete`` or ``compact`` publishes the next generation: a manifest
``generations/NNNNNN.json`` naming, for every shard, its segments (directories in the shard
directory format: ``shard_000/`` from the build, ``seg_NNNNNN_sSSS_<token>/`` from later writers)
and each segment's delete set (``deletes/*.npy``), with the generation's number and what changed.

Publishing is one exclusive create of the manifest: a local hard link that fails where the name
exists, or on S3 a ``PutObject`` with ``If-None-Match: *`` (written once, never overwritten). So
of two writers that start from the same generation only one publishes its successor; the other
gets ``GenerationConflict`` and publishes nothing (its change is not lost: it re-runs on top of
the winner's). ``CURRENT.json`` (the pointer) is replaced after the manifest, as a hint: readers
start there and step forward while a next manifest exists, so a writer killed between the two
leaves its generation published, and one killed before the manifest leaves nothing visible.

A reader loads one generation and answers from exactly its files (``view_infos``: the manifest as
the ``index_infos.json`` the loaders know, one entry per segment).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from core.errors import NeedleInputError
from core.kill_points import kill_point
from core.location import Location, location_of
from index.errors import IndexFileError
from index.layout import INFOS_FILE, LAYOUT_SHARDS

log = logging.getLogger(__name__)

GENERATIONS_DIR = "generations"
CURRENT_FILE = "CURRENT.json"  # {"generation": n}: where readers start looking (a hint, replaced last)
DELETES_DIR = "deletes"
TRAINED_EMPTY_FILE = f"{GENERATIONS_DIR}/trained.faiss"  # the build's trained quantizer and PQ, no vectors
MANIFEST_FORMAT = 1


class GenerationConflict(NeedleInputError):
    """Another writer published the generation this one meant to publish: nothing of this run was
    published; run the command again (it starts from the newer generation)."""


def manifest_name(number: int) -> str:
    return f"{GENERATIONS_DIR}/{number:06d}.json"


def read_json_at(location: Location, name: str) -> dict[str, Any] | None:
    data = location.read_bytes(name)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError as exc:
        raise IndexFileError(f"{location.url}/{name} is not JSON: {exc}") from exc


def base_infos(location: Location) -> dict[str, Any]:
    """The build's ``index_infos.json`` (generation 0), or IndexFileError."""
    infos = read_json_at(location, INFOS_FILE)
    if infos is None:
        raise IndexFileError(f"index {location.url} has no {INFOS_FILE}")
    return infos


def generation_zero(infos: dict[str, Any]) -> dict[str, Any]:
    """The manifest of what ``needle index build`` wrote: each shard directory its one segment."""
    if infos.get("layout") != LAYOUT_SHARDS:
        raise IndexFileError(
            "an index built before shard directories has one generation only: rebuild it to add, delete or compact"
        )
    shards = [{"shard": i, "segments": [{**entry, "deleted": None}]} for i, entry in enumerate(infos["shards"])]
    return {
        "format": MANIFEST_FORMAT,
        "generation": 0,
        "parent": None,
        "change": {"command": "build"},
        "shards": shards,
    }


def latest_number(location: Location) -> int:
    """The newest published generation: from the pointer, then forward while a next manifest exists
    (a writer killed after publishing but before moving the pointer); 0 where none was published."""
    pointer = read_json_at(location, CURRENT_FILE)
    number = int(pointer["generation"]) if pointer else 0
    if number and location.read_bytes(manifest_name(number)) is None:
        # the pointer's manifest was removed (compact --keep): the newest one listed
        numbers = [int(Path(n).stem) for n in location.list(GENERATIONS_DIR) if Path(n).stem.isdigit()]
        number = max(numbers, default=0)
    while location.read_bytes(manifest_name(number + 1)) is not None:
        number += 1
    return number


def read_manifest(location: Location, number: int | None = None) -> dict[str, Any]:
    """Generation ``number`` (default: the newest published) as a manifest."""
    number = latest_number(location) if number is None else number
    if number == 0:
        return generation_zero(base_infos(location))
    manifest = read_json_at(location, manifest_name(number))
    if manifest is None:
        raise IndexFileError(f"index {location.url} has no generation {number} ({manifest_name(number)})")
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("generation") != number:
        raise IndexFileError(f"{location.url}/{manifest_name(number)} is not a generation-{number} manifest")
    return manifest


def segments_of(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every segment of a generation, shard by shard, in order (each with its ``"shard"``)."""
    return [{**segment, "shard": shard["shard"]} for shard in manifest["shards"] for segment in shard["segments"]]


def manifest_totals(manifest: dict[str, Any]) -> dict[str, int]:
    """rows, ntotal (in the segments' files) and what its delete sets take away from them."""
    segments = segments_of(manifest)
    deleted = [s["deleted"] or {} for s in segments]
    rows = sum(int(s["rows"]) for s in segments)
    ntotal = sum(int(s["ntotal"]) for s in segments)
    deleted_rows = sum(int(d.get("rows", 0)) for d in deleted)
    deleted_indexed = sum(int(d.get("indexed", 0)) for d in deleted)
    return {
        "rows": rows,
        "ntotal": ntotal,
        "deleted_rows": deleted_rows,
        "live_rows": rows - deleted_rows,
        "live_ntotal": ntotal - deleted_indexed,
    }


def view_infos(infos: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
    """A generation as the ``index_infos.json`` the loaders read: the build's infos with one
    ``shards`` entry per segment (its delete set in ``"deleted"``), ``"generation"``, the segments
    of each shard (``"shard_segments"``) and the live counts."""
    segments = segments_of(manifest)
    groups: list[list[int]] = [[] for _ in manifest["shards"]]
    for position, segment in enumerate(segments):
        groups[int(segment["shard"])].append(position)
    totals = manifest_totals(manifest)
    view = {**infos, "shards": segments, "shard_segments": groups, "generation": int(manifest["generation"])}
    if manifest["generation"]:  # generation 0 keeps the build's own totals (checked against its shards)
        view.update(rows=totals["rows"], ntotal=totals["ntotal"])
    view.update(live_ntotal=totals["live_ntotal"], deleted_rows=totals["deleted_rows"])
    return view


def read_view(index: str | Path, endpoint_url: str | None = None, number: int | None = None) -> dict[str, Any]:
    """The newest generation (or ``number``) of the index at ``index`` as the infos loaders read."""
    location = location_of(index, endpoint_url)
    infos = base_infos(location)
    if infos.get("layout") != LAYOUT_SHARDS and number in (None, 0) and latest_number(location) == 0:
        return infos  # an index built before shard directories: one generation, as it is
    return view_infos(infos, read_manifest(location, number))


def publish(location: Location, manifest: dict[str, Any]) -> None:
    """Publish ``manifest`` as its generation: the exclusive create (GenerationConflict where
    another writer published that number first), then the pointer."""
    number = int(manifest["generation"])
    data = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    try:
        location.create_exclusive(manifest_name(number), data)
    except FileExistsError as exc:
        raise GenerationConflict(
            f"index {location.url}: generation {number} was published by another writer while this one ran "
            f"(from generation {manifest.get('parent')}); nothing of this run was published: run it again"
        ) from exc
    kill_point("published")
    location.replace(CURRENT_FILE, (json.dumps({"generation": number}) + "\n").encode())
