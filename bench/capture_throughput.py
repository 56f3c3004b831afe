"""How many calls per second the capture writer commits, with each call linked to the turn it continues.

Conversations of ``--turns`` calls (``--prompt`` new prompt tokens and ``--completion`` completion tokens per call,
each call's prompt a delta against its parent, as the gateway records them) are submitted as fast as possible;
the figure is calls committed per second until ``flush()`` returns, on SQLite and on PostgreSQL (the URL of
``--postgres``, default the machine's server). Every call but a conversation's first also sets its parent's
``next_call_id`` (the turn's next state), as in serving.

    .venv/bin/python bench/capture_throughput.py [--calls 20000] [--turns 10] [--postgres postgresql://…]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
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


def records(calls: int, turns: int, prompt: int, completion: int) -> list[CallRecord]:
    out: list[CallRecord] = []
    now = dt.datetime.now(dt.UTC)
    parent: CallRecord | None = None
    rollout = ""
    for i in range(calls):
        if i % turns == 0:
            parent, rollout = None, f"ro-{uuid.uuid4().hex[:24]}"
        prefix = 0 if parent is None else parent.prompt_len + parent.completion_len
        record = CallRecord(
            id=f"call-{uuid.uuid4().hex[:24]}",
            request_id=f"chatcmpl-{i}",
            rollout_id=rollout,
            api="chat",
            model="tiny",
            engine="bench",
            render_mode="spliced" if parent else "fresh",
            request={"model": "tiny", "messages": [{"role": "user", "content": f"turn {i}"}]},
            started_at=now,
            ended_at=now,
            parent_call_id=None if parent is None else parent.id,
            prompt_prefix_len=prefix,
            prompt_delta=list(range(prompt)),
            completion_ids=list(range(completion)),
            completion_logprobs=[-0.5] * completion,
            rollout=RolloutRecord(id=rollout, kind="implicit"),
        )
        out.append(record)
        parent = record
    return out


async def measure(url: str, spool: Path, batch: list[CallRecord]) -> float:
    engine = db.connect(url)
    writer = CallWriter(engine, spool, max_queue=len(batch) + 1)
    await writer.start()
    t0 = time.perf_counter()
    for record in batch:
        writer.submit(record)
    await writer.flush()
    seconds = time.perf_counter() - t0
    await writer.close()
    with engine.connect() as conn:
        linked = conn.scalar(sa.text("SELECT count(*) FROM calls WHERE next_call_id IS NOT NULL"))
    engine.dispose()
    assert writer.stats.dead_lettered == 0 and writer.stats.written == len(batch)
    turns_per_conversation = len({r.rollout_id for r in batch})
    assert linked == len(batch) - turns_per_conversation, "every continued turn links its next state"
    return len(batch) / seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--turns", type=int, default=10, help="calls per conversation")
    ap.add_argument("--prompt", type=int, default=250, help="new prompt tokens per call")
    ap.add_argument("--completion", type=int, default=250)
    ap.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = ap.parse_args()
    batch = records(args.calls, args.turns, args.prompt, args.completion)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        targets = [("sqlite", f"sqlite:///{work / 'capture.db'}")]
        name = f"capture_bench_{uuid.uuid4().hex[:8]}"
        admin = db.connect(args.postgres, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
            targets.append(("postgresql", args.postgres.rsplit("/", 1)[0] + f"/{name}"))
        except sa.exc.OperationalError as error:
            print(f"postgresql skipped: {str(error).splitlines()[0]}")
        try:
            for label, url in targets:
                db.upgrade(url)
                rate = asyncio.run(measure(url, work / f"spool-{label}", batch))
                print(
                    f"{label:>10}: {rate:,.0f} calls/s ({args.calls:,} calls of {args.prompt}+{args.completion} tokens)"
                )
        finally:
            if len(targets) > 1:
                with admin.connect() as conn:
                    conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
