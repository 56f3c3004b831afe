"""Failures are answered in the API's error format and recorded as failed or cancelled, never as ok."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import sqlalchemy as sa

from gateway.errors import EngineUnavailable
from gateway.store.db import connect
from tests.fakes import ScriptedEngine, SlowEngine

MESSAGES = [{"role": "user", "content": "hello"}]


def rows(gw, rollout: str) -> list[dict]:
    gw.flush()
    engine = connect(gw.settings.database_url)
    with engine.connect() as conn:
        out = conn.execute(sa.text("SELECT * FROM calls WHERE rollout_id = :r ORDER BY started_at"), {"r": rollout})
        result = [dict(r) for r in out.mappings()]
    engine.dispose()
    return result


def test_error_after_stream_began_is_an_event_and_recorded_failed(gateway_factory, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer)
    engine.push("one two three four five six", fail_after=3)
    client = openai.OpenAI(base_url=gw.url + "/rollouts/ro-fail/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, max_tokens=32)
    received = []
    with pytest.raises(openai.APIError, match="scripted failure"):
        for chunk in stream:
            received.append(chunk)
    assert received, "tokens before the failure were streamed"
    [row] = rows(gw, "ro-fail")
    assert row["status"] == "failed"
    assert "scripted failure" in row["error"]
    assert row["completion_len"] == 3


def test_error_before_first_token_gets_a_status_code(gateway_factory, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer)
    engine.push("never", fail_after=0)
    client = openai.OpenAI(base_url=gw.url + "/rollouts/ro-fail0/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:
        list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True))
    assert err.value.status_code == 502
    [row] = rows(gw, "ro-fail0")
    assert row["status"] == "failed"
    # The error names the call it ended, as a success would: a client can match it to what was recorded.
    assert err.value.response.headers["x-clawgate-call-id"] == row["id"]
    assert err.value.response.headers["x-clawgate-rollout-id"] == "ro-fail0"


class UnavailableEngine(ScriptedEngine):
    async def generate(self, request):
        raise EngineUnavailable("engine is down")
        yield  # pragma: no cover


def test_engine_unavailable_is_503_and_recorded(gateway_factory, tiny_tokenizer):
    gw = gateway_factory(engine=UnavailableEngine(tiny_tokenizer), tokenizer=tiny_tokenizer)
    client = openai.OpenAI(base_url=gw.url + "/rollouts/ro-down/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert err.value.status_code == 503
    [row] = rows(gw, "ro-down")
    assert row["status"] == "failed"
    assert err.value.response.headers["x-clawgate-call-id"] == row["id"]


async def test_client_disconnect_mid_stream_is_recorded_cancelled(gateway_factory, tiny_tokenizer):
    engine = SlowEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer)
    engine.push(" ".join(["word"] * 60))
    body = {"model": "tiny", "messages": MESSAGES, "stream": True, "max_tokens": 60}
    url = gw.url + "/rollouts/ro-gone/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30) as client, client.stream("POST", url, json=body) as r:
        n = 0
        async for line in r.aiter_lines():
            n += line.startswith("data: ")
            if n >= 4:
                break
    for _ in range(100):
        got = rows(gw, "ro-gone")
        if got:
            break
        await asyncio.sleep(0.05)
    [row] = got
    assert row["status"] == "cancelled"
    assert 0 < row["completion_len"] < 60


def test_failed_calls_are_not_spliced(gateway_factory, tiny_tokenizer):
    """A failed answer is never registered: echoing its partial text cannot splice to it."""
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer)
    client = openai.OpenAI(base_url=gw.url + "/rollouts/ro-nosplice/v1", api_key="x", max_retries=0)
    engine.push("alpha beta gamma", fail_after=2)
    with pytest.raises(openai.APIError):
        list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True))
    engine.push("ok")
    client.chat.completions.create(
        model="tiny",
        messages=[*MESSAGES, {"role": "assistant", "content": "alpha"}, {"role": "user", "content": "again"}],
    )
    got = rows(gw, "ro-nosplice")
    assert [r["status"] for r in got] == ["failed", "ok"]
    assert got[1]["parent_call_id"] is None and got[1]["render_mode"] == "fresh"


class GatedEngine(ScriptedEngine):
    """Holds every generation until ``release`` is set (the gateway runs it on its own thread's loop)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.release = threading.Event()
        self.entered = 0

    async def generate(self, request):
        self.entered += 1
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        async for event in super().generate(request):
            yield event


def test_calls_over_the_concurrency_limit_are_refused_before_the_engine(gateway_factory, tiny_tokenizer):
    engine = GatedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, max_concurrent_calls=2)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8}
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(httpx.post, gw.v1 + "/chat/completions", json=body, timeout=30) for _ in range(2)]
        deadline = time.monotonic() + 10
        while engine.entered < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        if engine.entered < 2:
            engine.release.set()
            pytest.fail("the first two calls never reached the engine")
        # A third call, in each API's shape, streamed or not: refused at once with Retry-After, never generated.
        refused = [
            httpx.post(gw.v1 + "/chat/completions", json={**body, "stream": True}, timeout=30),
            httpx.post(gw.v1 + "/messages", json=body, timeout=30),
            httpx.post(gw.v1 + "/responses", json={"model": "tiny", "input": "hello"}, timeout=30),
        ]
        assert engine.entered == 2
        engine.release.set()
        assert [f.result().status_code for f in held] == [200, 200]
    for r in refused:
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "CLAWGATE_MAX_CONCURRENT_CALLS" in r.text
    assert refused[0].json()["error"]["code"] == "overloaded"
    assert refused[1].json()["type"] == "error" and refused[1].json()["error"]["type"] == "overloaded_error"
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'clawgate_calls_refused_total{reason="concurrency"} 3.0' in metrics
    assert httpx.post(gw.v1 + "/chat/completions", json=body, timeout=30).status_code == 200  # room again
    gw.flush()
    store = connect(gw.settings.database_url)
    with store.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM calls")).scalar() == 3, "refused calls are not recorded"
    store.dispose()


def test_no_server_cap_by_default_a_harness_gets_the_budget_it_asks_for(gateway_factory, tiny_tokenizer):
    """Claude Code asks for 32,000 tokens and treats an answer cut shorter as an error: by default the budget is
    what the client asks, up to the context window; CLAWGATE_MAX_TOKENS is an opt-in cap."""
    engine = ScriptedEngine(tiny_tokenizer, max_model_len=40_000)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, max_tokens=None)
    body = {"model": "tiny", "max_tokens": 32_000, "messages": MESSAGES}
    assert httpx.post(gw.v1 + "/messages", json=body, timeout=30).status_code == 200
    assert engine.requests[-1].params.max_tokens == 32_000
    body["max_tokens"] = 60_000  # more than the window holds: what is left of it
    assert httpx.post(gw.v1 + "/messages", json=body, timeout=30).status_code == 200
    prompt = len(engine.requests[-1].prompt_ids)
    assert engine.requests[-1].params.max_tokens == 40_000 - prompt

    capped = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, max_tokens=512)
    assert httpx.post(capped.v1 + "/messages", json=body, timeout=30).status_code == 200
    assert engine.requests[-1].params.max_tokens == 512


def test_a_body_over_the_limit_is_refused_before_it_is_read(gateway_factory, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, max_request_bytes=4096)
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}
    r = httpx.post(gw.v1 + "/chat/completions", json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text
    r = httpx.post(gw.v1 + "/messages", json={**big, "max_tokens": 4}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large" and r.json()["type"] == "error"

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    r = httpx.post(gw.v1 + "/chat/completions", content=chunks(), timeout=30)
    assert r.status_code == 413 and "CLAWGATE_MAX_REQUEST_BYTES" in r.text, r.text
    assert engine.requests == [], "nothing oversized reached the engine"
    small = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(gw.v1 + "/chat/completions", json=small, timeout=30).status_code == 200
