"""Kill -9 the gateway mid-stream and the trainer mid-step, restart both, and check from the database that
nothing served was lost and nothing was trained twice.

The gateway runs as `clawgate serve` and the trainer as `clawgate train` (child processes, SQLite), driven over
HTTP like a harness: a rollout's first call completes, its second (streamed) call is cut by the kill, the client
retries it against the restarted gateway, which continues the rollout from the database (the retried call's
parent is the first call, recovered after the restart).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from gateway.store import db
from tests.online import UpProcess, wait_healthy
from tests.test_trainer_daemon import Daemon, consumed, recorded_versions, train_cmd, train_until_consumed

ADMIN = "crash-admin"
HEADERS = {"Authorization": f"Bearer {ADMIN}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_gateway(tmp: Path, model: Path, url: str, port: int, **settings: str) -> UpProcess:
    env = {
        "CLAWGATE_MODEL": str(model),
        "CLAWGATE_SERVED_MODEL_NAME": "tiny",
        "CLAWGATE_DATABASE_URL": url,
        "CLAWGATE_DATA_DIR": str(tmp / "data"),
        "CLAWGATE_PORT": str(port),
        "CLAWGATE_ADMIN_KEY": ADMIN,
        "CLAWGATE_MAX_TOKENS": "4000",
        "CLAWGATE_POLICY_POLL_INTERVAL": "0.2",
        **{f"CLAWGATE_{k.upper()}": v for k, v in settings.items()},
    }
    gw = UpProcess(env=env, cwd=tmp, command="serve")
    gw.start()
    wait_healthy(f"http://127.0.0.1:{port}", gw, 120, version=None)
    return gw


def calls_of(url: str, rollout_id: str) -> list[sa.Row]:
    engine = db.connect(url)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, status, parent_call_id FROM calls WHERE rollout_id = :r ORDER BY started_at"),
            {"r": rollout_id},
        ).all()
    engine.dispose()
    return list(rows)


@pytest.mark.parametrize("durable", [True, False])
def test_a_call_served_just_before_a_kill(tmp_path, tiny_model_dir, durable):
    """With durable capture (the default) a call is committed before its response ends, so a SIGKILL right after
    the client got it loses nothing; without it, the call waits for the writer's next flush (5 s here) and dies
    with the process."""
    url = f"sqlite:///{tmp_path / 'clawgate.db'}"
    db.upgrade(url)
    port = free_port()
    gw = start_gateway(
        tmp_path, tiny_model_dir, url, port, capture_durable=str(durable).lower(), capture_flush_interval="5"
    )
    try:
        for stream in (False, True):
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": stream}
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200 and (not stream or "data: [DONE]" in r.text)
        os.kill(gw.proc.pid, signal.SIGKILL)
        gw.proc.wait(30)
    finally:
        gw.stop()
    engine = db.connect(url)
    with engine.connect() as conn:
        stored = conn.execute(sa.text("SELECT count(*) FROM calls WHERE status = 'ok'")).scalar()
    engine.dispose()
    assert stored == (2 if durable else 0)


def test_sigterm_under_load_finishes_the_streams_and_drains_the_writer(tmp_path, tiny_model_dir):
    """A graceful stop (SIGTERM, as docker and systemd send) with streams in flight: each stream runs to its end,
    the process exits 0, and every call is in the database once, ok."""
    import threading

    url = f"sqlite:///{tmp_path / 'clawgate.db'}"
    db.upgrade(url)
    port = free_port()
    # Durable capture off: the calls wait in the writer's queue, so the drain at shutdown is what stores them.
    gw = start_gateway(tmp_path, tiny_model_dir, url, port, capture_durable="false", capture_flush_interval="30")
    streams = 6
    started = threading.Barrier(streams + 1, timeout=120)
    results: list[tuple[str, bool, int]] = []

    def client(i: int) -> None:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"stream {i}"}],
            "max_tokens": 400,
            "stream": True,
            "seed": i,
        }
        chunks, done, call_id = 0, False, ""
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120) as r:
            call_id = r.headers["x-clawgate-call-id"]
            for line in r.iter_lines():
                if line.startswith("data: ") and chunks == 0:
                    started.wait()
                if line.startswith("data: "):
                    chunks += 1
                done = done or line == "data: [DONE]"
        results.append((call_id, done, chunks))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    try:
        for t in threads:
            t.start()
        started.wait()  # every stream is under way
        gw.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert gw.proc.wait(120) == 0, gw.output
    finally:
        gw.stop()
    assert len(results) == streams and all(done for _, done, _ in results), results
    engine = db.connect(url)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, status FROM calls")).all()
    engine.dispose()
    assert sorted(rows) == sorted((call_id, "ok") for call_id, _, _ in results), "every stream stored once, ok"


@pytest.mark.slow
def test_kill_gateway_mid_stream_and_trainer_mid_step(tmp_path, tiny_model_dir):
    url = f"sqlite:///{tmp_path / 'clawgate.db'}"
    db.upgrade(url)
    port = free_port()
    adapters = tmp_path / "adapters"
    gw = start_gateway(tmp_path, tiny_model_dir, url, port)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    convs: dict[str, dict] = {}
    try:
        for i in range(6):
            ro = client.post("/v1/rollouts", json={"task_id": f"t{i % 2}", "harness": "h"}, headers=HEADERS).json()
            key = {"Authorization": f"Bearer {ro['api_key']}"}
            path = f"/rollouts/{ro['id']}/v1/chat/completions"
            messages = [{"role": "user", "content": f"task {i}"}]
            r = client.post(path, headers=key, json={"model": "tiny", "messages": messages, "max_tokens": 8})
            assert r.status_code == 200
            messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "go on"}]
            convs[ro["id"]] = {"key": key, "path": path, "messages": messages, "first": r.headers["x-clawgate-call-id"]}
        # The last rollout's next call streams up to 4000 tokens; the gateway is killed while it streams.
        victim = list(convs)[-1]
        c = convs[victim]
        chunks = 0
        with pytest.raises(httpx.HTTPError):  # the client sees the stream break, not a normal end
            body = {"model": "tiny", "messages": c["messages"], "max_tokens": 4000, "stream": True}
            with client.stream("POST", c["path"], headers=c["key"], json=body) as r:
                for _ in r.iter_lines():
                    chunks += 1
                    if chunks == 20:
                        os.kill(gw.proc.pid, signal.SIGKILL)
        assert chunks >= 20
        gw.proc.wait(30)
        # Every call that was served is recorded once; the one cut by the kill is not recorded as served.
        for rid, c in convs.items():
            assert [(row.id, row.status) for row in calls_of(url, rid)] == [(c["first"], "ok")]

        gw = start_gateway(tmp_path, tiny_model_dir, url, port)
        # The client goes on (retrying the cut call); the restarted gateway, with nothing in memory, finds each
        # conversation's parent call in the database and splices onto its exact tokens.
        for c in convs.values():
            body = {"model": "tiny", "messages": c["messages"], "max_tokens": 8}
            r = client.post(c["path"], headers=c["key"], json=body)
            assert r.status_code == 200, r.text
        for i, (rid, c) in enumerate(convs.items()):
            client.post(f"/v1/rollouts/{rid}/reward", json={"value": float(i % 3)}, headers=c["key"])
            client.post(f"/v1/rollouts/{rid}/finish", json={"status": "completed"}, headers=c["key"])
        for rid, c in convs.items():
            rows = calls_of(url, rid)
            assert len(rows) == 2 and all(row.status == "ok" for row in rows)
            assert rows[1].parent_call_id == c["first"], "continued from the call recorded before the kill"
    finally:
        gw.stop()
        client.close()

    # The trainer is killed inside its step, then restarted: every rollout is trained exactly once.
    daemon = Daemon(train_cmd(tiny_model_dir, url, adapters, "--min-rollouts", "6"))
    try:
        daemon.wait_line("step from policy@")
        time.sleep(0.3)
        daemon.proc.kill()
        daemon.proc.wait(30)
    finally:
        daemon.stop()
    train_until_consumed(tiny_model_dir, url, adapters, set(convs))
    trained = consumed(url)
    assert sorted(r for r, _ in trained) == sorted(convs), "each rollout trained exactly once"
    versions = recorded_versions(url)
    assert versions == list(range(len(versions))) and len(versions) >= 2
