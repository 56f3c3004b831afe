"""Echo normalization: a harness's rewrite of an earlier turn is the same turn; a change of meaning is not.

Seeded random conversations (assistant turns with reasoning and tool calls whose arguments nest numbers, strings
with non-ASCII text, booleans and lists; tool results; system and user turns) are echoed back the way harnesses
rewrite them -- tool-call ids renamed, reasoning dropped, arguments re-serialized with other key order, spacing,
escaping and 1 vs 1.0, content split into parts and merged with or without newlines, whitespace trimmed -- and
``normalized``, ``output_hash`` and ``prefix_hashes`` must not change. Changing a turn's text, a tool name, an
argument value, a role or the tools list must change them.
"""

from __future__ import annotations

import copy
import json
import random
from collections import Counter
from typing import Any

import pytest

from gateway.core.conversation import (
    Message,
    ToolCall,
    ToolSpec,
    exact_hash,
    extend_hash,
    normalized,
    output_hash,
    prefix_hashes,
    tools_hash,
)

WORDS = ["hello", "world", "Paris", "café", "日本語", "🙂", "ls -la", "x=1", "{}", '"q"', "tab\there", "a\nb"]
TOOL_NAMES = ["get_weather", "read_file", "run"]
TOOLS = [
    ToolSpec("get_weather", "Weather for a city.", {"type": "object", "properties": {"city": {"type": "string"}}}),
    ToolSpec("read_file", None, {"type": "object", "properties": {"path": {"type": "string"}}}),
    ToolSpec("run"),
]


# --- random conversations ------------------------------------------------------------------------------------


def random_words(rng: random.Random, lo: int = 1, hi: int = 8) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.choice(["int", "float", "whole_float", "str", "bool", "null", "list", "dict"][: 8 if depth < 2 else 6])
    if kind == "int":
        return rng.randint(-5, 1000)
    if kind == "float":
        return rng.randint(-500, 500) + 0.25
    if kind == "whole_float":
        return float(rng.randint(-5, 50))
    if kind == "str":
        return random_words(rng, 0, 3)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return random_object(rng, depth + 1)


def random_object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    keys = rng.sample(["city", "path", "cmd", "n", "opts", "flag", "ratio", "ids"], rng.randint(0, 4))
    return {k: random_value(rng, depth) for k in keys}


def random_message(rng: random.Random, role: str | None = None) -> Message:
    role = role or rng.choice(["system", "user", "assistant", "tool"])
    if role == "assistant":
        calls = [
            ToolCall(rng.choice(TOOL_NAMES), json.dumps(random_object(rng), ensure_ascii=False), f"call_{rng.random()}")
            for _ in range(rng.choice([0, 0, 1, 2]))
        ]
        content = random_words(rng) if not calls or rng.random() < 0.5 else None
        reasoning = random_words(rng) if rng.random() < 0.6 else None
        return Message("assistant", content, reasoning, calls)
    if role == "tool":
        return Message("tool", random_words(rng), tool_call_id=f"call_{rng.random()}", name=rng.choice(TOOL_NAMES))
    return Message(role, random_words(rng))  # type: ignore[arg-type]


def random_conversation(rng: random.Random) -> list[Message]:
    messages = [random_message(rng, "system")] if rng.random() < 0.5 else []
    messages.append(random_message(rng, "user"))
    for _ in range(rng.randint(1, 5)):
        messages.append(random_message(rng, rng.choice(["assistant", "assistant", "tool", "user"])))
    return messages


# --- what harnesses do to echoed turns -----------------------------------------------------------------------


def reshuffle(value: Any, rng: random.Random) -> Any:
    """The same JSON value with other key order and whole numbers flipped between 1 and 1.0."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: reshuffle(v, rng) for k, v in items}
    if isinstance(value, list):
        return [reshuffle(v, rng) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int) and rng.random() < 0.5:
        return float(value)
    if isinstance(value, float) and value.is_integer() and rng.random() < 0.5:
        return int(value)
    return value


def reserialize(arguments: str, rng: random.Random) -> str:
    value = reshuffle(json.loads(arguments), rng)
    style: dict[str, Any] = rng.choice(
        [
            {},
            {"separators": (",", ":")},
            {"indent": 2},
            {"ensure_ascii": False},
            {"indent": "\t", "ensure_ascii": False},
        ]
    )
    text = json.dumps(value, **style)
    return rng.choice(["", " ", "\n"]) + text + rng.choice(["", "\n"])


def rewrite_text(text: str | None, rng: random.Random) -> str | None:
    """Split into content parts and merge them back with or without newlines; trim; drop empty content."""
    if text is None:
        return rng.choice([None, ""])
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 3))))
    parts = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    merged = rng.choice(["", "\n", "\n\n", " "]).join(parts)
    return rng.choice([merged, merged.strip(), "  " + merged + "\n"])


def echo(message: Message, rng: random.Random) -> Message:
    return Message(
        message.role,
        rewrite_text(message.content, rng),
        None if rng.random() < 0.7 else message.reasoning,
        [
            ToolCall(tc.name, reserialize(tc.arguments, rng), rng.choice([None, f"toolu_{rng.random()}"]))
            for tc in message.tool_calls
        ],
        None if message.tool_call_id is None else message.tool_call_id.replace("_", ""),
        rng.choice([None, message.name]),
    )


# --- changes of meaning --------------------------------------------------------------------------------------


def change_a_leaf(value: Any, rng: random.Random) -> tuple[Any, bool]:
    if isinstance(value, dict) and value:
        key = rng.choice(sorted(value))
        new, changed = change_a_leaf(value[key], rng)
        return {**value, key: new}, changed
    if isinstance(value, list) and value:
        i = rng.randrange(len(value))
        new, changed = change_a_leaf(value[i], rng)
        return [*value[:i], new, *value[i + 1 :]], changed
    if isinstance(value, bool):
        return not value, True
    if isinstance(value, int | float):
        return value + 1, True
    if isinstance(value, str):
        return value + "x", True
    if value is None:
        return 0, True
    return value, False  # an empty dict or list has no leaf


def mutate(message: Message, rng: random.Random) -> tuple[str, Message] | None:
    """A copy that says something else (and the kind of change), or None if the change does not apply here."""
    out = copy.deepcopy(message)
    kind = rng.choice(["text", "role", "tool_name", "argument"])
    if kind == "text":
        text = out.content or ""
        at = rng.randint(0, len(text))
        out.content = text[:at] + rng.choice(["x", "é", "0", ".", "🙂"]) + text[at:]
    elif kind == "role":
        out.role = rng.choice([r for r in ("system", "user", "assistant", "tool") if r != message.role])
    elif not out.tool_calls:
        return None
    elif kind == "tool_name":
        tc = rng.choice(out.tool_calls)
        tc.name = rng.choice([n for n in TOOL_NAMES if n != tc.name])
    else:
        tc = rng.choice(out.tool_calls)
        value, changed = change_a_leaf(json.loads(tc.arguments), rng)
        if not changed:
            return None
        tc.arguments = json.dumps(value)
    return kind, out


# --- tests ---------------------------------------------------------------------------------------------------


def test_echoed_conversations_hash_the_same() -> None:
    rng = random.Random(2024)
    for _ in range(300):
        messages = random_conversation(rng)
        echoed = [echo(m, rng) for m in messages]
        assert [normalized(m) for m in echoed] == [normalized(m) for m in messages]
        assert [output_hash(m) for m in echoed] == [output_hash(m) for m in messages]
        assert prefix_hashes(echoed, TOOLS) == prefix_hashes(messages, TOOLS)


def test_changed_meaning_changes_the_hashes_from_that_turn_on() -> None:
    rng = random.Random(77)
    kinds_seen: Counter[str] = Counter()
    for _ in range(400):
        messages = random_conversation(rng)
        with_calls = [j for j, m in enumerate(messages) if m.tool_calls]
        i = rng.choice(with_calls) if with_calls and rng.random() < 0.5 else rng.randrange(len(messages))
        mutation = mutate(messages[i], rng)
        if mutation is None:
            continue
        kind, changed = mutation
        kinds_seen[kind] += 1
        # A harness rewrite on top of the change must not hide it.
        edited = [echo(m, rng) for m in messages[:i]] + [echo(changed, rng)] + messages[i + 1 :]
        assert normalized(edited[i]) != normalized(messages[i]), (messages[i], changed)
        assert output_hash(edited[i]) != output_hash(messages[i])
        before, after = prefix_hashes(messages, TOOLS), prefix_hashes(edited, TOOLS)
        assert after[:i] == before[:i]
        assert all(a != b for a, b in zip(after[i:], before[i:], strict=True))
    assert min(kinds_seen[k] for k in ("text", "role", "tool_name", "argument")) > 25, kinds_seen


def test_tools_list_seeds_every_prefix_hash() -> None:
    rng = random.Random(5)
    messages = random_conversation(rng)
    base = prefix_hashes(messages, TOOLS)
    other_tool_lists = [
        [],
        TOOLS[:2],
        [*TOOLS, ToolSpec("search")],
        [ToolSpec("get_weather", "Weather for a town.", TOOLS[0].parameters), *TOOLS[1:]],
        [ToolSpec("get_weather", TOOLS[0].description, {"type": "object", "properties": {}}), *TOOLS[1:]],
    ]
    for tools in other_tool_lists:
        assert all(a != b for a, b in zip(prefix_hashes(messages, tools), base, strict=True))
    # The same schemas with their JSON keys in another order are the same tools.
    reordered = [
        ToolSpec(t.name, t.description, None if t.parameters is None else dict(reversed(list(t.parameters.items()))))
        for t in TOOLS
    ]
    assert prefix_hashes(messages, reordered) == base
    assert tools_hash(reordered) == tools_hash(TOOLS)


def test_prefix_hashes_is_a_chain_that_extend_hash_continues() -> None:
    rng = random.Random(11)
    for _ in range(50):
        messages = random_conversation(rng)
        hashes = prefix_hashes(messages, TOOLS)
        assert len(hashes) == len(messages)
        assert len(set(hashes)) == len(hashes)
        assert hashes[:-1] == prefix_hashes(messages[:-1], TOOLS)
        assert extend_hash(hashes[-2], messages[-1]) == hashes[-1]
    assert prefix_hashes([], TOOLS) == []


def test_output_hash_ignores_history_but_not_role() -> None:
    answer = Message("assistant", "The capital is Paris.")
    assert output_hash(answer) == output_hash(Message("assistant", " The capital\nis Paris. ", "I recall it."))
    assert output_hash(answer) != output_hash(Message("user", "The capital is Paris."))
    assert output_hash(answer) != output_hash(Message("assistant", "The capital is Lyon."))


@pytest.mark.parametrize(
    ("written", "echoed"),
    [
        ('{"a": 1, "b": [1.0, 2.5]}', '{"b":[1,2.5],"a":1.0}'),
        ('{"city": "Zürich"}', '{"city": "Z\\u00fcrich"}'),
        ('{"n": 100000}', '{"n": 1e5}'),
        ('{"q": {"x": true, "y": null}}', '{\n  "q": {\n    "y": null,\n    "x": true\n  }\n}'),
        ("", "{}"),
        ("not json at all", " not json\nat all "),
    ],
)
def test_argument_reserializations_are_the_same_call(written: str, echoed: str) -> None:
    assert normalized(Message("assistant", None, tool_calls=[ToolCall("f", written, "call_1")])) == normalized(
        Message("assistant", "", tool_calls=[ToolCall("f", echoed, "fc_9")])
    )


@pytest.mark.parametrize(
    ("written", "echoed"),
    [
        ('{"a": 1}', '{"a": 2}'),
        ('{"a": 1}', '{"a": "1"}'),
        ('{"a": 1}', '{"a": true}'),
        ('{"a": 1.5}', '{"a": 1}'),
        ('{"a": "x y"}', '{"a": "xy"}'),  # whitespace inside a JSON string is a value, not layout
        ('{"a": 1}', '{"a": 1, "b": null}'),
        ('{"a": [1, 2]}', '{"a": [2, 1]}'),
    ],
)
def test_argument_value_changes_are_another_call(written: str, echoed: str) -> None:
    assert normalized(Message("assistant", None, tool_calls=[ToolCall("f", written)])) != normalized(
        Message("assistant", None, tool_calls=[ToolCall("f", echoed)])
    )


def test_whitespace_is_layout_in_content() -> None:
    # Content parts merged with or without newlines, re-indented or trimmed: the same turn.
    parts = ["First part.", "Second part,", " with more."]
    variants = ["".join(parts), "\n".join(parts), "\n\n".join(parts), "  " + " ".join(parts) + "\n"]
    assert len({normalized(Message("user", v)) for v in variants}) == 1
    assert normalized(Message("user", "First part.")) != normalized(Message("user", "First part!"))
    assert normalized(Message("user", None)) == normalized(Message("user", " \n"))
    assert normalized(Message("user", "a")) != normalized(Message("assistant", "a"))


def test_tool_results_ignore_call_ids_but_not_content() -> None:
    result = Message("tool", "42 files", tool_call_id="call_abc", name="run")
    assert normalized(result) == normalized(Message("tool", "42 files\n", tool_call_id="callabc"))
    assert normalized(result) != normalized(Message("tool", "43 files", tool_call_id="call_abc", name="run"))


def test_exact_hash_is_key_order_insensitive_and_content_sensitive() -> None:
    raw = {
        "role": "assistant",
        "content": [{"type": "text", "text": "Hi "}],
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}],
    }
    reordered = {
        "tool_calls": [{"function": {"arguments": '{"a":1}', "name": "f"}, "type": "function", "id": "call_1"}],
        "content": [{"text": "Hi ", "type": "text"}],
        "role": "assistant",
    }
    assert exact_hash(reordered) == exact_hash(raw)
    for change in (
        lambda m: m["content"][0].update(text="Hi"),  # even whitespace: this is the message as sent
        lambda m: m["tool_calls"][0].update(id="call_2"),
        lambda m: m["tool_calls"][0]["function"].update(arguments='{"a": 1}'),
        lambda m: m.update(content="Hi "),
        lambda m: m.update(name="bot"),
    ):
        other = copy.deepcopy(raw)
        change(other)
        assert exact_hash(other) != exact_hash(raw)


def test_message_to_template() -> None:
    message = Message(
        "assistant",
        None,
        "Think first.",
        [
            ToolCall("f", '{"city": "Paris", "n": 2}', "call_x"),
            ToolCall("g", "[1, 2]"),
            ToolCall("h", "{broken"),
            ToolCall("k", ""),
        ],
    )
    assert message.to_template() == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Think first.",
        "tool_calls": [
            {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": {"city": "Paris", "n": 2}}},
            {"id": "call_1", "type": "function", "function": {"name": "g", "arguments": "[1, 2]"}},
            {"id": "call_2", "type": "function", "function": {"name": "h", "arguments": "{broken"}},
            # No arguments at all is an empty object, which templates render as {}.
            {"id": "call_3", "type": "function", "function": {"name": "k", "arguments": {}}},
        ],
    }
    assert Message("tool", "ok", tool_call_id="call_x", name="f").to_template() == {
        "role": "tool",
        "content": "ok",
        "tool_call_id": "call_x",
        "name": "f",
    }
    # A name only means something on tool results; plain turns carry role and content only.
    assert Message("user", "hi", name="alice").to_template() == {"role": "user", "content": "hi"}
    assert Message("assistant", "hi", reasoning="").to_template() == {"role": "assistant", "content": "hi"}


def test_tool_spec_to_template() -> None:
    assert ToolSpec("run").to_template() == {
        "type": "function",
        "function": {"name": "run", "parameters": {"type": "object", "properties": {}}},
    }
    assert TOOLS[0].to_template()["function"] == {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }


def test_whitespace_removal_matches_the_regex_on_every_code_point() -> None:
    # Stored tail hashes were computed with re's ``\s+``; the faster str.split() must drop exactly the same
    # characters, or a conversation answered before an upgrade would no longer splice.
    import re

    from gateway.core.conversation import _norm_text

    pattern = re.compile(r"\s+")
    every = "".join(f"{chr(code)}." for code in range(0x110000) if not 0xD800 <= code <= 0xDFFF)
    assert _norm_text(every) == pattern.sub("", every)
