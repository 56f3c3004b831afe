"""Fault injection: the PostgreSQL server itself stopped for 30 s under concurrent load, then started again.

A throw-away cluster of the test's own (``pg_ctl stop``/``start`` on the same data directory and port), so the
outage is the real thing: every connection cut, new ones refused, the server's own recovery at restart. Clients
streaming and not streaming keep calling throughout; every call is answered, `/health` says degraded while the
server is down and ok once the capture caught up, and the database holds every served call exactly once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from gateway.store import db
from gateway.store.db import connect
from tests.fakes import ScriptedEngine
from tests.pg import ThrowawayCluster

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
OUTAGE_S = 30.0
CLIENTS = 4


class Load:
    """``CLIENTS`` threads calling chat completions back to back (every other one streamed) until stopped."""

    def __init__(self, gw: Any, engine: ScriptedEngine) -> None:
        self.gw, self.engine = gw, engine
        self.served: list[str] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(n,), daemon=True) for n in range(CLIENTS)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def _client(self, n: int) -> None:
        with httpx.Client(timeout=30) as client:
            i = 0
            while not self.stop.is_set():
                i += 1
                self.engine.push(f"answer {n}.{i}")
                body = {"model": "tiny", "messages": [{"role": "user", "content": f"q {n}.{i}"}], "stream": i % 2 == 0}
                try:
                    r = client.post(self.gw.v1 + "/chat/completions", json=body)
                except httpx.HTTPError as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                if r.status_code != 200 or '"error":' in r.text:  # a stream cut by an error ends with an error event
                    self.errors.append(f"{r.status_code} {r.text[:200]}")
                else:
                    self.served.append(r.headers["x-clawgate-call-id"])
                time.sleep(0.02)


def test_postgres_stopped_for_30s_under_load_loses_and_duplicates_nothing(gateway_factory, tiny_tokenizer):
    cluster = ThrowawayCluster()
    url = cluster.start()
    try:
        db.upgrade(url)
        engine = ScriptedEngine(tiny_tokenizer)
        gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, database_url=url, capture_durable=True)
        with Load(gw, engine) as load:
            time.sleep(2)
            before = len(load.served)
            cluster.pause()
            down_at = time.monotonic()
            time.sleep(OUTAGE_S / 2)
            during = httpx.get(gw.url + "/health", timeout=10)
            time.sleep(OUTAGE_S - (time.monotonic() - down_at))
            served_while_down = len(load.served) - before
            cluster.resume()
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                health = httpx.get(gw.url + "/health", timeout=10).json()
                # The policy follower backs off while the database is down (up to 30 s between looks): all parts
                # must have seen the recovery.
                if health["status"] == "ok" and health["capture"]["queued"] == 0:
                    break
                time.sleep(0.5)
            time.sleep(2)  # calls after the recovery, committed as usual
        assert not load.errors, f"{len(load.errors)} calls failed: {load.errors[:3]}"
        assert before > 0 and served_while_down >= 2 * CLIENTS, (before, served_while_down)
        assert during.status_code == 200 and during.json()["capture"]["state"] == "degraded", during.text
        assert health["status"] == "ok" and health["capture"]["recovered_at"], health
        gw.flush()
        store = connect(url)
        try:
            with store.connect() as conn:
                rows = conn.execute(sa.text("SELECT id, status FROM calls")).all()
        finally:
            store.dispose()
        counts = Counter(row[0] for row in rows)
        assert not [c for c, k in counts.items() if k > 1], "no call stored twice"
        assert sorted(counts) == sorted(load.served), "every call served (before, during, after) is stored"
        assert {row[1] for row in rows} == {"ok"}
        print(f"{len(load.served)} calls served, {served_while_down} while PostgreSQL was down for {OUTAGE_S:.0f}s")
    finally:
        cluster.stop()
