"""``Index``: what the query path (query/, webapi/, eval/) asks of an index, whichever it holds.

Two kinds implement it: ``index.search.SearchIndex`` (a directory searched in this process, also
over shard directories) and ``shards.coordinator.ShardedIndex`` (the coordinator of shards served
elsewhere, which routes each call to the shards that own the rows). The query path never asks
which kind it holds: where they differ (a request that may miss shards, the replicas' health, the
keys looked up in one call to every shard, where thumbnails and local scores are made), each
answers in its own way, the in-process one trivially.

An index is one generation of a living index (docs/live_index.md): ``query.live_index.LiveIndex``
follows the newest of them and is an ``Index`` too. So every index declares what living asks:
its ``generation``, its first-use work done ahead (``warm``) and the one way a request is pinned
to one generation (``pinned``); an index that never changes answers its own generation, warms
what it has, and pins to itself.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from core.tokens import LocalTokens

if TYPE_CHECKING:  # rerank.rerank imports torch: not for an annotation
    from index.search import SearchIndex
    from rerank.rerank import LocalScores, Reranker


class RequestScope(Protocol):
    """One request to an index (``Index.request``)."""

    @property
    def missing(self) -> Set[str]:
        """The shards that did not answer in time (a partial request's; always empty in one process)."""
        ...


class Index(Protocol):
    """An index to query: its size and settings, searches, and the rows' keys, vectors and tokens."""

    @property
    def infos(self) -> dict[str, Any]:
        """The top-level ``index_infos.json``."""
        ...

    @property
    def path(self) -> str | Path:
        """Where the index is (a directory, or an ``s3://`` prefix), for messages."""
        ...

    @property
    def d(self) -> int: ...

    @property
    def ntotal(self) -> int: ...

    @property
    def is_exact(self) -> bool: ...

    @property
    def has_locals(self) -> bool:
        """Whether the index was built with local tokens (re-ranking needs them)."""
        ...

    @property
    def generation(self) -> int:
        """The generation this index answers from (0: as built)."""
        ...

    def warm(self) -> None:
        """Do now the work a first request would otherwise do (none where there is none)."""
        ...

    def pinned(self) -> AbstractContextManager[Index]:
        """The one way to pin a request to a generation: ``with index.pinned() as view:`` gives the
        ``Index`` of one generation, and every call to ``index`` from this thread inside the block
        is answered by it too (an index that never changes: itself)."""
        ...

    def check_queries(self, xq: np.ndarray, k: int) -> np.ndarray:
        """(nq, d) float32 queries, or NeedleInputError naming what is wrong with ``xq`` or ``k``."""
        ...

    def search(
        self, xq: np.ndarray, k: int, nprobe: int | None = None, refine: bool = True, refine_factor: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(nq, d) queries -> (D, I): (nq, k) scores and row ids, best first, -1 padding;
        ``nprobe`` and ``refine_factor`` override the build's defaults for this search."""
        ...

    def keys_of(self, I: np.ndarray) -> list[list[str | None]]:
        """Row ids (nq, k) -> keys, None for the -1 padding."""
        ...

    def position_of(self, key: str) -> int:
        """The position of ``key`` (0..ntotal-1, the shards' rows in order); UnknownKeyError if absent."""
        ...

    def vector_of(self, key: str) -> np.ndarray:
        """The float32 vector of ``key``; UnknownKeyError where it is absent or has no valid descriptor."""
        ...

    def tokens_of_key(self, key: str) -> LocalTokens:
        """The stored local tokens of ``key``."""
        ...

    def vectors_of_rows(self, I: np.ndarray) -> np.ndarray:
        """The float32 vectors of row ids (nq, k) -> (nq, k, d), zeros for the -1 padding."""
        ...

    def rescore(self, xq: np.ndarray, I: np.ndarray) -> np.ndarray:
        """Exact inner products (nq, C) of (nq, d) queries with their rows ``I`` (nq, C), -inf for
        the -1 padding: re-ranking's second scoring of a shortlist by an expanded query."""
        ...

    def score_shortlists(
        self,
        reranker: Reranker,
        shortlists: list[np.ndarray],
        s_global: list[np.ndarray],
        tokens: Sequence[LocalTokens],
        k: int,
        evidence: bool = True,
    ) -> list[LocalScores]:
        """Each query's local evidence on its shortlist (row ids ``shortlists[q]``, global scores
        ``s_global[q]``) against the rows' stored tokens, by ``reranker`` with the query's
        ``tokens[q]``. Made where the tokens are: in one process from the local store; with shards
        elsewhere each shard scores its members, and with ``evidence`` the match evidence of the
        members that can reach the top k comes back with the scores."""
        ...

    def glue_matches(self, reranker: Reranker, rows: np.ndarray, query: LocalTokens) -> np.ndarray:
        """The second verification's expected matches (rerank/glue.py) of ``query`` with row ids
        ``rows`` (the top of its final order), made where the rows' tokens are: each shard for its own."""
        ...

    def request(self, partial: bool = False) -> AbstractContextManager[RequestScope]:
        """The scope of one request: ``partial`` allows answers from the shards that answered in
        time (their names in the scope's ``missing``), else a missing shard is ShardsUnavailable."""
        ...

    def prefetch_keys(self, keys: list[str], with_tokens: bool = False) -> None:
        """Look ``keys`` up ahead of this request's ``vector_of``/``tokens_of_key`` of them (shards
        elsewhere: one call to each for all keys; ``with_tokens``: their stored tokens too)."""
        ...

    def health(self, timeout: float | None = None) -> dict[str, Any]:
        """The /health fields about the shards' replicas: ``{"ok", "unavailable_shards",
        "replicas"}`` for shards served elsewhere; ``{}`` in one process (every shard is here)."""
        ...

    def thumbnail(self, key: str, px: int, tar_dirs: tuple[str, ...] = ()) -> bytes:
        """A JPEG of ``key``'s image, longer side ``px``, read from its source tar where the key's
        rows are (``tar_dirs``: where ``<shard>.tar`` is looked for when ingestion recorded no
        readable URL; shards served elsewhere read with their own configuration)."""
        ...


if TYPE_CHECKING:  # mypy checks that the index of this process is an Index (as shards.coordinator does for its own)
    _single: type[Index] = SearchIndex
