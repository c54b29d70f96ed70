"""One coarse assignment for many IVF segments: the segments of a living index's shards (index
files added by ``needle index add``, index/add_rows.py) are encoded with the build's trained
quantizer, so a query's nearest lists are the same in every segment. Searching each segment with
``index.search`` assigns the query again per segment (the OPQ rotation and a scan of every
centroid: ~0.3 ms per query and segment at 4,096 lists x 512 dims); here it is done once and each
segment scans its lists with FAISS's ``search_preassigned``, which gives the same ``(D, I)`` as
its own ``search`` (tests/test_coarse.py).

Segments share an assignment only where their coarse stages are byte for byte the same
(``coarse_fingerprint``: the pre-transform chain, the quantizer and its graph); any other index
(flat, another quantizer) is searched by itself.
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


def coarse_fingerprint(stage: CoarseStage) -> str:
    """A digest of everything that decides a query's lists: the transforms, the quantizer (its
    centroids and, for an HNSW quantizer, its graph), the metric and the number of lists."""
    import faiss as swig

    faiss: Any = swig
    digest = hashlib.sha256(f"{stage.ivf.nlist}:{stage.ivf.metric_type}:{stage.ivf.d}".encode())
    for transform in stage.chain:
        writer = faiss.VectorIOWriter()
        faiss.write_VectorTransform(transform, writer)
        digest.update(faiss.vector_to_array(writer.data).tobytes())
    digest.update(faiss.serialize_index(stage.ivf.quantizer).tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class CoarseAssignment:
    """Queries as the IVF index sees them and their lists, for every segment of one fingerprint."""

    xt: np.ndarray  # (nq, d_ivf) float32: the queries after the pre-transforms
    Dq: np.ndarray  # (nq, nprobe) float32: distances to the lists' centroids
    Iq: np.ndarray  # (nq, nprobe) int64: the lists to scan, best first


def assign(stage: CoarseStage, xq: np.ndarray, params: Any) -> CoarseAssignment:
    """The lists ``params`` (``index.merge.search_params``: nprobe, the HNSW depth) make a search
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
