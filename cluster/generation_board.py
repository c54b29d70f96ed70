"""The generation every Ray Serve replica serves, in one place: a small Ray actor (the "board").

Why: under ``needle serve --ray --replicas N`` each replica follows the index by itself and a
``/health`` probe reaches whichever replica the proxy picks, so one replica's generation says
nothing of the others: ``needle index delete --wait-for`` could return while another replica
still serves the deleted key. So each replica writes the generation it serves to the board (its
``BoardSeat``): ``None`` before it opens the index, then the one it opened, then each one it
switches to, after the switch. ``/health`` reports the minimum over the live replicas
(webapi.health): a generation every replica the proxy may route to serves, or a newer one.

Why it stays sound:

- a replica writes ``None`` *before* it reads which generation is the newest, so a replica still
  starting (a restart, a scale-up) holds ``/health``'s ``"generation"`` at null until it serves;
  one that starts after a generation was published opens that one or a newer one;
- a stopped replica's entry goes: it leaves on graceful shutdown (``__del__``), and the board
  drops an entry whose actor Ray reports dead whenever it is read. A replica that is alive but
  slow to answer the board's ping keeps its entry (it may still serve its old generation);
- the board is never restarted (``max_restarts=0``): a restarted board would not know the
  replicas that reported before, so a lost board makes ``/health`` a 503 (``--wait-for`` then
  waits and times out) rather than a generation it cannot vouch for.

``cluster.serve_run`` creates the board with the deployment (named, detached, so that it lives as
long as the Serve app, which outlives a driver that dies) and kills it when it stops the app.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray

from webapi.health import ReplicaStateUnavailable

log = logging.getLogger(__name__)

BOARD_NAME = "needle-generations"  # one per Serve app (serve_run deploys the app "needle")
BOARD_NAMESPACE = "needle"
PING_TIMEOUT_S = 2.0  # a replica that does not answer the board's ping in time is kept (it may serve)
CALL_TIMEOUT_S = 10.0  # a replica's call to the board: past it, /health is a 503


@ray.remote(num_cpus=0, max_restarts=0)
class GenerationBoard:
    """Replica id -> (the generation it serves, None while it opens the index; its actor)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[int | None, Any]] = {}

    async def report(self, replica: str, generation: int | None, actor: Any) -> None:
        self.entries[replica] = (generation, actor)

    async def forget(self, replica: str) -> None:
        self.entries.pop(replica, None)

    async def generations(self, ping_timeout: float = PING_TIMEOUT_S) -> dict[str, int | None]:
        """Each live replica's generation; the entries of replicas Ray reports dead are dropped."""
        replicas = list(self.entries)
        alive = await asyncio.gather(*(self._alive(self.entries[r][1], ping_timeout) for r in replicas))
        for replica, up in zip(replicas, alive):
            if not up:
                log.info("replica %s stopped: its generation no longer counts", replica)
                self.entries.pop(replica, None)
        return {replica: entry[0] for replica, entry in self.entries.items()}

    @staticmethod
    async def _alive(actor: Any, timeout: float) -> bool:
        """False only where Ray says the actor died; a slow answer counts as alive (it may serve)."""
        try:
            await asyncio.wait_for(actor.__ray_ready__.remote(), timeout)
        except ray.exceptions.ActorDiedError:
            return False
        except (TimeoutError, ray.exceptions.RayError):  # busy, unreachable for now: still counted
            pass
        return True


def start_board(detached: bool = False) -> Any:
    """A generation board: the named one of the app (created, or the one a previous run left) where
    ``detached``, else an anonymous one owned by this process (tests deploying with ray_app)."""
    if not detached:
        return GenerationBoard.remote()
    return GenerationBoard.options(
        name=BOARD_NAME, namespace=BOARD_NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote()


class BoardSeat:
    """One Serve replica's place on the board: it writes what it serves and reads everyone's."""

    def __init__(self, board: Any):
        from ray import serve

        self.board = board
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.actor = ray.get_runtime_context().current_actor
        self.reported: int | None = None
        self.report(None)  # before the index is opened: see the module's docstring

    def report(self, generation: int | None) -> None:
        """Write ``generation`` (None: opening) and wait until the board has it."""
        ray.get(self.board.report.remote(self.replica, generation, self.actor), timeout=CALL_TIMEOUT_S)
        self.reported = generation
        log.info("replica %s (pid %d) serves generation %s", self.replica, os.getpid(), generation)

    def served(self, generation: int) -> None:
        """After each check for a newer generation: write ``generation`` where the board has another
        one (a failed write is retried at the next check; meanwhile the board holds an older one,
        which only makes ``--wait-for`` wait)."""
        if generation == self.reported:
            return
        try:
            self.report(generation)
        except Exception:
            log.warning("could not write generation %d to the generation board; retried at the next check",
                        generation, exc_info=True)  # fmt: skip

    def generations(self, own: int) -> dict[str, int | None]:
        """Every live replica's generation, this one's as it is now; ReplicaStateUnavailable where
        the board cannot be read."""
        try:
            seen = ray.get(self.board.generations.remote(), timeout=CALL_TIMEOUT_S)
        except Exception as exc:
            reason = type(exc).__name__
            raise ReplicaStateUnavailable(f"the replicas' generation board cannot be read ({reason})") from exc
        seen[self.replica] = own
        return seen

    def leave(self) -> None:
        """On graceful shutdown: the entry goes at once (a crash's goes at the board's next read)."""
        try:
            self.board.forget.remote(self.replica)
        except Exception:  # the board is gone too: nothing left to forget
            log.debug("could not leave the generation board", exc_info=True)
