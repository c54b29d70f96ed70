"""One coarse assignment for many IVF segments: the segments of a living index's shards (index
files added by ``needle index add``, index/live/add_rows.py) are encoded with the build's trained
quantizer, so a query's nearest lists are the same in every segment. Searching each segment with
``index.search`` assigns the query again per segment (the OPQ rotation and a scan of every
centroid: ~0.3 ms per query and segment at 4,096 lists x 512 dims); here it is done once and each
segment scans its lists with FAISS's ``search_preassigned``, which gives the same ``(D, I)`` as
its own ``search`` (tests/index/test_coarse.py).

Segments share an assignment only where their coarse stages are equal to the bit
(``same_coarse``: the pre-transforms, the quantizer's centroids and graph, compared from views of
FAISS's arrays after a cheap ``coarse_key``); any other index (flat, another quantizer) is
searched by itself. The comparison is made once per pair of segments and kept (index/shard.py),
and made when a generation is opened (``warm_coarse``), not by the first request.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class CoarseStage:
    """What assigns a query to lists in an IVF index: its pre-transforms and its quantizer."""

    chain: tuple[Any, ...]  # VectorTransforms before the IVF index (an OPQ rotation), in order
    ivf: Any  # the IndexIVF they feed (its quantizer assigns, its lists are scanned)


def coarse_stage(index: Any) -> CoarseStage | None:
    """The coarse stage of an IVF index, optionally behind pre-transforms; None for any other."""
    import faiss as swig

    faiss: Any = swig  # its bundled stubs type the chain as a list and the writers by file name
    index = faiss.downcast_index(index)
    chain: tuple[Any, ...] = ()
    if isinstance(index, faiss.IndexPreTransform):
        chain = tuple(faiss.downcast_VectorTransform(index.chain.at(i)) for i in range(index.chain.size()))
        index = faiss.downcast_index(index.index)
    if not isinstance(index, faiss.IndexIVF):
        return None
    return CoarseStage(chain, index)


def coarse_key(stage: CoarseStage) -> tuple:
    """A cheap key of a coarse stage (shapes, kinds, and a digest of the first and last 64 KB of
    the centroids): stages of different keys never share; stages of one key share only once
    ``same_coarse`` found them equal."""
    centroids = quantizer_arrays(stage.ivf.quantizer)[0]
    raw = centroids.view(np.uint8)
    digest = hashlib.sha256(raw[:65536].tobytes() + raw[-65536:].tobytes()).hexdigest()
    kinds = (*(type(t).__name__ for t in stage.chain), type(stage.ivf.quantizer).__name__)
    return stage.ivf.nlist, stage.ivf.d, int(stage.ivf.metric_type), kinds, centroids.size, digest


def same_coarse(a: CoarseStage, b: CoarseStage) -> bool:
    """Whether two coarse stages assign every query to the same lists: their transforms and their
    quantizers (centroids and, for an HNSW quantizer, its graph) equal to the bit. Compared from
    views of FAISS's own arrays (no serialisation: a few ms for 4,096 x 512 centroids)."""
    shapes = [(s.ivf.nlist, s.ivf.d, int(s.ivf.metric_type), len(s.chain)) for s in (a, b)]
    if shapes[0] != shapes[1]:
        return False
    pairs = [(transform_arrays(x), transform_arrays(y)) for x, y in zip(a.chain, b.chain)]
    pairs.append((quantizer_arrays(a.ivf.quantizer), quantizer_arrays(b.ivf.quantizer)))
    return all(len(xs) == len(ys) and all(np.array_equal(x, y) for x, y in zip(xs, ys)) for xs, ys in pairs)


def quantizer_arrays(quantizer: Any) -> list[np.ndarray]:
    """The arrays that decide a quantizer's answers: a flat one's centroids (a view); an HNSW one's
    centroids and graph; any other kind's serialised bytes."""
    import faiss as swig

    faiss: Any = swig
    quantizer = faiss.downcast_index(quantizer)
    if isinstance(quantizer, faiss.IndexFlat):
        return [faiss.rev_swig_ptr(quantizer.get_xb(), quantizer.ntotal * quantizer.d)]
    if hasattr(quantizer, "hnsw") and isinstance(faiss.downcast_index(quantizer.storage), faiss.IndexFlat):
        graph = quantizer.hnsw
        arrays = [quantizer_arrays(quantizer.storage)[0]]
        arrays += [faiss.vector_to_array(v) for v in (graph.neighbors, graph.offsets, graph.levels)]
        return [*arrays, np.array([graph.entry_point, graph.max_level, graph.efSearch], np.int64)]
    return [faiss.serialize_index(quantizer)]


def transform_arrays(transform: Any) -> list[np.ndarray]:
    """A pre-transform's parameters: a linear one's (OPQ, PCA) matrix and bias; any other's
    serialised bytes."""
    import faiss as swig

    faiss: Any = swig  # its bundled stubs type the writers by file name
    if isinstance(transform, faiss.LinearTransform):
        return [faiss.vector_to_array(transform.A), faiss.vector_to_array(transform.b)]
    writer = faiss.VectorIOWriter()
    faiss.write_VectorTransform(transform, writer)
    return [faiss.vector_to_array(writer.data)]


@dataclass(frozen=True)
class CoarseAssignment:
    """Queries as the IVF index sees them and their lists, for every segment of one fingerprint."""

    xt: np.ndarray  # (nq, d_ivf) float32: the queries after the pre-transforms
    Dq: np.ndarray  # (nq, nprobe) float32: distances to the lists' centroids
    Iq: np.ndarray  # (nq, nprobe) int64: the lists to scan, best first

    def rows(self, rows: np.ndarray) -> CoarseAssignment:
        """The assignment of the queries ``rows`` only (FAISS's pointers want contiguous arrays)."""
        return CoarseAssignment(*(np.ascontiguousarray(a[rows]) for a in (self.xt, self.Dq, self.Iq)))


def assign(stage: CoarseStage, xq: np.ndarray, params: Any) -> CoarseAssignment:
    """The lists ``params`` (``index.build.merge.search_params``: nprobe, the HNSW depth) make a search
    of ``stage``'s index scan for the (nq, d) float32 queries ``xq``."""
    import faiss

    xt = np.array(xq, dtype=np.float32, order="C")  # a copy: queries off the wire are read-only
    for transform in stage.chain:
        xt = np.ascontiguousarray(transform.apply(xt), dtype=np.float32)
    nprobe = int(params.nprobe)
    Dq = np.empty((len(xt), nprobe), np.float32)
    Iq = np.empty((len(xt), nprobe), np.int64)
    # the quantizer's own settings where ``params`` carry none, as the index's search does
    stage.ivf.quantizer.search_c(
        len(xt), faiss.swig_ptr(xt), nprobe, faiss.swig_ptr(Dq), faiss.swig_ptr(Iq), params.quantizer_params
    )
    return CoarseAssignment(xt, Dq, Iq)


def search_assigned(
    stage: CoarseStage, assigned: CoarseAssignment, k: int, params: Any
) -> tuple[np.ndarray, np.ndarray]:
    """``(D, I)`` of ``stage``'s index for the queries of ``assigned`` (``k`` per query), scanning
    the lists assigned with ``params`` (their nprobe, and their IDSelector of deleted rows): what
    the index's own ``search(xq, k, params=params)`` returns. Through the SWIG method, since
    FAISS's Python wrapper of ``search_preassigned`` refuses search parameters."""
    import faiss

    nq = len(assigned.xt)
    if assigned.Iq.shape != (nq, int(params.nprobe)):
        raise ValueError(f"coarse assignment of shape {assigned.Iq.shape} for nprobe {params.nprobe}")
    D = np.empty((nq, k), np.float32)
    I = np.empty((nq, k), np.int64)
    stage.ivf.search_preassigned_c(
        nq,
        faiss.swig_ptr(assigned.xt),
        k,
        faiss.swig_ptr(assigned.Iq),
        faiss.swig_ptr(assigned.Dq),
        faiss.swig_ptr(D),
        faiss.swig_ptr(I),
        False,
        params,
    )
    return D, I
