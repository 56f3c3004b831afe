"""Anthropic Messages API wire models (`POST /v1/messages`, `POST /v1/messages/count_tokens`): requests and whole
responses (stream events are built per token as plain dicts, where a model costs more than it documents).

Content blocks are a tagged union on ``type``. Block types the gateway translates (text, thinking, tool use,
tool results) get their own model so a malformed one is a 400 naming the field; every other type (images,
documents, server-tool blocks, types newer than this file) parses as ``OtherBlock`` so the translation can answer
it with a clear message instead of a validation error listing every union member. Harness extras
(``cache_control``, ``citations``, ``context_management``, ``output_config``) are tolerated and logged by
``TolerantModel``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from gateway.core.job import JsonOutput
from gateway.protocols.common.wire import ModelRequest, ResponseModel, TolerantModel


class TextBlock(TolerantModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(TolerantModel):
    type: Literal["thinking"] = "thinking"
    thinking: str = ""
    # Replayed unchanged by clients; the gateway's own signatures carry no authority (see serving.py).
    signature: str | None = None


class RedactedThinkingBlock(TolerantModel):
    type: Literal["redacted_thinking"] = "redacted_thinking"
    data: str = ""


class ToolUseBlock(TolerantModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)


class OtherBlock(TolerantModel):
    """Any block type the gateway does not translate (image, document, tool_reference, server tools ...)."""

    type: str


def _inner_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "text" if kind == "text" else "other"


# Blocks inside a tool_result: text, or something the translation refuses or describes.
ToolResultContent = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[OtherBlock, Tag("other")],
    Discriminator(_inner_tag),
]


class ToolResultBlock(TolerantModel):
    type: Literal["tool_result"] = "tool_result"
    tool_use_id: str
    content: str | list[ToolResultContent] | None = None
    is_error: bool | None = None


_BLOCK_TAGS = {"text", "thinking", "redacted_thinking", "tool_use", "tool_result"}


def _block_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in _BLOCK_TAGS else "other"


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_tag),
]


class InputMessage(TolerantModel):
    # "system" is not in Anthropic's schema, but Claude Code sends mid-conversation system messages.
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class ToolDef(TolerantModel):
    """A client tool (``input_schema`` given) or a server tool (``type`` like ``web_search_20250305``)."""

    name: str | None = None
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(TolerantModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(TolerantModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    # "omitted": thinking blocks carry their signature but no text (Claude Code asks for this).
    display: str | None = None


class ConversationFields(ModelRequest):
    """What both endpoints render: the model, the conversation and the tools."""

    model: str = Field(min_length=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @model_validator(mode="after")
    def _check_tool_choice(self) -> ConversationFields:
        choice = self.tool_choice
        if choice is not None and choice.type == "tool":
            if not choice.name:
                raise ValueError("tool_choice of type 'tool' needs a name")
            if not any(t.name == choice.name for t in self.tools or []):
                raise ValueError(f"tool_choice names a tool that is not in tools: {choice.name!r}")
        return self


def output_format(output_config: dict[str, Any] | None) -> JsonOutput | None:
    """The JSON output ``output_config.format`` asks for (None: text); ValueError for a malformed one."""
    fmt = (output_config or {}).get("format") or {}
    if not isinstance(fmt, dict):
        raise ValueError("output_config.format must be an object")
    if fmt and fmt.get("type") != "json_schema":
        raise ValueError(f"output_config.format of type {fmt.get('type')!r} is not supported: use 'json_schema'")
    return JsonOutput.of(fmt, fmt.get("schema"), "output_config.format") if fmt else None


class MessagesRequest(ConversationFields):
    # Required by Anthropic; absent here means "up to the server cap".
    max_tokens: int | None = Field(default=None, ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    # effort is a hint (accepted); format (a JSON schema) is decoded under its grammar (gateway/core/structured.py).
    output_config: dict[str, Any] | None = None

    @field_validator("output_config")
    @classmethod
    def _check_output_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        output_format(value)
        return value

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty_stops(cls, value: list[str] | None) -> list[str] | None:
        if value and any(not s for s in value):
            raise ValueError("stop sequences must be non-empty")
        return value


class CountTokensRequest(ConversationFields):
    pass


# --- responses -----------------------------------------------------------------------------------------------


class ThinkingOut(ResponseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


class TextOut(ResponseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(ResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(ResponseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Annotated[ThinkingOut | TextOut | ToolUseOut, Field(discriminator="type")]]
    stop_reason: str
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(ResponseModel):
    input_tokens: int


class AnthropicErrorDetail(ResponseModel):
    type: str
    message: str


class AnthropicError(ResponseModel):
    """The Messages API's error shape."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
