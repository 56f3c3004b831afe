"""The output-parser interface: completion text → reasoning, content and tool calls.

An engine returns token ids; the gateway decodes them to text and a parser turns that text back into the
API's structured fields. Model families write tool calls and reasoning differently (Hermes/Qwen tags,
Mistral's ``[TOOL_CALLS]``, Llama 3's bare JSON), so each family is one ``OutputParser`` subclass, chosen by
name through ``gateway.core.parsers.get_parser``.

A parser instance serves one completion. It parses either the whole text at once (``parse``) or a stream of
text deltas (``feed`` … ``finish``). The two must agree exactly: the concatenated ``content`` and
``reasoning`` of all deltas, and their tool calls in order, equal what ``parse`` returns for the concatenated
text, however the text was split. Streaming parsers therefore hold back only text whose meaning is still
undecided (a possible tag prefix, whitespace that is dropped if nothing follows it) and release it as soon as
it is decided.

Parsers never raise on model output: text that does not form a well-formed structure stays content.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    name: str
    # JSON text of the arguments: the model's own string when it wrote one, else
    # ``json.dumps(obj, ensure_ascii=False)`` of the object it wrote.
    arguments: str
    index: int  # position among this completion's tool calls, from 0


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None  # None when the completion has no content text
    reasoning: str | None  # None when the completion has no reasoning text
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int
    name: str | None  # set on a call's first delta; later deltas of the same call only extend arguments
    arguments: str


@dataclass(slots=True)
class ParseDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


def collect(deltas: Iterable[ParseDelta]) -> ParsedOutput:
    """Merge a stream of deltas into the non-streaming result they add up to."""
    content: list[str] = []
    reasoning: list[str] = []
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        content.append(delta.content)
        reasoning.append(delta.reasoning)
        for call in delta.tool_calls:
            if call.name is not None:
                names[call.index] = call.name
            arguments.setdefault(call.index, []).append(call.arguments)
    return ParsedOutput(
        content="".join(content) or None,
        reasoning="".join(reasoning) or None,
        tool_calls=[
            ParsedToolCall(name=names[index], arguments="".join(arguments[index]), index=index)
            for index in sorted(names)
        ],
    )


class OutputParser(ABC):
    """Parses one completion's text; subclasses implement one model family's output format.

    ``tools_requested``: the request offered tools. When it did not, tool-call syntax is left as content,
    since the client could not act on a call it never offered. ``reasoning_started``: the prompt already
    opened a reasoning block (e.g. Qwen3's template ending with ``<think>\\n``), so the completion begins
    inside it (``starts_in_reasoning`` tells from the rendered prompt). Subclasses whose constructor takes
    more than these two arguments override ``parse``, which builds a fresh instance.
    """

    name: ClassVar[str]

    def __init__(self, *, tools_requested: bool = True, reasoning_started: bool = False) -> None:
        self.tools_requested = tools_requested
        self.reasoning_started = reasoning_started
        # Set when a grammar held the answer's tool calls: a call cut short by max_tokens is returned as a call
        # with the arguments written so far, not as the call's raw markup.
        self.partial_calls = False

    # The tag that ends a tool call in this family's format (None: none): where a completion stops when the client
    # allows one tool call per turn (parallel_tool_calls false).
    tool_call_close: ClassVar[str | None] = None
    # The tag that opens one (None: none): with the closing tag, what a grammar for tool calls is made of.
    tool_call_open: ClassVar[str | None] = None

    @classmethod
    def starts_in_reasoning(cls, prompt_text: str) -> bool:
        """Whether a completion of this rendered prompt begins inside a reasoning block."""
        return False

    @classmethod
    def closed_reasoning(cls) -> str:
        """Text that, appended to a prompt that opened a reasoning block, closes it empty: a grammar's answer starts
        after it (reasoning is not possible under a grammar)."""
        return ""

    @classmethod
    def forced_call_prefix(cls, name: str | None) -> str | None:
        """Text that, appended to the prompt, puts the model inside a tool call (of function ``name``, or of any
        function): how a tool_choice that forces a call is honoured. None: this family cannot."""
        return None

    def parse(self, text: str) -> ParsedOutput:
        """Parse a whole completion; leaves this instance's streaming state untouched."""
        fresh = type(self)(tools_requested=self.tools_requested, reasoning_started=self.reasoning_started)
        return collect((fresh.feed(text), fresh.finish()))

    @abstractmethod
    def feed(self, text_delta: str) -> ParseDelta:
        """Consume the next piece of completion text; return what is decided so far."""

    @abstractmethod
    def finish(self) -> ParseDelta:
        """End of completion: decide and return everything still held back."""
