"""One shard of an index: a FAISS index file and the float16 vectors of its rows, searched in this
process (index/search.py) or by a shard actor (shards/shard_actor.py), with the same code.

``open_shard`` opens a shard directory by itself (nothing outside it is read).

A flat (exact) shard is searched by its FAISS index on the CPU, unless a GPU backend is present
(faiss-gpu, or torch with CUDA: index/gpu/engine.py) and the search is large enough to pay for copying
the vectors to the GPU: at least ``GPU_EXACT_MIN_QUERIES`` queries over at least
``GPU_EXACT_MIN_VECTORS`` vectors. Then it scans its rows of the memory-mapped float16 vectors in
chunks with ``index.gpu.engine.exact_search`` (the ILIAS baseline). ``device`` ("auto" | "cpu" | "cuda")
overrides the choice; "cuda" scans on the GPU at any size.

With ``device="cuda"`` (and torch seeing CUDA) a flat shard keeps its vectors on the GPU from its
first scan on (``index.gpu.resident.keep_resident``: float16, where they fit beside 10 % of the
GPU's memory left free), and scans them there; where they do not fit it says so in a warning and
each scan streams them with the copy overlapped (the torch backend). "auto" streams: it takes no
GPU memory for good without being asked.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from core.blas import prefer_blas_for_batches
from core.joined_keys import JoinedKeys
from index.build.merge import float16_inner_products, inner_products_at, search_params, sort_by_score, tie_margin
from index.coarse import CoarseAssignment, CoarseStage, assign, coarse_key, coarse_stage, same_coarse, search_assigned
from index.errors import IndexFileError
from index.gpu.engine import check_device, chunks_at, exact_search, gpu_backend_available, torch_cuda_available
from index.gpu.resident import ResidentDatabase, keep_resident
from index.live.deletes import DeleteSet, search_live
from index.live.row_map import RowMap, row_map_of
from index.locals import LocalStore, open_local_store
from index.shard_files import ShardFiles, open_shard_files
from ingest.descriptors import valid_descriptors

# A flat shard scans on the GPU from this many vectors and queries on ("auto"). Below them the
# CPU's FAISS scan is cheap (the auto plan is flat only below 100k vectors), and a batch of few
# queries is bound on both sides by reading the vectors once (RAM for the CPU, the host-to-GPU
# copy of the float16 vectors for the GPU), so the GPU's arithmetic does not pay for the copy.
GPU_EXACT_MIN_VECTORS = 100_000
GPU_EXACT_MIN_QUERIES = 64
# A flat shard holding deleted rows may scan its live rows for a batch of at least this many
# queries (Shard.scans_live_rows): gathering them costs ~15 ms per 60,000 rows of d = 128.
LIVE_SCAN_MIN_QUERIES = 8
# ... and does where more than half is deleted, or where queries x deleted rows reach this many
# times the live rows: what scoring the deleted rows costs outweighs the gathering from there
LIVE_SCAN_PAYBACK = 40
RESIDENT_LOCK = threading.Lock()  # one shard at a time decides and copies (the fit rule reads the free memory)


@dataclass
class Shard:
    """One FAISS index file and the float16 vectors of its rows: searched in this process or in a
    Ray actor (cluster/serve.py), with the same code."""

    index: Any  # FAISS index, ids = Parquet row ids
    vectors: np.ndarray  # (N, d) float16 memory map of its shard directory's vectors
    row_map: RowMap  # row ids -> positions in ``vectors`` (index/live/row_map.py)
    exact: bool  # a flat index: its scores need no re-scoring
    nprobe: int  # default lists visited
    quantizer_ef: int | None  # HNSW coarse quantizer depth recorded by the build
    files: ShardFiles  # its shard directory's own files
    device: str = "auto"  # flat shards on a GPU: large searches when one is present (auto), never (cpu), always (cuda)
    deletes: DeleteSet = field(default_factory=lambda: DeleteSet.empty())  # rows deleted in the generation served
    resident: ResidentDatabase | bool | None = field(default=None, init=False, repr=False, compare=False)
    # its vectors on the GPU (device "cuda"): None until its first scan there, False where they do not fit

    @property
    def ntotal(self) -> int:
        """Vectors a search can return: those in its FAISS index less the deleted ones."""
        return int(self.index.ntotal) - self.deletes.indexed

    def positions_of_rows(self, I: np.ndarray) -> np.ndarray:
        """Row ids of this shard -> its own positions (-1 stays -1)."""
        return self.row_map.positions(I)

    def keys_of(self, I: np.ndarray) -> list[list[str | None]]:
        """Row ids (nq, k) of this shard -> keys from its own key files, None for the -1 padding."""
        I = np.atleast_2d(I)
        flat = self.files.keys.keys_at(self.positions_of_rows(I))
        return [flat[i * I.shape[1] : (i + 1) * I.shape[1]] for i in range(I.shape[0])]

    def joined_keys_of(self, rows: np.ndarray) -> JoinedKeys | list[str | None]:
        """Row ids (C,) of this shard -> their keys as one NUL-joined buffer (what the shard channel
        sends: no string made here), or as a list where that cannot hold them (no rows, a key
        holding a NUL)."""
        positions = self.positions_of_rows(np.asarray(rows, np.int64).reshape(-1))
        joined = self.files.keys.joined_keys_at(positions)
        return joined if joined is not None else self.files.keys.keys_at(positions)

    def position_of(self, key: str) -> int:
        """The shard-local position of ``key`` from this shard's own key files (O(log n)), or -1."""
        position = self.files.keys.position_of(key)
        if position >= 0 and len(self.deletes) and self.deletes.contains(self.files.ids["row"][position].as_py()):
            return -1  # deleted in the generation served: unknown
        return position

    def vector_at(self, position: int) -> np.ndarray | None:
        """The float32 vector at a shard-local position, or None where its row has no valid descriptor."""
        vector = np.asarray(self.vectors[position], dtype=np.float32)
        return vector if is_valid_descriptor(vector, self.files.ids["status"][position].as_py()) else None

    @cached_property
    def local_store(self) -> LocalStore | None:
        """This shard directory's local tokens, by its own positions (None: built without them)."""
        return open_local_store(self.files.directory, self.files.infos)

    @cached_property
    def gpu_present(self) -> bool:
        return gpu_backend_available()

    def scans_on_gpu(self, nq: int) -> bool:
        """Whether a flat shard answers ``nq`` queries by scanning its vectors with
        ``exact_search`` on a GPU instead of searching its FAISS index on the CPU."""
        if not self.exact or self.device == "cpu":
            return False
        if self.device == "cuda":
            return True
        return nq >= GPU_EXACT_MIN_QUERIES and self.ntotal >= GPU_EXACT_MIN_VECTORS and self.gpu_present

    def scans_live_rows(self, nq: int) -> bool:
        """Whether a flat shard on the CPU answers ``nq`` queries by scanning its live rows' vectors
        (``scan``) rather than its FAISS index: where it holds deleted rows, for a batch of at least
        ``LIVE_SCAN_MIN_QUERIES``, when more than half of it is deleted or the deleted rows the
        batch would score pay for gathering the live ones (``LIVE_SCAN_PAYBACK``).

        Through its FAISS index ``search_live``'s over-fetch scores the deleted rows too, and every
        query it searches with the selector (again, or all of a segment more than half deleted)
        runs FAISS's per-row selector loop instead of its scan kernels. 60,000 rows of d = 128,
        one thread, FAISS 1.15 (its index / the live rows gathered and scanned, ms): 60 % deleted,
        8 queries 17.9 / 11.0, 1,000 queries 2,215 / 116; 20 % deleted, 32 queries 13.1 / 23.3,
        300: 79.9 / 71.0, 1,000: 257 / 197; 5 % deleted, 300 queries 84.3 / 85.0, 1,000: 262 / 240."""
        if not self.exact or not len(self.deletes) or nq < LIVE_SCAN_MIN_QUERIES:
            return False
        stored = int(self.index.ntotal)
        share = self.deletes.share_of(stored)
        return self.deletes.past_overfetch(stored) or nq * share >= LIVE_SCAN_PAYBACK * (1.0 - share)

    @cached_property
    def scan_layout(self) -> tuple[np.ndarray, np.ndarray]:
        """(positions in the vectors file, row ids) of this flat shard's vectors, ascending: the
        rows its FAISS index holds (rows whose image failed or was rejected are not in it)."""
        import faiss

        index = faiss.downcast_index(self.index)
        if not hasattr(index, "id_map"):
            raise IndexFileError(f"a flat shard of {type(index).__name__} has no id map to scan its vectors by")
        rows = faiss.vector_to_array(index.id_map).astype(np.int64)
        positions = self.positions_of_rows(rows)
        keep = ~self.deletes.contains(rows)  # a deleted row is never scanned
        positions, rows = positions[keep], rows[keep]
        order = np.argsort(positions, kind="stable")
        return positions[order], rows[order]

    def scan(
        self, xq: np.ndarray, kk: int, device: str = "cuda", backend: str | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Exact (D, I) of this flat shard from its float16 vectors, ties to the lower row id: from
        its vectors kept on the GPU (``resident_vectors``), else with ``exact_search`` (on a GPU by
        default, or NeedleInputError; the torch backend's overlapped stream where torch has CUDA)."""
        positions, rows = self.scan_layout
        resident = self.resident_vectors(device, backend)
        if resident is not None:
            D, I = resident.search(xq, kk)
        else:
            if backend is None and device != "cpu" and self.device == "cuda" and torch_cuda_available():
                backend = "torch"
            D, I = exact_search(xq, chunks_at(self.vectors, positions), kk, "ip", device, backend)
        return D, np.where(I >= 0, rows[I.clip(0)], -1)

    def resident_vectors(self, device: str = "cuda", backend: str | None = None) -> ResidentDatabase | None:
        """This flat shard's scan vectors kept on the GPU, copied at its first scan there, or None:
        the shard's device is not "cuda", the scan's is "cpu", another backend than torch is asked
        for, torch sees no CUDA, or they do not fit (``keep_resident`` warns, once)."""
        if self.device != "cuda" or device == "cpu" or backend not in (None, "torch") or not torch_cuda_available():
            return None
        with RESIDENT_LOCK:
            if self.resident is None:
                positions, _ = self.scan_layout
                kept = keep_resident(
                    lambda: chunks_at(self.vectors, positions), len(positions), self.vectors.shape[1],
                    label=f"flat shard {self.files.directory} ({self.ntotal} vectors)",
                )  # fmt: skip
                self.resident = False if kept is None else kept
        return self.resident if isinstance(self.resident, ResidentDatabase) else None

    def candidates(
        self, xq: np.ndarray, kk: int, nprobe: int | None = None, assigned: CoarseAssignment | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """This shard's best ``kk`` candidates for (nq, d) float32 queries by index score:
        ``(D_index, I)``, ties to the lower row id, -inf/-1 padding last. ``assigned``: the
        queries' lists from ``coarse_key``'s shared stage (``shared_assignments``), not searched again."""
        if self.scans_on_gpu(len(xq)):
            return sort_by_score(*self.scan(xq, kk), kk)  # -inf for the -1 padding, as below
        if self.scans_live_rows(len(xq)):
            return sort_by_score(*self.scan(xq, kk, device="cpu"), kk)
        wanted = min(kk + tie_margin(kk), max(1, self.ntotal))

        def search(k: int, rows: np.ndarray | None, skip_deleted: bool) -> tuple[np.ndarray, np.ndarray]:
            params = self.params(nprobe, skip_deleted)
            if assigned is not None and self.coarse is not None:
                return search_assigned(self.coarse[1], assigned if rows is None else assigned.rows(rows), k, params)
            return self.index.search(xq if rows is None else xq[rows], k, params=params)

        D, I = search_live(search, wanted, int(self.index.ntotal), self.deletes)
        return sort_by_score(D, I, kk)  # a cut that does not depend on FAISS's order among ties

    @cached_property
    def coarse(self) -> tuple[tuple, CoarseStage] | None:
        """(cheap key, stage) of an IVF shard's coarse stage (index/coarse.py), None for a flat one."""
        stage = coarse_stage(self.index)
        return None if stage is None else (coarse_key(stage), stage)

    def coarse_key(self, nq: int, nprobe: int | None) -> tuple[tuple, int] | None:
        """What decides the lists this shard scans for ``nq`` queries at ``nprobe``, cheaply: only
        shards of one key may share an assignment (``shares_coarse_with`` decides). None: a flat
        shard, or one scanning on a GPU."""
        params = self.params(nprobe)
        if self.coarse is None or params is None or self.scans_on_gpu(nq):
            return None
        return self.coarse[0], int(params.nprobe)

    def shares_coarse_with(self, other: Shard) -> bool:
        """Whether ``other`` assigns every query to the same lists (``same_coarse``, to the bit);
        compared once per pair and kept (read by request threads: a race only compares twice).
        The peer is held weakly: a shard kept over generations must not keep the segments of
        generations no longer served (their maps, their deleted files) alive."""
        if other is self:
            return True
        known = self._coarse_peers.get(id(other))
        if known is None or known[0]() is not other:
            same = self.coarse is not None and other.coarse is not None
            known = (weakref.ref(other), same and same_coarse(self.coarse[1], other.coarse[1]))  # type: ignore[index]
            self._coarse_peers[id(other)] = known
        return known[1]

    def forget_gone_peers(self) -> None:
        """Drop the comparisons with shards that no longer exist (called when a generation opens)."""
        for key, (peer, _) in list(self._coarse_peers.items()):
            if peer() is None:
                self._coarse_peers.pop(key, None)

    @cached_property
    def _coarse_peers(self) -> dict[int, tuple[weakref.ref[Shard], bool]]:
        return {}

    def params(self, nprobe: int | None, skip_deleted: bool = False) -> Any | None:
        """``search_params`` for ``nprobe`` (None: this shard's default), skipping the deleted rows
        where ``skip_deleted`` (``with_selector``), made once per value: a query's search asks for
        them once per shard, and making them (SWIG objects) cost about half as much as sorting its
        candidates (profiled). Read-only once made: request threads share them."""
        return cached_params(
            self._params, self.index, nprobe or self.nprobe, self.quantizer_ef, self.deletes, skip_deleted
        )

    @cached_property
    def _params(self) -> dict[tuple[int, bool], Any]:
        return {}

    @cached_property
    def vector_rows(self) -> np.ndarray:
        """The vectors as a plain ndarray over the same map: indexing an np.memmap makes a memmap
        object per read (its bookkeeping was ~10 % of re-scoring a shard's 200 candidates)."""
        return self.vectors.view(np.ndarray)

    def exact_scores(self, xq: np.ndarray, D: np.ndarray, I: np.ndarray, refine: bool = True) -> np.ndarray:
        """The exact scores of candidates ``I`` of this shard (-1 padding: -inf): inner products
        with their float16 vectors for IVF-PQ with ``refine``, otherwise their index scores ``D``."""
        return self.rescore(xq, I) if refine and not self.exact else D

    def search(
        self, xq: np.ndarray, kk: int, nprobe: int | None = None, refine: bool = True
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This shard's shortlist for (nq, d) float32 queries: ``(D_index, I, D_exact)``, its best
        ``kk`` candidates by index score (ties to the lower row id) with their exact scores."""
        D, I = self.candidates(xq, kk, nprobe)
        return D, I, self.exact_scores(xq, D, I, refine)

    def warm(self) -> None:
        """Load what re-scoring needs (torch: seconds) now, not in the first request: a search of
        a zero vector may find no candidate, so it does not."""
        if not self.exact:
            float16_inner_products(
                np.zeros((1, self.vectors.shape[1]), np.float16), np.zeros(self.vectors.shape[1], np.float32)
            )

    def rescore(self, xq: np.ndarray, I: np.ndarray) -> np.ndarray:
        """Exact inner products of the candidates against their float16 vectors (-inf for -1)."""
        return inner_products_at(self.vector_rows, self.positions_of_rows(I), xq)


def shared_assignments(shards: list[Shard], xq: np.ndarray, nprobe: int | None) -> list[CoarseAssignment | None]:
    """Per shard, the coarse assignment of ``xq`` it shares with other shards of its coarse key
    (a living index's segments: one quantizer), made once per key; None for a shard that shares
    with none (it assigns in its own search, which costs the same)."""
    out: list[CoarseAssignment | None] = [None] * len(shards)
    for same in coarse_classes(shards, len(xq), nprobe):
        first = shards[same[0]]
        if len(same) > 1 and first.coarse is not None:
            assigned = assign(first.coarse[1], xq, first.params(nprobe))
            for i in same:
                out[i] = assigned
    return out


def coarse_classes(shards: list[Shard], nq: int = 1, nprobe: int | None = None) -> list[list[int]]:
    """The shards (by index) in classes of one coarse stage: same key, and equal to the class's
    first member (``Shard.shares_coarse_with``, kept once compared); flat shards in none."""
    keyed: dict[tuple, list[list[int]]] = {}
    for i, shard in enumerate(shards):
        key = shard.coarse_key(nq, nprobe)
        if key is None:
            continue
        classes = keyed.setdefault(key, [])
        found = next((c for c in classes if shards[c[0]].shares_coarse_with(shard)), None)
        if found is None:
            classes.append([i])
        else:
            found.append(i)
    return [c for classes in keyed.values() for c in classes]


def warm_coarse(shards: list[Shard]) -> int:
    """Compare the shards' coarse stages now (when a generation is opened), so that no request
    pays for it; the number of classes."""
    for shard in shards:
        shard.forget_gone_peers()
    return len(coarse_classes(shards))


def candidates_of(
    shards: list[Shard], xq: np.ndarray, kk: int, nprobe: int | None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every shard's ``candidates``, the shards of one coarse stage assigning the queries once."""
    assigned = shared_assignments(shards, xq, nprobe)
    return [shard.candidates(xq, kk, nprobe, a) for shard, a in zip(shards, assigned)]


def is_valid_descriptor(vector: np.ndarray, status: str | None) -> bool:
    """Whether a stored row's vector can be a query: its image was read (``status`` ok) and its
    descriptor is finite and not all zeros (``valid_descriptors`` of one row)."""
    return bool(valid_descriptors(np.asarray(vector).reshape(1, -1), np.array([status], object))[0])


def with_selector(params: Any | None, deletes: DeleteSet) -> Any | None:
    """``params`` that also skip the deleted rows (FAISS's IDSelector), where any are deleted."""
    if deletes.selector is None:
        return params
    import faiss

    out: Any = params if params is not None else faiss.SearchParameters()  # None: a flat index
    out.sel = deletes.selector
    out.referenced_objects = [*(getattr(out, "referenced_objects", None) or []), deletes.selector]
    return out


def cached_params(
    cache: dict[tuple[int, bool], Any],
    index: Any,
    nprobe: int,
    quantizer_ef: int | None,
    deletes: DeleteSet,
    skip_deleted: bool,
) -> Any | None:
    """``search_params(index, nprobe, quantizer_ef)``, with ``deletes``' selector where
    ``skip_deleted``, made once per (nprobe, skip_deleted) in ``cache`` (each its own object:
    ``with_selector`` sets the selector on the parameters it is given)."""
    if (nprobe, skip_deleted) not in cache:
        made = search_params(index, nprobe, quantizer_ef)
        cache[nprobe, skip_deleted] = with_selector(made, deletes) if skip_deleted else made
    return cache[nprobe, skip_deleted]


def make_shard(files: ShardFiles, device: str = "auto", deletes: DeleteSet | None = None) -> Shard:
    """A shard over a shard directory's opened ``files`` (its FAISS index loaded), whose
    positions its ``shard_infos.json`` gives (``index.live.row_map``), less the rows ``deletes`` names.
    The process's FAISS takes BLAS from small batches on (``core.blas``: once, where its
    default is in effect)."""
    prefer_blas_for_batches()
    infos = files.infos
    return Shard(
        files.index,
        files.vectors,
        row_map_of(infos, files.ids),
        infos.get("kind") == "flat",
        int(infos.get("nprobe", 64)),
        infos.get("quantizer_ef"),
        files,
        device,
        deletes or DeleteSet.empty(),
    )


def open_shard(path: str | Path, name: str, device: str = "auto", deletes: DeleteSet | None = None) -> Shard:
    """One shard of an index, with its own memory maps (a Ray shard actor's view): the shard
    directory ``path / name`` by itself (nothing outside it is read)."""
    device = check_device(device)
    return make_shard(open_shard_files(Path(path) / name), device, deletes)
