"""No secret reaches a log line: client keys, the admin key, per-rollout keys and a database password, used
rightly and wrongly, at DEBUG level."""

from __future__ import annotations

import logging

import httpx

from tests.fakes import ScriptedEngine

CLIENT_KEY = "sk-client-5f0c9a1e77d24b"
ADMIN_KEY = "adm-93be41d0c6a2417f"


def test_no_key_appears_in_any_log_line(gateway_factory, tiny_tokenizer, caplog):
    caplog.set_level(logging.DEBUG)
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, api_keys=[CLIENT_KEY], admin_key=ADMIN_KEY)
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    created = httpx.post(gw.v1 + "/rollouts", json={"task_id": "t"}, headers=admin, timeout=30).json()
    rollout_key = created["api_key"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    for key in (CLIENT_KEY, rollout_key, "sk-wrong-key-1234567890", ADMIN_KEY):
        httpx.post(created["base_url"] + "/chat/completions", json=body, headers={"x-api-key": key}, timeout=30)
        httpx.post(gw.v1 + "/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)
        httpx.post(gw.v1 + "/feedback", json={"call_id": "nope", "value": 1}, headers={"x-api-key": key}, timeout=30)
    reward = httpx.post(
        f"{gw.v1}/rollouts/{created['id']}/reward",
        json={"value": 1},
        headers={"authorization": f"Bearer {rollout_key}"},
        timeout=30,
    )
    assert reward.status_code == 201
    gw.flush()
    lines = [record.getMessage() + (record.exc_text or "") for record in caplog.records]
    assert lines, "the gateway logged something to check"
    for secret in (CLIENT_KEY, ADMIN_KEY, rollout_key):
        leaked = [line for line in lines if secret in line]
        assert not leaked, f"a key reached the log: {leaked[:3]}"
