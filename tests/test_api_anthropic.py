"""The Anthropic Messages API through the official `anthropic` SDK (and raw SSE where the exact event order
matters): the real tiny model for serving, capture, count_tokens and errors; a scripted engine for thinking and
tool-use output a random model cannot produce; token-in-token-out across echoed turns; and replays of real
Claude Code and OpenClaw request bodies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import sqlalchemy as sa

from gateway.core.conversation import Message, ToolCall, normalized
from gateway.protocols.anthropic.serving import to_messages
from gateway.protocols.anthropic.wire import MessagesRequest
from gateway.store import codec
from gateway.store.db import connect
from tests.conftest import LiveGateway
from tests.fakes import ScriptedEngine
from tests.test_tito import assert_chain, drift_count, stored_calls

FIXTURES = Path(__file__).parent / "fixtures" / "harness-requests"
SYSTEM = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
USER = [{"role": "user", "content": "Say something."}]
TOOLS = [
    {
        "name": "run",
        "description": "Run a shell command",
        "input_schema": {
            "type": "object",
            "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"}},
            "required": ["cmd"],
        },
    }
]


def rows(gw: LiveGateway, where: str) -> list[dict[str, Any]]:
    gw.flush()
    engine = connect(gw.settings.database_url)
    with engine.connect() as conn:
        found = conn.execute(sa.text(f"SELECT * FROM calls WHERE {where} ORDER BY started_at")).mappings().all()
    engine.dispose()
    return [dict(r) for r in found]


def sse(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) pairs of an SSE response, checking the `event:`/`data:` framing."""
    events: list[tuple[str, dict[str, Any]]] = []
    name: str | None = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            assert name is None, "two event lines without data"
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            assert name is not None, "data line without an event line"
            events.append((name, json.loads(line[len("data: ") :])))
            name = None
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


DELTA_FOR_BLOCK = {
    "text": {"text_delta"},
    "thinking": {"thinking_delta", "signature_delta"},
    "tool_use": {"input_json_delta"},
}


def check_well_formed(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Asserts the Messages stream grammar; returns the blocks' start payloads in order."""
    for name, data in events:
        assert data["type"] == name
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    start = events[0][1]["message"]
    assert start["content"] == [] and start["id"].startswith("msg_") and start["usage"]["input_tokens"] > 0
    blocks: list[dict[str, Any]] = []
    open_block: dict[str, Any] | None = None
    for name, data in events[1:-2]:
        if name == "ping":
            continue
        if name == "content_block_start":
            assert open_block is None and data["index"] == len(blocks)
            open_block = data["content_block"]
            blocks.append(open_block)
        elif name == "content_block_delta":
            assert open_block is not None and data["index"] == len(blocks) - 1
            assert data["delta"]["type"] in DELTA_FOR_BLOCK[open_block["type"]]
        elif name == "content_block_stop":
            assert open_block is not None and data["index"] == len(blocks) - 1
            open_block = None
        else:
            raise AssertionError(f"unexpected event {name} inside the message")
    assert open_block is None
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    assert delta["usage"]["output_tokens"] >= 0
    return blocks


@pytest.fixture(scope="module")
def client(shared_gateway: LiveGateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=shared_gateway.url, api_key="unused", max_retries=0)


@pytest.fixture
def scripted(gateway_factory: Any, tiny_tokenizer: Any) -> tuple[LiveGateway, ScriptedEngine]:
    engine = ScriptedEngine(tiny_tokenizer)
    return gateway_factory(engine=engine, tokenizer=tiny_tokenizer), engine


# --- the real tiny model -------------------------------------------------------------------------------------
def test_non_streaming_is_served_and_captured(client, shared_gateway, tiny_tokenizer):
    raw = client.messages.with_raw_response.create(
        # This SDK version no longer has sampling parameters; older clients still send them.
        model="tiny",
        system=SYSTEM,
        messages=USER,
        max_tokens=12,
        extra_body={"temperature": 1.0},
    )
    msg = raw.parse()
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
    assert msg.id.startswith("msg_")
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= msg.usage.output_tokens <= 12
    call_id = raw.headers["x-clawgate-call-id"]
    [row] = rows(shared_gateway, f"id = '{call_id}'")
    assert row["status"] == "ok" and row["api"] == "messages"
    assert row["rollout_id"] == raw.headers["x-clawgate-rollout-id"]
    assert row["prompt_len"] == msg.usage.input_tokens and row["completion_len"] == msg.usage.output_tokens
    # The stored prompt is the chat template's rendering of the translated conversation.
    expected = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are terse."}, *USER], tokenize=False, add_generation_prompt=True
    )
    assert codec.unpack_ids(row["prompt_delta"]) == tiny_tokenizer.encode(expected, add_special_tokens=False)
    text = "".join(b.text for b in msg.content if b.type == "text")
    decoded = tiny_tokenizer.decode(codec.unpack_ids(row["completion_ids"]), skip_special_tokens=True)
    assert text and text == decoded.strip()


def test_streaming_is_served_and_captured(shared_gateway):
    client = anthropic.Anthropic(
        base_url=shared_gateway.url, api_key="x", max_retries=0, default_headers={"X-Rollout-Id": "ro-anth-stream"}
    )
    with client.messages.stream(model="tiny", system="Be brief.", messages=USER, max_tokens=10) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    deltas = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert "".join(b.text for b in final.content if b.type == "text") == deltas
    [row] = rows(shared_gateway, "rollout_id = 'ro-anth-stream'")
    assert row["status"] == "ok" and row["api"] == "messages"
    assert row["completion_len"] == final.usage.output_tokens and row["prompt_len"] == final.usage.input_tokens


def test_raw_stream_is_well_formed(shared_gateway):
    body = {"model": "tiny", "messages": USER, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", shared_gateway.url + "/v1/messages?beta=true", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-clawgate-call-id"]
        events = sse(r)
    check_well_formed(events)
    assert [n for n, _ in events][:2] == ["message_start", "ping"]


def test_tools_server_tools_and_unknown_fields(client, shared_gateway, tiny_tokenizer):
    """Client tools reach the prompt; server tools are left out; Claude Code's extra fields are tolerated."""
    tools = [
        *TOOLS,
        {"name": "later", "description": "Deferred", "input_schema": {"type": "object"}, "defer_loading": True},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
    ]
    raw = client.messages.with_raw_response.create(
        model="tiny",
        messages=USER,
        tools=tools,
        tool_choice={"type": "auto"},
        max_tokens=6,
        thinking={"type": "enabled", "budget_tokens": 1024},
        metadata={"user_id": "u1"},
        stop_sequences=["\n\n\n"],
        output_config={"effort": "low"},
        extra_body={"context_management": {"edits": []}, "top_k": 40, "top_p": 0.95, "temperature": 0.7},
    )
    assert raw.parse().stop_reason in ("end_turn", "max_tokens", "tool_use", "stop_sequence")
    [row] = rows(shared_gateway, f"id = '{raw.headers['x-clawgate-call-id']}'")
    prompt = tiny_tokenizer.decode(codec.unpack_ids(row["prompt_delta"]))
    assert '"name": "run"' in prompt and '"name": "later"' in prompt and "web_search" not in prompt


def test_count_tokens_equals_stored_prompt_length(client, shared_gateway):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hi."}, {"type": "text", "text": "List files."}]},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "run", "input": {"cmd": "ls"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"}]},
    ]
    counted = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=messages, tools=TOOLS)
    raw = client.messages.with_raw_response.create(
        model="tiny", system=SYSTEM, messages=messages, tools=TOOLS, max_tokens=4
    )
    [row] = rows(shared_gateway, f"id = '{raw.headers['x-clawgate-call-id']}'")
    assert counted.input_tokens == row["prompt_len"] == raw.parse().usage.input_tokens
    # Under the rollout prefix too, and a different conversation counts differently.
    other = anthropic.Anthropic(base_url=shared_gateway.url + "/rollouts/ro-count", api_key="x", max_retries=0)
    assert other.messages.count_tokens(model="tiny", messages=USER).input_tokens < counted.input_tokens
    # A conversation that ends with an answer can be counted (it cannot be continued: no prefill).
    answered = [*USER, {"role": "assistant", "content": "Sure."}]
    assert client.messages.count_tokens(model="tiny", messages=answered).input_tokens > 0


# --- errors --------------------------------------------------------------------------------------------------
def _is_anthropic_error(body: Any, kind: str) -> None:
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]


def test_unknown_model_is_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-opus-5-5", messages=USER, max_tokens=4)
    _is_anthropic_error(err.value.body, "not_found_error")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-opus-5-5", messages=USER)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny", "max_tokens": 4},  # no messages
        {"model": "tiny", "max_tokens": 4, "messages": []},
        {"model": "tiny", "max_tokens": 4, "messages": [{"role": "wizard", "content": "hi"}]},
        {"model": "tiny", "max_tokens": 0, "messages": USER},
        {"model": "tiny", "max_tokens": 4, "messages": USER, "temperature": 1.5},
        {"model": "tiny", "max_tokens": 4, "messages": USER, "tool_choice": {"type": "tool", "name": "nope"}},
        {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_use"}]}]},
        {"model": "tiny", "max_tokens": 4, "messages": [*USER, {"role": "assistant", "content": "Sure"}]},
    ],
)
def test_malformed_bodies_are_bad_requests(client, body):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.post("/v1/messages", body=body, cast_to=httpx.Response)
    _is_anthropic_error(err.value.body, "invalid_request_error")


def test_invalid_json_is_400(shared_gateway):
    r = httpx.post(
        shared_gateway.url + "/v1/messages", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    _is_anthropic_error(r.json(), "invalid_request_error")


@pytest.mark.parametrize("kind", ["image", "document"])
def test_images_and_documents_are_refused_clearly(client, kind):
    block = {"type": kind, "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError, match="text only"):
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [block]}])
    inside_result = {"type": "tool_result", "tool_use_id": "t", "content": [block]}
    with pytest.raises(anthropic.BadRequestError, match="text only"):
        client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": [inside_result]}])


def test_over_long_prompt_is_400(client, shared_gateway):
    limit = shared_gateway.state.engine.max_model_len
    with pytest.raises(anthropic.BadRequestError, match="maximum context length") as err:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hello " * limit}])
    _is_anthropic_error(err.value.body, "invalid_request_error")


def test_api_keys_x_api_key_and_bearer(gateway_factory, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, api_keys="k1,k2")
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=gw.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", messages=USER, max_tokens=4
        )
    _is_anthropic_error(err.value.body, "authentication_error")
    engine.push("Hello.")
    good = anthropic.Anthropic(base_url=gw.url, api_key="k2", max_retries=0)  # sends x-api-key
    assert good.messages.create(model="tiny", messages=USER, max_tokens=4).content[0].text == "Hello."
    bearer = anthropic.Anthropic(base_url=gw.url, auth_token="k1", max_retries=0)
    assert bearer.messages.count_tokens(model="tiny", messages=USER).input_tokens > 0


def test_error_after_the_stream_began_is_an_error_event(scripted):
    gw, engine = scripted
    engine.push("Some words that will not all arrive.", fail_after=3)
    body = {"model": "tiny", "messages": USER, "max_tokens": 32, "stream": True}
    with httpx.stream("POST", gw.url + "/rollouts/ro-fail/v1/messages", json=body) as r:
        assert r.status_code == 200
        events = sse(r)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-1] == "error" and "message_stop" not in names
    _is_anthropic_error(events[-1][1], "api_error")
    [row] = rows(gw, "rollout_id = 'ro-fail'")
    assert row["status"] == "failed"
    # The SDK raises on the error event.
    engine.push("again", fail_after=1)
    client = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0)
    with (
        pytest.raises(anthropic.APIStatusError),
        client.messages.stream(model="tiny", messages=USER, max_tokens=8) as s,
    ):
        s.get_final_message()


# --- thinking and tool use (scripted output) -----------------------------------------------------------------
SCRIPT = (
    "<think>\nThe user wants files.\n</think>\n\nI'll look.\n<tool_call>\n"
    '{"name": "run", "arguments": {"cmd": "ls", "timeout": 5}}\n</tool_call>\n<tool_call>\n'
    '{"name": "run", "arguments": {"cmd": "pwd"}}\n</tool_call>'
)


def test_thinking_text_and_tool_use_blocks(scripted):
    gw, engine = scripted
    client = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0)
    engine.push(SCRIPT)
    msg = client.messages.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=200)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use", "tool_use"]
    thinking, text, first, second = msg.content
    assert thinking.thinking == "The user wants files." and thinking.signature
    assert text.text == "I'll look."
    assert (first.name, first.input, second.input) == ("run", {"cmd": "ls", "timeout": 5}, {"cmd": "pwd"})
    assert first.id.startswith("toolu_") and first.id != second.id
    assert msg.stop_reason == "tool_use" and msg.stop_sequence is None
    # The SDK's stream accumulator builds the same message from the events.
    engine.push(SCRIPT)
    with client.messages.stream(model="tiny", messages=USER, tools=TOOLS, max_tokens=200) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude={"id", "signature"}) for b in final.content] == [
        b.model_dump(exclude={"id", "signature"}) for b in msg.content
    ]
    assert final.stop_reason == "tool_use" and final.content[0].signature


def test_stream_event_sequence_exactly(scripted):
    gw, engine = scripted
    engine.push(SCRIPT)
    body = {"model": "tiny", "messages": USER, "tools": TOOLS, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", gw.url + "/v1/messages?beta=true", json=body) as r:
        events = sse(r)
    blocks = check_well_formed(events)
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use", "tool_use"]
    # The order of events, with runs of the same delta collapsed.
    order: list[str] = []
    for name, data in events:
        step = name
        if name == "content_block_start":
            step += ":" + data["content_block"]["type"]
        elif name == "content_block_delta":
            step += ":" + data["delta"]["type"]
            if order and order[-1] == step:
                continue
        order.append(step)
    assert order == [
        "message_start",
        "ping",
        "content_block_start:thinking",
        "content_block_delta:thinking_delta",
        "content_block_delta:signature_delta",
        "content_block_stop",
        "content_block_start:text",
        "content_block_delta:text_delta",
        "content_block_stop",
        "content_block_start:tool_use",
        "content_block_delta:input_json_delta",
        "content_block_stop",
        "content_block_start:tool_use",
        "content_block_delta:input_json_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    thinking = "".join(d["delta"].get("thinking", "") for n, d in events if n == "content_block_delta")
    assert thinking == "The user wants files."
    partial = [d["delta"]["partial_json"] for n, d in events if d.get("index") == 2 and n == "content_block_delta"]
    assert json.loads("".join(partial)) == {"cmd": "ls", "timeout": 5}
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    [row] = rows(gw, "1=1")
    assert events[-2][1]["usage"]["output_tokens"] == row["completion_len"]


def test_thinking_display_omitted_keeps_the_signature(scripted):
    gw, engine = scripted
    client = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0)
    engine.push("<think>\nsecret plan\n</think>\n\nHi.")
    msg = client.messages.create(
        model="tiny", messages=USER, max_tokens=50, thinking={"type": "adaptive", "display": "omitted"}
    )
    assert msg.content[0].type == "thinking" and msg.content[0].thinking == "" and msg.content[0].signature
    assert msg.content[1].text == "Hi." and msg.stop_reason == "end_turn"


def test_stop_sequence_and_tool_choice_none(scripted):
    gw, engine = scripted
    client = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0)
    engine.push("alpha beta STOP gamma")
    msg = client.messages.create(model="tiny", messages=USER, max_tokens=50, stop_sequences=["zzz", "STOP"])
    assert msg.content[0].text == "alpha beta" and msg.stop_reason == "stop_sequence" and msg.stop_sequence == "STOP"
    engine.push("x" * 200, end=False)
    assert client.messages.create(model="tiny", messages=USER, max_tokens=5).stop_reason == "max_tokens"
    # tool_choice none: tool-call syntax stays text.
    engine.push('<tool_call>\n{"name": "run", "arguments": {"cmd": "ls"}}\n</tool_call>')
    msg = client.messages.create(model="tiny", messages=USER, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=100)
    assert [b.type for b in msg.content] == ["text"] and "<tool_call>" in msg.content[0].text
    assert msg.stop_reason == "end_turn"


# --- translation -----------------------------------------------------------------------------------------------
def test_translation_of_a_mixed_conversation():
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B", "cache_control": {}}],
            "messages": [
                {"role": "user", "content": "one"},
                {"role": "user", "content": [{"type": "text", "text": "two"}]},
                {"role": "system", "content": "mid"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "redacted_thinking", "data": "xx"},
                        {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                        {"type": "text", "text": "ok"},
                        {"type": "tool_use", "id": "t1", "name": "run", "input": {"cmd": "ls"}},
                    ],
                },
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "run", "input": {}}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a"}]},
                        {"type": "tool_result", "tool_use_id": "t2", "content": "boom", "is_error": True},
                        {"type": "text", "text": "extra"},
                    ],
                },
            ],
        }
    )
    out = to_messages(req)
    assert [m.role for m in out] == ["system", "user", "system", "assistant", "tool", "tool", "user"]
    assert out[0].content == "A\nB" and out[1].content == "one\ntwo" and out[2].content == "mid"
    assistant = out[3]
    assert assistant.content == "ok" and assistant.reasoning == "hmm"
    assert [(c.name, json.loads(c.arguments), c.id) for c in assistant.tool_calls] == [
        ("run", {"cmd": "ls"}, "t1"),
        ("run", {}, "t2"),
    ]
    assert (out[4].content, out[4].tool_call_id, out[4].name) == ("a", "t1", "run")
    assert out[5].content == "Error: boom" and out[6].content == "extra"


def test_echoed_turn_normalizes_like_the_registered_answer():
    """What the service registers for an answer equals the translation of the client's echo of it."""
    answer = Message(role="assistant", content="I'll look.", tool_calls=[ToolCall("run", '{"cmd": "ls", "n": 1}')])
    echo = MessagesRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "private", "signature": "s"},
                        {"type": "text", "text": " I'll look. "},
                        {"type": "tool_use", "id": "toolu_rewritten", "name": "run", "input": {"n": 1.0, "cmd": "ls"}},
                    ],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_rewritten"}]},
            ],
        }
    )
    assert normalized(to_messages(echo)[1]) == normalized(answer)


# --- token-in-token-out --------------------------------------------------------------------------------------
def test_tito_across_echoed_tool_use_turns(scripted, tiny_tokenizer):
    """Thinking + tool_use answers echoed with tool-use ids rewritten, thinking replayed (with its signature),
    dropped or redacted, is_error results and extra user text: every call splices the raw ids of the last."""
    gw, engine = scripted
    client = anthropic.Anthropic(base_url=gw.url + "/rollouts/ro-anth-tito", api_key="x", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "List files."}]
    turns = 5
    for turn in range(turns):
        if turn < turns - 1:
            engine.push(
                f"<think>\nStep {turn}: I should list.\n</think>\n\nRunning step {turn}.\n<tool_call>\n"
                f'{{"name": "run", "arguments": {{"cmd": "ls -{turn}", "timeout": {turn}}}}}\n</tool_call>'
            )
        else:
            engine.push("All done.")
        kwargs: dict[str, Any] = {"model": "tiny", "system": SYSTEM, "messages": messages, "tools": TOOLS}
        if turn % 2:
            with client.messages.stream(max_tokens=100, **kwargs) as stream:
                msg = stream.get_final_message()
        else:
            msg = client.messages.create(max_tokens=100, **kwargs)
        if turn == turns - 1:
            assert msg.content[0].text == "All done."
            break
        assert msg.stop_reason == "tool_use"
        echo: list[dict[str, Any]] = []
        new_id = ""
        for block in msg.content:
            if block.type == "thinking":
                if turn % 3 == 0:  # replayed with its signature
                    echo.append({"type": "thinking", "thinking": block.thinking, "signature": block.signature})
                elif turn % 3 == 1:  # replaced by an opaque block
                    echo.append({"type": "redacted_thinking", "data": "opaque"})
                # else dropped
            elif block.type == "text":
                echo.append({"type": "text", "text": block.text})
            elif block.type == "tool_use":
                new_id = block.id.replace("_", "")  # OpenClaw rewrites toolu_abc -> tooluabc
                echo.append(
                    {"type": "tool_use", "id": new_id, "name": block.name, "input": dict(reversed(block.input.items()))}
                )
        messages.append({"role": "assistant", "content": echo})
        user: list[dict[str, Any]] = [
            {"type": "tool_result", "tool_use_id": new_id, "content": f"file{turn}.txt", "is_error": turn == 2}
        ]
        if turn % 2:
            user.append({"type": "text", "text": "<context>nothing new</context>"})
        messages.append({"role": "user", "content": user})
    chain = stored_calls(gw, "ro-anth-tito")
    assert len(chain) == turns
    assert chain[0][0].render_mode == "fresh"
    assert_chain(chain)
    assert drift_count(gw) == 0
    # Reasoning the client dropped is still in the prompt as the raw generated tokens.
    assert tiny_tokenizer.decode(chain[-1][1]).count("I should list.") == turns - 1
    assert [r.prompt_ids for r in engine.requests] == [c[1] for c in chain]


def _fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def _harness_headers(recorded: dict[str, str]) -> dict[str, str]:
    keep = {"x-claude-code-session-id", "x-claude-code-agent-id", "x-claude-code-parent-agent-id"}
    return {k: v for k, v in recorded.items() if k.lower() in keep}


def test_claude_code_second_turn_splices_the_first(gateway_factory, tiny_tokenizer):
    """Claude Code's real turn 2 (its echo of our tool call, then the tool result) continues turn 1 exactly."""
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, model_aliases="*")
    first, second = (
        _fixture("claude-code/01-first-turn-messages.json"),
        _fixture("claude-code/02-after-tool-result-messages.json"),
    )
    # What the recording server answered to turn 1, which Claude Code echoed in turn 2.
    engine.push(
        "I'll run a command.\n<tool_call>\n"
        + json.dumps({"name": "Bash", "arguments": {"command": "echo hi"}})
        + "\n</tool_call>"
    )
    engine.push("done")
    rollout = None
    for recorded in (first, second):
        with httpx.stream(
            "POST",
            gw.url + "/v1/messages?beta=true",
            json=recorded["body"],
            headers={**_harness_headers(recorded["headers"]), "x-api-key": "test"},
            timeout=120,
        ) as r:
            assert r.status_code == 200
            rollout = r.headers["x-clawgate-rollout-id"]
            check_well_formed(sse(r))
    assert rollout == "claude-code-" + first["headers"]["X-Claude-Code-Session-Id"]
    chain = stored_calls(gw, rollout)
    assert [c[0].render_mode for c in chain] == ["fresh", "spliced"]
    assert_chain(chain)
    assert drift_count(gw) == 0


# --- real harness requests against the real tiny model -----------------------------------------------------
HARNESS_FIXTURES = [
    "claude-code/01-first-turn-messages.json",
    "claude-code/02-after-tool-result-messages.json",
    "claude-code/03-subagent-request-messages.json",
    "openclaw/03-anthropic-messages-after-tool-result.json",
]


@pytest.mark.parametrize("name", HARNESS_FIXTURES)
def test_harness_request_replays(any_model_gateway, name):
    recorded = _fixture(name)
    assert recorded["path"] == "/v1/messages" and recorded["body"]["stream"] is True
    query = f"?{recorded['raw_query']}" if recorded["raw_query"] else ""
    headers = {**_harness_headers(recorded["headers"]), "x-api-key": "test"}
    with httpx.stream(
        "POST", any_model_gateway.url + "/v1/messages" + query, json=recorded["body"], headers=headers, timeout=300
    ) as r:
        assert r.status_code == 200, r.read()
        events = sse(r)
        call_id = r.headers["x-clawgate-call-id"]
        rollout = r.headers["x-clawgate-rollout-id"]
    check_well_formed(events)
    assert events[-2][1]["usage"]["output_tokens"] <= 8  # the server cap, whatever the body asked for
    [row] = rows(any_model_gateway, f"id = '{call_id}'")
    assert row["status"] == "ok" and row["model"] == recorded["body"]["model"]
    assert row["prompt_len"] == events[0][1]["message"]["usage"]["input_tokens"] > 5000
    session = {k.lower(): v for k, v in recorded["headers"].items()}.get("x-claude-code-session-id")
    if session:
        assert rollout == f"claude-code-{session}"
    agent = {k.lower(): v for k, v in recorded["headers"].items()}.get("x-claude-code-agent-id")
    assert bool(row["is_subagent"]) is (agent is not None)
    assert row["agent_id"] == agent
