"""The capture writer against real SQLite and Postgres databases, including real outages.

Outages are real failure modes: on SQLite another connection holds the write lock (the writer gets "database is
locked"); on Postgres the writer's database does not exist yet, then exists without tables, then is migrated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import math
import random
import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.store import codec, db, repo, rollout_lifecycle, training_data
from gateway.store.errors import CAPTURE_RETRY_AFTER_S, CaptureFull
from gateway.store.models import Call, Reward, Rollout
from gateway.store.records import (
    CallRecord,
    RewardRecord,
    RolloutRecord,
    record_from_json,
    record_to_json,
)
from gateway.store.writer import CallWriter
from tests import pg

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)


def fast_writer(engine: sa.Engine, spool: Path, *, batch_size: int = 8, max_queue: int = 100_000) -> CallWriter:
    """A writer that batches and backs off on a test's time scale."""
    return CallWriter(
        engine,
        spool,
        batch_size=batch_size,
        max_queue=max_queue,
        flush_interval=0.005,
        initial_backoff=0.01,
        max_backoff=0.05,
    )


def make_call(
    call_id: str,
    rollout_id: str,
    *,
    seq: int = 0,
    parent: str | None = None,
    prefix_len: int = 0,
    delta: list[int] | None = None,
    completion: list[int] | None = None,
    logprobs: list[float] | None = None,
    messages: list[dict[str, Any]] | None = None,
    prefix_messages: int = 0,
    rollout: RolloutRecord | None = None,
    tail_hash: str | None = None,
) -> CallRecord:
    completion = [7, 8, 9] if completion is None else completion
    return CallRecord(
        id=call_id,
        request_id=f"req-{call_id}",
        rollout_id=rollout_id,
        api="chat",
        model="tiny",
        engine="local",
        render_mode="spliced" if parent else "fresh",
        request={"model": "tiny", "messages": messages or [{"role": "user", "content": call_id}]},
        request_prefix_messages=prefix_messages,
        started_at=T0 + dt.timedelta(seconds=seq),
        ended_at=T0 + dt.timedelta(seconds=seq, milliseconds=500),
        parent_call_id=parent,
        prompt_prefix_len=prefix_len,
        prompt_delta=[1, 2, 3] if delta is None else delta,
        completion_ids=completion,
        completion_logprobs=[-0.5] * len(completion) if logprobs is None else logprobs,
        finish_reason="stop",
        tail_hash=tail_hash,
        rollout=rollout if rollout is not None else RolloutRecord(id=rollout_id, updated_at=T0),
    )


def count(engine: sa.Engine, model: type[Any]) -> int:
    with Session(engine) as session:
        return int(session.scalar(sa.select(sa.func.count()).select_from(model)) or 0)


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


# -- databases ---------------------------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'store.db'}"
        db.upgrade(url)
        yield url
        return
    with pg.fresh_database(request.getfixturevalue("postgres_server_url")) as url:
        db.upgrade(url)
        yield url


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    engine = db.connect(db_url, busy_timeout_ms=50)
    yield engine
    engine.dispose()


@pytest.fixture
async def writer(engine: sa.Engine, tmp_path: Path) -> AsyncIterator[CallWriter]:
    writer = fast_writer(engine, tmp_path / "spool", batch_size=64)
    await writer.start()
    yield writer
    await writer.close(timeout=5)


@dataclass
class Outage:
    """A database the writer cannot write to until ``restore()``."""

    url: str
    restore: Callable[[], None]
    cleanups: list[Callable[[], None]] = field(default_factory=list)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def outage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Outage]:
    if request.param == "sqlite":
        path = tmp_path / "store.db"
        url = f"sqlite:///{path}"
        db.upgrade(url)
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")  # another process holding the write lock

        def release() -> None:
            if holder.in_transaction:
                holder.execute("ROLLBACK")

        yield Outage(url, release)
        release()
        holder.close()
        return

    server = request.getfixturevalue("postgres_server_url")
    name = pg.unique_database_name()
    url = pg.database_url(server, name)

    def create_and_migrate() -> None:
        pg.create_database(server, name)
        db.upgrade(url)

    yield Outage(url, create_and_migrate)
    pg.drop_database(server, name)


# -- tests -------------------------------------------------------------------------------------------------------


async def test_concurrent_submissions_are_written_exactly_once(writer: CallWriter, engine: sa.Engine) -> None:
    async def harness(worker: int) -> None:
        rollout = f"r{worker}"
        parent: str | None = None
        for turn in range(20):
            call_id = f"c{worker}-{turn}"
            writer.submit(make_call(call_id, rollout, seq=turn, parent=parent, prefix_len=6 * turn if parent else 0))
            parent = call_id
            await asyncio.sleep(0)

    await asyncio.gather(*(harness(worker) for worker in range(50)))
    await writer.flush()

    assert writer.stats.written == 1000 and writer.stats.queued == 0 and writer.stats.dead_lettered == 0
    with Session(engine) as session:
        ids = session.scalars(sa.select(Call.id)).all()
        assert len(ids) == 1000 and len(set(ids)) == 1000
        assert session.scalar(sa.select(sa.func.count()).select_from(Rollout)) == 50
        call = session.get(Call, "c7-3")
        assert call is not None
        assert call.parent_call_id == "c7-2" and call.prompt_prefix_len == 18 and call.prompt_len == 21
        assert codec.unpack_ids(call.completion_ids) == [7, 8, 9] and call.completion_len == 3
        assert codec.unpack_logprobs(call.completion_logprobs) == [-0.5, -0.5, -0.5]
        assert call.started_at == T0 + dt.timedelta(seconds=3)  # aware UTC on both backends
        assert call.started_at.tzinfo is not None


async def test_outage_is_retried_until_the_database_is_back(outage: Outage, tmp_path: Path) -> None:
    engine = db.connect(outage.url, busy_timeout_ms=20)
    writer = fast_writer(engine, tmp_path / "spool")
    await writer.start()
    try:
        for i in range(20):
            writer.submit(make_call(f"c{i}", "r1", seq=i))
        await wait_until(lambda: writer.stats.retries >= 3)
        assert writer.stats.written == 0 and writer.stats.queued == 20
        assert writer.stats.last_error is not None

        outage.restore()
        await asyncio.wait_for(writer.flush(), 20)
        assert writer.stats.written == 20 and writer.stats.queued == 0 and writer.stats.dead_lettered == 0
        assert count(engine, Call) == 20
        assert not (tmp_path / "spool" / "dead-letter.jsonl").exists()
    finally:
        await writer.close(timeout=5)
        engine.dispose()


async def test_a_durable_wait_commits_at_once_and_stops_waiting_while_degraded(outage: Outage, tmp_path: Path) -> None:
    """A call waiting for its commit does not wait for the batch interval; once a commit has failed, calls stop
    waiting (the circuit breaker) until a commit succeeds again."""
    engine = db.connect(outage.url, busy_timeout_ms=20)
    writer = CallWriter(engine, tmp_path / "spool", flush_interval=30, initial_backoff=0.01, max_backoff=0.05)
    await writer.start()
    try:
        writer.submit(make_call("c0", "r1"))
        started = asyncio.get_running_loop().time()
        assert await writer.wait_committed(10) is False  # the first commit fails: answered then, not after 10 s
        assert asyncio.get_running_loop().time() - started < 5 and writer.degraded
        assert writer.fault.snapshot()["state"] == "degraded" and writer.fault.snapshot()["last_error"]

        writer.submit(make_call("c1", "r1", seq=1))
        started = asyncio.get_running_loop().time()
        assert await writer.wait_committed(10) is False  # degraded: no wait at all
        assert asyncio.get_running_loop().time() - started < 0.1

        outage.restore()
        await asyncio.wait_for(writer.flush(), 20)
        assert not writer.degraded and writer.fault.snapshot()["recovered_at"] is not None
        writer.submit(make_call("c2", "r1", seq=2))
        started = asyncio.get_running_loop().time()
        assert await writer.wait_committed(10) is True  # committed at once although batches wait up to 30 s
        assert asyncio.get_running_loop().time() - started < 5
        assert count(engine, Call) == 3
    finally:
        await writer.close(timeout=5)
        engine.dispose()


async def test_full_queue_sheds_load(outage: Outage, tmp_path: Path) -> None:
    engine = db.connect(outage.url, busy_timeout_ms=20)
    writer = fast_writer(engine, tmp_path / "spool", max_queue=10, batch_size=4)
    await writer.start()
    try:
        for i in range(10):
            writer.submit(make_call(f"c{i}", "r1", seq=i))  # in flight or queued: all count until committed
        await wait_until(lambda: writer.stats.retries >= 1)
        with pytest.raises(CaptureFull, match="capture queue full") as raised:
            writer.submit(make_call("c10", "r1", seq=10))
        assert raised.value.code == "capture_queue_full" and raised.value.retry_after == CAPTURE_RETRY_AFTER_S
        assert writer.stats.queued == 10

        outage.restore()
        await asyncio.wait_for(writer.flush(), 20)
        writer.submit(make_call("c10", "r1", seq=10))  # room again once rows are committed
        await writer.flush()
        assert count(engine, Call) == 11
    finally:
        await writer.close(timeout=5)
        engine.dispose()


async def test_close_during_outage_spools_and_next_writer_replays_once(outage: Outage, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    engine = db.connect(outage.url, busy_timeout_ms=20)
    writer = fast_writer(engine, spool)
    await writer.start()
    records: list[CallRecord | RolloutRecord | RewardRecord] = [
        make_call(
            f"c{i}",
            "r1",
            seq=i,
            parent=f"c{i - 1}" if i else None,
            prefix_len=6 * i,
            logprobs=[-0.25, float("-inf"), float("nan")],
        )
        for i in range(25)
    ]
    records.append(RewardRecord(rollout_id="r1", call_id="c24", value=1.0, source="verifier", details={"ok": 1}))
    records.append(RolloutRecord(id="r1", status="completed", finished_at=T0 + dt.timedelta(hours=1)))
    for record in records:
        writer.submit(record)
    await wait_until(lambda: writer.stats.retries >= 2)
    await writer.close(timeout=0.2)
    engine.dispose()

    pending = sorted(spool.glob("pending-*.jsonl"))
    assert len(pending) == 1
    assert len(pending[0].read_text().splitlines()) == len(records) == writer.stats.spooled
    with pytest.raises(CaptureFull):
        writer.submit(make_call("late", "r1"))  # a closed writer refuses rather than dropping

    # A restart while the database is still down: the file is replayed, fails, and is re-spooled as one file.
    engine = db.connect(outage.url, busy_timeout_ms=20)
    interim = fast_writer(engine, spool)
    await interim.start()
    await wait_until(lambda: interim.stats.retries >= 1)
    await interim.close(timeout=0.2)
    engine.dispose()
    respooled = sorted(spool.glob("pending-*.jsonl"))
    assert len(respooled) == 1 and respooled != pending
    assert interim.stats.replayed == interim.stats.spooled == len(records)

    outage.restore()
    replayed = []
    for attempt in range(2):  # a second start must find nothing left to replay
        engine = db.connect(outage.url)
        second = fast_writer(engine, spool)
        if attempt == 0:
            # Submitted before start(): still written after the spooled rows, so its parent exists by then.
            second.submit(make_call("c25", "r1", seq=25, parent="c24", prefix_len=150))
        await second.start()
        await asyncio.wait_for(second.flush(), 20)
        await second.close(timeout=5)
        replayed.append(second.stats.replayed)
        assert not list(spool.glob("pending-*"))
        with Session(engine) as session:
            assert session.scalar(sa.select(sa.func.count()).select_from(Call)) == 26
            assert session.scalar(sa.select(sa.func.count()).select_from(Reward)) == 1
            assert second.stats.dead_lettered == 0
            rollout = session.get(Rollout, "r1")
            assert rollout is not None and rollout.status == "completed"
            assert rollout.finished_at == T0 + dt.timedelta(hours=1)
            call = session.get(Call, "c24")
            assert call is not None
            lp = codec.unpack_logprobs(call.completion_logprobs)
            assert lp[:2] == [-0.25, float("-inf")] and math.isnan(lp[2])
            assert repo.full_prompt_ids(session, call) == [1, 2, 3] + [7, 8, 9, 1, 2, 3] * 24
        engine.dispose()
    assert replayed == [len(records), 0]


async def test_bad_rows_are_dead_lettered_and_the_rest_written(writer: CallWriter, engine: sa.Engine) -> None:
    good = [make_call(f"good{i}", "r1", seq=i) for i in range(10)]
    orphan = make_call("orphan", "nope", seq=20)
    orphan.rollout = None  # rollout never created: the foreign key fails
    negative = make_call("negative", "r1", seq=21, delta=[5, -1])  # not a token id
    lost_reward = RewardRecord(rollout_id="r1", call_id="no-such-call", value=0.5)
    batch: list[CallRecord | RewardRecord] = [*good[:5], orphan, negative, lost_reward, *good[5:]]
    for record in batch:  # all in one batch: nothing runs between these submissions
        writer.submit(record)
    await writer.flush()

    assert writer.stats.written == 10 and writer.stats.dead_lettered == 3
    assert count(engine, Call) == 10 and count(engine, Reward) == 0
    lines = [json.loads(line) for line in writer.dead_letter_path.read_text().splitlines()]
    by_id = {entry["record"].get("id") or entry["record"]["call_id"]: entry for entry in lines}
    assert set(by_id) == {"orphan", "negative", "no-such-call"}
    assert "IntegrityError" in by_id["orphan"]["error"]
    assert "negative token id" in by_id["negative"]["error"]
    assert "IntegrityError" in by_id["no-such-call"]["error"]
    assert record_from_json(by_id["orphan"]["record"]) == orphan  # enough to replay it by hand


async def test_rollout_upsert_fills_and_never_duplicates(writer: CallWriter, engine: sa.Engine) -> None:
    first = RolloutRecord(id="r1", kind="explicit", updated_at=T0, created_at=T0)
    writer.submit(make_call("a", "r1", seq=0, rollout=first))
    await writer.flush()

    later = RolloutRecord(
        id="r1",
        kind="explicit",
        task_id="t1",
        harness="codex",
        group_key="t1/codex",
        metadata={"k": "v"},
        updated_at=T0 + dt.timedelta(minutes=5),
    )
    older = RolloutRecord(id="r1", task_id="other", updated_at=T0 + dt.timedelta(minutes=1))
    writer.submit(make_call("b", "r1", seq=1, rollout=later))
    writer.submit(make_call("c", "r1", seq=2, rollout=older))  # same batch, same rollout
    await writer.flush()
    writer.submit(
        RolloutRecord(
            id="r1",
            status="completed",
            finished_at=T0 + dt.timedelta(minutes=9),
            updated_at=T0 + dt.timedelta(minutes=9),
        )
    )
    await writer.flush()
    writer.submit(make_call("d", "r1", seq=3, rollout=RolloutRecord(id="r1", updated_at=T0)))  # late straggler
    await writer.flush()
    # The same within one batch: finished, then a straggler's "open" record.
    writer.submit(RolloutRecord(id="r2", status="aborted", updated_at=T0 + dt.timedelta(minutes=2)))
    writer.submit(make_call("e", "r2", seq=4, rollout=RolloutRecord(id="r2", task_id="t2", updated_at=T0)))
    await writer.flush()

    with Session(engine) as session:
        rows = session.scalars(sa.select(Rollout).order_by(Rollout.id)).all()
        assert [row.id for row in rows] == ["r1", "r2"]
        assert (rows[1].status, rows[1].task_id) == ("aborted", "t2")
        assert rows[1].updated_at == T0 + dt.timedelta(minutes=2)
        rollout = rows[0]
        assert (rollout.task_id, rollout.harness, rollout.group_key) == ("t1", "codex", "t1/codex")
        assert rollout.metadata_ == {"k": "v"}
        assert rollout.kind == "explicit"
        assert rollout.status == "completed"  # an "open" record does not reopen it
        assert rollout.updated_at == T0 + dt.timedelta(minutes=9)  # never moves backwards
        assert rollout.created_at == T0
        assert [call.id for call in rollout.calls] == ["a", "b", "c", "d"]


async def test_a_call_replayed_after_an_in_doubt_commit_is_stored_once(writer: CallWriter, engine: sa.Engine) -> None:
    # A batch whose COMMIT reply was lost is retried, and a spool file whose deletion was cut short is replayed:
    # either way the same call arrives again and must neither duplicate nor be rejected as a bad row.
    writer.submit(make_call("a", "r1", seq=0))
    await writer.flush()
    writer.submit(make_call("a", "r1", seq=0))
    writer.submit(make_call("b", "r1", seq=1))
    await writer.flush()
    assert count(engine, Call) == 2 and count(engine, Rollout) == 1
    assert writer.stats.dead_lettered == 0


async def test_constrained_flag_round_trips_to_the_tree(writer: CallWriter, engine: sa.Engine) -> None:
    # A free-form call, then a structured-output follow-up sampled under a grammar (masked logprobs).
    free = make_call("free", "r1", seq=0, delta=[1, 2, 3], completion=[7, 8])
    forced = dataclasses.replace(
        make_call("forced", "r1", seq=1, parent="free", prefix_len=5, delta=[4], completion=[9, 10, 11]),
        constrained=True,
    )
    writer.submit(free)
    writer.submit(forced)
    await writer.flush()
    assert writer.stats.dead_lettered == 0

    with Session(engine) as session:
        views = {v.id: v for v in training_data.call_views(session, "r1")}
        assert views["forced"].constrained is True and views["free"].constrained is False
        stored = session.get(Call, "free")
        assert stored is not None and stored.constrained is False
    loaded = training_data.load_rollout(engine, "r1")
    assert loaded is not None
    report = loaded.tree.report
    assert report.trainable_tokens == 2 and report.constrained_tokens == 3
    calls = {c["id"]: c for c in rollout_lifecycle.detail(engine, "r1", with_tokens=False)["calls"]}
    assert calls["forced"]["constrained"] is True and calls["free"]["constrained"] is False


def _trie_size(sequences: list[list[int]]) -> int:
    """Number of distinct prefixes: the unique tokens of a set of token sequences."""
    return len({tuple(sequence[: i + 1]) for sequence in sequences for i in range(len(sequence))})


async def test_ten_turn_rollout_stores_deltas_and_rebuilds_exact_prompts(writer: CallWriter, engine: sa.Engine) -> None:
    rng = random.Random(0)
    system = [rng.randrange(150_000) for _ in range(300)]
    prompt = system + [rng.randrange(150_000) for _ in range(40)]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s" * 50}, {"role": "user", "content": "go"}]
    full_prompts: dict[str, list[int]] = {}
    full_messages: dict[str, list[dict[str, Any]]] = {}
    parent: CallRecord | None = None
    for turn in range(10):
        completion = [rng.randrange(150_000) for _ in range(rng.randrange(20, 200))]
        prefix = len(parent.prompt_delta) + parent.prompt_prefix_len + len(parent.completion_ids) if parent else 0
        record = make_call(
            f"t{turn}",
            "r1",
            seq=turn,
            parent=parent.id if parent else None,
            prefix_len=prefix,
            delta=prompt[prefix:],
            completion=completion,
            logprobs=[-float(i) for i in range(len(completion))],
            messages=list(messages),
            prefix_messages=len(full_messages[parent.id]) if parent else 0,
            tail_hash=f"hash{turn}",
        )
        writer.submit(record)
        full_prompts[record.id], full_messages[record.id] = list(prompt), list(messages)
        # Next turn: the conversation so far, the completion, then a tool result the harness adds.
        prompt = prompt + completion + [rng.randrange(150_000) for _ in range(rng.randrange(5, 60))]
        messages = [*messages, {"role": "assistant", "content": f"a{turn}"}, {"role": "tool", "content": f"r{turn}"}]
        parent = record
    await writer.flush()

    with Session(engine) as session:
        calls = repo.calls_for_rollout(session, "r1")
        assert [call.id for call in calls] == [f"t{turn}" for turn in range(10)]
        cache = repo.CallCache.for_rollout(session, "r1", memo_size=2)
        for call in reversed(calls):  # out of order: walks longer chains through the small memo
            assert repo.full_prompt_ids(cache, call) == full_prompts[call.id]
            assert repo.full_prompt_ids(session, call) == full_prompts[call.id]
            assert repo.full_request(cache, call)["messages"] == full_messages[call.id]
            assert repo.full_request(session, call) == {"model": "tiny", "messages": full_messages[call.id]}

        # Storage is linear: every token of the prompt tree and of the completions is stored once.
        delta_bytes = sum(len(call.prompt_delta) for call in calls)
        completion_bytes = sum(len(call.completion_ids) for call in calls)
        last = calls[-1]
        unique = _trie_size([full_prompts[last.id] + codec.unpack_ids(last.completion_ids)])
        assert delta_bytes + completion_bytes == 4 * unique
        assert delta_bytes == 4 * (unique - sum(call.completion_len for call in calls))
        assert delta_bytes < sum(4 * call.prompt_len for call in calls) / 3  # vs. storing every full prompt
        stored_messages = [len(codec.unpack_request(call.request)["messages"]) for call in calls]
        assert sum(stored_messages) == len(full_messages[last.id])  # each message stored once

        found = repo.latest_call_by_tail_hash(session, "hash4")
        assert found is not None and found.id == "t4"
        assert repo.latest_call_by_tail_hash(session, "hash4", rollout_id="other") is None
        assert repo.get_call(session, "t9") is not None and repo.get_call(session, "nope") is None


async def test_branches_and_cuts_into_the_parent_rebuild_exactly(writer: CallWriter, engine: sa.Engine) -> None:
    # root: prompt P0, completion C0. child: template re-rendered the end of C0 (prefix cuts into it).
    # retry: a sibling of `child` that shares only part of root's prompt and messages (an edited history).
    # grandchild extends `child`, but its harness dropped child's last message (compaction).
    def m(name: str) -> dict[str, Any]:
        return {"role": "user", "content": name}

    p0, c0 = list(range(100, 120)), list(range(500, 510))
    prompts = {
        "root": p0,
        "child": [*p0, *c0[:6], 900, 901],
        "retry": [*p0[:15], 777],
        "grandchild": [*p0, *c0[:6], 900, 901, 42, 43, 5],
    }
    messages = {
        "root": [m("S"), m("U1"), m("T1")],
        "child": [m("S"), m("U1"), m("T1"), m("A1"), m("U2")],
        "retry": [m("S"), m("U1-edited")],
        "grandchild": [m("S"), m("U1"), m("T1"), m("A1"), m("U3")],
    }
    records = [
        make_call("root", "r1", seq=0, delta=p0, completion=c0, messages=messages["root"]),
        make_call(
            "child",
            "r1",
            seq=1,
            parent="root",
            prefix_len=26,
            delta=[900, 901],
            completion=[42, 43],
            messages=messages["child"],
            prefix_messages=3,
        ),
        make_call(
            "retry",
            "r1",
            seq=2,
            parent="root",
            prefix_len=15,
            delta=[777],
            completion=[1],
            messages=messages["retry"],
            prefix_messages=1,
        ),
        make_call(
            "grandchild",
            "r1",
            seq=3,
            parent="child",
            prefix_len=30,
            delta=[5],
            completion=[],
            messages=messages["grandchild"],
            prefix_messages=4,
        ),
    ]
    for record in records:
        writer.submit(record)
    await writer.flush()

    with Session(engine) as session:
        cache = repo.CallCache(session)
        for call_id in ("child", "root", "grandchild", "retry"):  # grandchild walks through the memo of child
            call = session.get(Call, call_id)
            assert call is not None
            assert call.prompt_len == len(prompts[call_id])
            assert repo.full_prompt_ids(session, call) == prompts[call_id]
            assert repo.full_prompt_ids(cache, call) == prompts[call_id]
            assert repo.full_request(session, call)["messages"] == messages[call_id]
            assert repo.full_request(cache, call)["messages"] == messages[call_id]


async def test_corrupt_parent_chain_is_reported_not_guessed(writer: CallWriter, engine: sa.Engine) -> None:
    writer.submit(make_call("root", "r1", seq=0, delta=[1, 2], completion=[3]))
    # Claims four tokens from a parent that has only three (prompt 2 + completion 1).
    writer.submit(make_call("child", "r1", seq=1, parent="root", prefix_len=4, delta=[9]))
    await writer.flush()
    with Session(engine) as session:
        child = session.get(Call, "child")
        assert child is not None
        with pytest.raises(ValueError, match="exceeds"):
            repo.full_prompt_ids(session, child)


def test_records_round_trip_through_json() -> None:
    record = make_call("x", "r1", seq=5, parent="p", prefix_len=3, logprobs=[-0.5, float("-inf"), -1.0])
    data = json.loads(json.dumps(record_to_json(record)))
    back = record_from_json(data)
    assert back == record and isinstance(back, CallRecord) and back.started_at.tzinfo is not None
    constrained = dataclasses.replace(record, constrained=True)
    assert record_from_json(json.loads(json.dumps(record_to_json(constrained)))) == constrained
    # A spool file written before the flag existed replays as an unconstrained call.
    old = {k: v for k, v in json.loads(json.dumps(record_to_json(constrained))).items() if k != "constrained"}
    assert record_from_json(old) == record
    reward = RewardRecord(rollout_id="r1", value=-1.0, details={"a": [1, 2]})
    assert record_from_json(json.loads(json.dumps(record_to_json(reward)))) == reward
