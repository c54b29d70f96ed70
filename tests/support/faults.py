"""Storage faults for the living index's writers: a location that counts every storage call a
writer makes and, at the call of a chosen number, fails it (an error before the call, an error
after the call took effect, as a PUT whose answer was lost), kills the process there (SIGKILL:
no handler, no cleanup), or halts it there (nothing from that call on reaches storage: a kill as
storage sees it, in-process). tests/index/live/test_live_faults.py makes each call of each write
command fail in turn."""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass, field
from typing import Any

# Every operation of core.location.Location that touches storage (local_root, url and url_of do not).
STORAGE_CALLS = frozenset(
    {
        "read_bytes", "probe", "read_required", "read_range", "read_json", "write_json", "create_exclusive", "replace",
        "upload", "download", "local_copy", "stat", "remove", "list", "commit_file", "committed",
    }
)  # fmt: skip
KINDS = ("error", "error_after", "kill", "halt")


class InjectedFault(OSError):
    """The error a faulty call raises (an EIO, as a failing disk or a 5xx answer would)."""


class Halted(BaseException):
    """The writer "died" at a storage call (kind ``halt``): raised there and at every later call,
    none of which reaches storage. What storage is left holding is what a SIGKILL at that call
    leaves where every byte goes through the location (S3); no ``except Exception`` of the writer
    catches it, and its cleanup's calls are refused like any other."""


@dataclass
class Faults:
    """Which storage call fails, and how; ``calls``: every call seen, ``"method name"``."""

    fail_at: int | None = None  # 1-based number of the call that fails (None: none)
    kind: str = "error"  # one of KINDS
    calls: list[str] = field(default_factory=list)

    halted: bool = False  # kind ``halt``: the call was reached, nothing more reaches storage

    def call(self, method: str, name: str, real: Any) -> Any:
        self.calls.append(f"{method} {name}")
        hit = len(self.calls) == self.fail_at
        if hit and self.kind == "halt":
            self.halted = True
        if self.halted:
            raise Halted(f"halted at storage call {self.fail_at}")
        if hit and self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if hit and self.kind == "error":
            raise InjectedFault(errno.EIO, f"injected fault before storage call {self.fail_at}: {method} {name}")
        result = real()
        if hit:  # error_after: the call took effect, its caller sees it fail
            raise InjectedFault(errno.EIO, f"injected fault after storage call {self.fail_at}: {method} {name}")
        return result


class FaultyLocation:
    """``inner`` (a core.location Location) with every storage call going through ``faults``."""

    def __init__(self, inner: Any, faults: Faults):
        self._inner = inner
        self._faults = faults

    def __getattr__(self, attribute: str) -> Any:
        value = getattr(self._inner, attribute)
        if attribute not in STORAGE_CALLS:
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            name = str(args[0]) if args else ""
            return self._faults.call(attribute, name, lambda: value(*args, **kwargs))

        return call
