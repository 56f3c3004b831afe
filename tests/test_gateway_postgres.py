"""The gateway capturing into a real PostgreSQL database (the production store)."""

from __future__ import annotations

import itertools

import httpx
import openai
import pytest
import sqlalchemy as sa

from gateway.store import codec
from gateway.store.db import connect

pytestmark = pytest.mark.postgres

MESSAGES = [{"role": "user", "content": "Hello there."}]


def test_calls_rollouts_and_rewards_on_postgres(gateway_factory, postgres_url):
    gw = gateway_factory(database_url=postgres_url, admin_key="adm")
    admin = {"Authorization": "Bearer adm"}
    ro = httpx.post(gw.url + "/v1/rollouts", json={"task_id": "pg", "harness": "sdk"}, headers=admin).json()
    client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["api_key"], max_retries=0)
    messages = list(MESSAGES)
    for turn in range(3):
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, seed=turn)
        messages += [
            {"role": "assistant", "content": out.choices[0].message.content or ""},
            {"role": "user", "content": "more"},
        ]
    # A harness session header gives a long rollout id (prefix + up to 100 characters).
    long_session = "s" * 100
    r = httpx.post(
        gw.v1 + "/chat/completions",
        json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2},
        headers={"X-Claude-Code-Session-Id": long_session},
    )
    assert r.status_code == 200 and r.headers["x-clawgate-rollout-id"] == "claude-code-" + long_session
    assert httpx.post(f"{gw.url}/v1/rollouts/{ro['id']}/reward", json={"value": 1.0}, headers=admin).status_code == 201
    detail = httpx.get(f"{gw.url}/v1/rollouts/{ro['id']}", headers=admin).json()
    calls = detail["calls"]
    assert [c["render_mode"] for c in calls] == ["fresh", "spliced", "spliced"]
    for prev, cur in itertools.pairwise(calls):
        full = prev["prompt_token_ids"] + prev["completion_token_ids"]
        assert cur["prompt_token_ids"][: len(full)] == full
    assert detail["reward"] == 1.0
    engine = connect(postgres_url)
    with engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT rollout_id, completion_ids, completion_len FROM calls WHERE rollout_id LIKE 'claude-code-%'"
            )
        ).one()
        assert codec.unpack_ids(row.completion_ids).__len__() == row.completion_len
        assert gw.state.writer.stats.dead_lettered == 0
    engine.dispose()
