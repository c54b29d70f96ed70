"""Several index shards served by one process (one Ray actor): a request reaches the group in one
call carrying every member's arguments, the members answer in parallel threads (FAISS, numpy and
torch release the GIL), and one reply carries every answer.

Why: a Ray call costs about as much coordinator and transport time as a whole shard's search
(``bench/sharded_serving.py``: ~0.5 ms of CPU at each end, measured with a method that does
nothing), so on nodes with fewer cores than shards a request pays per call, not per shard. With
``--shards-per-actor G`` the shards are grouped G to an actor (consecutive shards), one call per
group. Each member is a ``ShardActor`` (cluster/shard_actor.py), staged and opened as on its own.

Members' searches of one query batch go back trimmed to the batch's shortlist among them (the
merge at the coordinator is unchanged and exact: index.search.trim_to_shortlist). Arguments and
answers travel pickled in one bytes object each way: Ray's own serialisation of
several small numpy arrays and lists per call costs more than the pickling (measured with
bench/sharded_serving.py's fan-out; the answers are a few KB).
"""

from __future__ import annotations

import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from cluster.shard_actor import ShardActor
from cluster.staging import StageConfig
from index.search import trim_to_shortlist
from ingest.source_images import SourceImagesConfig


def trimmed_searches(calls: list[tuple[int, tuple]], answers: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Several members' searches of one query batch (same arguments) sent back with only their
    members of the batch's shortlist (``index.search.trim_to_shortlist``: the coordinator's
    merge gives the same answer from them, with less to send, decode and merge)."""
    batches: dict[tuple, list[int]] = {}
    for slot, ((_, args), (status, _)) in enumerate(zip(calls, answers)):
        if status == "ok":
            xq = np.asarray(args[0])
            batches.setdefault((xq.shape, xq.tobytes(), repr(args[1:])), []).append(slot)
    out = list(answers)
    for slots in batches.values():
        if len(slots) > 1:
            kk = int(calls[slots[0]][1][1])
            for slot, part in zip(slots, trim_to_shortlist([answers[s][1] for s in slots], kk)):
                out[slot] = ("ok", part)
    return out


class ShardGroup:
    """The shards ``entries`` (top-level infos entries) of the index at ``source``, each staged to
    this node and opened by its own ``ShardActor``; ``run`` answers many members' calls at once."""

    def __init__(
        self,
        source: str,
        entries: list[dict[str, Any]],
        stage: StageConfig,
        replica: int = 0,
        images: SourceImagesConfig | None = None,
    ):
        self.members = [ShardActor(source, e["name"], stage, replica, e, images) for e in entries]
        self.pool = ThreadPoolExecutor(max(1, len(self.members)), thread_name_prefix="shard")

    def info(self) -> list[dict[str, Any]]:
        """Every member's ``info()`` (where it runs, what it staged)."""
        return [member.info() for member in self.members]

    def memory(self) -> dict[str, int]:
        """This process's memory (all members)."""
        return self.members[0].memory()

    def run(self, packed: bytes) -> bytes:
        """``packed``: pickled ``(method, [(member, args), ...])``; returns the pickled list of
        ``("ok", value)`` or ``("error", exception)``, in order: each member's
        ``method(*args)``, in parallel threads."""
        method, calls = pickle.loads(packed)
        answers = self.answer(method, calls)
        try:
            return pickle.dumps(answers, protocol=5)
        except Exception:  # an error that does not pickle goes back as its message
            plain = [a if a[0] == "ok" else ("error", RuntimeError(repr(a[1]))) for a in answers]
            return pickle.dumps(plain, protocol=5)

    def answer(self, method: str, calls: list[tuple[int, tuple]]) -> list[tuple[str, Any]]:
        def one(member: int, args: tuple) -> tuple[str, Any]:
            try:
                return "ok", getattr(self.members[member], method)(*args)
            except Exception as exc:  # the member's error goes back to its caller, the others still answer
                return "error", exc

        if len(calls) == 1:  # no thread hop for a single member
            return [one(*calls[0])]
        futures = [self.pool.submit(one, member, args) for member, args in calls]
        answers = [future.result() for future in futures]
        return trimmed_searches(calls, answers) if method == "search" else answers
