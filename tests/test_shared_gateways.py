"""Two gateway processes (`clawgate serve`, local engine on the tiny model) on one PostgreSQL database and one data
directory: a conversation may go to either process at every turn, as behind a load balancer.

Checked from the database and each process's /metrics: alternating turns splice exactly (each prompt starts with
its parent's exact prompt + completion ids) and stay one rollout; `previous_response_id` continues on the other
process and after a restart, and a `store: false` response is refused the same way everywhere; a rewritten
answer is counted as drift by the process that did not generate it; a rollout one process closed is not extended
by the other. The adapter-unloading rule is tested without processes, against the same database.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import fcntl
import itertools
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.policy import PolicyFollower
from gateway.settings import Settings
from gateway.store import adapter_leases, db, repo, spool
from gateway.store.models import Call, GatewayAdapter, Rollout
from tests import pg
from tests.online import UpProcess, wait_healthy
from tests.test_crash import free_port

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

ADMIN = "shared-admin"
IDLE_S = 8.0  # session idle timeout: the idle-close loop looks every 2 s


@dataclass
class Pair:
    url: str
    tmp: Path
    model: Path
    ports: list[int]
    procs: list[UpProcess]

    def start(self, i: int) -> None:
        env = {
            "CLAWGATE_MODEL": str(self.model),
            "CLAWGATE_SERVED_MODEL_NAME": "tiny",
            "CLAWGATE_DATABASE_URL": self.url,
            "CLAWGATE_DATA_DIR": str(self.tmp / "data"),  # shared: each process claims its own spool directory
            "CLAWGATE_PORT": str(self.ports[i]),
            "CLAWGATE_ADMIN_KEY": ADMIN,
            "CLAWGATE_MAX_TOKENS": "8",
            "CLAWGATE_SESSION_IDLE_TIMEOUT": str(IDLE_S),
            "CLAWGATE_POLICY_FOLLOW": "false",
        }
        proc = UpProcess(env=env, cwd=self.tmp, command="serve")
        proc.start()
        wait_healthy(self.base(i), proc, 180, version=None)
        self.procs[i] = proc

    def base(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def client(self, i: int, base_url: str | None = None, key: str = ADMIN) -> openai.OpenAI:
        return openai.OpenAI(base_url=base_url or self.base(i) + "/v1", api_key=key, max_retries=0, timeout=120)

    def drift(self, i: int) -> float:
        text = httpx.get(self.base(i) + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).text
        lines = [x for x in text.splitlines() if x.startswith("clawgate_drift_total")]
        return float(lines[0].split()[-1]) if lines else 0.0


@pytest.fixture(scope="module")
def pair(postgres_server_url: str, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Pair]:
    with pg.fresh_database(postgres_server_url) as url:
        db.upgrade(url)
        two = Pair(url, tmp_path_factory.mktemp("shared"), tiny_model_dir, [free_port(), free_port()], [None, None])  # type: ignore[list-item]
        try:
            two.start(0)
            two.start(1)
            yield two
        finally:
            for proc in two.procs:
                if proc is not None:
                    proc.stop()


def calls_by_request(url: str, request_ids: list[str]) -> list[Call]:
    engine = db.connect(url)
    with Session(engine, expire_on_commit=False) as session:
        found = {c.request_id: c for c in session.scalars(sa.select(Call).where(Call.request_id.in_(request_ids)))}
    engine.dispose()
    return [found[r] for r in request_ids]


def assert_exact_splices(url: str, calls: list[Call]) -> None:
    """Each call continues the one before: its prompt starts with the parent's exact prompt + completion ids."""
    engine = db.connect(url)
    with Session(engine) as session:
        cache = repo.CallCache(session)
        for parent, child in itertools.pairwise(calls):
            parent_ids = repo.full_prompt_ids(cache, cache.get(parent.id)) + repo.codec.unpack_ids(
                parent.completion_ids
            )
            child_ids = repo.full_prompt_ids(cache, cache.get(child.id))
            assert child.parent_call_id == parent.id
            assert child.prompt_prefix_len == len(parent_ids)
            assert child_ids[: len(parent_ids)] == parent_ids
    engine.dispose()


def chat_turns(pair: Pair, clients: list[openai.OpenAI], turns: int) -> list[str]:
    messages: list[Any] = [{"role": "user", "content": "Hello there."}]
    ids = []
    for turn in range(turns):
        resp = clients[turn % len(clients)].chat.completions.create(model="tiny", messages=messages, max_tokens=6)
        ids.append(resp.id)
        messages += [
            {"role": "assistant", "content": resp.choices[0].message.content or ""},
            {"role": "user", "content": f"Tell me more, part {turn}."},
        ]
    return ids


def test_a_conversation_alternating_between_processes_splices_exactly_and_stays_one_rollout(pair: Pair) -> None:
    drift_before = [pair.drift(0), pair.drift(1)]
    ids = chat_turns(pair, [pair.client(0), pair.client(1)], 5)
    calls = calls_by_request(pair.url, ids)
    assert [c.render_mode for c in calls] == ["fresh"] + ["spliced"] * 4
    assert len({c.rollout_id for c in calls}) == 1, "one implicit rollout across both processes"
    assert_exact_splices(pair.url, calls)
    assert [pair.drift(0), pair.drift(1)] == drift_before, "no drift on either process"

    # The same for an explicit rollout, addressed by its URL prefix and key.
    ro = httpx.post(
        pair.base(0) + "/v1/rollouts", json={"task_id": "t"}, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30
    ).json()
    clients = [pair.client(i, f"{pair.base(i)}/rollouts/{ro['id']}/v1", ro["api_key"]) for i in (1, 0)]
    calls = calls_by_request(pair.url, chat_turns(pair, clients, 3))
    assert [c.render_mode for c in calls] == ["fresh", "spliced", "spliced"]
    assert {c.rollout_id for c in calls} == {ro["id"]}
    assert_exact_splices(pair.url, calls)


def test_previous_response_id_continues_on_the_other_process_and_after_a_restart(pair: Pair) -> None:
    a, b = pair.client(0), pair.client(1)
    r1 = a.responses.create(model="tiny", input="Hi.", max_output_tokens=6)
    r2 = b.responses.create(model="tiny", previous_response_id=r1.id, input="And then?", max_output_tokens=6)
    pair.procs[0].stop()
    pair.start(0)  # its memory is gone: the chain is read back from the database
    r3 = pair.client(0).responses.create(model="tiny", previous_response_id=r2.id, input="Go on.", max_output_tokens=6)
    calls = calls_by_request(pair.url, [r1.id, r2.id, r3.id])
    assert [c.render_mode for c in calls] == ["fresh", "spliced", "spliced"], "each continuation splices raw ids"
    assert_exact_splices(pair.url, calls)

    unstored = pair.client(0).responses.create(model="tiny", input="Hi.", store=False, max_output_tokens=4)
    errors = []
    for i in (0, 1):
        with pytest.raises(openai.BadRequestError) as refused:
            pair.client(i).responses.create(model="tiny", previous_response_id=unstored.id, input="More.")
        errors.append(refused.value.message)
    assert "store=false" in errors[0] and errors[0] == errors[1], "refused the same way on both processes"
    with pytest.raises(openai.BadRequestError, match="not found"):
        b.responses.create(model="tiny", previous_response_id="resp_doesnotexist", input="More.")


def test_a_rewritten_answer_sent_to_the_other_process_counts_as_drift(pair: Pair) -> None:
    a = pair.client(0)
    first = a.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi, drift."}], max_tokens=6)
    history: list[Any] = [
        {"role": "user", "content": "Hi, drift."},
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "Next."},
    ]
    second = a.chat.completions.create(model="tiny", messages=history, max_tokens=6)
    # The harness rewrites the first answer; the second one (ours) can no longer be spliced.
    history[1] = {"role": "assistant", "content": "Something the model never said."}
    history += [
        {"role": "assistant", "content": second.choices[0].message.content or ""},
        {"role": "user", "content": "?"},
    ]
    before = pair.drift(1)
    third = pair.client(1).chat.completions.create(model="tiny", messages=history, max_tokens=6)
    assert pair.drift(1) == before + 1, "the other process knows the answer was ours"
    assert calls_by_request(pair.url, [third.id])[0].render_mode == "drifted"


def rollout_status(url: str, rollout_id: str) -> str:
    engine = db.connect(url)
    with engine.connect() as conn:
        status = conn.execute(sa.select(Rollout.status).where(Rollout.id == rollout_id)).scalar_one()
    engine.dispose()
    return str(status)


def test_a_rollout_closed_by_one_process_is_not_extended_by_the_other(pair: Pair) -> None:
    def two_turns(tag: str) -> tuple[list[Any], Call]:
        messages: list[Any] = [{"role": "user", "content": f"Close me, {tag}."}]
        for i in (0, 1):
            resp = pair.client(i).chat.completions.create(model="tiny", messages=messages, max_tokens=6)
            messages += [{"role": "assistant", "content": resp.choices[0].message.content or ""}]
            messages += [{"role": "user", "content": "More."}]
        return messages, calls_by_request(pair.url, [resp.id])[0]

    # Finished through process 0's API while process 1 holds the conversation in memory (its last turn is fresh).
    messages, last = two_turns("finish")
    finished = httpx.post(
        f"{pair.base(0)}/v1/rollouts/{last.rollout_id}/finish",
        json={"status": "completed"},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=30,
    )
    assert finished.status_code == 200
    time.sleep(IDLE_S / 4 + 1)  # process 1's idle loop has looked since (its parent is still too recent to check)
    resp = pair.client(1).chat.completions.create(model="tiny", messages=messages, max_tokens=6)
    [after] = calls_by_request(pair.url, [resp.id])
    assert after.parent_call_id == last.id and after.render_mode == "spliced", "still spliced from the raw ids"
    assert after.rollout_id != last.rollout_id, "but in a new rollout"

    # Closed for idleness (by whichever process looked first), then resumed on both.
    messages, last = two_turns("idle")
    deadline = time.monotonic() + 4 * IDLE_S
    while rollout_status(pair.url, last.rollout_id) == "open":
        assert time.monotonic() < deadline, "the idle rollout was not closed"
        time.sleep(0.5)
    resumed = [pair.client(i).chat.completions.create(model="tiny", messages=messages, max_tokens=6) for i in (1, 0)]
    for call in calls_by_request(pair.url, [r.id for r in resumed]):
        assert call.parent_call_id == last.id and call.rollout_id != last.rollout_id


def test_serve_with_two_workers_splices_one_conversation_and_each_worker_has_its_own_spool(
    pair: Pair, tmp_path: Path
) -> None:
    port = free_port()
    env = {
        "CLAWGATE_MODEL": str(pair.model),
        "CLAWGATE_SERVED_MODEL_NAME": "tiny",
        "CLAWGATE_DATABASE_URL": pair.url,
        "CLAWGATE_DATA_DIR": str(tmp_path / "data"),
        "CLAWGATE_ADMIN_KEY": ADMIN,
        "CLAWGATE_POLICY_FOLLOW": "false",
    }
    proc = UpProcess(env=env, cwd=tmp_path, command="serve", args=["--workers", "2", "--port", str(port)])
    proc.start()
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc, 180, version=None)
        deadline = time.monotonic() + 120  # /health answers once the first worker is up
        locks = [tmp_path / "data" / name / spool.LOCK_FILE for name in ("spool", "spool-1")]
        while not all(lock.exists() for lock in locks):
            assert time.monotonic() < deadline, f"two workers did not start:\n{proc.output}"
            time.sleep(0.5)
        for lock in locks:  # each held by a live worker
            with lock.open("ab") as f, pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # A new connection per turn: the workers share the listening socket and take turns as they accept.
        clients = [openai.OpenAI(base_url=base + "/v1", api_key=ADMIN, max_retries=0, timeout=120) for _ in range(4)]
        calls = calls_by_request(pair.url, chat_turns(pair, clients, 4))
        assert [c.render_mode for c in calls] == ["fresh"] + ["spliced"] * 3
        assert len({c.rollout_id for c in calls}) == 1
    finally:
        assert proc.stop() == 0, proc.output


# --- unloading adapters that several gateways share (no processes) ---------------------------------------------
def test_an_adapter_counts_as_used_only_by_other_live_gateways() -> None:
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    lease = dt.timedelta(seconds=30)
    rows = [
        ("me", "policy@v1", now),
        ("live", "policy@v1", now - dt.timedelta(seconds=29)),
        ("stale", "policy@v1", now - dt.timedelta(seconds=31)),
        ("live", "policy@v2", now),
    ]
    assert adapter_leases.users(rows, "policy@v1", me="me", now=now, lease=lease) == {"live"}
    assert adapter_leases.users(rows[:1] + rows[2:3], "policy@v1", me="me", now=now, lease=lease) == set()
    assert adapter_leases.users(rows, "policy@v3", me="me", now=now, lease=lease) == set()


class _Engine:
    def __init__(self) -> None:
        self.unloaded: list[str] = []

    async def unload_adapter(self, name: str) -> None:
        self.unloaded.append(name)


class _Service:
    def __init__(self) -> None:
        self.adapter = "policy@v4"
        self.adapter_in_flight: Counter[str] = Counter()


def test_a_version_is_unloaded_only_when_no_live_gateway_reports_it(postgres_url: str) -> None:
    store = db.connect(postgres_url)
    settings = Settings(policy_keep_loaded=2, adapter_lease_seconds=30)
    engine = _Engine()
    follower = PolicyFollower(settings, engine, _Service(), store, None, [1], gateway_id="A")  # type: ignore[arg-type]
    follower.loaded = {1: "policy@v1", 2: "policy@v2", 3: "policy@v3", 4: "policy@v4"}
    follower.current = 4
    adapter_leases.heartbeat(store, "A", ["policy@v4"])
    adapter_leases.heartbeat(store, "B", ["policy@v2", "policy@v1"])  # B still serves v1 and runs calls on v2
    asyncio.run(follower._retire())
    assert engine.unloaded == [] and list(follower.loaded) == [1, 2, 3, 4]

    adapter_leases.heartbeat(store, "B", ["policy@v2"])  # v1's calls on B are done; v2 still runs
    asyncio.run(follower._retire())
    assert engine.unloaded == ["policy@v1"] and list(follower.loaded) == [2, 3, 4]

    with Session(store) as session, session.begin():  # B stopped reporting (killed): its lease runs out
        session.execute(sa.update(GatewayAdapter).values(seen_at=dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)))
    asyncio.run(follower._retire())
    assert engine.unloaded == ["policy@v1", "policy@v2"] and list(follower.loaded) == [3, 4]

    adapter_leases.forget(store, "A")
    with Session(store) as session:
        assert session.scalars(sa.select(GatewayAdapter.gateway_id).where(GatewayAdapter.gateway_id == "A")).all() == []
    store.dispose()


def test_each_process_claims_a_spool_directory_of_its_own(tmp_path: Path) -> None:
    base = tmp_path / "spool"
    first, lock1 = spool.claim_dir(base)
    second, lock2 = spool.claim_dir(base)
    assert (first, second) == (base, tmp_path / "spool-1")
    lock1.close()  # that process stopped: the next one to start takes over its directory (and replays its files)
    third, lock3 = spool.claim_dir(base)
    assert third == base
    lock2.close()
    lock3.close()
