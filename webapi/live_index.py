"""Serving an index that changes: ``LiveIndex`` follows its newest generation without a restart.

A thread checks every ``reload_interval`` seconds which generation is the newest
(index.live.generations.latest_number: one small read, or two). When there is a newer one, it opens it
beside the one served (``open_generation(number, served)``: a ``SearchIndex`` in this process,
which takes over the served one's unchanged segments, or a coordinator and a new set of shard
actors under ``--ray-shards``), then switches new requests to it in one
assignment. A request pins the generation it started on (``pinned``: per thread, for all the
index calls it makes), so it is answered by exactly one generation, on every shard; the old one is
closed (``close_generation``: its shard actors stopped) once the last request pinned to it ends.
A generation that fails to open is logged and retried at the next check; the one served goes on.

Everything else is the served generation's (``__getattr__``): LiveIndex answers what the query
path asks of any index (query/index_protocol.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)


class LiveIndex:
    def __init__(
        self,
        open_generation: Callable[[int | None, Any | None], Any],
        latest: Callable[[], int],
        reload_interval: float = 2.0,
        close_generation: Callable[[Any], None] | None = None,
    ):
        self._open = open_generation  # (number (None: the newest), the one served or None) -> an opened index
        self._latest = latest  # the newest published generation's number
        self._close = close_generation
        self.reload_interval = reload_interval
        self._current = self._opened(None, None)
        self._pins: dict[int, int] = {}  # id(index) -> requests pinned to it
        self._retiring: list[Any] = []  # generations switched away from, still pinned
        self._lock = threading.Lock()
        self._local = threading.local()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if reload_interval > 0:
            self._thread = threading.Thread(target=self._follow, name="needle-index-reload", daemon=True)
            self._thread.start()

    def _opened(self, generation: int | None, served: Any | None) -> Any:
        """A generation opened (beside ``served``), and its first-use work done before it is served
        (``warm``, where the index has it: no request pays for it)."""
        index = self._open(generation, served)
        warm = getattr(index, "warm", None)
        if callable(warm):
            warm()
        return index

    # --- the generation a request sees -----------------------------------------------------------
    def _active(self) -> Any:
        pinned = getattr(self._local, "index", None)
        return pinned if pinned is not None else self._current

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._active(), name)

    @property
    def generation(self) -> int:
        return int(getattr(self._active(), "generation", 0))

    @contextmanager
    def pinned(self) -> Iterator[Any]:
        """Every index call of this thread inside the block goes to one generation (nested: the outer one's)."""
        if getattr(self._local, "index", None) is not None:
            yield self._local.index
            return
        with self._lock:
            index = self._current
            self._pins[id(index)] = self._pins.get(id(index), 0) + 1
        self._local.index = index
        try:
            yield index
        finally:
            self._local.index = None
            self._unpin(index)

    @contextmanager
    def request(self, partial: bool = False) -> Iterator[Any]:
        """``Index.request`` of the pinned generation."""
        with self.pinned() as index, index.request(partial) as scope:
            yield scope

    def _unpin(self, index: Any) -> None:
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
        if newest <= int(getattr(self._current, "generation", 0)):
            return False
        opened = self._opened(newest, self._current)
        with self._lock:
            old, self._current = self._current, opened
            if self._pins.get(id(old)):
                self._retiring.append(old)
                old = None
            else:
                self._pins.pop(id(old), None)
        log.info("serving generation %d", int(getattr(opened, "generation", newest)))
        if old is not None:
            self._close_quietly(old)
        return True

    def _follow(self) -> None:
        while not self._stop.wait(self.reload_interval):
            try:
                self.reload()
            except Exception:  # the generation served goes on; the next check tries again
                log.exception("could not open the newest generation; still serving %d", self.generation)

    def _close_quietly(self, index: Any) -> None:
        if self._close is None:
            return
        try:
            self._close(index)
        except Exception:
            log.exception("closing generation %s", getattr(index, "generation", "?"))

    def close(self) -> None:
        """Stop following (the served generation stays open)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


@contextmanager
def pinned(index: Any) -> Iterator[None]:
    """``index.pinned()`` where ``index`` follows generations (LiveIndex); nothing otherwise."""
    if isinstance(index, LiveIndex):
        with index.pinned():
            yield
    else:
        yield
