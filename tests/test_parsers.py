"""Output parsers: Hermes/Qwen reasoning and tool calls, non-streaming cases and streaming agreement.

The streaming parser must give exactly the non-streaming result however the text is split, and the
non-streaming result must follow the documented rules; both are checked against a deliberately naive reference
implementation of those rules on hundreds of seeded random texts built from tags, partial tags, valid and
malformed tool-call bodies, whitespace and non-ASCII text.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from gateway.core.parsers import (
    DEFAULT_PARSER,
    HermesParser,
    OutputParser,
    ParsedOutput,
    ParsedToolCall,
    collect,
    get_parser,
)


def stream(parser: OutputParser, chunks: list[str]) -> ParsedOutput:
    deltas = [parser.feed(chunk) for chunk in chunks]
    deltas.append(parser.finish())
    for delta in deltas:
        # Hermes emits each tool call whole, as one delta with its name.
        assert all(call.name is not None for call in delta.tool_calls)
    return collect(deltas)


def call(name: str, arguments: str, index: int = 0) -> ParsedToolCall:
    return ParsedToolCall(name=name, arguments=arguments, index=index)


# --- non-streaming cases ----------------------------------------------------------------------


def test_registry() -> None:
    assert DEFAULT_PARSER == "hermes"
    assert get_parser("hermes") is HermesParser
    with pytest.raises(ValueError, match="hermes"):
        get_parser("no-such-family")


def test_plain_text() -> None:
    assert HermesParser().parse("Hello, world!\n") == ParsedOutput("Hello, world!", None, [])
    assert HermesParser().parse("") == ParsedOutput(None, None, [])
    assert HermesParser().parse(" \n ") == ParsedOutput(None, None, [])


def test_reasoning_and_content() -> None:
    text = "<think>\nLet me think.\nStill thinking.\n</think>\n\nThe answer is 4."
    assert HermesParser().parse(text) == ParsedOutput("The answer is 4.", "Let me think.\nStill thinking.", [])
    # Leading whitespace before <think> is allowed; only one newline is stripped on each side.
    text = "\n <think>\n\nidea\n\n</think>answer"
    assert HermesParser().parse(text) == ParsedOutput("answer", "\nidea\n", [])
    # Qwen3 with thinking disabled emits an empty block.
    assert HermesParser().parse("<think>\n\n</think>\n\nHi") == ParsedOutput("Hi", None, [])


def test_think_tag_not_at_start_is_content() -> None:
    text = "Use <think> tags like <think>this</think>."
    assert HermesParser().parse(text) == ParsedOutput(text, None, [])


def test_unterminated_reasoning() -> None:
    assert HermesParser().parse("<think>\nstill going <tool_call>") == ParsedOutput(None, "still going <tool_call>", [])


def test_reasoning_started_by_prompt() -> None:
    parser = HermesParser(reasoning_started=True)
    assert parser.parse("I should call it.\n</think>\n\nDone.") == ParsedOutput("Done.", "I should call it.", [])
    assert parser.parse("cut off by length") == ParsedOutput(None, "cut off by length", [])
    # A stray </think> without an opened block is just text.
    assert HermesParser().parse("a</think>b") == ParsedOutput("a</think>b", None, [])


def test_starts_in_reasoning() -> None:
    assert HermesParser.starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not HermesParser.starts_in_reasoning("<|im_start|>assistant\n")
    assert not HermesParser.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_reasoning_then_tool_call() -> None:
    text = (
        "<think>\nNeed the weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    )
    assert HermesParser().parse(text) == ParsedOutput(
        None, "Need the weather.", [call("get_weather", '{"city": "Paris", "unit": "c"}')]
    )


def test_two_tool_calls_with_text_between() -> None:
    text = (
        "I'll check both.\n"
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        "Now the second.\n"
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n'
    )
    assert HermesParser().parse(text) == ParsedOutput(
        "I'll check both.\nNow the second.",
        None,
        [call("a", '{"x": 1}', 0), call("b", "{}", 1)],
    )


def test_arguments_as_json_string_and_aliases() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"q\\":  \\"x\\"}"}</tool_call>'
    # A string is passed through as the model wrote it (two spaces included).
    assert HermesParser().parse(text).tool_calls == [call("f", '{"q":  "x"}')]
    text = '<tool_call>{"name": "g", "parameters": {"k": [1, 2]}}</tool_call>'
    assert HermesParser().parse(text).tool_calls == [call("g", '{"k": [1, 2]}')]
    text = '<tool_call>{"name": "now"}</tool_call>'
    assert HermesParser().parse(text).tool_calls == [call("now", "{}")]


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "f", "arguments": {"x": 1}',  # truncated JSON
        '{"arguments": {"x": 1}}',  # no name
        '{"name": 3, "arguments": {}}',  # name not a string
        '["f", {}]',  # not an object
        '{"name": "f", "arguments": "not json"}',
        '{"name": "f", "arguments": "[1, 2]"}',
        '{"name": "f", "arguments": [1, 2]}',
        '{"name": "f", "arguments": {"x": NaN}}',
        "",
        "[" * 100_000,  # deep nesting must not escape as RecursionError
    ],
)
def test_malformed_tool_call_is_content(body: str) -> None:
    text = f"Before.\n<tool_call>\n{body}\n</tool_call>\nAfter."
    assert HermesParser().parse(text) == ParsedOutput(text, None, [])


def test_malformed_block_does_not_hide_valid_one() -> None:
    bad = "<tool_call>{oops}</tool_call>"
    good = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert HermesParser().parse(bad + "\n" + good) == ParsedOutput(bad, None, [call("f", "{}")])


def test_unterminated_tool_call_is_content() -> None:
    text = 'Calling.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}'
    assert HermesParser().parse(text) == ParsedOutput(text, None, [])


def test_no_tools_offered_leaves_tool_call_text() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert HermesParser(tools_requested=False).parse(text) == ParsedOutput(text, None, [])
    assert HermesParser(tools_requested=True).parse(text).tool_calls == [call("f", "{}")]


def test_unicode_in_arguments() -> None:
    text = '<tool_call>{"name": "translate", "arguments": {"text": "日本語 🙂", "esc": "\\u00e9"}}</tool_call>'
    parsed = HermesParser().parse(text)
    # Unicode is written as itself, not as \\u escapes.
    assert parsed.tool_calls == [call("translate", '{"text": "日本語 🙂", "esc": "é"}')]
    assert json.loads(parsed.tool_calls[0].arguments) == {"text": "日本語 🙂", "esc": "é"}


def test_whitespace_around_blocks() -> None:
    block = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    parser = HermesParser()
    assert parser.parse(f"  A \n\n{block}\n\n  B  ") == ParsedOutput("A \n\nB", None, [call("f", "{}")])
    assert parser.parse(f"A\n{block}\n \n{block}\n").content == "A"
    assert parser.parse(f"{block} B").content == "B"


# --- streaming --------------------------------------------------------------------------------


def test_streaming_emits_text_as_soon_as_it_cannot_be_a_tag() -> None:
    parser = HermesParser()
    assert parser.feed("Hello <tool").content == "Hello"  # the space waits: it may precede a tool call
    assert parser.feed("_ca").content == ""
    assert parser.feed("x").content == " <tool_cax"
    parser = HermesParser()
    assert parser.feed("<thi").reasoning == ""
    assert parser.feed("nk>\nabc </th").reasoning == "abc "
    delta = parser.feed("ink>\n\nHi")
    assert (delta.reasoning, delta.content) == ("", "Hi")


def test_streaming_emits_a_tool_call_when_its_block_closes() -> None:
    parser = HermesParser()
    assert parser.feed('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_ca').tool_calls == []
    delta = parser.feed("ll>\n")
    assert [(c.index, c.name, c.arguments) for c in delta.tool_calls] == [(0, "f", '{"a": 1}')]
    assert not parser.finish()


def test_feed_after_finish_is_an_error() -> None:
    parser = HermesParser()
    parser.feed("x")
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("y")


def test_parse_does_not_disturb_streaming_state() -> None:
    parser = HermesParser()
    assert parser.feed("<think>a").reasoning == "a"
    assert parser.parse("plain") == ParsedOutput("plain", None, [])
    assert parser.feed("b</think>c").reasoning == "b"
    assert parser.finish().content == ""


# --- reference implementation and random texts --------------------------------------------------


def reference_body(body: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters"))
    if arguments is None:
        return obj["name"], "{}"
    if isinstance(arguments, dict):
        return obj["name"], json.dumps(arguments, ensure_ascii=False)
    if isinstance(arguments, str):
        try:
            return (obj["name"], arguments) if isinstance(json.loads(arguments), dict) else None
        except ValueError:
            return None
    return None


def reference_parse(text: str, *, tools: bool, started: bool) -> ParsedOutput:
    rest, reasoning = text, None
    if not started and text.lstrip().startswith("<think>"):
        started, rest = True, text.lstrip()[len("<think>") :]
    if started:
        thought, closed, after = rest.partition("</think>")
        rest = after if closed else ""
        reasoning = thought.removeprefix("\n").removesuffix("\n") or None
    segments: list[str] = [""]
    calls: list[ParsedToolCall] = []
    pos = 0
    while tools:
        start = rest.find("<tool_call>", pos)
        end = rest.find("</tool_call>", start + len("<tool_call>")) if start >= 0 else -1
        if end < 0:
            break
        parsed = reference_body(rest[start + len("<tool_call>") : end])
        if parsed is None:
            segments[-1] += rest[pos : end + len("</tool_call>")]
        else:
            segments[-1] += rest[pos:start]
            calls.append(call(parsed[0], parsed[1], len(calls)))
            segments.append("")
        pos = end + len("</tool_call>")
    segments[-1] += rest[pos:]
    # Whitespace after a call (or at the start) goes, as does trailing whitespace.
    content = "".join(segment.lstrip() for segment in segments).rstrip()
    return ParsedOutput(content or None, reasoning, calls)


VALID_BODIES = [
    '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
    '{"name":"f","arguments":"{\\"a\\": 1}"}',
    '{"name": "g", "parameters": {"q": "日本 🙂"}}',
    ' {"name": "h"} ',
    '{"name": "search", "arguments": {"query": "a <tool_call> b", "n": [1, 2.5, null, true]}}',
]
INVALID_BODIES = ['{"name": 1}', "{bad", "[]", '{"arguments": {}}', '{"name": "x", "arguments": "nope"}', ""]
PIECES = [
    "Hello",
    " world",
    "é",
    "日本語",
    "🙂",
    "\n",
    " ",
    "\n\n",
    "\t",
    "x",
    "<",
    "</",
    "<t",
    "<tool",
    "<tool_call",
    "</tool_call",
    "<think",
    "</think",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "> ",
    "{",
    '"',
]


def random_text(rng: random.Random) -> str:
    parts: list[str] = []
    if rng.random() < 0.5:
        parts.append(rng.choice(["", " ", "\n", " \n "]))
        if rng.random() < 0.7:
            parts.append("<think>" + rng.choice(["", "\n", "\n\n"]))
            parts.extend(rng.choice([*PIECES[:10], "<tool_call>", "</thi", "<think>"]) for _ in range(rng.randrange(5)))
            if rng.random() < 0.8:
                parts.append(rng.choice(["", "\n", "\n\n"]) + "</think>" + rng.choice(["", "\n", "\n\n"]))
    for _ in range(rng.randrange(14)):
        roll = rng.random()
        if roll < 0.25:
            body = rng.choice(VALID_BODIES if rng.random() < 0.7 else INVALID_BODIES)
            closing = "</tool_call>" if rng.random() < 0.9 else ""
            parts.append(rng.choice(["", "\n", " "]) + "<tool_call>" + body + closing)
        else:
            parts.append(rng.choice(PIECES))
    return "".join(parts)


def random_chunks(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("seed", range(400))
def test_random_texts_match_reference_and_stream_agrees(seed: int) -> None:
    rng = random.Random(seed)
    text = random_text(rng)
    for tools in (True, False):
        for started in (False, True):
            expected = reference_parse(text, tools=tools, started=started)
            parsers = [HermesParser(tools_requested=tools, reasoning_started=started) for _ in range(5)]
            assert parsers[0].parse(text) == expected, (text, tools, started)
            for parser in parsers[1:4]:
                assert stream(parser, random_chunks(rng, text)) == expected, (text, tools, started)
            assert stream(parsers[4], list(text)) == expected, (text, tools, started)


def test_every_split_point() -> None:
    text = (
        " <think>\nplan: call f\n</think>\n\nOK.\n"
        '<tool_call>\n{"name": "f", "arguments": {"s": "日本 🙂"}}\n</tool_call>\n'
        "mid </tool_call> <tool_call>{bad}</tool_call>\n"
        '<tool_call>{"name": "g", "arguments": "{}"}</tool_call>  tail <tool_call>{"name": "h"'
    )
    expected = HermesParser().parse(text)
    assert expected == reference_parse(text, tools=True, started=False)
    assert [c.name for c in expected.tool_calls] == ["f", "g"]
    for i in range(len(text) + 1):
        for j in (i, min(i + 3, len(text)), min(i + 11, len(text))):
            assert stream(HermesParser(), [text[:i], text[i:j], text[j:]]) == expected, (i, j)


# --- adversarial inputs: linear-time scanning --------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "<" * 100_000,
        "<tool_call>" * 10_000,
        "<tool_call></tool_call>" * 5_000,
        "<tool_call" * 10_000,
        " " * 100_000 + "x",
        "<think>" + "</thin" * 20_000,
        "<tool_call>" + "</tool_cal" * 10_000,
        '<tool_call>{"name": "f", "arguments": {"a": "' + "x" * 100_000 + '"}}</tool_call>',
    ],
)
def test_pathological_inputs_parse_and_stream(text: str) -> None:
    expected = reference_parse(text, tools=True, started=False)
    assert HermesParser().parse(text) == expected
    # Small deltas re-scan at most a tag's worth of held text, so this stays linear too.
    chunks = [text[i : i + 7] for i in range(0, len(text), 7)]
    assert stream(HermesParser(), chunks) == expected
