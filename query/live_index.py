"""Serving an index that changes: ``LiveIndex`` follows its newest generation without a restart.

A thread checks every ``reload_interval`` seconds which generation is the newest
(index.live.generations.latest_number: one small read, or two). When there is a newer one, it opens it
beside the one served (``open_generation(number, served)``: a ``SearchIndex`` in this process,
which takes over the served one's unchanged segments, or a coordinator and a new set of shard
actors under ``--ray-shards``), warms it (``Index.warm``: no request pays for its first use), then
switches new requests to it in one assignment. A request pins the generation it started on
(``Index.pinned``, the one way to pin: per thread, for all the index calls it makes), so it is
answered by exactly one generation, on every shard; the old one is closed (``close_generation``:
its shard actors stopped) once the last request pinned to it ends. A generation that fails to open
is logged and retried at the next check; the one served goes on.

LiveIndex is itself an ``Index`` (query/index_protocol.py): each of the protocol's members is
answered by the generation this thread is pinned to, else by the one served now; mypy checks
that it offers every member (the check at the end).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.tokens import LocalTokens
from query.index_protocol import Index, RequestScope

if TYPE_CHECKING:  # rerank.rerank imports torch: not for an annotation
    from rerank.rerank import LocalScores, Reranker

log = logging.getLogger(__name__)

# (the number to open (None: the newest), the generation served or None) -> that generation opened
OpenGeneration = Callable[[int | None, Index | None], Index]


class _Pin(threading.local):
    """The generation this thread's request is pinned to: per thread, as each request runs on one."""

    index: Index | None = None  # None: outside ``LiveIndex.pinned`` (calls go to the one served now)


class LiveIndex:
    """An ``Index`` that serves the newest generation of an index and follows it (``reload``)."""

    def __init__(
        self,
        open_generation: OpenGeneration,
        latest: Callable[[], int],
        reload_interval: float = 2.0,
        close_generation: Callable[[Index], None] | None = None,
        on_check: Callable[[int], None] | None = None,
    ):
        self._open = open_generation  # opens a generation (beside the one served)
        self._on_check = on_check  # told the generation served after each check (a Serve replica's board)
        self._latest = latest  # the newest published generation's number
        self._close = close_generation  # releases a generation no request uses any more (None: nothing to)
        self.reload_interval = reload_interval  # seconds between checks for a newer generation (0: never)
        self._current = self._opened(None, None)  # the generation new requests get
        self._pins: dict[int, int] = {}  # id(generation) -> requests pinned to it
        self._retiring: list[Index] = []  # generations switched away from, still pinned
        self._lock = threading.Lock()  # guards _current's switch, _pins and _retiring
        self._pin = _Pin()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if reload_interval > 0:
            self._thread = threading.Thread(target=self._follow, name="needle-index-reload", daemon=True)
            self._thread.start()

    def _opened(self, generation: int | None, served: Index | None) -> Index:
        """A generation opened (beside ``served``), its first-use work done before it is served."""
        index = self._open(generation, served)
        index.warm()
        return index

    # --- pinning: the generation a request sees --------------------------------------------------
    def _active(self) -> Index:
        pinned = self._pin.index
        return pinned if pinned is not None else self._current

    @contextmanager
    def pinned(self) -> Iterator[Index]:
        """``Index.pinned``: the generation served now, and every index call of this thread inside
        the block goes to it (nested: the outer block's); it stays open until the block ends."""
        if self._pin.index is not None:
            yield self._pin.index
            return
        with self._lock:
            index = self._current
            self._pins[id(index)] = self._pins.get(id(index), 0) + 1
        self._pin.index = index
        try:
            yield index
        finally:
            self._pin.index = None
            self._unpin(index)

    @contextmanager
    def request(self, partial: bool = False) -> Iterator[RequestScope]:
        """``Index.request`` of one generation: the request is pinned (``pinned``) for its length."""
        with self.pinned() as index, index.request(partial) as scope:
            yield scope

    def _unpin(self, index: Index) -> None:
        with self._lock:
            self._pins[id(index)] -= 1
            done = [old for old in self._retiring if not self._pins.get(id(old))]
            self._retiring = [old for old in self._retiring if self._pins.get(id(old))]
            for old in done:
                self._pins.pop(id(old), None)
        for old in done:
            self._close_quietly(old)

    # --- following the index ---------------------------------------------------------------------
    def reload(self) -> bool:
        """Switch to the newest generation where it is newer than the one served; whether it switched."""
        newest = self._latest()
        if newest <= self._current.generation:
            return False
        opened = self._opened(newest, self._current)
        with self._lock:
            old, self._current = self._current, opened
            in_use = bool(self._pins.get(id(old)))  # closed by its last request's unpin instead
            if in_use:
                self._retiring.append(old)
            else:
                self._pins.pop(id(old), None)
        log.info("serving generation %d", opened.generation)
        if not in_use:
            self._close_quietly(old)
        return True

    def _follow(self) -> None:
        while not self._stop.wait(self.reload_interval):
            try:
                self.reload()
            except Exception:  # the generation served goes on; the next check tries again
                log.exception("could not open the newest generation; still serving %d", self.generation)
            if self._on_check is not None:  # after the switch: what it is told is already served
                try:
                    self._on_check(self.generation)
                except Exception:  # never the end of following the index
                    log.exception("telling generation %d served", self.generation)

    def _close_quietly(self, index: Index) -> None:
        if self._close is None:
            return
        try:
            self._close(index)
        except Exception:
            log.exception("closing generation %s", index.generation)

    def close(self) -> None:
        """Stop following (the served generation stays open)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # --- the Index protocol: the pinned (else the served) generation's answers -------------------
    @property
    def generation(self) -> int:
        return self._active().generation

    def warm(self) -> None:
        """``Index.warm``: nothing to do, each generation is warmed as it is opened."""

    @property
    def infos(self) -> dict[str, Any]:
        return self._active().infos

    @property
    def path(self) -> str | Path:
        return self._active().path

    @property
    def d(self) -> int:
        return self._active().d

    @property
    def ntotal(self) -> int:
        return self._active().ntotal

    @property
    def is_exact(self) -> bool:
        return self._active().is_exact

    @property
    def has_locals(self) -> bool:
        return self._active().has_locals

    def check_queries(self, xq: np.ndarray, k: int) -> np.ndarray:
        return self._active().check_queries(xq, k)

    def search(
        self, xq: np.ndarray, k: int, nprobe: int | None = None, refine: bool = True, refine_factor: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        return self._active().search(xq, k, nprobe, refine, refine_factor)

    def keys_of(self, I: np.ndarray) -> list[list[str | None]]:
        return self._active().keys_of(I)

    def position_of(self, key: str) -> int:
        return self._active().position_of(key)

    def vector_of(self, key: str) -> np.ndarray:
        return self._active().vector_of(key)

    def tokens_of_key(self, key: str) -> LocalTokens:
        return self._active().tokens_of_key(key)

    def vectors_of_rows(self, I: np.ndarray) -> np.ndarray:
        return self._active().vectors_of_rows(I)

    def rescore(self, xq: np.ndarray, I: np.ndarray) -> np.ndarray:
        return self._active().rescore(xq, I)

    def score_shortlists(
        self,
        reranker: Reranker,
        shortlists: list[np.ndarray],
        s_global: list[np.ndarray],
        tokens: Sequence[LocalTokens],
        k: int,
        evidence: bool = True,
    ) -> list[LocalScores]:
        return self._active().score_shortlists(reranker, shortlists, s_global, tokens, k, evidence)

    def glue_matches(self, reranker: Reranker, rows: np.ndarray, query: LocalTokens) -> np.ndarray:
        return self._active().glue_matches(reranker, rows, query)

    def prefetch_keys(self, keys: list[str], with_tokens: bool = False) -> None:
        self._active().prefetch_keys(keys, with_tokens)

    def health(self, timeout: float | None = None) -> dict[str, Any]:
        return self._active().health(timeout)

    def thumbnail(self, key: str, px: int, tar_dirs: tuple[str, ...] = ()) -> bytes:
        return self._active().thumbnail(key, px, tar_dirs)


if TYPE_CHECKING:  # mypy checks that a following index is an Index, as the two it serves are
    _live: type[Index] = LiveIndex
