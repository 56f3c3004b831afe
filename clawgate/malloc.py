"""Fewer glibc malloc arenas for a long-running clawgate process.

glibc gives each thread that allocates under contention an arena of its own, up to eight per core, and memory freed
in one arena is not reused by the others. The gateway's threads (render and tokenizer work in ``asyncio.to_thread``,
the capture writer, the engine's worker) each end up with one, and a 30-minute soak at 50 sessions kept growing
0.34 MiB a minute with the default, but not with two arenas (``bench/soak.py``: +11.2 MiB over its last 20 minutes
with the default, +3.1 MiB with two, at the same call rate). The CPU cost of two arenas is the lock contention
between threads that allocate at once, small next to the GIL these threads share.

``MALLOC_ARENA_MAX`` set in the environment wins (glibc reads it at start); elsewhere (another libc) nothing
happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

ARENAS = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap malloc arenas for threads created from now on; True when glibc took the setting."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_ARENA_MAX, arenas))
