"""A generation of an index, typed: what ``index_infos.json`` and ``generations/NNNNNN.json`` hold
(docs/schema.md), read, validated and written here and nowhere else.

``IndexInfos`` is the build's ``index_infos.json`` (generation 0), ``Generation`` a manifest: per
shard (``ShardSegments``) its ``Segment`` entries, each with the ``DeleteFile`` that records the rows
deleted from it. ``GenerationView`` is one generation as a loader opens it: the build's infos with
the generation's segments and counts. Each ``from_json`` refuses a malformed record with an
``IndexFileError`` naming the file and the field; each ``to_json`` gives back the record as read
(fields this module does not know are kept as they were), so that an index written before opens
unchanged and a manifest written again is the same bytes. Where these files lie and how a
generation is published: index/live/generations.py.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from core.quoting import short_repr
from index.errors import IndexFileError
from index.layout import check_delete_file_name, check_layout, check_segment_name, written_for

MANIFEST_FORMAT = 1
SEGMENT_FIELDS = ("name", "rows", "ntotal", "parquet_shard_ids", "bytes", "deleted")
MANIFEST_FIELDS = ("format", "generation", "parent", "created_unix", "writer", "change", "shards", "totals", "training")
# a retrain's files beside the manifests: its trained index and its drift baseline, named for the
# generation that published them and the writer's token (written once, never rewritten)
TRAINED_NAME = re.compile(r"generations/trained_(\d{6,12})_[0-9a-f]{1,64}\.(?:faiss|drift\.json)")
PLAN_FIELDS = ("kind", "factory", "nlist", "code_bytes", "quantizer_ef")  # a retrain's plan, over the build's
SEARCH_FIELDS = ("nprobe", "refine_factor")  # the served search defaults, over the build's


def _get(record: Mapping[str, Any], name: str, source: str) -> Any:
    if name not in record:
        raise IndexFileError(f"{source}: field {name!r} is missing")
    return record[name]


def _int(record: Mapping[str, Any], name: str, source: str) -> int:
    """A non-negative integer field (a JSON bool is not one)."""
    value = _get(record, name, source)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise IndexFileError(f"{source}: field {name!r} is {short_repr(value)}, not a non-negative integer")
    return value


def _str(record: Mapping[str, Any], name: str, source: str) -> str:
    value = _get(record, name, source)
    if not isinstance(value, str) or not value:
        raise IndexFileError(f"{source}: field {name!r} is {short_repr(value)}, not a name")
    return value


def _list(record: Mapping[str, Any], name: str, source: str) -> list[Any]:
    value = _get(record, name, source)
    if not isinstance(value, list):
        raise IndexFileError(f"{source}: field {name!r} is {short_repr(value)}, not a list")
    return value


def _object(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise IndexFileError(f"{what} is {short_repr(value)}, not a JSON object")
    return value


def parse_json_object(data: bytes | str, source: str) -> Mapping[str, Any]:
    """The JSON object in ``data`` (the file ``source``), or IndexFileError naming it."""
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise IndexFileError(f"{source} is not JSON: {exc}") from exc
    return _object(value, source)


@dataclass(frozen=True)
class DeleteFile:
    """A segment's delete set as a manifest records it (the rows themselves: index/live/deletes.py)."""

    file: str  # the .npy under the index (deletes/NNNNNN_<segment>_<token>.npy)
    rows: int  # rows it deletes
    indexed: int  # of them, those with a vector in the segment's FAISS index

    @staticmethod
    def from_json(record: object, source: str, segment: str | None = None) -> DeleteFile:
        """The record, validated; ``segment``: the segment it belongs to (its name is in the file's)."""
        record = _object(record, source)
        file = check_delete_file_name(_str(record, "file", source), source, segment)
        rows, indexed = _int(record, "rows", source), _int(record, "indexed", source)
        if indexed > rows:
            raise IndexFileError(f"{source}: field 'indexed' is {indexed}, more than its {rows} rows")
        return DeleteFile(file, rows, indexed)

    def to_json(self) -> dict[str, object]:
        return {"file": self.file, "rows": self.rows, "indexed": self.indexed}


@dataclass(frozen=True)
class Segment:
    """One segment (a shard directory) as ``index_infos.json`` lists a shard and a manifest a segment."""

    name: str  # its directory under the index
    rows: int  # its rows (positions), deleted or not
    ntotal: int  # vectors in its FAISS index
    parquet_shard_ids: tuple[int, ...]  # the Parquet files it holds (routes a row id to it)
    bytes: int  # its files' size
    deleted: DeleteFile | None = None  # its delete set in this generation (None: nothing deleted)
    extra: Mapping[str, Any] = field(default_factory=dict)  # other recorded fields, kept as written

    @staticmethod
    def from_json(record: object, source: str) -> Segment:
        record = _object(record, source)
        name = check_segment_name(_str(record, "name", source), source)
        where = f"{source} (segment {name})"
        ids = _list(record, "parquet_shard_ids", where)
        if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise IndexFileError(f"{where}: field 'parquet_shard_ids' is {ids!r}, not a list of integers")
        deleted = record.get("deleted")
        segment = Segment(
            name=name,
            rows=_int(record, "rows", where),
            ntotal=_int(record, "ntotal", where),
            parquet_shard_ids=tuple(ids),
            bytes=_int(record, "bytes", where),
            deleted=None if deleted is None else DeleteFile.from_json(deleted, f"{where} field 'deleted'", name),
            extra={k: v for k, v in record.items() if k not in SEGMENT_FIELDS},
        )
        if segment.ntotal > segment.rows or segment.deleted_rows > segment.rows:
            raise IndexFileError(
                f"{where} is inconsistent: {segment.rows} rows, {segment.ntotal} vectors, "
                f"{segment.deleted_rows} deleted"
            )
        return segment

    def to_json(self, with_deleted: bool = True) -> dict[str, object]:
        """Its record (``with_deleted=False``: as ``index_infos.json`` lists a shard, no ``deleted``)."""
        out: dict[str, object] = {
            **self.extra,
            "name": self.name,
            "rows": self.rows,
            "ntotal": self.ntotal,
            "parquet_shard_ids": list(self.parquet_shard_ids),
            "bytes": self.bytes,
        }
        if with_deleted:
            out["deleted"] = None if self.deleted is None else self.deleted.to_json()
        return out

    @property
    def deleted_rows(self) -> int:
        return self.deleted.rows if self.deleted is not None else 0

    @property
    def deleted_indexed(self) -> int:
        return self.deleted.indexed if self.deleted is not None else 0

    @property
    def live_rows(self) -> int:
        return self.rows - self.deleted_rows


@dataclass(frozen=True)
class ShardSegments:
    """One shard of a generation: its segments, oldest first."""

    shard: int  # the shard's number (its position in the manifest)
    segments: tuple[Segment, ...]  # what answers for its rows

    @staticmethod
    def from_json(record: object, source: str) -> ShardSegments:
        record = _object(record, source)
        shard = _int(record, "shard", source)
        where = f"{source} (shard {shard})"
        return ShardSegments(shard, tuple(Segment.from_json(s, where) for s in _list(record, "segments", where)))

    def to_json(self) -> dict[str, object]:
        return {"shard": self.shard, "segments": [s.to_json() for s in self.segments]}

    @property
    def live_rows(self) -> int:
        return sum(s.live_rows for s in self.segments)


@dataclass(frozen=True)
class Totals:
    """A generation's counts over its segments (a manifest's ``totals``)."""

    rows: int  # rows in the segments' files
    ntotal: int  # vectors in the segments' FAISS indexes
    deleted_rows: int  # rows their delete sets take away
    live_rows: int  # rows - deleted_rows
    live_ntotal: int  # vectors a search can return: ntotal less the deleted rows' vectors

    @staticmethod
    def of(segments: tuple[Segment, ...]) -> Totals:
        rows = sum(s.rows for s in segments)
        ntotal = sum(s.ntotal for s in segments)
        deleted = sum(s.deleted_rows for s in segments)
        return Totals(rows, ntotal, deleted, rows - deleted, ntotal - sum(s.deleted_indexed for s in segments))

    def to_json(self) -> dict[str, int]:
        return {
            "rows": self.rows,
            "ntotal": self.ntotal,
            "deleted_rows": self.deleted_rows,
            "live_rows": self.live_rows,
            "live_ntotal": self.live_ntotal,
        }


@dataclass(frozen=True)
class WriterStamp:
    """Who wrote a generation."""

    host: str  # the writer's host name
    pid: int  # its process id
    token: str  # the token in every name it wrote (index/live/writer.py)

    def to_json(self) -> dict[str, object]:
        return {"host": self.host, "pid": self.pid, "token": self.token}


def _trained_file(record: Mapping[str, Any], name: str, source: str) -> str | None:
    value = record.get(name)
    if value is not None and (not isinstance(value, str) or not TRAINED_NAME.fullmatch(value)):
        raise IndexFileError(f"{source}: field {name!r} is {short_repr(value)}, not a trained file's name")
    return value


@dataclass(frozen=True)
class Training:
    """What the segments of a generation were encoded with, carried from manifest to manifest
    (a manifest's ``training``; absent: the build's, as before retraining existed)."""

    generation: int  # the generation whose publish trained it (0: the build)
    index: str | None  # generations/trained_<generation>_<token>.faiss (None: the build's)
    drift: str | None  # the drift baseline, generations/trained_<generation>_<token>.drift.json (None: the build's)
    trained_rows: int  # live rows when it was trained
    added_rows: int  # rows added by ``needle index add`` since
    drift_recommended: bool  # an add since then reported drift past its limits
    plan: Mapping[str, Any] = field(default_factory=dict)  # PLAN_FIELDS where a retrain changed them
    search: Mapping[str, Any] = field(default_factory=dict)  # SEARCH_FIELDS chosen for a recall target, and how

    @staticmethod
    def from_json(record: object, source: str) -> Training:
        record = _object(record, source)
        plan, search = record.get("plan") or {}, record.get("search") or {}
        _object(plan, f"{source} field 'plan'"), _object(search, f"{source} field 'search'")
        for name in SEARCH_FIELDS:
            if name in search:
                _int(search, name, f"{source} field 'search'")
        return Training(
            _int(record, "generation", source),
            _trained_file(record, "index", source),
            _trained_file(record, "drift", source),
            _int(record, "trained_rows", source),
            _int(record, "added_rows", source),
            record.get("drift_recommended") is True,
            dict(plan),
            dict(search),
        )

    def to_json(self) -> dict[str, object]:
        return {
            "generation": self.generation,
            "index": self.index,
            "drift": self.drift,
            "trained_rows": self.trained_rows,
            "added_rows": self.added_rows,
            "drift_recommended": self.drift_recommended,
            "plan": dict(self.plan),
            "search": dict(self.search),
        }

    def overlay(self) -> dict[str, Any]:
        """The index_infos fields this training replaces (its plan, its search defaults)."""
        out = {k: self.plan[k] for k in PLAN_FIELDS if k in self.plan}
        out.update({k: self.search[k] for k in SEARCH_FIELDS if k in self.search})
        if self.search:
            out["search_tuning"] = dict(self.search)
        return out

    @property
    def files(self) -> list[str]:
        return [name for name in (self.index, self.drift) if name is not None]


@dataclass(frozen=True)
class Generation:
    """A manifest ``generations/NNNNNN.json`` (generation 0: what the build wrote, never a file)."""

    number: int  # the generation (its manifest's "generation")
    parent: int | None  # the generation it was written from (None: the build's)
    shards: tuple[ShardSegments, ...]  # every shard's segments, in shard order
    change: Mapping[str, Any]  # what the command that wrote it printed: "command" and its figures
    created_unix: float | None = None  # when it was written (None: generation 0)
    writer: WriterStamp | None = None  # who wrote it (None: generation 0)
    training: Training | None = None  # what its segments were encoded with (None: the build's)
    extra: Mapping[str, Any] = field(default_factory=dict)  # other recorded fields, kept as written

    @staticmethod
    def zero(infos: IndexInfos) -> Generation:
        """What ``needle index build`` wrote: each shard directory its one segment."""
        shards = tuple(ShardSegments(i, (entry,)) for i, entry in enumerate(infos.shards))
        return Generation(0, None, shards, {"command": "build"})

    @staticmethod
    def from_json(data: bytes | str, source: str, number: int) -> Generation:
        """The manifest of generation ``number`` in ``data`` (the file ``source``), validated."""
        record = parse_json_object(data, source)
        if record.get("format") != MANIFEST_FORMAT or record.get("generation") != number:
            raise IndexFileError(f"{source} is not a generation-{number} manifest")
        parent = record.get("parent")
        if parent is not None:
            parent = _int(record, "parent", source)
        shards = tuple(ShardSegments.from_json(s, source) for s in _list(record, "shards", source))
        if [s.shard for s in shards] != list(range(len(shards))):
            raise IndexFileError(f"{source}: field 'shards' numbers its shards {[s.shard for s in shards]}")
        stamp = record.get("writer")
        writer = None
        if stamp is not None:
            stamp = _object(stamp, f"{source} field 'writer'")
            writer = WriterStamp(_str(stamp, "host", source), _int(stamp, "pid", source), _str(stamp, "token", source))
        created = record.get("created_unix")
        if created is not None and (isinstance(created, bool) or not isinstance(created, (int, float))):
            raise IndexFileError(f"{source}: field 'created_unix' is {created!r}, not a time")
        change = _object(record.get("change"), f"{source} field 'change'")
        extra = {k: v for k, v in record.items() if k not in MANIFEST_FIELDS}
        training = record.get("training")
        if training is not None:
            training = Training.from_json(training, f"{source} field 'training'")
        generation = Generation(number, parent, shards, dict(change), created, writer, training, extra)
        check_names(generation, source)
        recorded = record.get("totals")
        if recorded is not None and recorded != generation.totals.to_json():
            raise IndexFileError(
                f"{source} is inconsistent: field 'totals' is {recorded}, its segments add up to "
                f"{generation.totals.to_json()}"
            )
        return generation

    def to_json(self) -> bytes:
        """The manifest file's bytes (as every writer wrote them: sorted keys, one-space indent)."""
        record: dict[str, object] = {
            **self.extra,
            "format": MANIFEST_FORMAT,
            "generation": self.number,
            "parent": self.parent,
            "change": dict(self.change),
            "shards": [s.to_json() for s in self.shards],
            "totals": self.totals.to_json(),
        }
        if self.created_unix is not None:
            record["created_unix"] = self.created_unix
        if self.writer is not None:
            record["writer"] = self.writer.to_json()
        if self.training is not None:
            record["training"] = self.training.to_json()
        return (json.dumps(record, indent=1, sort_keys=True) + "\n").encode()

    @property
    def segments(self) -> tuple[Segment, ...]:
        """Every segment, shard by shard, in order (the positions of a view run over them so)."""
        return tuple(segment for shard in self.shards for segment in shard.segments)

    @property
    def totals(self) -> Totals:
        return Totals.of(self.segments)

    @property
    def segment_shards(self) -> tuple[int, ...]:
        """The shard of each of ``segments``, in the same order."""
        return tuple(shard.shard for shard in self.shards for _ in shard.segments)


def _names(names: list[str]) -> str:
    return ", ".join(short_repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def trained_or_written_for(name: str) -> int:
    """The generation a segment, delete set or trained file was written for."""
    match = TRAINED_NAME.fullmatch(name)
    return int(match.group(1)) if match else written_for(name)


def check_names(generation: Generation, source: str) -> None:
    """A manifest names each segment and delete set once, and nothing written for a later
    generation than its own (a writer names only what exists when it publishes); IndexFileError
    naming ``source`` otherwise."""
    names = [s.name for s in generation.segments] + [s.deleted.file for s in generation.segments if s.deleted]
    repeated = sorted(n for n, count in Counter(names).items() if count > 1)
    if repeated:
        raise IndexFileError(f"{source} names {_names(repeated)} more than once")
    names += generation.training.files if generation.training else []
    later = [n for n in names if trained_or_written_for(n) > generation.number]
    if later:
        raise IndexFileError(
            f"{source} (generation {generation.number}) names {_names(later)}, written for a later one"
        )
    if generation.parent is not None and generation.parent >= generation.number:
        raise IndexFileError(f"{source}: field 'parent' is {generation.parent}, not before {generation.number}")


@dataclass(frozen=True)
class IndexInfos:
    """The build's ``index_infos.json``: its shards typed (an index of shard directories), every
    other field kept as recorded (``fields``) for the loaders and the answers that report them."""

    fields: Mapping[str, Any]  # the whole record, as read (its "shards" as written)
    shards: tuple[Segment, ...]  # its shard directories

    @staticmethod
    def from_json(data: bytes | str | Mapping[str, Any], source: str) -> IndexInfos:
        """The infos in ``data`` (the file ``source``; or its record, already read), validated:
        an index of shard directories lists them, and they add up to its rows and vectors."""
        record = data if isinstance(data, Mapping) else parse_json_object(data, source)
        check_layout(record, source)  # an index built before shard directories: refused, rebuild it
        shards = tuple(Segment.from_json(s, source) for s in _list(record, "shards", source))
        if not shards:
            raise IndexFileError(f"{source} lists no shards")
        if any(s.deleted is not None for s in shards):
            raise IndexFileError(f"{source}: a shard records deleted rows (only a manifest does)")
        rows, ntotal = _int(record, "rows", source), _int(record, "ntotal", source)
        if sum(s.rows for s in shards) != rows or sum(s.ntotal for s in shards) != ntotal:
            raise IndexFileError(
                f"{source} is inconsistent: its shards hold {sum(s.rows for s in shards)} rows, "
                f"{sum(s.ntotal for s in shards)} vectors; it says {rows}, {ntotal}"
            )
        return IndexInfos(dict(record), shards)

    def to_json(self) -> dict[str, object]:
        """The record to write (core.atomic.write_json_atomic, or the S3 build's write_json)."""
        return {**self.fields, "shards": [s.to_json(with_deleted=False) for s in self.shards]}

    @property
    def dim(self) -> int:
        return int(self.fields["dim"])


@dataclass(frozen=True)
class GenerationView:
    """One generation of an index of shard directories as a loader opens it: the build's infos
    (plan, dimension, kind, ...) with this generation's segments and counts."""

    infos: IndexInfos  # the build's index_infos.json
    generation: Generation  # the manifest read (generation 0: the build's shards)

    @property
    def number(self) -> int:
        return self.generation.number

    @property
    def segments(self) -> tuple[Segment, ...]:
        return self.generation.segments

    @property
    def shard_segments(self) -> list[list[int]]:
        """Per shard, the positions in ``segments`` of its segments."""
        groups: list[list[int]] = [[] for _ in self.generation.shards]
        for position, shard in enumerate(self.generation.segment_shards):
            groups[shard].append(position)
        return groups

    @property
    def rows(self) -> int:
        """Rows in the segments' files (generation 0: the build's count, which its shards add up to)."""
        return self.generation.totals.rows

    @property
    def ntotal(self) -> int:
        """Vectors in the segments' FAISS indexes, deleted rows' included."""
        return self.generation.totals.ntotal

    def as_infos(self) -> dict[str, Any]:
        """The view as the infos an ``Index`` reports (``Index.infos``, /health; a Ray coordinator's
        routing): the build's fields with one ``shards`` entry per segment (with ``"shard"`` and
        ``"deleted"``), ``"shard_segments"``, ``"generation"`` and the live counts."""
        totals = self.generation.totals
        shards = self.generation.segment_shards
        entries = [{**segment.to_json(), "shard": shard} for segment, shard in zip(self.segments, shards)]
        training = self.generation.training
        return {
            **self.infos.fields,
            **(training.overlay() if training is not None else {}),
            "shards": entries,
            "shard_segments": self.shard_segments,
            "generation": self.number,
            "rows": self.rows,
            "ntotal": self.ntotal,
            "live_ntotal": totals.live_ntotal,
            "deleted_rows": totals.deleted_rows,
        }
