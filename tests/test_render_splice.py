"""Rendering and token-in-token-out splicing with the tiny model's real tokenizer, and the session index.

A fresh render must be exactly what ``apply_chat_template`` produces. A spliced prompt must begin with the parent's
raw ids (here deliberately tokenized differently from how the tokenizer would split the same text, as sampled ids
often are) and continue with exactly what the template writes after that turn. The decisive case is a Qwen3-style
template that drops the ``<think>`` block of assistant turns before the last user query: the spliced prompt still
carries the raw reasoning tokens of earlier turns, which a re-render would have lost. ``plan_prompt`` must splice on
the latest answer it knows in the request's scope, and say "drifted" whenever model output gets re-tokenized.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import pytest

from gateway.core.conversation import Message, ToolCall, ToolSpec, extend_hash, output_hash
from gateway.core.render import SPLICE_MARK, Renderer, Splice
from gateway.core.sessions import CallEntry, PromptPlan, SessionIndex, plan_prompt

IM_END = "<|im_end|>"

TOOLS = [
    ToolSpec(
        "get_weather",
        "Get the current weather for a city.",
        {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    ),
    ToolSpec("run", "Run a shell command."),
]

# ChatML with Qwen3's reasoning rule: an assistant turn keeps its <think> block only when it comes after the last
# real user query (tool results wrapped as user turns do not count); earlier turns are rendered without it.
QWEN3_STYLE_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string
          and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'
                + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if loop.first and content or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {%- set fn = tool_call.function if tool_call.function else tool_call %}
            {{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
            {%- if fn.arguments is string %}
                {{- fn.arguments }}
            {%- else %}
                {{- fn.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


# --- a simulated model and harness ---------------------------------------------------------------------------

_TAGS = re.compile(r"(<think>|</think>|<tool_call>|</tool_call>)")


def sampled_ids(renderer: Renderer, text: str) -> list[int]:
    """Ids that decode to ``text`` but split it one character at a time, as a sampler may well have done.

    A re-tokenization of the same text gives other ids, so a prompt that carries these was spliced, not re-rendered.
    """
    ids: list[int] = []
    for piece in _TAGS.split(text):
        ids += renderer.encode(piece) if _TAGS.fullmatch(piece) else [i for ch in piece for i in renderer.encode(ch)]
    return ids


def completion_text(reasoning: str, content: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """What a Qwen-family model writes for a turn (the shape both templates here render)."""
    text = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""
    text += content
    for i, (name, args) in enumerate(calls):
        text += "\n" if content or i else ""
        text += '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(args, ensure_ascii=False)
        text += "}\n</tool_call>"
    return text


@dataclass
class Answered:
    plan: PromptPlan
    entry: CallEntry
    produced: Message  # the turn as the model wrote it, reasoning included
    echo: Message  # what a harness sends back: reasoning dropped, ids renamed, arguments re-serialized, trimmed


def answer(
    renderer: Renderer,
    index: SessionIndex,
    scope: str | None,
    messages: list[Message],
    tools: list[ToolSpec],
    *,
    content: str = "",
    reasoning: str = "",
    calls: list[tuple[str, dict[str, Any]]] | None = None,
    ended: bool = True,
) -> Answered:
    """Plan a request, "generate" an answer and register it the way the service does after a call."""
    calls = calls or []
    plan = plan_prompt(renderer, index, scope, messages, tools)
    completion = sampled_ids(renderer, completion_text(reasoning, content, calls))
    if ended:
        completion.append(im_end_id(renderer))
    entry = CallEntry(
        call_id=f"call_{len(index)}",
        rollout_id=scope or "ro_implicit",
        token_ids=plan.prompt_ids + completion,
        ends_with_end_of_turn=renderer.ends_with_end_of_turn(completion),
        explicit=scope is not None,
    )
    produced = Message("assistant", content, reasoning, [ToolCall(n, json.dumps(a)) for n, a in calls])
    index.add(scope, extend_hash(plan.hashes[-1], produced), output_hash(produced), entry)
    echo = Message(
        "assistant",
        content.strip() or None,
        None,
        [ToolCall(n, json.dumps(a, sort_keys=True, indent=1), f"fc_{i}") for i, (n, a) in enumerate(calls)],
    )
    return Answered(plan, entry, produced, echo)


def template_text(tokenizer: Any, messages: list[Message], tools: list[ToolSpec], template: str | None = None) -> str:
    text = tokenizer.apply_chat_template(
        [m.to_template() for m in messages],
        tools=[t.to_template() for t in tools] or None,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert isinstance(text, str)
    return text


def text_after_turn(full_text: str, turn_content: str) -> str:
    """What the template writes after the assistant turn whose (unique) content is ``turn_content``."""
    start = full_text.index(turn_content)
    assert full_text.count(turn_content) == 1
    return full_text[full_text.index(IM_END, start) :]


def decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False))


@pytest.fixture(scope="module")
def renderer(tiny_tokenizer: Any) -> Renderer:
    return Renderer(tiny_tokenizer)


@pytest.fixture(scope="module")
def qwen3_renderer(tiny_tokenizer: Any) -> Renderer:
    return Renderer(tiny_tokenizer, chat_template=QWEN3_STYLE_TEMPLATE)


def im_end_id(renderer: Renderer) -> int:
    tid = renderer.tokenizer.convert_tokens_to_ids(IM_END)
    assert isinstance(tid, int)
    return tid


# --- fresh rendering -----------------------------------------------------------------------------------------

CONVERSATIONS = [
    [Message("user", "Hi!")],
    [Message("system", "Be brief."), Message("user", "Weather in Zürich? 🙂")],
    [
        Message("system", "You are an agent."),
        Message("user", "Check Paris and Tokyo."),
        Message(
            "assistant",
            "Checking both.",
            "Two cities, two calls.",
            [
                ToolCall("get_weather", '{"city": "Paris", "days": 2}', "call_a"),
                ToolCall("get_weather", '{"city": "東京"}', "call_b"),
            ],
        ),
        Message("tool", '{"temp": 24}', tool_call_id="call_a", name="get_weather"),
        Message("tool", '{"temp": 19}', tool_call_id="call_b", name="get_weather"),
        Message("assistant", "Paris 24, Tokyo 19."),
        Message("user", "Now run `ls`."),
        Message("assistant", None, None, [ToolCall("run", "not json")]),
        Message("tool", "a.txt\nb.txt", tool_call_id="call_0"),
    ],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("tools", [[], TOOLS])
def test_fresh_render_is_the_tokenizers_chat_template(
    renderer: Renderer, tiny_tokenizer: Any, conversation: list[Message], tools: list[ToolSpec]
) -> None:
    text = template_text(tiny_tokenizer, conversation, tools)
    assert renderer.render_text([m.to_template() for m in conversation], tools) == text
    expected = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert renderer.render_fresh(conversation, tools) == expected
    assert decode(tiny_tokenizer, expected) == text


def test_fresh_render_gives_templates_the_special_tokens(tiny_tokenizer: Any) -> None:
    # Llama- and Mistral-style templates write {{ eos_token }} themselves instead of a literal token.
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"
    messages = [Message("user", "Hi"), Message("assistant", "Hello")]
    text = Renderer(tiny_tokenizer, chat_template=template).render_text([m.to_template() for m in messages], [])
    assert text == "[user] Hi<|im_end|>[assistant] Hello<|im_end|>"
    assert text == template_text(tiny_tokenizer, messages, [], template)


# --- splicing ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ended", [True, False], ids=["ended", "cut_by_length"])
def test_spliced_prompt_is_parent_ids_then_the_templates_text(
    renderer: Renderer, tiny_tokenizer: Any, ended: bool
) -> None:
    index = SessionIndex()
    history = [Message("system", "You are an agent."), Message("user", "Weather in Paris?")]
    first = answer(
        renderer,
        index,
        None,
        history,
        TOOLS,
        reasoning="The user wants Paris.",
        content="Let me check.",
        calls=[("get_weather", {"city": "Paris", "days": 1.0})],
        ended=ended,
    )
    assert first.plan.mode == "fresh"
    messages = [
        *history,
        first.echo,
        Message("tool", '{"temp": 24}', tool_call_id="fc_0", name="get_weather"),
        Message("user", "And tomorrow?"),
    ]
    plan = plan_prompt(renderer, index, None, messages, TOOLS)
    assert plan.mode == "spliced"
    assert plan.parent is first.entry
    parent_ids = list(first.entry.token_ids)
    assert plan.prompt_ids[: len(parent_ids)] == parent_ids

    # The rest is exactly the template's text after that turn; the end-of-turn token appears once either way.
    with_answer = [*history, first.produced, *messages[3:]]
    full_text = template_text(tiny_tokenizer, with_answer, TOOLS)
    after = text_after_turn(full_text, '"days": 1.0}}\n</tool_call>')
    rest = plan.prompt_ids[len(parent_ids) :]
    assert decode(tiny_tokenizer, rest) == (after.removeprefix(IM_END) if ended else after)
    assert rest == renderer.encode(decode(tiny_tokenizer, rest))
    assert (rest[0] == im_end_id(renderer)) is not ended
    # Had the model's answer been rendered as the template writes it, the text would be the same...
    assert decode(tiny_tokenizer, plan.prompt_ids) == full_text
    # ...but not the ids: the sampled split of the answer survives, a re-tokenization would not keep it.
    assert renderer.encode(full_text) != plan.prompt_ids
    assert plan.prompt_ids.count(im_end_id(renderer)) == renderer.encode(full_text).count(im_end_id(renderer))


def test_splice_of_the_tokenizers_own_split_equals_a_fresh_render(renderer: Renderer) -> None:
    # With a template that keeps reasoning and ids that are the tokenizer's own split, splicing changes nothing.
    history = [Message("user", "Say hi.")]
    produced = Message("assistant", "Hi there!", "Greet back.")
    messages = [*history, produced, Message("user", "Again, in French.")]
    head = renderer.render_fresh(history, TOOLS)
    answer_ids = [*renderer.encode(completion_text("Greet back.", "Hi there!", [])), im_end_id(renderer)]
    spliced = renderer.render_spliced(messages, TOOLS, Splice(1, head + answer_ids, True))
    assert spliced == renderer.render_fresh(messages, TOOLS)


def test_splice_gives_up_when_the_template_defeats_it(tiny_tokenizer: Any) -> None:
    messages = [Message("user", "Hi"), Message("assistant", "Hello"), Message("user", "Bye")]
    parent = Renderer(tiny_tokenizer).encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>")
    # Turns end with another token than the one the model ended its answer with.
    other_end = Renderer(
        tiny_tokenizer,
        chat_template="{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|endoftext|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    assert other_end.render_spliced(messages, [], Splice(1, parent, True)) is None
    # The template repeats the conversation, so "after the turn" is not one place.
    twice = Renderer(tiny_tokenizer, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}" * 2)
    assert twice.render_spliced(messages, [], Splice(1, parent, False)) is None
    # plan_prompt then falls back to a fresh render and reports the drift.
    index = SessionIndex()
    hashes = answer(other_end, index, None, messages[:1], [], content="Hello").plan.hashes
    assert index.lookup(None, extend_hash(hashes[-1], Message("assistant", "Hello"))) is not None
    plan = plan_prompt(other_end, index, None, messages, [])
    assert (plan.mode, plan.parent) == ("drifted", None)
    assert plan.prompt_ids == other_end.render_fresh(messages, [])
    assert SPLICE_MARK not in decode(tiny_tokenizer, plan.prompt_ids)


# --- Qwen3-style templates that drop old reasoning -----------------------------------------------------------


def test_qwen3_style_template_drops_old_reasoning(qwen3_renderer: Renderer, tiny_tokenizer: Any) -> None:
    # The premise of the next test: a re-render loses the reasoning of turns before the last user query.
    turn = Message("assistant", "Paris it is.", "OLD-REASONING", [ToolCall("get_weather", '{"city": "Paris"}')])
    tool = Message("tool", "sunny", tool_call_id="call_0")
    base = [Message("system", "S"), Message("user", "Weather?"), turn, tool]
    assert "OLD-REASONING" in template_text(tiny_tokenizer, base, TOOLS, QWEN3_STYLE_TEMPLATE)
    later = [*base, Message("assistant", "Sunny."), Message("user", "Thanks")]
    assert "OLD-REASONING" not in template_text(tiny_tokenizer, later, TOOLS, QWEN3_STYLE_TEMPLATE)
    assert qwen3_renderer.render_text([m.to_template() for m in later], TOOLS) == template_text(
        tiny_tokenizer, later, TOOLS, QWEN3_STYLE_TEMPLATE
    )


def test_qwen3_style_splice_keeps_raw_reasoning_of_earlier_turns(qwen3_renderer: Renderer, tiny_tokenizer: Any) -> None:
    r = qwen3_renderer
    index = SessionIndex()
    messages = [Message("system", "You are an agent."), Message("user", "What is the weather in Paris?")]
    # Turn 1: reasoning and a tool call.
    first = answer(
        r,
        index,
        None,
        messages,
        TOOLS,
        reasoning="REASON-ONE: call the tool.",
        calls=[("get_weather", {"city": "Paris"})],
    )
    assert first.plan.mode == "fresh"
    messages += [first.echo, Message("tool", "sunny, 24C", tool_call_id="fc_0")]
    # Turn 2: after the tool result, still within the same user query.
    second = answer(r, index, None, messages, TOOLS, reasoning="REASON-TWO: report it.", content="Sunny, 24C.")
    assert second.plan.mode == "spliced"
    assert second.plan.prompt_ids[: len(first.entry.token_ids)] == list(first.entry.token_ids)
    messages += [second.echo, Message("user", "Thanks! And in Lyon?")]
    # Turn 3: a new user query; the template now drops both earlier <think> blocks.
    plan = plan_prompt(r, index, None, messages, TOOLS)
    assert plan.mode == "spliced"
    assert plan.parent is second.entry
    assert plan.prompt_ids[: len(second.entry.token_ids)] == list(second.entry.token_ids)
    assert plan.prompt_ids[: len(first.entry.token_ids)] == list(first.entry.token_ids)
    spliced_text = decode(tiny_tokenizer, plan.prompt_ids)
    assert "REASON-ONE" in spliced_text and "REASON-TWO" in spliced_text
    assert spliced_text.count("<think>") == 2

    # A re-render would not contain the reasoning, even had the harness sent it back.
    with_reasoning = [*messages[:2], first.produced, messages[3], second.produced, messages[5]]
    fresh_text = template_text(tiny_tokenizer, with_reasoning, TOOLS, QWEN3_STYLE_TEMPLATE)
    assert "REASON" not in fresh_text and "<think>" not in fresh_text
    assert "REASON" not in decode(tiny_tokenizer, r.render_fresh(messages, TOOLS))
    # What follows the spliced turn is exactly what the template writes after it.
    rest = plan.prompt_ids[len(second.entry.token_ids) :]
    assert decode(tiny_tokenizer, rest) == text_after_turn(fresh_text, "Sunny, 24C.").removeprefix(IM_END)
    assert rest[0] != im_end_id(r)

    # Turn 4 continues from turn 3's raw ids in the same way.
    third = answer(r, index, None, messages, TOOLS, reasoning="REASON-THREE", content="Lyon: rain.")
    assert third.plan.prompt_ids == plan.prompt_ids
    messages += [third.echo, Message("user", "Bye")]
    last = plan_prompt(r, index, None, messages, TOOLS)
    assert (last.mode, last.parent) == ("spliced", third.entry)
    assert last.prompt_ids[: len(third.entry.token_ids)] == list(third.entry.token_ids)
    assert decode(tiny_tokenizer, last.prompt_ids).count("<think>") == 3


# --- plan_prompt ---------------------------------------------------------------------------------------------


@pytest.fixture
def two_turns(renderer: Renderer) -> tuple[SessionIndex, list[Message], Answered, Answered]:
    """An implicit session with two answered calls; ``messages`` ends with the second answer's echo."""
    index = SessionIndex()
    messages = [Message("system", "Be brief."), Message("user", "Count to two.")]
    one = answer(renderer, index, None, messages, [], content="One.")
    messages += [one.echo, Message("user", "Go on.")]
    two = answer(renderer, index, None, messages, [], content="Two.")
    messages.append(two.echo)
    return index, messages, one, two


def test_plan_splices_the_latest_known_answer(renderer: Renderer, two_turns: Any) -> None:
    index, messages, one, two = two_turns
    assert two.plan.mode == "spliced" and two.plan.parent is one.entry
    plan = plan_prompt(renderer, index, None, [*messages, Message("user", "Now three.")], [])
    assert (plan.mode, plan.parent) == ("spliced", two.entry)
    assert plan.prompt_ids[: len(two.entry.token_ids)] == list(two.entry.token_ids)


def test_plan_renders_turns_it_did_not_write_after_the_splice(
    renderer: Renderer, tiny_tokenizer: Any, two_turns: Any
) -> None:
    # A harness may insert an assistant turn of its own (a canned reply, a compaction summary): not ours, no drift.
    index, messages, _, two = two_turns
    inserted = [Message("user", "Status?"), Message("assistant", "CANNED: all good."), Message("user", "Three?")]
    plan = plan_prompt(renderer, index, None, [*messages, *inserted], [])
    assert (plan.mode, plan.parent) == ("spliced", two.entry)
    rest = decode(tiny_tokenizer, plan.prompt_ids[len(two.entry.token_ids) :])
    assert rest == "\n" + "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in inserted) + (
        "<|im_start|>assistant\n"
    )


def test_plan_is_fresh_for_assistant_turns_it_never_wrote(renderer: Renderer, two_turns: Any) -> None:
    index, *_ = two_turns
    few_shot = [
        Message("system", "Answer with one word."),
        Message("user", "Capital of France?"),
        Message("assistant", "Paris."),
        Message("user", "Capital of Japan?"),
    ]
    plan = plan_prompt(renderer, index, None, few_shot, [])
    assert (plan.mode, plan.parent) == ("fresh", None)
    assert plan.prompt_ids == renderer.render_fresh(few_shot, [])


def test_plan_reports_drift_when_history_before_a_known_answer_was_edited(renderer: Renderer, two_turns: Any) -> None:
    index, messages, one, _ = two_turns
    # The first user turn edited: neither answer can be spliced, and both are ours.
    edited = [messages[0], Message("user", "Count to two, please."), *messages[2:], Message("user", "Three?")]
    plan = plan_prompt(renderer, index, None, edited, [])
    assert (plan.mode, plan.parent) == ("drifted", None)
    assert plan.prompt_ids == renderer.render_fresh(edited, [])
    # The turn between the answers edited: the first answer still splices, the second is re-tokenized.
    edited = [*messages[:3], Message("user", "Go on!"), messages[4], Message("user", "Three?")]
    plan = plan_prompt(renderer, index, None, edited, [])
    assert (plan.mode, plan.parent) == ("drifted", one.entry)
    assert plan.prompt_ids[: len(one.entry.token_ids)] == list(one.entry.token_ids)


def test_plan_reports_drift_when_a_known_answer_was_rewritten_in_place(renderer: Renderer, two_turns: Any) -> None:
    # The harness sends the second answer changed: the first still splices; the edited turn is simply new text.
    index, messages, one, _ = two_turns
    edited = [*messages[:4], Message("assistant", "Two!!"), Message("user", "Three?")]
    plan = plan_prompt(renderer, index, None, edited, [])
    assert (plan.mode, plan.parent) == ("spliced", one.entry)
    # ...but the unedited second answer placed after an unknown one is ours, after the splice point: drift.
    edited = [*messages[:4], Message("assistant", "Two!!"), Message("user", "Again"), messages[4]]
    plan = plan_prompt(renderer, index, None, edited, [])
    assert (plan.mode, plan.parent) == ("drifted", one.entry)


def test_plan_respects_scopes(renderer: Renderer) -> None:
    index = SessionIndex()
    history = [Message("user", "Hello")]
    explicit = answer(renderer, index, "ro_A", history, [], content="Hi from A.")
    implicit = answer(renderer, index, None, [Message("user", "Yo")], [], content="Hi, implicit.")
    follow_a = [*history, explicit.echo, Message("user", "More")]
    assert plan_prompt(renderer, index, "ro_A", follow_a, []).parent is explicit.entry
    # Another rollout and implicit lookups neither see the entry nor count its answer as theirs (no drift).
    for scope in ("ro_B", None):
        plan = plan_prompt(renderer, index, scope, follow_a, [])
        assert (plan.mode, plan.parent) == ("fresh", None)
    # An explicit rollout does not continue implicit sessions either.
    follow_implicit = [Message("user", "Yo"), implicit.echo, Message("user", "More")]
    assert plan_prompt(renderer, index, None, follow_implicit, []).parent is implicit.entry
    plan = plan_prompt(renderer, index, "ro_A", follow_implicit, [])
    assert (plan.mode, plan.parent) == ("fresh", None)


def test_plan_falls_back_to_storage_for_the_last_assistant_turn(renderer: Renderer, two_turns: Any) -> None:
    old_index, messages, _, two = two_turns
    request = [*messages, Message("user", "Three?")]
    asked: list[tuple[str | None, bytes]] = []

    def stored(scope: str | None, tail: bytes) -> CallEntry | None:
        asked.append((scope, tail))
        return two.entry

    plan = plan_prompt(renderer, SessionIndex(), None, request, [], fallback=stored)
    assert (plan.mode, plan.parent) == ("spliced", two.entry)
    assert asked == [(None, plan.hashes[4])]
    assert plan.prompt_ids == plan_prompt(renderer, old_index, None, request, []).prompt_ids
    # A known conversation never reaches storage.
    asked.clear()
    plan_prompt(renderer, old_index, None, request, [], fallback=stored)
    assert asked == []


def test_plan_hashes_and_tools_scope_the_match(renderer: Renderer, two_turns: Any) -> None:
    index, messages, _, two = two_turns
    plan = plan_prompt(renderer, index, None, [*messages, Message("user", "Three?")], [])
    assert plan.hashes[:5] == [*two.plan.hashes, extend_hash(two.plan.hashes[-1], two.produced)]
    # The same messages under another tools list are another conversation; the answers are still ours.
    plan = plan_prompt(renderer, index, None, [*messages, Message("user", "Three?")], TOOLS)
    assert (plan.mode, plan.parent) == ("drifted", None)


# --- the session index ---------------------------------------------------------------------------------------


def entry(name: str, n_tokens: int) -> CallEntry:
    return CallEntry(call_id=name, rollout_id="ro", token_ids=list(range(n_tokens)), ends_with_end_of_turn=True)


def test_index_evicts_least_recently_used_beyond_max_tokens() -> None:
    index = SessionIndex(max_tokens=30)
    for name in "abc":
        index.add(None, name.encode(), b"out-" + name.encode(), entry(name, 10))
    index.add(None, b"a", b"out-a", entry("a", 10))  # replacing an entry does not count its tokens twice
    assert len(index) == 3
    assert index.lookup(None, b"b") is not None  # b is now the most recently used, then a, then c
    index.add(None, b"d", b"out-d", entry("d", 10))
    assert index.lookup(None, b"c") is None
    assert [index.lookup(None, k) is not None for k in (b"a", b"b", b"d")] == [True, True, True]
    index.add(None, b"e", b"out-e", entry("e", 15))  # needs two entries' room: the two least recently used go
    assert [index.lookup(None, k) is not None for k in (b"a", b"b", b"d", b"e")] == [False, False, True, True]
    assert len(index) == 2
    # A single call larger than the whole budget is kept (it is the one the harness is about to continue).
    index.add(None, b"f", b"out-f", entry("f", 100))
    assert len(index) == 1 and index.lookup(None, b"f") is not None


def test_index_lookup_is_scoped() -> None:
    index = SessionIndex()
    index.add("ro_1", b"t", b"o", entry("x", 3))
    assert index.lookup("ro_1", b"t") is not None
    assert index.lookup("ro_2", b"t") is None
    assert index.lookup(None, b"t") is None
    assert index.is_known_output("ro_1", b"o")
    assert not index.is_known_output(None, b"o")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_index_forgets_entries_idle_longer_than_the_session_timeout() -> None:
    clock = Clock()
    index = SessionIndex(max_idle_s=100, clock=clock)
    index.add(None, b"a", b"out-a", entry("a", 10))
    index.add(None, b"b", b"out-b", entry("b", 10))
    clock.now += 60
    assert index.lookup(None, b"a") is not None  # a conversation within its idle window is continued
    clock.now += 60
    index.add(None, b"c", b"out-c", entry("c", 10))
    # b was last used 120 s ago: gone; a was looked up 60 s ago: kept.
    assert [index.lookup(None, k) is not None for k in (b"a", b"b", b"c")] == [True, False, True]
    assert index.tokens == 20
    clock.now += 1000
    index.add(None, b"d", b"out-d", entry("d", 10))  # never evicts the entry just added
    assert len(index) == 1 and index.lookup(None, b"d") is not None


def test_index_memory_levels_off_under_endless_new_conversations() -> None:
    """Steady traffic of new conversations (as real traffic brings) holds one idle window's worth of calls, however
    long it runs; before the idle expiry, the index held every call until its 20M-token budget was full."""
    clock = Clock()
    index = SessionIndex(max_idle_s=60, clock=clock)
    sizes = []
    for i in range(20_000):  # 10 calls a second for 2,000 s
        clock.now += 0.1
        index.add(None, f"tail-{i}".encode(), f"out-{i}".encode(), entry(f"c{i}", 50))
        if i % 1000 == 999:
            sizes.append((len(index), index.tokens))
    assert all(n <= 601 for n, _ in sizes), sizes
    assert sizes[-1] == sizes[5]
    assert len(index._outputs) <= 601


def test_index_forgets_answer_hashes_with_their_calls() -> None:
    clock = Clock()
    index = SessionIndex(max_idle_s=100, clock=clock)
    index.add(None, b"a", b"out-a", entry("a", 10))
    clock.now += 150
    index.add(None, b"b", b"out-b", entry("b", 10))
    assert not index.is_known_output(None, b"out-a")  # the database is asked instead (known_outputs)
    assert index.is_known_output(None, b"out-b")
