"""tool_choice that forces a call, and one call per answer, are honoured, not just accepted: a forced call's opening
is appended to the prompt (the model continues inside the call), and one-call-per-answer stops the completion at the
end of its first call. Both keep the exact tokens: the next turn, echoing the call, is spliced onto them."""

from __future__ import annotations

import json

import httpx
import pytest
import sqlalchemy as sa

from gateway.store import codec
from gateway.store.db import connect
from tests.fakes import ScriptedEngine

TOOLS = [
    {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "cat", "parameters": {"type": "object"}}},
]
USER = [{"role": "user", "content": "list the files"}]


def stored_calls(gw, rollout: str) -> list[dict]:
    gw.flush()
    engine = connect(gw.settings.database_url)
    with engine.connect() as conn:
        query = sa.text("SELECT * FROM calls WHERE rollout_id = :r ORDER BY started_at")
        rows = [dict(r) for r in conn.execute(query, {"r": rollout}).mappings()]
    engine.dispose()
    return rows


@pytest.fixture
def gw_engine(gateway_factory, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer)
    return gateway_factory(engine=engine, tokenizer=tiny_tokenizer), engine


def test_a_named_tool_choice_puts_the_model_inside_that_call_and_the_next_turn_splices(gw_engine, tiny_tokenizer):
    gw, engine = gw_engine
    engine.push('{"path": "."}}\n</tool_call>')  # the model continues after '{"name": "ls", "arguments": '
    body = {
        "model": "tiny",
        "messages": USER,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "ls"}},
    }
    r = httpx.post(f"{gw.url}/rollouts/forced/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "ls" and json.loads(call["function"]["arguments"]) == {"path": "."}
    prompt = tiny_tokenizer.decode(engine.requests[-1].prompt_ids)
    assert prompt.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "ls", "arguments": ')

    # The client runs the tool and sends the result: spliced onto the raw tokens (forced opening included).
    engine.push("done")
    follow = {
        **body,
        "tool_choice": "auto",
        "messages": [*USER, message, {"role": "tool", "tool_call_id": call["id"], "content": "a.txt"}],
    }
    assert httpx.post(f"{gw.url}/rollouts/forced/v1/chat/completions", json=follow, timeout=30).status_code == 200
    first, second = stored_calls(gw, "forced")
    assert second["render_mode"] == "spliced" and second["parent_call_id"] == first["id"]
    # The forced opening is prompt (not sampled, never trained on); the completion is only what the model wrote.
    completion = tiny_tokenizer.decode(codec.unpack_ids(first["completion_ids"]))
    assert completion.startswith('{"path": "."}}') and "<tool_call>" not in completion
    assert tiny_tokenizer.decode(codec.unpack_ids(first["prompt_delta"])).endswith('{"name": "ls", "arguments": ')


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_a_required_call_is_forced_in_every_api(gw_engine, tiny_tokenizer, api):
    gw, engine = gw_engine
    engine.push('{"name": "cat", "arguments": {"file": "a"}}\n</tool_call>')
    if api == "chat":
        body = {"model": "tiny", "messages": USER, "tools": TOOLS, "tool_choice": "required"}
        r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=30)
        names = [c["function"]["name"] for c in r.json()["choices"][0]["message"]["tool_calls"]]
    elif api == "messages":
        tools = [{"name": t["function"]["name"], "input_schema": {"type": "object"}} for t in TOOLS]
        body = {"model": "tiny", "messages": USER, "tools": tools, "tool_choice": {"type": "any"}, "max_tokens": 64}
        r = httpx.post(gw.v1 + "/messages", json=body, timeout=30)
        assert r.json()["stop_reason"] == "tool_use"
        names = [b["name"] for b in r.json()["content"] if b["type"] == "tool_use"]
    else:
        tools = [{"type": "function", "name": t["function"]["name"], "parameters": {"type": "object"}} for t in TOOLS]
        body = {"model": "tiny", "input": "list the files", "tools": tools, "tool_choice": "required"}
        r = httpx.post(gw.v1 + "/responses", json=body, timeout=30)
        names = [o["name"] for o in r.json()["output"] if o["type"] == "function_call"]
        assert r.json()["tool_choice"] == "required"
    assert r.status_code == 200 and names == ["cat"], r.text
    assert tiny_tokenizer.decode(engine.requests[-1].prompt_ids).endswith("<|im_start|>assistant\n<tool_call>\n")


def test_one_call_per_answer_stops_after_the_first_call(gw_engine, tiny_tokenizer):
    gw, engine = gw_engine
    two_calls = "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {{}}}}\n</tool_call>' for n in ("ls", "cat"))
    for parallel in (True, False):
        engine.push(two_calls)
        body = {"model": "tiny", "messages": USER, "tools": TOOLS, "parallel_tool_calls": parallel}
        r = httpx.post(f"{gw.url}/rollouts/par-{parallel}/v1/chat/completions", json=body, timeout=30)
        names = [c["function"]["name"] for c in r.json()["choices"][0]["message"]["tool_calls"]]
        assert names == (["ls", "cat"] if parallel else ["ls"])
    [row] = stored_calls(gw, "par-False")
    completion = tiny_tokenizer.decode(codec.unpack_ids(row["completion_ids"]))
    assert completion.endswith("</tool_call>") and "cat" not in completion, "generation stopped, nothing hidden"
    assert row["finish_reason"] == "stop"

    # Anthropic's disable_parallel_tool_use, streamed: one tool_use block.
    engine.push(two_calls)
    tools = [{"name": t["function"]["name"], "input_schema": {"type": "object"}} for t in TOOLS]
    body = {
        "model": "tiny",
        "messages": USER,
        "tools": tools,
        "max_tokens": 64,
        "stream": True,
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
    }
    r = httpx.post(gw.v1 + "/messages", json=body, timeout=30)
    assert r.text.count('"type":"tool_use"') == 1 and '"stop_reason":"tool_use"' in r.text


def test_constraints_that_cannot_be_honoured_are_refused(gw_engine):
    gw, _ = gw_engine
    cases = [
        ("/chat/completions", {"model": "tiny", "messages": USER, "tool_choice": "required"}, "tool_choice"),
        ("/responses", {"model": "tiny", "input": "hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        # Output formats no grammar stands for, or a JSON schema format without its schema: refused, never answered
        # as free text.
        ("/chat/completions", {"model": "tiny", "messages": USER, "response_format": {"type": "xml"}}, "response_"),
        ("/responses", {"model": "tiny", "input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        (
            "/messages",
            {"model": "tiny", "messages": USER, "max_tokens": 8, "output_config": {"format": {"type": "json_schema"}}},
            "output_config.format",
        ),
        (
            "/messages",
            {"model": "tiny", "messages": USER, "max_tokens": 8, "output_config": {"format": {"type": "json_object"}}},
            "output_config.format",
        ),
    ]
    for path, body, param in cases:
        r = httpx.post(gw.v1 + path, json=body, timeout=30)
        assert r.status_code == 400 and param in r.text, r.text
    # Hints a harness sends on every call are accepted, and not echoed as if applied.
    hinted = {"model": "tiny", "input": "hi", "reasoning": {"effort": "low"}, "text": {"verbosity": "low"}}
    r = httpx.post(gw.v1 + "/responses", json=hinted, timeout=30)
    assert r.status_code == 200 and r.json()["reasoning"]["effort"] is None
    assert r.json()["text"] == {"format": {"type": "text"}}
    effort = {"model": "tiny", "messages": USER, "max_tokens": 8, "output_config": {"effort": "high"}}
    assert httpx.post(gw.v1 + "/messages", json=effort, timeout=30).status_code == 200


def test_the_real_model_continues_inside_a_forced_call(gateway_factory, tiny_tokenizer):
    """With the in-process engine on the real tiny model: the prompt it saw ends with the call's opening."""
    gw = gateway_factory(max_tokens=8)
    body = {"model": "tiny", "messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 8}
    r = httpx.post(f"{gw.url}/rollouts/real/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    [row] = stored_calls(gw, "real")
    assert tiny_tokenizer.decode(codec.unpack_ids(row["prompt_delta"])).endswith("<|im_start|>assistant\n<tool_call>\n")
    assert row["status"] == "ok" and row["completion_len"] >= 1


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_tool_choice_none_leaves_tool_call_syntax_as_text(gw_engine, api):
    gw, engine = gw_engine
    text = '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    engine.push(text)
    if api == "chat":
        body = {"model": "tiny", "messages": USER, "tools": TOOLS, "tool_choice": "none"}
        message = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=30).json()["choices"][0]["message"]
        assert not message.get("tool_calls") and "<tool_call>" in message["content"]
    else:
        tools = [{"type": "function", "name": "ls", "parameters": {"type": "object"}}]
        body = {"model": "tiny", "input": "list", "tools": tools, "tool_choice": "none"}
        output = httpx.post(gw.v1 + "/responses", json=body, timeout=30).json()["output"]
        assert [o["type"] for o in output] == ["message"] and "<tool_call>" in output[0]["content"][0]["text"]
