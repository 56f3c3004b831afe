"""Soak: does the gateway's memory level off under steady multi-session traffic?

The gateway runs in its own process as ``clawgate up`` runs it (``build_app`` with the in-process engine on the
tiny model, SQLite in a temporary directory, durable capture, a small ``max_tokens``), without the trainer.
``--sessions`` clients each hold a multi-turn chat conversation through the OpenAI API (each turn echoes the
previous answer, as harnesses do, so calls are spliced and join their implicit rollout) and start a new
conversation every 2–6 turns, so new conversation and rollout ids keep appearing, as real traffic makes them.
Printed every minute: the gateway's RSS and calls/s; at the end the RSS growth over the last two thirds of the run,
which must level off (target: ≤ 10 MiB over the last 20 minutes of a 30-minute soak at 50 sessions).

Implicit sessions stay open for ``session_idle_timeout`` (1800 s), but the session index keeps a turn nobody continued
only for ``session_cache_idle`` (300 s; a later turn is continued from the database), so its memory fills within the
first five minutes and then levels off. ``--cache-idle 1800`` shows what holding the whole idle window would cost.

    .venv/bin/python bench/soak.py                                   # 30 minutes, 50 sessions
    .venv/bin/python bench/soak.py --minutes 10 --cache-idle 120     # a short run past a full memory window
    .venv/bin/python bench/soak.py --minutes 10 --tracemalloc        # + the top growing allocation sites

The server caps glibc's malloc arenas as the ``clawgate`` command does (clawgate/malloc.py); ``--default-arenas``
leaves glibc's default (one arena per thread that allocates under contention), which grew 11.2 MiB over the last
20 minutes of the default soak against 3.1 MiB with the cap.

``--tracemalloc`` traces the gateway's allocations (slower: compare RSS only between runs without it) and prints
the allocation sites that grew most between the end of the first third of the run and its end, and the sizes of
the gateway's in-memory caches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SERVER = r"""
import json, os, signal, sys, tracemalloc
import uvicorn
from gateway.app import build_app
from gateway.settings import Settings

model, url, port, data, max_tokens, idle, cache_idle, trace_out = sys.argv[1:9]
if os.environ.get("SOAK_DEFAULT_ARENAS") != "1":
    from clawgate.malloc import limit_arenas

    limit_arenas()  # as the clawgate command does
if trace_out:
    tracemalloc.start(8)
    marks = []

    def mark(signum, frame):
        marks.append(tracemalloc.take_snapshot())
        if len(marks) < 2:
            return
        keep = [tracemalloc.Filter(False, tracemalloc.__file__)]
        first, last = (s.filter_traces(keep) for s in marks[-2:])
        stats = last.compare_to(first, "traceback")
        state = app.state.clawgate
        svc = state.service
        sizes = {
            "session index entries": len(state.index),
            "session index tokens": state.index.tokens,
            "session index output hashes": len(state.index._outputs),
            "closed rollouts": len(svc.closed_rollouts),
            "rollout keys": len(state.rollout_keys),
            "stored responses": len(state.responses),
            "capture queue": len(state.writer._queue) if hasattr(state.writer, "_queue") else None,
        }
        with open(trace_out + ".part", "w") as f:
            json.dump({
                "traced_mib": tracemalloc.get_traced_memory()[0] / 2**20,
                "sizes": sizes,
                "top": [
                    {"kib": s.size_diff / 1024, "count": s.count_diff,
                     "where": [f"{fr.filename.replace(sys.prefix, '<venv>')}:{fr.lineno}" for fr in s.traceback][-4:]}
                    for s in stats[:15]
                ],
            }, f)
        os.replace(trace_out + ".part", trace_out)

    signal.signal(signal.SIGUSR1, mark)

settings = Settings(model=model, served_model_name="tiny", database_url=url, port=int(port), data_dir=data,
                    policy_follow=False, max_tokens=int(max_tokens), session_idle_timeout=float(idle),
                    session_cache_idle=float(cache_idle))
app = build_app(settings)
uvicorn.run(app, host="127.0.0.1", port=int(port), log_level="warning", access_log=False)
"""

WORDS = ("read", "the", "file", "run", "tests", "fix", "failing", "import", "then", "check", "build", "report")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


async def session(base: str, sid: int, deadline: float, max_tokens: int, out: dict) -> None:
    """One client: conversations of 2–6 turns, one after another, until the deadline."""
    rng = random.Random(sid)
    async with httpx.AsyncClient(timeout=120) as client:
        conversation = 0
        while time.monotonic() < deadline:
            conversation += 1
            task = " ".join(rng.choices(WORDS, k=8))
            messages = [{"role": "user", "content": f"session {sid} conversation {conversation}: {task}"}]
            for turn in range(rng.randint(2, 6)):
                if time.monotonic() >= deadline:
                    return
                body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 1.0}
                try:
                    r = await client.post(base + "/v1/chat/completions", json=body)
                except httpx.HTTPError as exc:
                    out["errors"].append(repr(exc))
                    await asyncio.sleep(1)
                    break
                if r.status_code != 200:
                    out["errors"].append(f"status {r.status_code}: {r.text[:200]}")
                    await asyncio.sleep(1)
                    break
                out["calls"] += 1
                answer = r.json()["choices"][0]["message"]["content"] or ""
                messages += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"turn {turn}: " + " ".join(rng.choices(WORDS, k=6))},
                ]


async def drive(args: argparse.Namespace, base: str, server: subprocess.Popen, trace_out: Path | None) -> None:
    out: dict = {"calls": 0, "errors": []}
    start = time.monotonic()
    deadline = start + args.minutes * 60
    tasks = [asyncio.create_task(session(base, i, deadline, args.max_tokens, out)) for i in range(args.sessions)]
    samples = [(0.0, rss_mib(server.pid), 0)]
    print(f"{'minute':>6} {'RSS MiB':>8} {'calls/s':>8} {'calls':>8} {'errors':>6}", flush=True)
    print(f"{0:6.1f} {samples[0][1]:8.1f} {'':>8} {0:8d} {0:6d}", flush=True)
    marked = False
    step = 60.0 if args.minutes >= 5 else args.minutes * 6  # every minute (ten samples in a short run)
    while time.monotonic() < deadline:
        await asyncio.sleep(min(step, max(deadline - time.monotonic(), 0.0)))
        elapsed = time.monotonic() - start
        rss, calls = rss_mib(server.pid), out["calls"]
        rate = (calls - samples[-1][2]) / max(elapsed - samples[-1][0], 1e-9)
        samples.append((elapsed, rss, calls))
        print(f"{elapsed / 60:6.1f} {rss:8.1f} {rate:8.1f} {calls:8d} {len(out['errors']):6d}", flush=True)
        if trace_out is not None and not marked and elapsed >= args.minutes * 20:
            server.send_signal(signal.SIGUSR1)  # the baseline snapshot, at the end of the first third
            marked = True
    await asyncio.gather(*tasks)  # each session ends its call in flight
    elapsed = samples[-1][0]

    third = elapsed / 3
    base_rss = min(samples, key=lambda s: abs(s[0] - third))
    end_rss = samples[-1]
    window = (end_rss[0] - base_rss[0]) / 60
    rate = out["calls"] / elapsed
    print(f"\n{args.sessions} sessions, {out['calls']} calls in {elapsed / 60:.1f} min ({rate:.1f} calls/s)")
    print(f"errors: {len(out['errors'])}" + (f" (first: {out['errors'][0]})" if out["errors"] else ""))
    print(f"RSS {samples[0][1]:.1f} -> {end_rss[1]:.1f} MiB (peak {max(s[1] for s in samples):.1f})")
    growth = end_rss[1] - base_rss[1]
    print(
        f"growth over the last two thirds ({base_rss[0] / 60:.1f} -> {end_rss[0] / 60:.1f} min): {growth:+.1f} MiB "
        f"({growth / max(window, 1e-9):+.2f} MiB/min)"
    )
    if trace_out is not None:
        server.send_signal(signal.SIGUSR1)
        for _ in range(6000):  # a snapshot of a few million traced blocks and its diff take minutes
            if trace_out.exists():  # written whole, then renamed
                break
            await asyncio.sleep(0.1)
        report = json.loads(trace_out.read_text())
        print(f"\ntracemalloc: {report['traced_mib']:.1f} MiB traced; in-memory caches: {report['sizes']}")
        print("top growing allocation sites since the end of the first third:")
        for s in report["top"]:
            print(f"  {s['kib']:+10.1f} KiB {s['count']:+8d} blocks  " + " <- ".join(reversed(s["where"])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--sessions", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per answer (the tiny model never ends a turn)")
    ap.add_argument("--idle-timeout", type=float, default=1800.0, help="CLAWGATE_SESSION_IDLE_TIMEOUT, seconds")
    ap.add_argument("--cache-idle", type=float, default=300.0, help="CLAWGATE_SESSION_CACHE_IDLE, seconds")
    ap.add_argument("--tracemalloc", action="store_true", help="print the top growing allocation sites at the end")
    ap.add_argument("--default-arenas", action="store_true", help="leave glibc's malloc arenas uncapped")
    args = ap.parse_args()

    from clawgate.tiny_model import build_tiny_model
    from gateway.store import db

    tmp = Path(tempfile.mkdtemp(prefix="clawgate-soak-"))
    model = build_tiny_model(tmp / "model", seed=0)
    url = f"sqlite:///{tmp / 'soak.db'}"
    db.upgrade(url)
    # `timeout` and Ctrl-C end the run through the `finally` below, so the gateway never outlives it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    port = free_port()
    trace_out = tmp / "tracemalloc.json" if args.tracemalloc else None
    argv = [
        str(model),
        url,
        str(port),
        str(tmp / "data"),
        str(args.max_tokens),
        str(args.idle_timeout),
        str(args.cache_idle),
    ]
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, *argv, str(trace_out or "")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "SOAK_DEFAULT_ARENAS": "1" if args.default_arenas else "0"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(6000):  # a traced start on a busy machine takes minutes
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                sys.exit(f"the gateway exited ({server.returncode}) before it answered")
            time.sleep(0.1)
        print(
            f"soak: {args.sessions} sessions for {args.minutes:g} min, in-process tiny model, max_tokens "
            f"{args.max_tokens}, SQLite, session idle timeout {args.idle_timeout:g} s, "
            f"memory window {args.cache_idle:g} s, malloc arenas "
            + ("glibc's default" if args.default_arenas else "capped")
            + (", tracemalloc on" if args.tracemalloc else ""),
            flush=True,
        )
        asyncio.run(drive(args, base, server, trace_out))
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
