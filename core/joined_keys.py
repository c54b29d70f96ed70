"""A list of keys as one UTF-8 buffer, NUL-separated: how a shard's key files hand keys to the shard
channel without making a Python string per key.

Why: the keys of a 1,000-row answer cost a shard more as strings (one decode and one split to
make them, one join and one encode to send them) than the lookup in its key files. The channel
(shards/wire.py) carries keys NUL-joined anyway, so a shard sends this buffer as it is and only the
coordinator makes the strings, once (``split``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class JoinedKeys:
    """``count`` keys: ``data`` holds them NUL-separated (UTF-8; a padding slot is empty), no key
    holds a NUL itself (``of`` checks), and ``padding`` lists the slots that are None (FAISS's -1)."""

    data: bytes  # the keys' UTF-8 bytes joined by b"\0" (count - 1 separators)
    count: int  # how many keys (padding slots included)
    padding: tuple[int, ...] = ()  # the slots that hold no key (None), ascending

    @staticmethod
    def of(data: bytes, count: int, padding: tuple[int, ...] = ()) -> JoinedKeys | None:
        """The keys of ``data``, or None where a key holds a NUL itself (the separators would not
        tell the keys apart: the caller makes the strings one by one instead)."""
        if count == 0 or data.count(b"\0") != count - 1:
            return None
        return JoinedKeys(data, count, padding)

    def split(self) -> list[str | None]:
        """The keys as strings, None at the padding slots."""
        keys: list[str | None] = list(self.data.decode("utf-8").split("\0"))
        for i in self.padding:
            keys[i] = None
        return keys
