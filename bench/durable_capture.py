"""What durable capture adds to a call on Postgres, with ``synchronous_commit`` on and off, and whether concurrent
calls share commits (group commit).

A durable call is submitted to the capture writer and waits for its commit (``wait_committed``), as the gateway
does before a call's last byte. Sequential calls (one at a time: each waits for a commit of its own) and
``--concurrency`` callers at once are timed; the writer's commits (counted by SQLAlchemy's commit event) show how
many calls shared one. The figures are the added time per call (p50, p95) in milliseconds and the process's CPU
per call (the writer's thread and the event loop, from ``time.process_time``).

    .venv/bin/python bench/durable_capture.py [--calls 400] [--concurrency 8] [--postgres postgresql://…]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.store import db  # noqa: E402
from gateway.store.records import CallRecord, RolloutRecord  # noqa: E402
from gateway.store.writer import CallWriter  # noqa: E402


def record(i: int) -> CallRecord:
    now = dt.datetime.now(dt.UTC)
    rollout = f"ro-{uuid.uuid4().hex[:24]}"
    return CallRecord(
        id=f"call-{uuid.uuid4().hex[:24]}",
        request_id=f"chatcmpl-{i}",
        rollout_id=rollout,
        api="chat",
        model="tiny",
        engine="bench",
        render_mode="fresh",
        request={"model": "tiny", "messages": [{"role": "user", "content": f"call {i}"}]},
        started_at=now,
        ended_at=now,
        prompt_delta=list(range(200)),
        completion_ids=list(range(16)),
        completion_logprobs=[-0.5] * 16,
        rollout=RolloutRecord(id=rollout, kind="implicit"),
    )


async def run(url: str, spool: Path, setting: str, calls: int, concurrency: int) -> dict[str, tuple[float, ...]]:
    engine = db.connect(url)
    commits = [0]
    sa.event.listen(engine, "commit", lambda conn: commits.__setitem__(0, commits[0] + 1))
    writer = CallWriter(engine, spool, synchronous_commit=setting)
    await writer.start()

    async def durable_call(i: int) -> float:
        t0 = time.perf_counter()
        writer.submit(record(i))
        assert await writer.wait_committed(5.0)
        return (time.perf_counter() - t0) * 1000

    for i in range(20):  # warm the pool and the statement caches
        await durable_call(i)
    out: dict[str, tuple[float, ...]] = {}
    before, cpu = commits[0], time.process_time()
    sequential = [await durable_call(i) for i in range(calls)]
    cpu_ms = (time.process_time() - cpu) * 1000 / calls
    used = commits[0] - before
    out["sequential"] = (statistics.median(sequential), quantile(sequential, 0.95), calls / max(used, 1), cpu_ms)

    async def caller(k: int) -> list[float]:
        return [await durable_call(k * calls + i) for i in range(calls // concurrency)]

    before, cpu = commits[0], time.process_time()
    parallel = [t for ts in await asyncio.gather(*(caller(k) for k in range(concurrency))) for t in ts]
    cpu_ms = (time.process_time() - cpu) * 1000 / len(parallel)
    used = commits[0] - before
    out[f"{concurrency} at once"] = (
        statistics.median(parallel),
        quantile(parallel, 0.95),
        len(parallel) / max(used, 1),
        cpu_ms,
    )
    await writer.close()
    engine.dispose()
    return out


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = ap.parse_args()
    name = f"durable_bench_{uuid.uuid4().hex[:8]}"
    admin = db.connect(args.postgres, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = args.postgres.rsplit("/", 1)[0] + f"/{name}"
    try:
        db.upgrade(url)
        columns = ("calls", 10), ("p50 ms", 8), ("p95 ms", 8), ("calls/commit", 13), ("CPU ms/call", 12)
        print(f"{'synchronous_commit':>18} " + " ".join(f"{name:>{width}}" for name, width in columns))
        with tempfile.TemporaryDirectory() as tmp:
            for setting in ("on", "off"):
                figures = asyncio.run(run(url, Path(tmp) / setting, setting, args.calls, args.concurrency))
                for label, (p50, p95, per_commit, cpu_ms) in figures.items():
                    print(f"{setting:>18} {label:>10} {p50:8.2f} {p95:8.2f} {per_commit:13.1f} {cpu_ms:12.2f}")
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
