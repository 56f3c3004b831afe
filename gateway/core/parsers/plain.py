"""The output parser of the APIs that return raw text (completions): everything is content, nothing is parsed."""

from __future__ import annotations

from gateway.core.parsers.base import ParseDelta, ParsedOutput


class PlainText:
    """The parser interface for APIs that return raw text."""

    def feed(self, text: str) -> ParseDelta:
        return ParseDelta(content=text)

    def finish(self) -> ParseDelta:
        return ParseDelta()

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput(content=text, reasoning=None)
