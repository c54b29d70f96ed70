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
leaves its generation published, and one killed before the manifest leaves nothing visible. A
missing or malformed pointer is never fatal: the chain of manifests is followed from 0 instead.
``compact --keep`` retires a manifest by replacing it with a tombstone, never by deleting it: a
number, once published, can never be published again (a paused writer's exclusive create fails).

A reader loads one generation and answers from exactly its files (``read_view``: the build's infos
with the generation's segments, index.generation.GenerationView). What the files hold, read,
validated and written: index/generation.py.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from core.errors import NeedleInputError
from core.location import Location
from core.quoting import short_repr
from index.errors import IndexFileError
from index.generation import MANIFEST_FORMAT, Generation, GenerationView, IndexInfos, parse_json_object
from index.layout import INFOS_FILE

log = logging.getLogger(__name__)

GENERATIONS_DIR = "generations"
CURRENT_FILE = "CURRENT.json"  # {"generation": n}: where readers start looking (a hint, replaced last)
DELETES_DIR = "deletes"
TRAINED_EMPTY_FILE = f"{GENERATIONS_DIR}/trained.faiss"  # the build's trained quantizer and PQ, no vectors


class GenerationConflict(NeedleInputError):
    """Another writer published the generation this one meant to publish: nothing of this run was
    published; run the command again (it starts from the newer generation)."""


class PublishOutcomeUnknown(IndexFileError):
    """Publishing failed in a way that may have published the generation (an S3 PUT that errored
    may still be applied): the writer keeps every file it wrote; running the command again finds
    out, and compaction removes the files of a generation that was never published."""


class GenerationRemoved(IndexFileError):
    """A generation whose manifest ``needle index compact --keep`` replaced by a tombstone."""


MANIFEST_NAME = re.compile(r"(\d{6,12})\.json")
MAX_GENERATION = 10**12 - 1  # manifest names have at most 12 digits


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


def pointed_number(location: Location) -> int | None:
    """The generation ``CURRENT.json`` points to; None where there is none or it is unusable (not
    JSON, not a generation number): the pointer is a hint, so a bad one is logged and readers fall
    back to listing the manifests, never failing on it."""
    source = f"{location.url}/{CURRENT_FILE}"
    data = location.probe(CURRENT_FILE)
    if data is None:
        return None
    try:
        number = parse_json_object(data, source).get("generation")
    except IndexFileError as exc:
        log.warning("ignoring %s: %s", source, exc)
        return None
    if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= MAX_GENERATION:
        log.warning("ignoring %s: field 'generation' is %s, not a generation number", source, short_repr(number))
        return None
    return number


def listed_numbers(location: Location) -> list[int]:
    """The numbers of the manifests under ``generations/`` (removed ones' tombstones included)."""
    names = (Path(name).name for name in location.list(GENERATIONS_DIR))
    return sorted(int(match.group(1)) for name in names if (match := MANIFEST_NAME.fullmatch(name)))


def latest_number(location: Location) -> int:
    """The newest published generation: from the pointer, then forward while a next manifest exists
    (a writer killed after publishing but before moving the pointer). Where the pointer is missing
    or unusable, forward from 0 (a retired generation's tombstone keeps its place in the chain);
    where that finds no chain or the pointer names no manifest (an index compacted by a needle that
    deleted manifests), from the newest manifest listed. 0 where none was published."""
    number = pointed_number(location)
    if number is None and location.probe(manifest_name(1)) is not None:
        number = 0
    elif number is None or (number and location.probe(manifest_name(number)) is None):
        number = newest_listed(location)
    while location.probe(manifest_name(number + 1)) is not None:
        number += 1
    return number


def newest_listed(location: Location) -> int:
    """The newest manifest listed under ``generations/`` (0: none). Where the listing is refused
    (S3 without ``s3:ListBucket``) there is no chain to list: 0, with a warning."""
    try:
        return max(listed_numbers(location), default=0)
    except Exception as exc:  # botocore's own types: any refusal leaves the chain from 0
        log.warning("cannot list %s/%s (%s: %s); starting from generation 0", location.url, GENERATIONS_DIR,
                    type(exc).__name__, exc)  # fmt: skip
        return 0


def read_manifest(location: Location, number: int | None = None, infos: IndexInfos | None = None) -> Generation:
    """Generation ``number`` (default: the newest published); generation 0 from ``infos`` (the
    build's, read where not given)."""
    number = latest_number(location) if number is None else number
    if number == 0:
        return Generation.zero(infos if infos is not None else read_infos_at(location))
    data = location.read_bytes(manifest_name(number))
    if data is None:
        raise IndexFileError(f"index {location.url} has no generation {number} ({manifest_name(number)})")
    source = f"{location.url}/{manifest_name(number)}"
    if is_tombstone(data, source):
        raise GenerationRemoved(
            f"generation {number} of index {location.url} was removed (`needle index compact --keep`)"
        )
    return Generation.from_json(data, source, number)


def tombstone(number: int) -> bytes:
    """What a removed generation's manifest becomes: its number stays taken (an exclusive create
    of it fails), so no writer that started from an older generation can publish it again."""
    return (json.dumps({"format": MANIFEST_FORMAT, "generation": number, "removed": True}) + "\n").encode()


def is_tombstone(data: bytes, source: str) -> bool:
    return parse_json_object(data, source).get("removed") is True


def read_view(location: Location, infos: IndexInfos | None = None, number: int | None = None) -> GenerationView:
    """Generation ``number`` (default: the newest) of an index of shard directories as loaders open
    it; ``infos``: its ``index_infos.json`` where the caller read it already (read once per open)."""
    infos = infos if infos is not None else read_infos_at(location)
    return GenerationView(infos, read_manifest(location, number, infos))


def publish(location: Location, generation: Generation) -> None:
    """Publish ``generation``: the exclusive create of its manifest. GenerationConflict where
    another writer published that number first (nothing of this one is published);
    PublishOutcomeUnknown where the create failed in a way that may still have published it (its
    files must be kept). The pointer is the caller's to move, after it forgot what it wrote."""
    name = manifest_name(generation.number)
    data = generation.to_json()
    try:
        location.create_exclusive(name, data)
        return
    except FileExistsError:
        failure: Exception | None = None
    except Exception as exc:  # a full disk, a failed PUT: the manifest may or may not be there
        failure = exc
    try:
        there = location.read_bytes(name)
    except Exception as exc:
        raise PublishOutcomeUnknown(unknown_message(location, generation, failure or exc)) from exc
    if there == data:
        return  # ours: a retried request of ours had been applied, or the error came after the create
    if there is not None:
        raise GenerationConflict(
            f"index {location.url}: generation {generation.number} was published by another writer while this one "
            f"ran (from generation {generation.parent}); nothing of this run was published: run it again"
        )
    if failure is None or location.local_root is None:
        # S3: a PUT that failed for the client may still be applied later; a directory is certain
        raise PublishOutcomeUnknown(unknown_message(location, generation, failure)) from failure
    raise failure


def unknown_message(location: Location, generation: Generation, cause: Exception | None) -> str:
    return (
        f"index {location.url}: publishing generation {generation.number} failed ({type(cause).__name__}: {cause}) "
        "and it cannot be told whether it was published; its files are kept. Run the command again: it finds "
        "what was published, and `needle index compact` removes the files of what was not"
    )


def move_pointer(location: Location, number: int) -> None:
    """Point ``CURRENT.json`` at generation ``number``; a failure is logged, not raised: the
    generation is published (readers find it by stepping forward from any older pointer, or by
    listing the manifests)."""
    try:
        location.replace(CURRENT_FILE, (json.dumps({"generation": number}) + "\n").encode())
    except Exception as exc:
        log.warning(
            "generation %d of %s is published, but %s could not be updated (%s: %s); readers find it all the same",
            number, location.url, CURRENT_FILE, type(exc).__name__, exc,
        )  # fmt: skip
