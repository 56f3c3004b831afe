"""A turn's next state: found in the next request of all three APIs (real harness requests), recorded on the turn
(`next_call_id`), and read by the tool-error rule."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.core.conversation import Message
from gateway.core.next_state import RULE_SOURCE, next_state, tool_errors
from gateway.protocols.anthropic import serving as messages_serving
from gateway.protocols.anthropic.wire import MessagesRequest
from gateway.protocols.openai import chat as chat_serving
from gateway.protocols.openai.wire import ChatCompletionRequest
from gateway.protocols.responses import serving as responses_serving
from gateway.protocols.responses.wire import ResponsesRequest
from gateway.store.db import connect
from gateway.store.models import Call, Reward
from tests.fakes import ScriptedEngine

FIXTURES = Path(__file__).parent / "fixtures" / "harness-requests"


def body(path: str) -> dict[str, Any]:
    return dict(json.loads((FIXTURES / path).read_text())["body"])


def conversation(api: str, raw: dict[str, Any]) -> list[Message]:
    """A request as the gateway's internal messages (what the service sees)."""
    if api == "chat":
        return chat_serving.to_messages(ChatCompletionRequest.model_validate(raw).messages)
    if api == "messages":
        return messages_serving.to_messages(MessagesRequest.model_validate(raw))
    req = ResponsesRequest.model_validate(raw)
    assert not isinstance(req.input, str) and req.input is not None
    return responses_serving.to_messages(req.input)


def last_assistant(messages: list[Message]) -> int:
    return max(i for i, m in enumerate(messages) if m.role == "assistant")


CASES = [
    # (fixture, api, the tool output the next state starts with, whether a user message follows the results)
    ("openclaw/01-chat-completions-after-tool-result.json", "chat", "hi", True),
    ("openclaw/02-responses-after-tool-result.json", "responses", "hi", False),
    ("openclaw/03-anthropic-messages-after-tool-result.json", "messages", "hi", True),
    ("claude-code/02-after-tool-result-messages.json", "messages", "hi", False),
    ("codex/02-after-tool-result-responses-custom-model.json", "responses", "Chunk ID", False),
    ("codex/03-known-model-codemode-after-custom-tool-call.json", "responses", "Script completed", False),
]


@pytest.mark.parametrize(("path", "api", "output", "user_after"), CASES, ids=[c[0] for c in CASES])
def test_next_state_of_a_real_harness_request_is_what_followed_the_answer(path, api, output, user_after):
    messages = conversation(api, body(path))
    k = last_assistant(messages)
    assert messages[k].tool_calls, "the fixtures continue an answer that called a tool"
    state = next_state(messages, k)
    assert state and state[0].role == "tool" and (state[0].content or "").startswith(output)
    assert state[0].tool_call_id == messages[k].tool_calls[0].id
    assert [m.role for m in state[1:]] == (["user"] if user_after else [])
    assert tool_errors(state) == [], "a successful tool result is no error"
    assert next_state(messages, -1) == [], "nothing spliced: no parent turn, no next state"


def test_anthropic_is_error_marks_the_tool_result_failed():
    raw = body("claude-code/02-after-tool-result-messages.json")
    raw["messages"][-1]["content"][0]["is_error"] = True
    messages = conversation("messages", raw)
    state = next_state(messages, last_assistant(messages))
    errors = tool_errors(state)
    assert [(e.why, e.tool_call_id) for e in errors] == [("marked as an error", "toolu_7bb3a3ccd25740c98636d0f5")]
    assert state[0].content == "Error: hi", "the model still reads the error the way the API translation writes it"


def test_a_failed_responses_output_and_a_nonzero_exit_status_are_errors():
    raw = body("openclaw/02-responses-after-tool-result.json")
    raw["input"][-1]["status"] = "incomplete"
    messages = conversation("responses", raw)
    assert [e.why for e in tool_errors(next_state(messages, last_assistant(messages)))] == ["marked as an error"]

    codex = body("codex/02-after-tool-result-responses-custom-model.json")
    codex["input"][-1]["output"] = codex["input"][-1]["output"].replace("exited with code 0", "exited with code 2")
    messages = conversation("responses", codex)
    errors = tool_errors(next_state(messages, last_assistant(messages)))
    assert [e.why for e in errors] == ["exit code 2"] and "Process exited with code 2" in errors[0].excerpt


def test_tool_errors_only_reads_tool_results():
    state = [
        Message(role="user", content="Exit code: 3"),  # a user quoting an exit status is not a tool result
        Message(role="tool", content="ok\nExit code: 0", tool_call_id="a"),
        Message(role="tool", content="boom\nexit code: 1", tool_call_id="b", name="run"),
    ]
    assert [(e.tool_call_id, e.name, e.why) for e in tool_errors(state)] == [("b", "run", "exit code 1")]


# --- through the gateway ----------------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {}}}}]


def _calls(url: str) -> list[Call]:
    engine = connect(url)
    try:
        with Session(engine) as session:
            return list(session.scalars(sa.select(Call).order_by(Call.started_at)))
    finally:
        engine.dispose()


def _rewards(url: str) -> list[Reward]:
    engine = connect(url)
    try:
        with Session(engine) as session:
            return list(session.scalars(sa.select(Reward).order_by(Reward.id)))
    finally:
        engine.dispose()


@pytest.mark.parametrize("failed", [True, False], ids=["tool-error", "tool-ok"])
def test_the_next_call_is_recorded_on_the_turn_and_a_failed_tool_gives_it_the_rule_reward(
    gateway_factory, tiny_tokenizer, failed
):
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, tool_error_reward=-0.7)
    engine.push('<tool_call>\n{"name": "run", "arguments": {"cmd": "make"}}\n</tool_call>')
    engine.push("Done.")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "build it"}]
    first = httpx.post(gw.v1 + "/chat/completions", json={"model": "tiny", "messages": messages, "tools": TOOLS})
    assert first.status_code == 200, first.text
    answer = first.json()["choices"][0]["message"]
    assert answer["tool_calls"], answer
    result = "make: *** [all] Error 2\nExit code: 2" if failed else "built\nExit code: 0"
    messages += [answer, {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": result}]
    second = httpx.post(gw.v1 + "/chat/completions", json={"model": "tiny", "messages": messages, "tools": TOOLS})
    assert second.status_code == 200, second.text
    gw.flush()
    parent, child = _calls(gw.settings.database_url)
    assert child.parent_call_id == parent.id and child.render_mode == "spliced"
    assert parent.next_call_id == child.id, "the turn records where its next state is"
    assert child.next_call_id is None, "the last turn's next state is not known yet"
    rewards = _rewards(gw.settings.database_url)
    if failed:
        assert [(r.call_id, r.source, r.value) for r in rewards] == [(parent.id, RULE_SOURCE, -0.7)]
        assert rewards[0].rollout_id == parent.rollout_id
        assert rewards[0].details["next_call_id"] == child.id
        assert rewards[0].details["errors"][0]["why"] == "exit code 2"
    else:
        assert rewards == []


def test_a_retried_next_request_keeps_the_first_link(gateway_factory, tiny_tokenizer):
    """Retries of the next request (same prompt) do not move the turn's link: its next state is recorded once."""
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer)
    engine.push("First answer.")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    first = httpx.post(gw.v1 + "/chat/completions", json={"model": "tiny", "messages": messages}).json()
    messages += [first["choices"][0]["message"], {"role": "user", "content": "no, I meant goodbye"}]
    for _ in range(2):
        engine.push("Goodbye.")
        assert httpx.post(gw.v1 + "/chat/completions", json={"model": "tiny", "messages": copy.deepcopy(messages)})
    gw.flush()
    parent, child, retry = _calls(gw.settings.database_url)
    assert child.parent_call_id == retry.parent_call_id == parent.id
    assert parent.next_call_id == child.id


def test_the_rule_is_off_at_zero(gateway_factory, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, tool_error_reward=0.0)
    engine.push('<tool_call>\n{"name": "run", "arguments": {}}\n</tool_call>')
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    answer = httpx.post(gw.v1 + "/chat/completions", json={"model": "tiny", "messages": messages, "tools": TOOLS})
    message = answer.json()["choices"][0]["message"]
    messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "Exit code: 1"}]
    assert httpx.post(gw.v1 + "/chat/completions", json={"model": "tiny", "messages": messages, "tools": TOOLS})
    gw.flush()
    assert _rewards(gw.settings.database_url) == []
    parent, child = _calls(gw.settings.database_url)
    assert parent.next_call_id == child.id, "the next state is recorded whether or not the rule is on"


def test_a_huge_tool_result_is_scanned_at_its_ends_only():
    body = "x" * 2_000_000
    assert [e.why for e in tool_errors([Message(role="tool", content=body + "\nExit code: 4")])] == ["exit code 4"]
    assert [e.why for e in tool_errors([Message(role="tool", content="Exit code: 5\n" + body)])] == ["exit code 5"]
    assert tool_errors([Message(role="tool", content=body + "\nExit code: 6\n" + body)]) == []
