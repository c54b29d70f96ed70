"""Rewriting segments and removing what no kept generation names: the steps ``needle index compact``
(index/live/compact.py) and a retrain (index/live/retrain.py) share.

``rewrite_rows`` writes one segment of the live rows of some segments, in ascending row id order
(``"row_order": "sorted"``: index/live/row_map.py): its FAISS index is a trained index (the parent's,
or a retrain's) with the rows' stored vectors added, its vectors, ids, keys and local tokens are
gathered from the old segments, and no byte of a deleted row is copied. ``remove_unreferenced``
removes the files no kept generation names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc

from core.atomic import atomic_path, write_atomic, write_json_atomic
from core.kill_points import kill_point
from core.location import Location
from index.build.records import BuildFields
from index.build.shard import IDS_SCHEMA, _checksum, write_float16_npy_header, write_keys_of_ids
from index.errors import IndexFileError
from index.generation import TRAINED_NAME, Generation, Segment, trained_or_written_for
from index.keys import KEY_FILES
from index.layout import (
    DELETE_FILE_NAME,
    IDS_FILE,
    INDEX_FILE,
    SEGMENT_NAME,
    SHARD_INFOS_FILE,
    VECTORS_FILE,
)
from index.live.generations import (
    DELETES_DIR,
    GENERATIONS_DIR,
    GenerationRemoved,
    is_tombstone,
    latest_number,
    manifest_name,
    read_manifest,
    tombstone,
)
from index.live.writer import Writer
from index.locals import TOKEN_DTYPE, SegmentInfo, _save_npy, locals_infos, open_local_store
from index.shard_files import ShardFiles, open_shard_files
from ingest.descriptors import ROW_SHARD_SHIFT, valid_descriptors

log = logging.getLogger(__name__)
CHUNK_ROWS = 1 << 15  # rows gathered at a time (vectors, tokens)


def rewrite(writer: Writer, segments: list[Segment], name: str, shard: int) -> Segment:
    """One segment ``name`` of the live rows of ``segments``, ascending by row id; its manifest entry."""
    return rewrite_rows(writer, segments, name, shard).entry


@dataclass(frozen=True)
class Rewritten:
    """A segment written by ``rewrite_rows``, with the rows it holds (a retrain carries changes by them)."""

    entry: Segment  # its manifest entry
    rows: np.ndarray  # its rows, ascending
    indexed: np.ndarray  # of them those in its FAISS index, ascending
    sources: dict[str, np.ndarray]  # old segment name -> its rows written here, ascending


def rewrite_rows(
    writer: Writer,
    segments: list[Segment],
    name: str,
    shard: int,
    trained: Path | None = None,
    fields: BuildFields | None = None,
    keep: np.ndarray | None = None,
) -> Rewritten:
    """``rewrite``, encoding with ``trained`` (default: the parent's trained index) and recording
    ``fields`` (default: the old segments'), of only the live rows in ``keep`` where given."""
    opened = []
    for segment in segments:
        listed = list(writer.segment_infos(segment.name)["checksums"])
        opened.append(open_shard_files(writer.segment_dir(segment.name, listed), with_index=False))
    live = live_rows(writer, segments, opened, keep)  # (row, segment, position), ascending by row
    directory = writer.new_segment_dir(name)
    write_rows_table(opened, live, directory / IDS_FILE)
    write_keys_of_ids(directory / IDS_FILE, directory)
    indexed = write_vectors_and_index(writer, opened, live, directory, trained)
    first_infos = opened[0].infos
    names = [INDEX_FILE, VECTORS_FILE, IDS_FILE, *KEY_FILES]
    local = None
    if first_infos.get("locals"):
        local = write_tokens(opened, live, directory)
        names += [local.tokens, local.offsets]
    files, offsets = file_entries(opened, live)
    checksums = {file: _checksum(directory / file) for file in names}
    infos = {
        **(fields or BuildFields.of(first_infos)).to_json(),
        "shard": shard,
        "name": name,
        "rows": len(live[0]),
        "ntotal": len(indexed),
        "row_order": "sorted",  # live rows only, ascending by row id (index/live/row_map.py)
        "files": files,
        "shard_offsets": offsets,
        "rejected_non_finite": 0,
        "locals": locals_infos([local], (first_infos["locals"] or {}).get("extractor"), len(live[0]))
        if local
        else None,
        "checksums": checksums,
        "compacted_from": [s.name for s in segments],
    }
    write_json_atomic(infos, directory / SHARD_INFOS_FILE)
    entry = Segment(
        name=name,
        rows=len(live[0]),
        ntotal=len(indexed),
        parquet_shard_ids=tuple(sorted(int(i) for i in offsets)),
        bytes=sum(c["bytes"] for c in checksums.values()),
    )
    sources = {s.name: live[0][live[1] == i] for i, s in enumerate(segments)}
    return Rewritten(entry, live[0], indexed, sources)


def live_rows(
    writer: Writer, segments: list[Segment], opened: list[ShardFiles], only: np.ndarray | None = None
) -> tuple[np.ndarray, ...]:
    """(rows, segment, position) of the segments' rows not deleted (and in ``only`` where given),
    ascending by row id."""
    rows, which, positions = [], [], []
    for number, (segment, files) in enumerate(zip(segments, opened)):
        column = files.ids["row"].to_numpy()
        keep = ~np.isin(column, writer.deleted_rows(segment))
        if only is not None:
            keep &= np.isin(column, only)
        rows.append(column[keep])
        which.append(np.full(int(keep.sum()), number, np.int64))
        positions.append(np.flatnonzero(keep))
    all_rows = np.concatenate(rows)
    order = np.argsort(all_rows, kind="stable")
    return all_rows[order], np.concatenate(which)[order], np.concatenate(positions)[order]


def chunks(live: tuple[np.ndarray, ...]):
    """The live rows in runs of at most CHUNK_ROWS, each split by its segment (reads in order)."""
    rows, which, positions = live
    for start in range(0, len(rows), CHUNK_ROWS):
        stop = min(start + CHUNK_ROWS, len(rows))
        yield start, stop, which[start:stop], positions[start:stop]


def write_rows_table(opened: list[ShardFiles], live: tuple[np.ndarray, ...], path: Path) -> None:
    """The id table of the live rows, in order, as one record batch (index.live.row_map reads its row column whole)."""
    parts = []
    for _, _, which, positions in chunks(live):
        gathered = [opened[s].ids.take(pa.array(positions[which == s])) for s in range(len(opened))]
        order = np.argsort(np.argsort(which, kind="stable"), kind="stable")  # back to row order
        parts.append(pa.concat_tables(gathered).take(pa.array(order)))
    table = pa.concat_tables(parts).cast(IDS_SCHEMA).combine_chunks() if parts else IDS_SCHEMA.empty_table()
    with atomic_path(path) as tmp, pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, IDS_SCHEMA) as out:
        out.write_table(table, max_chunksize=max(1, table.num_rows))


def gather(arrays: list[Any], which: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``arrays[which[i]][positions[i]]`` for every i, each segment's rows read in ascending order."""
    out = None
    for s in np.unique(which):
        take = np.flatnonzero(which == s)
        block = np.asarray(arrays[s][positions[take]])
        if out is None:
            out = np.empty((len(which), *block.shape[1:]), block.dtype)
        out[take] = block
    return out if out is not None else np.zeros((0,), np.float16)


def write_vectors_and_index(
    writer: Writer, opened: list[ShardFiles], live: tuple[np.ndarray, ...], directory: Path, trained: Path | None = None
) -> np.ndarray:
    """The live rows' float16 vectors, and the trained index (``trained``, default the parent's)
    with those of them that a search can return (status ok, finite, not zero: what the build added)
    added under their row ids; returns the rows it holds, ascending."""
    import faiss

    index = faiss.read_index(str(trained or writer.trained_empty()))
    dim = int(opened[0].infos["dim"])
    indexed = []
    statuses = [f.ids["status"].to_numpy(zero_copy_only=False) for f in opened]  # once, not per chunk
    with atomic_path(directory / VECTORS_FILE) as tmp, open(tmp, "wb") as out:
        write_float16_npy_header(out, len(live[0]), dim)
        for start, stop, which, positions in chunks(live):
            block = gather([f.vectors for f in opened], which, positions).reshape(-1, dim)
            out.write(np.ascontiguousarray(block, np.float16).tobytes())
            status = gather(statuses, which, positions)
            ok = valid_descriptors(block, status)  # what the build and add index, and delete counts
            if ok.any():
                index.add_with_ids(np.ascontiguousarray(block[ok], np.float32), live[0][start:stop][ok])
                indexed.append(live[0][start:stop][ok])
    write_atomic(directory / INDEX_FILE, lambda tmp: faiss.write_index(index, str(tmp)))
    return np.concatenate(indexed) if indexed else np.zeros(0, np.int64)


def write_tokens(opened: list[ShardFiles], live: tuple[np.ndarray, ...], directory: Path) -> SegmentInfo:
    """The live rows' local tokens as one segment (``locals_000``), in order."""
    stores = [open_local_store(f.directory, f.infos) for f in opened]
    offsets = [np.zeros(1, np.int64)]
    total, longest = 0, 0
    with atomic_path(directory / "locals_000.tokens.bin") as tmp, open(tmp, "wb") as out:
        for _, _, which, positions in chunks(live):
            for s, position in zip(which.tolist(), positions.tolist()):
                store = stores[s]
                records = store.records(position) if store is not None else np.zeros(0, TOKEN_DTYPE)
                out.write(records.tobytes())
                total += len(records)
                longest = max(longest, len(records))
                offsets.append(np.array([total], np.int64))
    offsets_array = np.concatenate(offsets)
    write_atomic(directory / "locals_000.offsets.npy", lambda tmp: _save_npy(tmp, offsets_array))
    return SegmentInfo("locals_000.tokens.bin", "locals_000.offsets.npy", 0, len(live[0]), total, longest)


def file_entries(opened: list[ShardFiles], live: tuple[np.ndarray, ...]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Every Parquet file the old segments were made from (those whose rows are all deleted too:
    ``needle index add`` must still know them, or re-running it would bring them back), with its
    live rows and first position here; and the first positions of those with live rows."""
    rows = live[0]
    ids = rows >> ROW_SHARD_SHIFT
    files, offsets = [], {}
    for f in (f for o in opened for f in o.infos["files"]):
        pid = int(f["shard_id"])
        first = int(np.searchsorted(ids, pid))
        count = int(np.searchsorted(ids, pid, side="right")) - first
        files.append({**f, "offset": first if count else -1, "live_rows": count})
        if count:
            offsets[str(pid)] = first
    return files, offsets


def remove_unreferenced(writer: Writer, keep: int | None) -> list[str]:
    """Remove the files no kept generation names: with ``keep``, the newest ``keep`` generations
    are kept (the older manifests become tombstones, their numbers never published again);
    always, the files of writers that never published (named for a generation that exists, by no
    manifest). Only names of the index's own forms are candidates, and any error reading a kept
    manifest, or a file the newest one names being missing, stops it before it removes anything."""
    location = writer.location
    newest = latest_number(location)
    first_kept = max(0, newest - keep + 1) if keep is not None else 0
    referenced = kept_names(writer, first_kept, newest)
    candidates = [n for n in location.list("") if SEGMENT_NAME.fullmatch(n)]
    candidates += [n for n in location.list(DELETES_DIR) if DELETE_FILE_NAME.fullmatch(n)]
    candidates += [n for n in location.list(GENERATIONS_DIR) if TRAINED_NAME.fullmatch(n)]  # retrains' (retrain.py)
    doomed = sorted(n for n in candidates if n not in referenced and trained_or_written_for(n) <= newest)
    retired = retired_manifests(location, first_kept) if keep is not None else []
    if retired:
        kill_point("retiring")
        for number in retired:  # before their files go: no reader opens a generation half removed
            location.replace(manifest_name(number), tombstone(number))
        log.info("retired generations %s (tombstones keep their numbers taken)", retired)
    if doomed:
        kill_point("removing")
        location.remove(doomed)
        log.info("removed %d files and directories no kept generation names", len(doomed))
    return doomed + [manifest_name(n) for n in retired]


def kept_names(writer: Writer, first_kept: int, newest: int) -> set[str]:
    """Every segment and delete set the kept generations name. A kept generation already retired
    (a tombstone, or a manifest an older needle removed) names nothing; any other failure to read
    one raises (IndexFileError, or the storage's own error): nothing may be removed on a guess.
    The newest generation's files must all be there, or the index is broken and nothing is removed."""
    location = writer.location
    referenced: set[str] = set()
    for number in range(first_kept, newest + 1):
        try:
            manifest = read_manifest(location, number, infos=writer.infos)
        except GenerationRemoved:
            continue
        except IndexFileError:
            if number == newest or location.read_bytes(manifest_name(number)) is not None:
                raise
            continue  # removed by a needle that deleted manifests (before tombstones)
        referenced.update(manifest.training.files if manifest.training else [])
        for segment in manifest.segments:
            referenced.add(segment.name)
            if segment.deleted is not None:
                referenced.add(segment.deleted.file)
        if number == newest:
            check_present(writer, manifest)
    return referenced


def check_present(writer: Writer, manifest: Generation) -> None:
    """IndexFileError where a file the newest generation names is missing (a broken index:
    compaction stops, and ``needle index compact`` exits non-zero, instead of removing more)."""
    location = writer.location
    for segment in manifest.segments:
        for name in [f"{segment.name}/{SHARD_INFOS_FILE}", *([segment.deleted.file] if segment.deleted else [])]:
            if location.stat(name) is None:
                raise IndexFileError(
                    f"index {location.url} is broken: generation {manifest.number} names {name}, which is missing; "
                    "compaction removed nothing"
                )


def retired_manifests(location: Location, first_kept: int) -> list[int]:
    """The manifests before ``first_kept`` still to retire, ascending. Compaction retires them in
    ascending order, so walking down from ``first_kept`` the first tombstone (or manifest removed by
    an older needle) marks where an earlier compaction got to: each is read once in the index's life."""
    retired = []
    for number in range(first_kept - 1, 0, -1):
        data = location.read_bytes(manifest_name(number))
        if data is None or is_tombstone(data, location.url_of(manifest_name(number))):
            break
        retired.append(number)
    return retired[::-1]
