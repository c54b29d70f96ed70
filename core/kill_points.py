"""Named points where a test may kill a writer (``kill -9``), to check that what it leaves behind
is still a whole index (docs/live_index.md, tests/index/live/test_live_kill.py).

``NEEDLE_KILL_AT=<name>`` in a writer's environment makes it SIGKILL itself on reaching the point
of that name: no handler runs, no file is closed or flushed, as when the machine loses power or an
operator kills the process. Unset (always, outside those tests), a point costs one lookup.
"""

from __future__ import annotations

import os
import signal

KILL_ENV = "NEEDLE_KILL_AT"


def kill_point(name: str) -> None:
    """SIGKILL this process where ``$NEEDLE_KILL_AT`` names this point."""
    if os.environ.get(KILL_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
