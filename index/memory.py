"""Memory of a process, and what the machine has left, as Linux accounts it: for serving reports,
benchmarks and the fit rule of resident vectors (index/gpu/resident.py).

RSS counts every resident page, including pages of memory-mapped files (index shards, the float16
refine vectors) that the kernel can drop and re-read at will; PSS divides shared pages among the
processes that map them, so the PSS of a coordinator and its shard actors can be summed. The
anonymous part is what must really fit in RAM.
"""

from __future__ import annotations

import os
from pathlib import Path

FIELDS = {"Rss": "rss", "Pss": "pss", "Pss_Anon": "pss_anon", "Pss_File": "pss_file"}


def process_memory(pid: int | None = None) -> dict[str, int]:
    """``{"rss", "pss", "pss_anon", "pss_file"}`` in bytes for ``pid`` (default: this process);
    empty where /proc/PID/smaps_rollup does not exist (not Linux, or the process is gone)."""
    path = Path(f"/proc/{pid or os.getpid()}/smaps_rollup")
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, _, rest = line.partition(":")
        if name in FIELDS:
            out[FIELDS[name]] = int(rest.split()[0]) * 1024  # reported in kB
    return out


def peak_rss_bytes() -> int:
    """This process's high-water resident memory (Linux reports kilobytes)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_available_bytes(free_pages_bytes: int, meminfo: str = "/proc/meminfo") -> int:
    """The memory a new allocation can take: Linux's ``MemAvailable`` (free pages plus the page
    cache it can drop), not the free pages alone, which a warm page cache (an index's mapped
    files read once) brings near zero; ``free_pages_bytes`` where the kernel does not say."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return free_pages_bytes
