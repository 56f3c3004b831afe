"""The block state machine of the typed streams (Anthropic content blocks, Responses output items).

Both protocols stream an answer as a sequence of blocks, each one kind of text: a run of reasoning, a run of
answer text, or one tool call. A delta of another kind than the open block's (or a tool call's first delta)
closes the open block and opens a new one. This class owns that sequencing; a protocol says only which events
open, extend and close a block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from gateway.core.job import ChoiceDelta
from gateway.core.parsers.base import ToolCallDelta

REASONING = "reasoning"
TEXT = "text"
TOOL_CALL = "tool_call"


class BlockStream(ABC):
    def __init__(self) -> None:
        self.kind: str | None = None  # REASONING | TEXT | TOOL_CALL while a block is open

    @abstractmethod
    def open_block(self, kind: str, call: ToolCallDelta | None) -> list[bytes]:
        """The events that start a block of ``kind`` (``call``: the tool call's first delta, for TOOL_CALL)."""

    @abstractmethod
    def extend_block(self, kind: str, text: str) -> list[bytes]:
        """The events that add ``text`` to the open block."""

    @abstractmethod
    def close_block(self, kind: str) -> list[bytes]:
        """The events that end the open block."""

    @abstractmethod
    def starts_call(self, call: ToolCallDelta) -> bool:
        """Whether a tool-call delta begins another call while a tool-call block is open."""

    def open(self, kind: str, call: ToolCallDelta | None = None) -> list[bytes]:
        out = self.close()
        self.kind = kind
        out += self.open_block(kind, call)
        return out

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        out = self.close_block(self.kind)
        self.kind = None
        return out

    def feed(self, ev: ChoiceDelta) -> list[bytes]:
        out: list[bytes] = []
        if ev.reasoning:
            if self.kind != REASONING:
                out += self.open(REASONING)
            out += self.extend_block(REASONING, ev.reasoning)
        if ev.content:
            if self.kind != TEXT:
                out += self.open(TEXT)
            out += self.extend_block(TEXT, ev.content)
        for tc in ev.tool_calls:
            if self.kind != TOOL_CALL or self.starts_call(tc):
                out += self.open(TOOL_CALL, tc)
            if tc.arguments:
                out += self.extend_block(TOOL_CALL, tc.arguments)
        return out
