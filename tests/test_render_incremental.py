"""The spliced render's shortcut: the text a template writes after the spliced turn, taken from a short conversation
(leading system message, last user message before the turn, the turn, what follows), equals the text taken from
the full conversation, over the harness fixtures and hundreds of seeded random conversations, for the tiny model's
template, a Qwen3-style one that drops old reasoning and a Llama 3-style one. A template for which it does not hold
is caught by the check against the full render and rendered in full from then on."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from gateway.core.conversation import Message, ToolCall, ToolSpec
from gateway.core.render import Renderer, Splice
from gateway.protocols.anthropic import serving as messages
from gateway.protocols.anthropic.wire import MessagesRequest
from gateway.protocols.openai import chat
from gateway.protocols.openai.wire import ChatCompletionRequest
from tests.test_render_splice import QWEN3_STYLE_TEMPLATE, TOOLS

FIXTURES = Path(__file__).parent / "fixtures" / "harness-requests"

LLAMA3_STYLE_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- for tc in message.tool_calls %}{{- '{"name": "' + tc.function.name + '", "parameters": '
            + (tc.function.arguments | tojson) + '}' }}{%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

# Numbers every turn: the text after a turn depends on how many came before it, so the shortcut cannot hold.
COUNTING_TEMPLATE = """{%- for message in messages %}{{- '[' ~ loop.index ~ '] ' + message.role + ': '
    + message.content + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}"""


@pytest.fixture(params=["tiny", "qwen3", "llama3"])
def renderer(request: pytest.FixtureRequest, tiny_tokenizer: Any) -> Renderer:
    template = {"tiny": None, "qwen3": QWEN3_STYLE_TEMPLATE, "llama3": LLAMA3_STYLE_TEMPLATE}[request.param]
    return Renderer(tiny_tokenizer, chat_template=template)


def fixture_conversations() -> list[tuple[str, list[Message], list[ToolSpec]]]:
    out = []
    for path in sorted(FIXTURES.rglob("*.json")):
        body = json.loads(path.read_text())
        body = body.get("body", body)
        if "messages" in body and "system" in body:  # Anthropic messages (Claude Code, OpenClaw)
            req = MessagesRequest.model_validate(body)
            convo = messages.to_messages(req, final_assistant_ok=True)
            out.append((path.name, convo, messages.to_tools(req.tools)))
        elif "messages" in body:  # chat completions (OpenClaw); the Responses fixtures have no messages list
            chat_req = ChatCompletionRequest.model_validate(body)
            out.append((path.name, chat.to_messages(chat_req.messages), chat.to_tools(chat_req)))
    return out


def random_conversation(rng: random.Random) -> list[Message]:
    def text() -> str:
        return " ".join(rng.choice(["ls", "ok", "déjà", "{}", "\n", "<b>", "42", "tool", "  "]) for _ in range(6))

    convo = [Message(role="system", content=text())] if rng.random() < 0.7 else []
    convo.append(Message(role="user", content=text()))
    for _ in range(rng.randint(1, 8)):
        calls = [
            ToolCall(rng.choice(["run", "get_weather"]), json.dumps({"city": text()})) for _ in range(rng.randint(0, 2))
        ]
        reasoning = text() if rng.random() < 0.4 else None
        convo.append(
            Message(
                role="assistant", content=text() if rng.random() < 0.7 else "", reasoning=reasoning, tool_calls=calls
            )
        )
        for i, _ in enumerate(calls):
            convo.append(Message(role="tool", content=text(), tool_call_id=f"call_{i}"))
        if not calls or rng.random() < 0.3:
            convo.append(Message(role="user", content=text()))
    return convo


def assistant_turns(convo: list[Message]) -> list[int]:
    return [i for i, m in enumerate(convo) if m.role == "assistant"]


def grown(convo: list[Message], tools: list[ToolSpec], turns: int) -> list[Message]:
    """The fixture's conversation continued for ``turns`` more tool rounds, with its own tool results' text."""
    results = [m.content for m in convo if m.role == "tool" and m.content] or ["(no output)"]
    name = tools[0].name if tools else "run"
    out = list(convo)
    if out[-1].role == "assistant":
        out.append(Message(role="user", content="go on"))
    for turn in range(turns):
        call = ToolCall(name, json.dumps({"step": turn}), id=f"call{turn}")
        out.append(Message(role="assistant", content=f"step {turn}", tool_calls=[call]))
        out.append(Message(role="tool", content=results[turn % len(results)], tool_call_id=f"call{turn}"))
        if turn % 3 == 2:  # OpenClaw's extra user message after tool results
            out.append(Message(role="user", content="Continue where you left off."))
    return out


def test_the_harness_fixtures_render_the_same_after_every_turn(renderer: Renderer) -> None:
    checked = 0
    for name, convo, tools in fixture_conversations():
        convo = grown(convo, tools, 6)
        for index in assistant_turns(convo):
            full = renderer.full_after(convo, tools, index)
            assert renderer.incremental_after(convo, tools, index) == full, (name, index)
            checked += 1
    assert checked >= 5 * 6  # five fixtures (Claude Code, OpenClaw chat and messages), six answers or more each


def test_random_conversations_render_the_same_after_every_turn(renderer: Renderer) -> None:
    rng = random.Random(12)
    checked = 0
    for _ in range(300):
        convo = random_conversation(rng)
        tools = TOOLS if rng.random() < 0.5 else []
        for index in assistant_turns(convo):
            assert renderer.incremental_after(convo, tools, index) == renderer.full_after(convo, tools, index)
            checked += 1
    assert checked > 800


def test_render_spliced_equals_the_full_render_path(renderer: Renderer) -> None:
    rng = random.Random(7)
    for _ in range(100):
        convo = random_conversation(rng)
        index = rng.choice(assistant_turns(convo))
        parent = renderer.encode("raw parent ids")
        spliced = renderer.render_spliced(convo, [], Splice(index, parent, False))
        after = renderer.full_after(convo, [], index)
        assert spliced == (None if after is None else parent + renderer.encode(after))
    assert renderer._incremental.enabled


def test_a_template_that_is_not_prefix_stable_is_rendered_in_full(tiny_tokenizer: Any) -> None:
    renderer = Renderer(tiny_tokenizer, chat_template=COUNTING_TEMPLATE)
    convo = [Message(role="user", content="a"), Message(role="assistant", content="b")]
    convo += [
        Message(role="user", content="c"),
        Message(role="assistant", content="d"),
        Message(role="user", content="e"),
    ]
    assert renderer.incremental_after(convo, [], 3) != renderer.full_after(convo, [], 3)  # "[4]" vs "[3]"
    parent = renderer.encode("raw")
    assert renderer.render_spliced(convo, [], Splice(3, parent, False)) == parent + renderer.encode(
        renderer.full_after(convo, [], 3) or ""
    )
    assert not renderer._incremental.enabled
    # From now on every splice is rendered in full, whatever its shape.
    convo.append(Message(role="assistant", content="f"))
    convo.append(Message(role="user", content="g"))
    assert renderer.render_spliced(convo, [], Splice(5, parent, False)) == parent + renderer.encode(
        "\n[7] user: g\nassistant: "
    )
