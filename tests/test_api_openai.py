"""The official openai SDK (sync and async) against a live gateway with the in-process engine and tiny model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import sqlalchemy as sa

from gateway.store import codec
from gateway.store.db import connect
from tests.fakes import ScriptedEngine

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def client(shared_gateway):
    return openai.OpenAI(base_url=shared_gateway.v1, api_key="unused", max_retries=0)


def calls(gw, where: str = "1=1") -> list[dict]:
    gw.flush()
    engine = connect(gw.settings.database_url)
    with engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT * FROM calls WHERE {where} ORDER BY started_at")).mappings().all()
    engine.dispose()
    return [dict(r) for r in rows]


def test_non_streaming_chat_is_served_and_captured(client, shared_gateway, tiny_tokenizer):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=3
    )
    resp = raw.parse()
    call_id = raw.headers["x-clawgate-call-id"]
    rollout_id = raw.headers["x-clawgate-rollout-id"]
    assert resp.object == "chat.completion" and resp.model == "tiny"
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens >= 1
    [row] = calls(shared_gateway, f"id = '{call_id}'")
    assert row["status"] == "ok" and row["rollout_id"] == rollout_id and row["api"] == "chat"
    ids = codec.unpack_ids(row["completion_ids"])
    assert len(ids) == resp.usage.completion_tokens == row["completion_len"]
    assert len(codec.unpack_logprobs(row["completion_logprobs"])) == len(ids)
    assert row["prompt_len"] == resp.usage.prompt_tokens
    # The stored prompt is the chat template rendering of the messages.
    expected = tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert codec.unpack_ids(row["prompt_delta"]) == tiny_tokenizer.encode(expected, add_special_tokens=False)
    # What the client saw is the decoded completion (seed 3 samples text, not an immediate end of turn).
    content = choice.message.content or ""
    assert content and content == tiny_tokenizer.decode(ids, skip_special_tokens=True).strip()


def test_streaming_with_usage(client, shared_gateway, tiny_tokenizer):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, max_tokens=10, seed=3, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(raw.parse())
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens >= 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes and finishes[-1] in ("stop", "length")
    # The streamed deltas add up to the captured completion's text (seed 3 samples text at once).
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    [row] = calls(shared_gateway, f"id = '{raw.headers['x-clawgate-call-id']}'")
    ids = codec.unpack_ids(row["completion_ids"])
    assert len(ids) == usage[0].completion_tokens
    assert text and text == tiny_tokenizer.decode(ids, skip_special_tokens=True).strip()


async def test_async_client_streaming_and_not(shared_gateway):
    client = openai.AsyncOpenAI(base_url=shared_gateway.v1, api_key="x", max_retries=0)
    resp = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5)
    assert resp.choices[0].message.role == "assistant"
    stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, stream=True)
    n = 0
    async for _chunk in stream:
        n += 1
    assert n >= 2
    await client.close()


def test_logprobs_match_capture(client, shared_gateway):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=3
    )
    resp = raw.parse()
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in content)
    # The sampled token's logprob never exceeds the best alternative's.
    assert all(t.logprob <= max(a.logprob for a in t.top_logprobs) + 1e-5 for t in content)
    [row] = calls(shared_gateway, f"id = '{raw.headers['x-clawgate-call-id']}'")
    stored = codec.unpack_logprobs(row["completion_logprobs"])
    assert stored == pytest.approx([t.logprob for t in content], abs=1e-6)


def test_n2_gives_two_captured_choices(client, shared_gateway):
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=6, n=2, seed=11)
    resp = raw.parse()
    assert sorted(c.index for c in resp.choices) == [0, 1]
    ids = raw.headers["x-clawgate-call-id"].split(",")
    assert len(ids) == 2
    rows = calls(shared_gateway, f"request_id = '{resp.id}'")
    assert sorted(r["choice_index"] for r in rows) == [0, 1]
    assert rows[0]["prompt_delta"] == rows[1]["prompt_delta"]


def test_streaming_n2(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, n=2, stream=True))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_stop_sequences_trim_output(client, tiny_tokenizer):
    # Find a word the model will produce with a fixed seed, then ask it to stop there.
    for seed in range(5, 50):
        base = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, seed=seed)
        text = base.choices[0].message.content or ""
        if len(text.strip()) >= 6:
            break
    assert len(text.strip()) >= 6, text
    stop = text.strip()[3:5]
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, seed=seed, stop=[stop])
    out = resp.choices[0].message.content or ""
    assert stop not in out
    assert text.startswith(out)
    assert resp.choices[0].finish_reason == "stop"


def test_tools_offered(client, shared_gateway, tiny_tokenizer):
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=10)
    assert raw.parse().choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The offered tool reaches the model: its schema is in the rendered prompt.
    [row] = calls(shared_gateway, f"id = '{raw.headers['x-clawgate-call-id']}'")
    prompt = tiny_tokenizer.decode(codec.unpack_ids(row["prompt_delta"]))
    assert '"name": "read_file"' in prompt and "Read a file" in prompt


def test_a_tool_call_reaches_the_sdk_as_tool_calls(gateway_factory, tiny_tokenizer):
    """A random model rarely calls a tool, so the call is scripted: the model's call comes back well-formed."""
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer)
    engine.push('<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>')
    client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)
    choice = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id
    assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"path": "a.txt"}


def test_unknown_model_raises_not_found(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert err.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny"},  # no messages
        {"model": "tiny", "messages": []},
        {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]},
        {"model": "tiny", "messages": MESSAGES, "temperature": 9},
        {"model": "tiny", "messages": MESSAGES, "n": 0},
        {
            "model": "tiny",
            "messages": MESSAGES,
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
    ],
)
def test_malformed_bodies_raise_bad_request(client, body):
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/chat/completions", body=body, cast_to=httpx.Response)
    assert err.value.status_code == 400
    assert err.value.body["type"] == "invalid_request_error"


def test_invalid_json_is_400(shared_gateway):
    r = httpx.post(
        shared_gateway.v1 + "/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_image_content_is_refused_clearly(client):
    with pytest.raises(openai.BadRequestError, match="text only"):
        client.chat.completions.create(
            model="tiny",
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
                }
            ],
        )


def test_over_long_prompt_is_400(client, shared_gateway):
    limit = shared_gateway.state.engine.max_model_len
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello " * limit}])
    assert err.value.body["code"] == "context_length_exceeded"


def test_unknown_fields_are_tolerated(client):
    resp = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=3,
        seed=0,
        extra_body={"some_vendor_field": {"x": 1}, "prompt_cache_key": "k"},
    )
    # Served as usual: seed 0 samples no end of turn in 3 tokens, so the answer runs to its max_tokens.
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 3 and choice.message.content


def test_server_side_cap(client, shared_gateway):
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10_000, temperature=0)
    # The greedy answer has no end of turn before the gateway's cap: it is cut there, not at the asked 10 000.
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == shared_gateway.settings.max_tokens


def test_completions_with_text_and_token_prompts(client, tiny_tokenizer):
    resp = client.completions.create(model="tiny", prompt="def main():", max_tokens=5, logprobs=1)
    assert resp.object == "text_completion"
    assert len(resp.choices[0].logprobs.token_logprobs) == resp.usage.completion_tokens
    ids = tiny_tokenizer.encode("import os", add_special_tokens=False)
    resp2 = client.completions.create(model="tiny", prompt=ids, max_tokens=4, extra_body={"return_token_ids": True})
    extra = resp2.choices[0].model_extra
    assert extra["prompt_token_ids"] == ids
    assert len(extra["token_ids"]) == resp2.usage.completion_tokens


def test_completion_token_ids_out_of_vocab(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=[10**9], max_tokens=2)


def test_models_health_metrics(client, shared_gateway):
    assert [m.id for m in client.models.list()] == ["tiny"]
    r = httpx.get(shared_gateway.url + "/health")
    assert r.status_code == 200 and r.json()["engine"]["ok"] is True
    m = httpx.get(shared_gateway.url + "/metrics").text
    assert "clawgate_calls_total" in m and "clawgate_drift_total" in m


def test_rollout_prefix_and_header_group_calls(shared_gateway):
    c = openai.OpenAI(base_url=shared_gateway.url + "/rollouts/ro-test-a/v1", api_key="x", max_retries=0)
    r1 = c.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert r1.headers["x-clawgate-rollout-id"] == "ro-test-a"
    c2 = openai.OpenAI(
        base_url=shared_gateway.v1, api_key="x", max_retries=0, default_headers={"X-Rollout-Id": "ro-test-b"}
    )
    r2 = c2.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert r2.headers["x-clawgate-rollout-id"] == "ro-test-b"
    rows = calls(shared_gateway, "rollout_id IN ('ro-test-a', 'ro-test-b')")
    assert {r["rollout_id"] for r in rows} == {"ro-test-a", "ro-test-b"}


def test_api_keys_enforced(gateway_factory):
    gw = gateway_factory(api_keys="k1,k2")
    bad = openai.OpenAI(base_url=gw.v1, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    good = openai.OpenAI(base_url=gw.v1, api_key="k2", max_retries=0)
    served = good.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert served.choices[0].message.role == "assistant" and served.usage.completion_tokens >= 1
    r = httpx.post(
        gw.v1 + "/chat/completions", json={"model": "tiny", "messages": MESSAGES}, headers={"x-api-key": "k1"}
    )
    assert r.status_code == 200


def test_completions_echo(client):
    resp = client.completions.create(model="tiny", prompt="def main():", max_tokens=3, echo=True)
    assert resp.choices[0].text.startswith("def main():")
    chunks = list(client.completions.create(model="tiny", prompt="x = 1", max_tokens=3, echo=True, stream=True))
    assert chunks[0].choices[0].text == "x = 1"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=3, echo=True, logprobs=1)
