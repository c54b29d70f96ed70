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

A reader loads one generation and answers from exactly its files (``read_view``: the build's infos
with the generation's segments, index.generation.GenerationView). What the files hold, read,
validated and written: index/generation.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from core.errors import NeedleInputError
from core.kill_points import kill_point
from core.location import Location
from index.errors import IndexFileError
from index.generation import Generation, GenerationView, IndexInfos, parse_json_object
from index.layout import INFOS_FILE

log = logging.getLogger(__name__)

GENERATIONS_DIR = "generations"
CURRENT_FILE = "CURRENT.json"  # {"generation": n}: where readers start looking (a hint, replaced last)
DELETES_DIR = "deletes"
TRAINED_EMPTY_FILE = f"{GENERATIONS_DIR}/trained.faiss"  # the build's trained quantizer and PQ, no vectors


class GenerationConflict(NeedleInputError):
    """Another writer published the generation this one meant to publish: nothing of this run was
    published; run the command again (it starts from the newer generation)."""


def manifest_name(number: int) -> str:
    return f"{GENERATIONS_DIR}/{number:06d}.json"


def read_infos_at(location: Location) -> IndexInfos:
    """The build's ``index_infos.json`` (generation 0), validated: what every reader of an index
    reads first. IndexFileError where there is none (not an index), OldIndexLayoutError for an
    index built before shard directories (index.layout.check_layout)."""
    try:
        data = location.read_bytes(INFOS_FILE)
    except Exception as exc:  # a directory in its place, no permission; botocore's own types
        raise IndexFileError(f"cannot read {location.url}/{INFOS_FILE}: {type(exc).__name__}: {exc}") from exc
    if data is None:
        raise IndexFileError(f"{location.url} is not an index (no {INFOS_FILE}): build one with `needle index build`")
    return IndexInfos.from_json(data, f"{location.url}/{INFOS_FILE}")


def pointed_number(location: Location) -> int:
    """The generation ``CURRENT.json`` points to (0 where there is none)."""
    data = location.read_bytes(CURRENT_FILE)
    if data is None:
        return 0
    source = f"{location.url}/{CURRENT_FILE}"
    number = parse_json_object(data, source).get("generation")
    if isinstance(number, bool) or not isinstance(number, int) or number < 0:
        raise IndexFileError(f"{source}: field 'generation' is {number!r}, not a generation number")
    return number


def latest_number(location: Location) -> int:
    """The newest published generation: from the pointer, then forward while a next manifest exists
    (a writer killed after publishing but before moving the pointer); 0 where none was published."""
    number = pointed_number(location)
    if number and location.read_bytes(manifest_name(number)) is None:
        # the pointer's manifest was removed (compact --keep): the newest one listed
        numbers = [int(Path(n).stem) for n in location.list(GENERATIONS_DIR) if Path(n).stem.isdigit()]
        number = max(numbers, default=0)
    while location.read_bytes(manifest_name(number + 1)) is not None:
        number += 1
    return number


def read_manifest(location: Location, number: int | None = None, infos: IndexInfos | None = None) -> Generation:
    """Generation ``number`` (default: the newest published); generation 0 from ``infos`` (the
    build's, read where not given)."""
    number = latest_number(location) if number is None else number
    if number == 0:
        return Generation.zero(infos if infos is not None else read_infos_at(location))
    data = location.read_bytes(manifest_name(number))
    if data is None:
        raise IndexFileError(f"index {location.url} has no generation {number} ({manifest_name(number)})")
    return Generation.from_json(data, f"{location.url}/{manifest_name(number)}", number)


def read_view(location: Location, infos: IndexInfos | None = None, number: int | None = None) -> GenerationView:
    """Generation ``number`` (default: the newest) of an index of shard directories as loaders open
    it; ``infos``: its ``index_infos.json`` where the caller read it already (read once per open)."""
    infos = infos if infos is not None else read_infos_at(location)
    return GenerationView(infos, read_manifest(location, number, infos))


def publish(location: Location, generation: Generation) -> None:
    """Publish ``generation``: the exclusive create of its manifest (GenerationConflict where
    another writer published that number first), then the pointer."""
    number = generation.number
    try:
        location.create_exclusive(manifest_name(number), generation.to_json())
    except FileExistsError as exc:
        raise GenerationConflict(
            f"index {location.url}: generation {number} was published by another writer while this one ran "
            f"(from generation {generation.parent}); nothing of this run was published: run it again"
        ) from exc
    kill_point("published")
    location.replace(CURRENT_FILE, (json.dumps({"generation": number}) + "\n").encode())
