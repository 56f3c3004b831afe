"""Postgres durable capture with ``synchronous_commit`` (CLAWGATE_CAPTURE_SYNCHRONOUS_COMMIT): the setting is the
one the capture transaction runs with (observed from inside it, by a trigger on the calls table), it stays on the
writer's own connection, and with ``off`` a call served just before a SIGKILL of the gateway is still in
Postgres."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from gateway.store import db
from gateway.store.writer import CallWriter
from tests.stand_in_vllm import stand_in_vllm, start_vllm_gateway
from tests.test_store_writer import make_call

pytestmark = pytest.mark.postgres

# Each inserted call notes the synchronous_commit of the transaction that inserts it.
OBSERVER = """
CREATE TABLE seen_commit (call_id text, setting text);
CREATE FUNCTION note_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO seen_commit VALUES (NEW.id, current_setting('synchronous_commit')); RETURN NEW; END $$;
CREATE TRIGGER note_commit AFTER INSERT ON calls FOR EACH ROW EXECUTE FUNCTION note_commit();
"""


@pytest.mark.parametrize("setting", ["on", "off"])
async def test_the_capture_transaction_runs_with_the_setting(postgres_url: str, tmp_path: Path, setting: str) -> None:
    engine = db.connect(postgres_url, pool_size=1)
    with engine.begin() as conn:
        conn.exec_driver_sql(OBSERVER)
        # Neither value by default, so the setting seen can only come from the writer.
        conn.exec_driver_sql(f'ALTER DATABASE "{sa.make_url(postgres_url).database}" SET synchronous_commit = local')
    engine.dispose()
    engine = db.connect(postgres_url)
    writer = CallWriter(engine, tmp_path / "spool", synchronous_commit=setting)
    await writer.start()
    try:
        writer.submit(make_call("c1", "r1"))
        assert await writer.wait_committed(5.0)
    finally:
        await writer.close()
    with engine.connect() as conn:
        seen = conn.execute(sa.text("SELECT call_id, setting FROM seen_commit")).all()
        after = conn.execute(sa.text("SHOW synchronous_commit")).scalar()
    engine.dispose()
    assert [tuple(row) for row in seen] == [("c1", setting)]
    assert after == "local"  # the pool's connections keep the database's own setting


async def test_a_connection_closed_while_idle_is_replaced_without_a_fault(postgres_url: str, tmp_path: Path) -> None:
    engine = db.connect(postgres_url)
    writer = CallWriter(engine, tmp_path / "spool")
    await writer.start()
    try:
        writer.submit(make_call("c1", "r1"))
        assert await writer.wait_committed(5.0)
        with engine.connect() as conn:  # the server ends the writer's session (as a restart or an idle timeout would)
            ended = (
                conn.execute(
                    sa.text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                )
                .scalars()
                .all()
            )
        assert ended and all(ended)
        writer.submit(make_call("c2", "r1"))
        assert await writer.wait_committed(5.0)
        assert writer.stats.retries == 0 and not writer.degraded
    finally:
        await writer.close()
    with engine.connect() as conn:
        assert sorted(conn.execute(sa.text("SELECT id FROM calls")).scalars()) == ["c1", "c2"]
    engine.dispose()


async def test_sqlite_ignores_the_setting(sqlite_url: str, tmp_path: Path) -> None:
    engine = db.connect(sqlite_url)
    writer = CallWriter(engine, tmp_path / "spool", synchronous_commit="off")
    await writer.start()
    try:
        writer.submit(make_call("c1", "r1"))
        assert await writer.wait_committed(5.0)
    finally:
        await writer.close()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT id FROM calls")).scalars().all() == ["c1"]
    engine.dispose()


def test_a_call_served_with_commit_off_survives_a_kill_of_the_gateway(
    postgres_url: str, tmp_path: Path, tiny_model_dir: Path, tiny_tokenizer: Any
) -> None:
    answer = [*tiny_tokenizer.encode("Hi", add_special_tokens=False), tiny_tokenizer.eos_token_id]
    with stand_in_vllm(tiny_model_dir, answer) as vllm_url:
        # A long flush interval: only the durable wait (not a later flush) can have written the call.
        gw = start_vllm_gateway(
            tmp_path,
            tiny_model_dir,
            vllm_url,
            postgres_url,
            capture_synchronous_commit="off",
            capture_flush_interval="30",
        )
        try:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            r = httpx.post(gw.env["URL"] + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200
            os.kill(gw.proc.pid, signal.SIGKILL)
            gw.proc.wait(30)
        finally:
            gw.stop()
    engine = db.connect(postgres_url)
    with engine.connect() as conn:
        stored = conn.execute(sa.text("SELECT id FROM calls WHERE status = 'ok'")).scalars().all()
    engine.dispose()
    assert stored == [r.headers["x-clawgate-call-id"]]
