"""clawgate caps glibc's malloc arenas (clawgate/malloc.py): threads that allocate at once share two arenas instead
of one each. Counted from glibc's own report (malloc_stats prints one "Arena N:" block per arena)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROGRAM = """
import ctypes, ctypes.util, sys, threading
from clawgate.malloc import limit_arenas
if sys.argv[1] == "limit":
    assert limit_arenas()
barrier = threading.Barrier(8)
def churn():
    barrier.wait()
    for _ in range(20000):
        bytearray(4096)
threads = [threading.Thread(target=churn) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
ctypes.CDLL(ctypes.util.find_library("c")).malloc_stats()
"""


def arenas(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode],
        env={**env, "PYTHONPATH": str(ROOT), "PYTHONMALLOC": "malloc"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return sum(line.startswith("Arena ") for line in out.stderr.splitlines())


def test_threads_share_two_arenas_once_limited():
    assert arenas("limit") <= 2
    assert arenas("default") > 2  # the same threads, without the cap


def test_an_operator_setting_wins(monkeypatch):
    from clawgate.malloc import limit_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_arenas() is False
