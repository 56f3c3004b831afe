"""One choice's text pipeline: sampled token ids → text deltas → stop strings cut → content, reasoning, tool calls.

``ChatService.run_choice`` feeds each engine delta's ids in and sends what comes out to the protocol; at the end
``finish`` flushes what the detokenizer and the parser held back, and ``output`` is the whole parsed answer (what a
non-streaming response returns, and what the next turn is matched against).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.core.detokenize import IncrementalDetokenizer
from gateway.core.parsers.base import OutputParser, ParseDelta, ParsedOutput, collect
from gateway.core.parsers.plain import PlainText
from gateway.core.stops import StopTrimmer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TextPipeline:
    """The text of one choice as its tokens arrive (see the module docstring)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        parser: OutputParser | PlainText,
        stop: tuple[str, ...],
        forced_text: str = "",
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self.trimmer = StopTrimmer(stop)
        self.parser = parser
        # A forced tool call's opening was appended to the prompt: the parser reads it first, and it is part of the
        # answer's parsed output (never of a delta: the client sees the call itself).
        self.deltas: list[ParseDelta] = [parser.feed(forced_text) if forced_text else ParseDelta()]

    def feed(self, token_ids: list[int]) -> ParseDelta:
        """What ``token_ids`` add to the text the client sees (empty while a stop string or a tag may be starting)."""
        text = self.trimmer.feed(self.detokenizer.add(token_ids))
        delta = self.parser.feed(text) if text else ParseDelta()
        self.deltas.append(delta)
        return delta

    def finish(self) -> ParseDelta:
        """What was held back, once the engine is done."""
        tail = self.trimmer.feed(self.detokenizer.finish()) + self.trimmer.finish()
        last = self.parser.feed(tail) if tail else ParseDelta()
        closing = self.parser.finish()
        self.deltas += (last, closing)
        return ParseDelta(
            last.content + closing.content, last.reasoning + closing.reasoning, last.tool_calls + closing.tool_calls
        )

    def output(self) -> ParsedOutput:
        return collect(self.deltas)

    @property
    def stopped(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self.trimmer.stopped
