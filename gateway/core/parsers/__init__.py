"""Output parsers by model family: completion text → reasoning, content and tool calls.

``get_parser(name)`` returns the parser class for a family; the gateway builds one instance per completion
(``parser_cls(tools_requested=..., reasoning_started=...)``). Supporting another family (Mistral's
``[TOOL_CALLS]``, Llama 3's JSON tool calls) means one more ``OutputParser`` subclass listed in ``_PARSERS``.
"""

from __future__ import annotations

from gateway.core.parsers.base import (
    OutputParser,
    ParseDelta,
    ParsedOutput,
    ParsedToolCall,
    ToolCallDelta,
    collect,
)
from gateway.core.parsers.hermes import HermesParser

DEFAULT_PARSER = "hermes"  # Qwen2.5, Qwen3 and the tiny test model

_PARSERS: dict[str, type[OutputParser]] = {cls.name: cls for cls in (HermesParser,)}


def parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_parser(name: str) -> type[OutputParser]:
    """The parser class registered as ``name``; ValueError (listing the known names) when there is none."""
    try:
        return _PARSERS[name]
    except KeyError:
        known = ", ".join(parser_names())
        raise ValueError(f"unknown output parser {name!r}; known parsers: {known}") from None


__all__ = [
    "DEFAULT_PARSER",
    "HermesParser",
    "OutputParser",
    "ParseDelta",
    "ParsedOutput",
    "ParsedToolCall",
    "ToolCallDelta",
    "collect",
    "get_parser",
    "parser_names",
]
