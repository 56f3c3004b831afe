"""The training figures on /metrics follow the store: a finished, rewarded task rollout counts as ready."""

from __future__ import annotations

import httpx

from tests.fakes import ScriptedEngine


def metric(text: str, name: str) -> float:
    [line] = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[-1])


def test_ready_rollouts_and_capture_figures(gateway_factory, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer)
    before = httpx.get(gw.url + "/metrics").text
    assert metric(before, "clawgate_rollouts_ready") == 0
    assert metric(before, "clawgate_capture_dead_lettered") == 0 and metric(before, "clawgate_capture_degraded") == 0

    created = httpx.post(gw.v1 + "/rollouts", json={"task_id": "t", "harness": "h"}, timeout=30).json()
    engine.push("an answer")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "do it"}]}
    assert httpx.post(created["base_url"] + "/chat/completions", json=body, timeout=30).status_code == 200
    assert metric(httpx.get(gw.url + "/metrics").text, "clawgate_rollouts_ready") == 0, "not finished yet"
    assert httpx.post(f"{gw.v1}/rollouts/{created['id']}/reward", json={"value": 1}, timeout=30).status_code == 201
    assert httpx.post(f"{gw.v1}/rollouts/{created['id']}/finish", json={}, timeout=30).status_code == 200
    after = httpx.get(gw.url + "/metrics").text
    assert metric(after, "clawgate_rollouts_ready") == 1 and metric(after, "clawgate_rollouts_trained") == 0
    assert metric(after, "clawgate_capture_written") >= 1  # the call (with its rollout row)
