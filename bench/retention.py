"""Retention: how fast ``clawgate db prune`` deletes captured traffic on Postgres, and what capture sees meanwhile.

Fills a fresh database with ``--calls`` calls (token ids and logprobs packed as the gateway stores them: a 64-token
prompt delta, a 32-token completion) in conversations of ``--turns`` turns, one rollout each, with a reward per
rollout and per call; then prunes everything older than a day and prints rows deleted per second. While the prune
runs, a capture-like writer inserts a new conversation's calls one commit at a time: the commit latency with and
without the prune running beside it is printed too.

    .venv/bin/python bench/retention.py                     # 1,000,000 calls on 127.0.0.1:5432
    .venv/bin/python bench/retention.py --calls 100000 --database-url postgresql://127.0.0.1:5432/postgres
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.store import codec, db, retention  # noqa: E402
from gateway.store.models import Call, Reward, Rollout  # noqa: E402

DB_NAME = "clawgate_bench_retention"


def fresh_database(server_url: str) -> str:
    admin = sa.create_engine(db.normalize_url(server_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)"))
        conn.execute(sa.text(f"CREATE DATABASE {DB_NAME}"))
    admin.dispose()
    url = make_url(db.normalize_url(server_url)).set(database=DB_NAME).render_as_string(hide_password=False)
    db.upgrade(url)
    return url


def call_row(call_id: str, rollout_id: str, parent: str | None, when: dt.datetime, prompt_len: int) -> dict:
    return {
        "id": call_id,
        "request_id": "chatcmpl-" + call_id,
        "choice_index": 0,
        "rollout_id": rollout_id,
        "api": "chat",
        "model": "bench",
        "engine": "bench",
        "status": "ok",
        "render_mode": "spliced" if parent else "fresh",
        "is_subagent": False,
        "constrained": False,
        "request": codec.pack_request({"messages": [{"role": "user", "content": "x" * 200}]}),
        "request_prefix_messages": 0,
        "parent_call_id": parent,
        "prompt_prefix_len": prompt_len - 64 if parent else 0,
        "prompt_delta": codec.pack_ids(list(range(64))),
        "prompt_len": prompt_len,
        "completion_ids": codec.pack_ids(list(range(32))),
        "completion_logprobs": codec.pack_logprobs([-0.5] * 32),
        "completion_len": 32,
        "started_at": when,
        "ended_at": when,
    }


def fill(engine: sa.Engine, calls: int, turns: int) -> int:
    """Old conversations; the rows written."""
    old = retention.utcnow() - dt.timedelta(days=40)
    rollouts: list[dict] = []
    rows: list[dict] = []
    rewards: list[dict] = []
    written = 0
    started = time.perf_counter()

    def flush() -> None:
        nonlocal written
        with engine.begin() as conn:
            if rollouts:
                conn.execute(sa.insert(Rollout.__table__), rollouts)
            conn.execute(sa.insert(Call.__table__), rows)
            conn.execute(sa.insert(Reward.__table__), rewards)
        written += len(rollouts) + len(rows) + len(rewards)
        rollouts.clear(), rows.clear(), rewards.clear()

    for n in range(calls // turns):
        rollout_id = f"bench-{n}"
        rollouts.append(
            {"id": rollout_id, "kind": "explicit", "status": "completed", "created_at": old, "updated_at": old}
        )
        parent = None
        for turn in range(turns):
            call_id = f"c{n}-{turn}"
            rows.append(call_row(call_id, rollout_id, parent, old, 64 + 96 * turn))
            rewards.append(
                {"rollout_id": rollout_id, "call_id": call_id, "value": 0.1, "source": "rule", "created_at": old}
            )
            parent = call_id
        rewards.append(
            {"rollout_id": rollout_id, "call_id": None, "value": 1.0, "source": "verifier", "created_at": old}
        )
        if len(rows) >= 20_000:
            flush()
            print(f"filled {written:,} rows ({written / (time.perf_counter() - started):,.0f} rows/s)", file=sys.stderr)
    if rows:
        flush()
    return written


def capture_latencies(engine: sa.Engine, stop: threading.Event, out: list[float]) -> None:
    """A new conversation's calls committed one at a time, as the capture writer would with no other traffic."""
    rollout_id = "live-" + uuid.uuid4().hex[:8]
    now = retention.utcnow()
    with engine.begin() as conn:
        conn.execute(
            sa.insert(Rollout.__table__),
            [{"id": rollout_id, "kind": "explicit", "status": "open", "created_at": now, "updated_at": now}],
        )
    parent = None
    turn = 0
    while not stop.is_set():
        call_id = f"{rollout_id}-{turn}"
        t0 = time.perf_counter()
        with engine.begin() as conn:
            conn.execute(sa.insert(Call.__table__), [call_row(call_id, rollout_id, parent, now, 64 + 96 * turn)])
        out.append(time.perf_counter() - t0)
        parent, turn = call_id, turn + 1
        time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=1_000_000)
    ap.add_argument("--turns", type=int, default=50, help="calls per conversation (one rollout each)")
    ap.add_argument("--database-url", default="postgresql://127.0.0.1:5432/postgres", help="a Postgres server")
    args = ap.parse_args()
    url = fresh_database(args.database_url)
    engine = db.connect(url, pool_size=4)
    t0 = time.perf_counter()
    rows = fill(engine, args.calls, args.turns)
    print(f"filled {rows:,} rows ({args.calls:,} calls) in {time.perf_counter() - t0:.0f} s")
    with engine.connect() as conn:
        size = conn.execute(sa.text("SELECT pg_database_size(current_database())")).scalar_one()
    print(f"database size: {size / 2**20:,.0f} MiB")

    alone: list[float] = []
    stop = threading.Event()
    baseline = threading.Thread(target=capture_latencies, args=(engine, stop, alone))
    baseline.start()
    time.sleep(3)
    stop.set()
    baseline.join()

    beside: list[float] = []
    stop = threading.Event()
    writer = threading.Thread(target=capture_latencies, args=(engine, stop, beside))
    writer.start()
    last = [time.perf_counter(), 0]

    def progress(report: retention.Report) -> None:
        now = time.perf_counter()
        if now - last[0] > 10:
            print(f"... {report.rows:,} rows deleted", file=sys.stderr)
            last[0] = now

    report = retention.prune(engine, older_than=dt.timedelta(days=1), progress=progress)
    stop.set()
    writer.join()
    print(
        f"prune: {report.rows:,} rows in {report.seconds:.1f} s = {report.rows / report.seconds:,.0f} rows/s "
        f"({report.deleted['calls'] / report.seconds:,.0f} calls/s); "
        + ", ".join(f"{n:,} {t}" for t, n in report.deleted.items() if n)
    )

    def pct(values: list[float], q: float) -> float:
        return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1e3

    print(
        f"a capture commit alone: p50 {statistics.median(alone) * 1e3:.2f} ms, p99 {pct(alone, 0.99):.2f} ms "
        f"({len(alone)} commits); beside the prune: p50 {statistics.median(beside) * 1e3:.2f} ms, "
        f"p99 {pct(beside, 0.99):.2f} ms, max {max(beside) * 1e3:.1f} ms ({len(beside)} commits)"
    )
    engine.dispose()


if __name__ == "__main__":
    main()
