"""Hermes-format output parser (Qwen2.5, Qwen3 and the tiny test model).

Format::

    <think>
    reasoning
    </think>

    content
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Rules, identical for ``parse`` and for streaming:

- Reasoning: when the text starts with ``<think>`` (after optional whitespace), or the prompt already opened
  the block (``reasoning_started``), everything up to ``</think>`` is reasoning, minus one leading and one
  trailing newline; without ``</think>`` the whole rest is reasoning. ``<think>`` anywhere else is content.
- Tool calls (only when tools were offered): a ``<tool_call>…</tool_call>`` block whose body is a JSON object
  with a string ``name`` and ``arguments`` (alias ``parameters``) that is an object, a JSON-text string, or
  absent (no arguments). Any other block, and an unterminated one, is content, byte for byte.
- Content: all other text. Whitespace at its start and end, and whitespace right after a tool call, is
  dropped; whitespace before a tool call is kept only if more content follows (it separates the two parts).

The scanner is a small state machine over the text: every character is looked at a bounded number of times
(tag searches use ``str.find`` on new text plus a tag-length overlap), so any input, however adversarial,
parses in linear time, whether it arrives as one delta or one character at a time.
"""

from __future__ import annotations

import contextlib
import json
import re
from enum import Enum
from typing import ClassVar

from gateway.core.parsers.base import OutputParser, ParseDelta, ToolCallDelta

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


class _State(Enum):
    START = "start"  # before the first non-whitespace character: may still open a reasoning block
    REASONING = "reasoning"
    CONTENT = "content"
    TOOL = "tool"  # inside <tool_call>, collecting the body until </tool_call>


def _partial_tag_len(text: str, tag: str, pos: int = 0) -> int:
    """Length of the longest suffix of ``text[pos:]`` that is a proper prefix of ``tag`` (to hold back)."""
    start = max(len(text) - len(tag) + 1, pos)
    # Every candidate suffix starts with the tag's first character; try them longest first.
    i = text.find(tag[0], start)
    while i != -1:
        if tag.startswith(text[i:]):
            return len(text) - i
        i = text.find(tag[0], i + 1)
    return 0


def _reject_constant(name: str) -> float:
    # NaN and Infinity are not JSON; json.dumps would write them back as invalid arguments.
    raise ValueError(f"non-standard JSON constant {name}")


def parse_tool_call_body(body: str) -> tuple[str, str] | None:
    """``(name, arguments JSON text)`` of a well-formed tool-call body, else None."""
    try:
        call = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # RecursionError: pathologically deep nesting
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call["arguments"] if "arguments" in call else call.get("parameters")
    if arguments is None:
        return call["name"], "{}"
    if isinstance(arguments, dict):
        return call["name"], json.dumps(arguments, ensure_ascii=False)
    if isinstance(arguments, str):
        # Some models write the arguments as a JSON-encoded string, as the OpenAI API carries them;
        # pass it on verbatim, but only if it is JSON a client can decode.
        try:
            decoded = json.loads(arguments, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            return None
        return (call["name"], arguments) if isinstance(decoded, dict) else None
    return None


_PARTIAL_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"?\s*(?:,\s*"arguments"\s*:\s*)?(.*)', re.S)


def partial_tool_call_body(body: str) -> tuple[str, str]:
    """``(name, arguments so far)`` of a call cut off inside its body, as OpenAI returns a call cut by max_tokens."""
    match = _PARTIAL_CALL.match(body)
    if match is None:
        return "", body
    name, arguments = match.groups()
    with contextlib.suppress(ValueError):  # a name cut inside an escape stays as written
        name = json.loads(f'"{name}"')
    return name, arguments


class HermesParser(OutputParser):
    name: ClassVar[str] = "hermes"

    def __init__(self, *, tools_requested: bool = True, reasoning_started: bool = False) -> None:
        super().__init__(tools_requested=tools_requested, reasoning_started=reasoning_started)
        self._state = _State.REASONING if reasoning_started else _State.START
        self._buffer = ""  # held-back text: a possible tag prefix (plus one newline in reasoning)
        # Reasoning: its first character is not out yet (a leading newline there is dropped).
        self._reasoning_fresh = True
        # Content: leading whitespace is dropped (start of content, or right after a tool call) ...
        self._content_strip_leading = True
        # ... and trailing whitespace waits here until more content shows it was not trailing.
        self._content_pending_ws = ""
        # TOOL: body pieces since <tool_call>; the closing tag is searched in new text plus an overlap.
        self._body: list[str] = []
        self._body_len = 0
        self._body_tail = ""
        self._tool_index = 0
        self._finished = False

    tool_call_close: ClassVar[str | None] = TOOL_CLOSE
    tool_call_open: ClassVar[str | None] = TOOL_OPEN

    @classmethod
    def starts_in_reasoning(cls, prompt_text: str) -> bool:
        tail = prompt_text.rstrip()
        return tail.endswith(THINK_OPEN)

    @classmethod
    def closed_reasoning(cls) -> str:
        # As Qwen3's templates write a turn without reasoning: '<think>\n\n</think>\n\n'.
        return "\n" + THINK_CLOSE + "\n\n"

    @classmethod
    def forced_call_prefix(cls, name: str | None) -> str | None:
        # As Hermes/Qwen chat templates render a call: '<tool_call>\n{"name": "…", "arguments": …}\n</tool_call>'.
        if name is None:
            return TOOL_OPEN + "\n"
        return TOOL_OPEN + '\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '

    def feed(self, text_delta: str) -> ParseDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        out = ParseDelta()
        if text_delta:
            self._run(text_delta, out)
        return out

    def finish(self) -> ParseDelta:
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        out = ParseDelta()
        if self._state is _State.START:
            self._emit_content(self._buffer, out)
        elif self._state is _State.REASONING:
            self._emit_reasoning(self._buffer, out, closing=True)
        elif self._state is _State.CONTENT:
            self._emit_content(self._buffer, out)
        elif self.partial_calls:  # a grammar held the call: cut short, it is still a call
            name, arguments = partial_tool_call_body("".join(self._body))
            out.tool_calls.append(ToolCallDelta(index=self._tool_index, name=name, arguments=arguments))
        else:  # an unterminated tool call is content, as written
            self._emit_content(TOOL_OPEN + "".join(self._body), out)
        self._buffer = ""
        self._body = []
        # Whatever whitespace is still pending ends the content: it is trailing, so it is dropped.
        self._content_pending_ws = ""
        return out

    def _run(self, text: str, out: ParseDelta) -> None:
        """Advance the state machine over ``text``.

        ``pos`` only moves forward and every ``find`` starts at it, so each character is scanned a bounded
        number of times; text held back from the previous delta (at most a tag's length) is scanned again.
        """
        if self._buffer:
            text = self._buffer + text
            self._buffer = ""
        pos, n = 0, len(text)
        while pos < n:
            if self._state is _State.START:
                # Leading whitespace is dropped whether or not a reasoning block follows (START is only
                # ever entered at the start of a delta, so pos == 0 here).
                pos = n - len(text.lstrip())
                if pos == n:
                    return
                if text.startswith(THINK_OPEN, pos):
                    self._state = _State.REASONING
                    pos += len(THINK_OPEN)
                elif n - pos < len(THINK_OPEN) and THINK_OPEN.startswith(text[pos:]):
                    self._buffer = text[pos:]
                    return
                else:
                    self._state = _State.CONTENT
            elif self._state is _State.REASONING:
                end = text.find(THINK_CLOSE, pos)
                if end != -1:
                    self._emit_reasoning(text[pos:end], out, closing=True)
                    self._state = _State.CONTENT
                    pos = end + len(THINK_CLOSE)
                    continue
                cut = n - _partial_tag_len(text, THINK_CLOSE, pos)
                # A newline right before the held-back text may be the one dropped before </think>.
                if cut > pos and text[cut - 1] == "\n":
                    cut -= 1
                self._emit_reasoning(text[pos:cut], out, closing=False)
                self._buffer = text[cut:]
                return
            elif self._state is _State.CONTENT:
                if not self.tools_requested:
                    self._emit_content(text[pos:], out)
                    return
                start = text.find(TOOL_OPEN, pos)
                if start != -1:
                    self._emit_content(text[pos:start], out)
                    self._state = _State.TOOL
                    pos = start + len(TOOL_OPEN)
                    continue
                cut = n - _partial_tag_len(text, TOOL_OPEN, pos)
                self._emit_content(text[pos:cut], out)
                self._buffer = text[cut:]
                return
            else:
                pos = self._scan_tool_body(text, pos, out)

    def _scan_tool_body(self, text: str, pos: int, out: ParseDelta) -> int:
        """Find ``</tool_call>`` from ``pos``; when found, emit the block and return the position after it."""
        if self._body:
            # The block began in an earlier delta (so pos == 0); the closing tag may start in its tail.
            window = self._body_tail + text
            end = window.find(TOOL_CLOSE)
            if end == -1:
                self._append_body(text)
                return len(text)
            body_end = self._body_len - len(self._body_tail) + end
            body = ("".join(self._body) + text)[:body_end]
            pos = body_end + len(TOOL_CLOSE) - self._body_len
            self._body = []
            self._body_len = 0
            self._body_tail = ""
        else:
            end = text.find(TOOL_CLOSE, pos)
            if end == -1:
                self._append_body(text[pos:])
                return len(text)
            body = text[pos:end]
            pos = end + len(TOOL_CLOSE)
        self._state = _State.CONTENT
        parsed = parse_tool_call_body(body)
        if parsed is None:
            self._emit_content(TOOL_OPEN + body + TOOL_CLOSE, out)
        else:
            name, arguments = parsed
            out.tool_calls.append(ToolCallDelta(index=self._tool_index, name=name, arguments=arguments))
            self._tool_index += 1
            self._content_strip_leading = True
        return pos

    def _append_body(self, text: str) -> None:
        # An empty piece still marks the block as open (a non-empty list) for the next delta.
        self._body.append(text)
        self._body_len += len(text)
        self._body_tail = (self._body_tail + text)[-(len(TOOL_CLOSE) - 1) :]

    def _emit_reasoning(self, text: str, out: ParseDelta, *, closing: bool) -> None:
        if text and self._reasoning_fresh:
            self._reasoning_fresh = False
            if text.startswith("\n"):
                text = text[1:]
        if closing and text.endswith("\n"):
            text = text[:-1]
        out.reasoning += text

    def _emit_content(self, text: str, out: ParseDelta) -> None:
        if self._content_strip_leading:
            text = text.lstrip()
            if not text:
                return
            self._content_strip_leading = False
        body = text.rstrip()
        if not body:
            self._content_pending_ws += text
            return
        out.content += self._content_pending_ws + body
        self._content_pending_ws = text[len(body) :]
