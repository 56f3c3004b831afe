"""The Responses API (`POST /v1/responses`) through the official openai SDK's `client.responses` and raw SSE.

Real tiny model for serving, streaming, tools, continuation and the harness fixtures; the scripted engine only for
what a random model cannot produce on demand (reasoning, tool calls, a failure mid-stream, exact event order).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy as sa

from gateway.core.conversation import Message, ToolCall, normalized
from gateway.protocols.responses.serving import to_messages
from gateway.protocols.responses.wire import ResponsesRequest, decode_reasoning, encode_reasoning
from gateway.store import codec
from gateway.store.db import connect
from tests.fakes import ScriptedEngine, SlowEngine
from tests.test_tito import assert_chain, drift_count, stored_calls

FIXTURES = Path(__file__).parent / "fixtures" / "harness-requests"

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "run",
        "description": "Run a shell command",
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"}},
            "required": ["cmd"],
        },
        "strict": False,
    }
]
UNSUPPORTED_TOOLS: list[dict[str, Any]] = [
    {"type": "web_search", "external_web_access": False},
    {
        "type": "namespace",
        "name": "multi_agent",
        "description": "Sub-agents.",
        "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object", "properties": {}}}],
    },
    {"type": "custom", "name": "exec_js", "description": "Run JavaScript", "format": {"type": "text"}},
    {"type": "local_shell"},
    {"type": "mcp", "server_label": "docs", "server_url": "http://127.0.0.1:9/mcp"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
]


@pytest.fixture(scope="module")
def client(shared_gateway):
    return openai.OpenAI(base_url=shared_gateway.v1, api_key="unused", max_retries=0)


def call_row(gw, call_id: str) -> dict[str, Any]:
    gw.flush()
    engine = connect(gw.settings.database_url)
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT * FROM calls WHERE id = :id"), {"id": call_id}).mappings().one()
    engine.dispose()
    return dict(row)


def sse_events(body: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of every server-sent event; each must have both lines."""
    out = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        assert set(lines) == {"event", "data"}, block
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def check_well_formed(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The event grammar every client relies on; returns the final response object."""
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.completed", names[-1]
    response_id = events[0][1]["response"]["id"]
    assert response_id.startswith("resp_")
    open_item: dict[str, Any] | None = None
    done_items: list[dict[str, Any]] = []
    for name, data in events[2:-1]:
        if name == "response.output_item.added":
            assert open_item is None and data["output_index"] == len(done_items)
            open_item = data["item"]
        elif name == "response.output_item.done":
            assert open_item is not None and data["item"]["id"] == open_item["id"]
            assert data["item"]["status"] == "completed"
            done_items.append(data["item"])
            open_item = None
        else:
            assert open_item is not None and data["item_id"] == open_item["id"], name
            assert data["output_index"] == len(done_items)
    assert open_item is None
    final = events[-1][1]["response"]
    assert final["id"] == response_id and final["status"] in ("completed", "incomplete")
    assert final["output"] == done_items
    usage = final["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] and usage["output_tokens"] >= 1
    return final


def collapsed(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Event names with runs of the same delta event counted once (how many deltas depends on tokenization)."""
    return [name for name, _ in itertools.groupby(name for name, _ in events)]


def post_stream(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    r = httpx.post(url, json={**body, "stream": True}, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return r


# --- translation (pure) ----------------------------------------------------------------------------------------
def items(raw: list[dict[str, Any]]) -> list[Any]:
    req = ResponsesRequest.model_validate({"model": "m", "input": raw})
    assert isinstance(req.input, list)
    return req.input


def test_items_to_messages_group_assistant_turns():
    messages = to_messages(
        items(
            [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
                {"role": "user", "content": "Do it."},
                {"type": "reasoning", "summary": [], "encrypted_content": encode_reasoning("Think first.")},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
                {"type": "function_call", "call_id": "c1", "name": "run", "arguments": '{"cmd": "ls"}'},
                {"type": "function_call", "call_id": "c2", "name": "run", "arguments": {"cmd": "pwd"}},
                {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "/"}]},
                {"type": "custom_tool_call", "call_id": "c3", "name": "exec", "input": "text(1)"},
                {"type": "custom_tool_call_output", "call_id": "c3", "output": "1"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Summed up."}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
            ]
        )
    )
    assert [m.role for m in messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    first = messages[2]
    assert (first.content, first.reasoning) == ("Looking.", "Think first.")
    assert [(tc.name, tc.arguments, tc.id) for tc in first.tool_calls] == [
        ("run", '{"cmd": "ls"}', "c1"),
        ("run", '{"cmd": "pwd"}', "c2"),
    ]
    assert [(m.tool_call_id, m.content) for m in messages[3:5]] == [("c1", "a.txt"), ("c2", "/")]
    assert messages[5].tool_calls == [ToolCall("exec", "text(1)", "c3")] and messages[5].content is None
    assert (messages[7].content, messages[7].reasoning) == ("Done.", "Summed up.")


def test_echoed_turn_normalizes_like_the_registered_answer():
    """The service registers Message(assistant, content, tool_calls=[name, arguments]): an echo with new ids,
    re-serialized arguments and a foreign reasoning blob must normalize the same."""
    registered = Message("assistant", content="Step one.", tool_calls=[ToolCall("run", '{"cmd": "ls", "timeout": 2}')])
    [echo] = to_messages(
        items(
            [
                {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAABnot-ours"},
                {"type": "message", "id": "msg_x", "role": "assistant", "content": "Step one.\n"},
                {
                    "type": "function_call",
                    "id": "fc_y",
                    "call_id": "z",
                    "name": "run",
                    "arguments": '{"timeout":2,"cmd":"ls"}',
                },
            ]
        )
    )
    assert normalized(echo) == normalized(registered)
    assert echo.reasoning is None  # another provider's encrypted reasoning cannot be read


def test_unreadable_reasoning_alone_makes_no_turn_and_unknown_items_are_skipped():
    messages = to_messages(
        items(
            [
                {"type": "additional_tools", "role": "developer", "tools": [{"type": "custom", "name": "exec"}]},
                {"role": "user", "content": "Hi."},
                {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},
                {"type": "item_reference", "id": "msg_1"},
                {"role": "user", "content": "Again."},
            ]
        )
    )
    assert [(m.role, m.content) for m in messages] == [("user", "Hi."), ("user", "Again.")]


def test_reasoning_codec_round_trip():
    text = 'Plan: ü, "quotes" and\nnewlines.'
    assert decode_reasoning(encode_reasoning(text)) == text
    assert decode_reasoning("gAAAAABhZ") is None
    assert decode_reasoning(base64.b64encode(b'{"text": "no tag"}').decode()) is None


# --- serving with the real tiny model --------------------------------------------------------------------------
def test_non_streaming_is_served_and_captured(client, shared_gateway, tiny_tokenizer):
    raw = client.responses.with_raw_response.create(
        model="tiny",
        instructions="You are terse.",
        input="Say something.",
        max_output_tokens=12,
        temperature=1.0,
        extra_body={"seed": 3},  # a seed whose answer is plain text (no reasoning, no immediate end of turn)
    )
    resp = raw.parse()
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == "tiny"
    assert resp.instructions == "You are terse." and resp.max_output_tokens == 12
    row = call_row(shared_gateway, raw.headers["x-clawgate-call-id"])
    assert row["status"] == "ok" and row["api"] == "responses"
    assert row["rollout_id"] == raw.headers["x-clawgate-rollout-id"]
    assert resp.status == ("incomplete" if row["finish_reason"] == "length" else "completed")
    assert resp.usage.output_tokens == row["completion_len"] and resp.usage.input_tokens == row["prompt_len"]
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
    expected = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert codec.unpack_ids(row["prompt_delta"]) == tiny_tokenizer.encode(expected, add_special_tokens=False)
    assert [item.type for item in resp.output] == ["message"]
    completion = tiny_tokenizer.decode(codec.unpack_ids(row["completion_ids"]), skip_special_tokens=True)
    assert resp.output_text and resp.output_text == completion.strip()


def test_streaming_through_the_sdk(client, shared_gateway):
    raw = client.responses.with_raw_response.create(
        model="tiny",
        input=[{"role": "user", "content": "Tell me a story."}],
        max_output_tokens=10,
        stream=True,
        extra_body={"seed": 3},  # a seed whose answer is text
    )
    events = list(raw.parse())
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed and streamed == final.output_text
    row = call_row(shared_gateway, raw.headers["x-clawgate-call-id"])
    assert row["status"] == "ok" and final.usage.output_tokens == row["completion_len"]


def test_function_tools_offered_and_unsupported_tools_ignored(client, shared_gateway, tiny_tokenizer):
    raw = client.responses.with_raw_response.create(
        model="tiny",
        input="List the files.",
        tools=TOOLS + UNSUPPORTED_TOOLS,
        tool_choice="auto",
        parallel_tool_calls=False,
        max_output_tokens=8,
    )
    resp = raw.parse()
    assert resp.status in ("completed", "incomplete")
    assert [t.type for t in resp.tools] == ["function", *(t["type"] for t in UNSUPPORTED_TOOLS)]
    row = call_row(shared_gateway, raw.headers["x-clawgate-call-id"])
    prompt = tiny_tokenizer.decode(codec.unpack_ids(row["prompt_delta"]))
    assert '"name": "run"' in prompt and "Run a shell command" in prompt
    for absent in ("web_search", "multi_agent", "spawn", "exec_js", "local_shell", "docs", "vs_1"):
        assert absent not in prompt


def test_previous_response_id_continues_the_stored_conversation(client, shared_gateway, tiny_tokenizer):
    first = client.responses.with_raw_response.create(
        model="tiny", instructions="Be brief.", input="Hello there.", max_output_tokens=8
    )
    r1 = first.parse()
    second = client.responses.with_raw_response.create(
        model="tiny", instructions="Be brief.", previous_response_id=r1.id, input="And then?", max_output_tokens=8
    )
    r2 = second.parse()
    assert r2.previous_response_id == r1.id
    row1 = call_row(shared_gateway, first.headers["x-clawgate-call-id"])
    row2 = call_row(shared_gateway, second.headers["x-clawgate-call-id"])
    assert second.headers["x-clawgate-rollout-id"] == first.headers["x-clawgate-rollout-id"]
    assert row2["parent_call_id"] == row1["id"] and row2["render_mode"] == "spliced"
    assert row2["prompt_prefix_len"] == row1["prompt_len"] + row1["completion_len"]
    prompt2 = tiny_tokenizer.decode(codec.unpack_ids(row2["prompt_delta"]))
    assert "And then?" in prompt2 and "Hello there." not in prompt2  # the earlier part is the parent's tokens
    # A third turn continues the second.
    r3 = client.responses.create(model="tiny", previous_response_id=r2.id, input="Go on.", max_output_tokens=4)
    assert r3.status in ("completed", "incomplete")


def test_previous_response_id_refused_for_unstored_and_unknown(client):
    unstored = client.responses.create(model="tiny", input="Hi.", store=False, max_output_tokens=4)
    assert unstored.store is False
    with pytest.raises(openai.BadRequestError, match="store=false") as err:
        client.responses.create(model="tiny", previous_response_id=unstored.id, input="More.")
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model="tiny", previous_response_id="resp_doesnotexist", input="More.")


def test_unknown_model_raises_not_found(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="no-such-model", input="Hi.")
    assert err.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny"},  # no input
        {"model": "tiny", "input": 5},
        {"model": "tiny", "input": [{"role": "wizard", "content": "hi"}]},
        {"model": "tiny", "input": []},
        {"model": "tiny", "input": "hi", "temperature": 9},
        {"model": "tiny", "input": "hi", "max_output_tokens": 0},
        {"model": "tiny", "input": "hi", "tools": [{"type": "function"}]},
        {"model": "tiny", "input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
        {"model": "tiny", "input": [{"type": "function_call", "name": "run", "arguments": "{}"}]},  # no call_id
        {"model": "tiny", "input": "hi", "background": True},
        {"model": "tiny", "input": [{"role": "user", "content": [{"type": "mystery_part", "text": "x"}]}]},
    ],
)
def test_malformed_bodies_raise_bad_request(client, body):
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/responses", body=body, cast_to=httpx.Response)
    assert err.value.body["type"] == "invalid_request_error"


def test_invalid_json_and_images_are_400(client, shared_gateway):
    r = httpx.post(shared_gateway.v1 + "/responses", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    with pytest.raises(openai.BadRequestError, match="text only"):
        client.responses.create(model="tiny", input=[{"role": "user", "content": [image]}])
    output = [{"type": "input_text", "text": "see:"}, image]
    with pytest.raises(openai.BadRequestError, match="text only"):
        client.responses.create(
            model="tiny",
            input=[
                {"role": "user", "content": "Look."},
                {"type": "function_call", "call_id": "c", "name": "view", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": output},
            ],
        )


def test_rollout_prefix_groups_calls(shared_gateway):
    c = openai.OpenAI(base_url=shared_gateway.url + "/rollouts/ro-resp/v1", api_key="x", max_retries=0)
    raw = c.responses.with_raw_response.create(model="tiny", input="Hi.", max_output_tokens=3)
    assert raw.headers["x-clawgate-rollout-id"] == "ro-resp"


# --- scripted: reasoning, tool calls, exact events, failures -------------------------------------------------
@pytest.fixture
def scripted(gateway_factory, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer)
    return gw, engine


def codex_echo(output: list[dict[str, Any]], turn: int) -> list[dict[str, Any]]:
    """Our output items as Codex sends them back: new ids, reasoning only as encrypted_content, and arguments
    re-serialized."""
    echoed: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "reasoning":
            echoed.append({"type": "reasoning", "summary": [], "encrypted_content": item["encrypted_content"]})
        elif item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            echoed.append(
                {
                    "type": "message",
                    "id": f"msg_echo{turn}",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text}],
                }
            )
        elif item["type"] == "function_call":
            args = json.loads(item["arguments"])
            echoed.append(
                {
                    "type": "function_call",
                    "id": f"fc_echo{turn}_{len(echoed)}",
                    "call_id": item["call_id"],
                    "name": item["name"],
                    "arguments": json.dumps(dict(reversed(list(args.items()))), separators=(",", ":")),
                    "status": "completed",
                }
            )
    return echoed


def test_codex_style_tool_loop_keeps_raw_tokens(scripted, tiny_tokenizer):
    """store:false, every input item re-sent with new ids, encrypted reasoning replayed: each call's stored prompt
    begins with the previous call's prompt + completion, and nothing drifts."""
    gw, engine = scripted
    client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0, default_headers={"session-id": "s-loop"})
    inputs: list[dict[str, Any]] = [
        {
            "type": "message",
            "id": "msg_dev",
            "role": "developer",
            "content": [{"type": "input_text", "text": "Agent."}],
        },
        {"type": "message", "id": "msg_u1", "role": "user", "content": [{"type": "input_text", "text": "List files."}]},
    ]
    common: dict[str, Any] = {
        "model": "tiny",
        "tools": TOOLS + UNSUPPORTED_TOOLS[:2],
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "reasoning": {"summary": "auto"},
        "prompt_cache_key": "s-loop",
    }
    for turn in range(5):
        # Turn 2 calls two tools at once; odd turns say something before calling.
        calls = [{"cmd": f"ls -{turn}", "timeout": turn}] + ([{"cmd": "pwd"}] if turn == 2 else [])
        if turn < 4:
            engine.push(
                f"<think>\nI should run step {turn}.\n</think>\n\n"
                + (f"Running step {turn}.\n" if turn % 2 else "")
                + "\n".join(f"<tool_call>\n{json.dumps({'name': 'run', 'arguments': c})}\n</tool_call>" for c in calls)
            )
        else:
            engine.push("<think>\nFinished.\n</think>\n\nAll done.")
        if turn % 2:  # Codex always streams; the plain path must keep the chain too
            raw = client.responses.with_raw_response.create(input=inputs, **common)
            resp = raw.parse()
        else:
            raw = client.responses.with_raw_response.create(input=inputs, stream=True, **common)
            events = list(raw.parse())
            assert events[-1].type == "response.completed"
            resp = events[-1].response
        assert raw.headers["x-clawgate-rollout-id"] == "codex-s-loop"
        output = resp.model_dump()["output"]
        reasoning = output[0]
        assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == (
            f"I should run step {turn}." if turn < 4 else "Finished."
        )
        assert decode_reasoning(reasoning["encrypted_content"]) == reasoning["content"][0]["text"]
        if turn < 4:
            made = [i for i in output if i["type"] == "function_call"]
            assert [i["type"] for i in output] == [
                "reasoning",
                *(["message"] if turn % 2 else []),
                *["function_call"] * len(calls),
            ]
            assert [json.loads(c["arguments"]) for c in made] == calls
            assert len({c["call_id"] for c in made}) == len(calls) and all(
                c["call_id"].startswith("call_") for c in made
            )
            inputs += codex_echo(output, turn)
            inputs += [{"type": "function_call_output", "call_id": c["call_id"], "output": f"out{turn}"} for c in made]
        else:
            assert resp.output_text == "All done."
    chain = stored_calls(gw, "codex-s-loop")
    assert len(chain) == 5
    assert chain[0][0].render_mode == "fresh"
    assert_chain(chain)
    assert drift_count(gw) == 0
    assert [r.prompt_ids for r in engine.requests] == [c[1] for c in chain]
    # Reasoning the harness only carried encrypted is in the prompt as the raw tokens that were generated.
    assert tiny_tokenizer.decode(chain[-1][1]).count("I should run step") == 4


def test_encrypted_reasoning_is_read_back_when_not_spliced(scripted, tiny_tokenizer):
    """A conversation moved to another rollout renders fresh: our encoded reasoning is decoded into the prompt."""
    gw, engine = scripted
    engine.push(
        '<think>\nCheck the disk.\n</think>\n\n<tool_call>\n{"name": "run", "arguments": {"cmd": "df"}}\n</tool_call>'
    )
    first = openai.OpenAI(base_url=gw.url + "/rollouts/ro-a/v1", api_key="x", max_retries=0)
    user = {"role": "user", "content": "Disk space?"}
    resp = first.responses.create(
        model="tiny",
        input=[user],
        tools=TOOLS,
        store=False,
        include=["reasoning.encrypted_content"],
    )
    output = resp.model_dump()["output"]
    call = output[-1]
    engine.push("Plenty.")
    other = openai.OpenAI(base_url=gw.url + "/rollouts/ro-b/v1", api_key="x", max_retries=0)
    fco = {"type": "function_call_output", "call_id": call["call_id"], "output": "90% free"}
    other.responses.create(model="tiny", input=[user, *codex_echo(output, 0), fco], tools=TOOLS)
    [(row, prompt, _)] = stored_calls(gw, "ro-b")
    assert row.render_mode == "fresh"
    assert "<think>\nCheck the disk.\n</think>" in tiny_tokenizer.decode(prompt)


def test_stream_event_order_for_a_text_answer(scripted):
    gw, engine = scripted
    engine.push("<think>\nPlan it.\n</think>\n\nHello there, friend.")
    r = post_stream(
        gw.v1 + "/responses",
        {"model": "tiny", "input": "Hi.", "include": ["reasoning.encrypted_content"]},
    )
    assert r.headers["x-clawgate-call-id"] and r.headers["x-clawgate-rollout-id"]
    events = sse_events(r.text)
    final = check_well_formed(events)
    assert collapsed(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    reasoning, message = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Plan it."}]
    assert decode_reasoning(reasoning["encrypted_content"]) == "Plan it."
    assert message["content"][0]["text"] == "Hello there, friend." and message["role"] == "assistant"
    deltas = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert deltas == "Hello there, friend."
    [text_done] = [d for n, d in events if n == "response.output_text.done"]
    assert text_done["text"] == "Hello there, friend."
    assert final["status"] == "completed" and final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0


def test_stream_event_order_for_a_function_call(scripted):
    gw, engine = scripted
    engine.push('<tool_call>\n{"name": "run", "arguments": {"cmd": "ls"}}\n</tool_call>')
    r = post_stream(gw.v1 + "/responses", {"model": "tiny", "input": "Files?", "tools": TOOLS})
    events = sse_events(r.text)
    final = check_well_formed(events)
    assert collapsed(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [call] = final["output"]
    assert call["type"] == "function_call" and call["name"] == "run" and call["id"].startswith("fc_")
    assert call["call_id"].startswith("call_") and json.loads(call["arguments"]) == {"cmd": "ls"}
    added = events[2][1]["item"]
    assert (added["call_id"], added["name"], added["status"]) == (call["call_id"], "run", "in_progress")


def test_error_after_stream_began_is_response_failed(scripted):
    gw, engine = scripted
    engine.push("one two three four five six", fail_after=3)
    r = post_stream(gw.url + "/rollouts/ro-rfail/v1/responses", {"model": "tiny", "input": "Hi."})
    events = sse_events(r.text)
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in names
    assert names[-1] == "response.failed" and "response.completed" not in names
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and "scripted failure" in failed["error"]["message"]
    [(row, _, completion)] = stored_calls(gw, "ro-rfail")
    assert row.status == "failed" and len(completion) == 3


def test_error_before_first_token_gets_a_status_code(scripted):
    gw, engine = scripted
    engine.push("never", fail_after=0)
    client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:
        list(client.responses.create(model="tiny", input="Hi.", stream=True))
    assert err.value.status_code == 502


async def test_client_disconnect_mid_stream_is_recorded_cancelled(gateway_factory, tiny_tokenizer):
    engine = SlowEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer)
    engine.push(" ".join(["word"] * 60))
    url = gw.url + "/rollouts/ro-rgone/v1/responses"
    body = {"model": "tiny", "input": "Hi.", "stream": True}
    async with httpx.AsyncClient(timeout=30) as c, c.stream("POST", url, json=body) as r:
        deltas = 0
        async for line in r.aiter_lines():
            deltas += "response.output_text.delta" in line
            if deltas >= 6:
                break
    for _ in range(100):
        if got := stored_calls(gw, "ro-rgone"):
            break
        await asyncio.sleep(0.05)
    [(row, _, completion)] = got
    assert row.status == "cancelled" and 0 < len(completion) < 61


# --- real harness requests -------------------------------------------------------------------------------------
REPLAYED_HEADERS = ("session-id", "thread-id", "originator", "user-agent", "accept", "content-type", "traceparent")


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


@pytest.mark.parametrize(
    "name",
    [
        "codex/01-first-turn-responses-custom-model.json",
        "codex/02-after-tool-result-responses-custom-model.json",
        "codex/03-known-model-codemode-after-custom-tool-call.json",
        "openclaw/02-responses-after-tool-result.json",
    ],
)
def test_harness_requests_replay(any_model_gateway, name):
    captured = fixture(name)
    headers = {k: v for k, v in captured["headers"].items() if k in REPLAYED_HEADERS}
    r = post_stream(any_model_gateway.v1 + "/responses", captured["body"], headers)
    events = sse_events(r.text)
    final = check_well_formed(events)
    assert final["model"] == captured["body"]["model"] and final["store"] is False
    assert "response.failed" not in [n for n, _ in events]
    session = captured["headers"].get("session-id")
    if session is not None:  # Codex: one rollout per Codex session
        assert r.headers["x-clawgate-rollout-id"] == f"codex-{session}"
    row = call_row(any_model_gateway, r.headers["x-clawgate-call-id"])
    assert row["status"] == "ok" and row["api"] == "responses"
