"""OpenAI Responses API wire format: request models, output items, the Response object, and the reasoning
round-trip codec.

Request models accept every documented input item and tool type (and tolerate unknown ones); the serving decides
what the model can act on. Output items are plain dicts built by small functions, shared by the streaming and
the non-streaming paths so both describe an answer identically; the Response object around them is a model.

Reasoning round trip: harnesses that send ``store: false`` (Codex, OpenClaw) cannot continue a response by id, so
they send our earlier output items back, and they keep a reasoning item only as its ``encrypted_content``. We have
no secret to protect in our own reasoning, so ``encrypted_content`` is a reversible encoding of its text (base64 of
a small JSON object with a version tag); ``decode_reasoning`` reads it back and returns None for anything another
provider encrypted.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from gateway.core.job import JsonOutput
from gateway.protocols.common.wire import ModelRequest, ResponseModel, TolerantModel, omitted

# --- request ---------------------------------------------------------------------------------------------------


class ContentPart(TolerantModel):
    """One part of a message's or a tool output's content (`input_text`, `output_text`, `refusal`, images...)."""

    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(TolerantModel):
    # `type` is optional on input messages ("easy input message" in the API reference).
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    status: str | None = None


class FunctionCallItem(TolerantModel):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str
    name: str
    # The standard is a JSON string; tolerate an object.
    arguments: str | dict[str, Any] = ""
    status: str | None = None


class FunctionCallOutputItem(TolerantModel):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: str | list[ContentPart]
    status: str | None = None


class CustomToolCallItem(TolerantModel):
    type: Literal["custom_tool_call"]
    id: str | None = None
    call_id: str
    name: str
    input: str = ""
    status: str | None = None


class CustomToolCallOutputItem(TolerantModel):
    type: Literal["custom_tool_call_output"]
    id: str | None = None
    call_id: str
    output: str | list[ContentPart]
    status: str | None = None


class SummaryPart(TolerantModel):
    type: str = "summary_text"
    text: str = ""


class ReasoningItem(TolerantModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryPart] = Field(default_factory=list)
    content: list[ContentPart] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class OtherItem(TolerantModel):
    """Any other item (`additional_tools`, `web_search_call`, `item_reference`, `compaction`...): kept, not used."""

    type: str


KNOWN_ITEMS = frozenset(
    {"message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output", "reasoning"}
)


def _item_kind(value: Any) -> str:
    if isinstance(value, dict):
        kind = value.get("type", "message" if "role" in value else None)
    else:
        kind = getattr(value, "type", None)
    return kind if isinstance(kind, str) and kind in KNOWN_ITEMS else "other"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_kind),
]


class ToolIn(TolerantModel):
    """A tool of any type; only ``function`` tools reach the model (the rest need a runtime we do not have)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningConfig(TolerantModel):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(ModelRequest):
    model: str
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[ToolIn] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    reasoning: ReasoningConfig | None = None
    # The API stores responses unless told not to.
    store: bool | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    client_metadata: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    user: str | None = None
    background: bool | None = None
    conversation: Any = None
    # Extensions (not in the OpenAI API): sampling seed, as on chat completions.
    seed: int | None = None

    def json_output(self) -> JsonOutput | None:
        """The JSON output ``text.format`` asks for (None: text); ValueError for a malformed one."""
        fmt = (self.text or {}).get("format") or {}
        if not isinstance(fmt, dict):
            raise ValueError("text.format must be an object")
        return JsonOutput.of(fmt, fmt.get("schema"), "text.format")

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        for i, tool in enumerate(self.tools or []):
            if tool.type == "function" and not tool.name:
                raise ValueError(f"tools[{i}]: a function tool needs a name")
        if isinstance(self.tool_choice, dict) and self.tool_choice.get("type") != "function":
            raise ValueError(
                f"tool_choice of type {self.tool_choice.get('type')!r} is not supported: only function tools can be "
                'forced ("required" or {"type": "function", "name": …})'
            )
        if isinstance(self.tool_choice, dict):
            name = self.tool_choice.get("name")
            if not name:
                raise ValueError("tool_choice of type function needs a name")
            if not any(t.type == "function" and t.name == name for t in self.tools or []):
                raise ValueError(f"tool_choice names a function that is not in tools: {name!r}")
        self.json_output()
        if self.background:
            raise ValueError("background responses are not supported")
        if self.conversation is not None:
            raise ValueError("conversations are not supported; send the input items or use previous_response_id")
        if self.input is None and self.previous_response_id is None:
            raise ValueError("input is required")
        return self

    @property
    def stored(self) -> bool:
        return self.store is not False

    def wants(self, include: str) -> bool:
        return include in (self.include or ())


# --- reasoning codec -----------------------------------------------------------------------------------------

REASONING_TAG = "clawgate.reasoning.v1"


def encode_reasoning(text: str) -> str:
    payload = json.dumps({"v": REASONING_TAG, "text": text}, ensure_ascii=False, separators=(",", ":"))
    return base64.b64encode(payload.encode()).decode("ascii")


def decode_reasoning(blob: str) -> str | None:
    """The reasoning text of an ``encrypted_content`` we produced; None for anyone else's."""
    try:
        value = json.loads(base64.b64decode(blob, validate=True))
    except (binascii.Error, ValueError):
        return None
    if not isinstance(value, dict) or value.get("v") != REASONING_TAG or not isinstance(value.get("text"), str):
        return None
    text: str = value["text"]
    return text


# --- output items ------------------------------------------------------------------------------------------------


def reasoning_item(item_id: str, text: str, *, encrypted: bool, status: str = "completed") -> dict[str, Any]:
    item: dict[str, Any] = {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }
    if encrypted:
        item["encrypted_content"] = encode_reasoning(text)
    return item


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, *, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [output_text_part(text)],
    }


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, *, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage(input_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


# --- response models -----------------------------------------------------------------------------------------
# The Response object is a model (documented in the OpenAPI schema, serialized with ``model_dump_json``); its
# output items are built as dicts by the functions above, because the stream sends them one event at a time, and
# validated into the item models once per Response object.


class ReasoningText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOut(ResponseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[SummaryPart] = Field(default_factory=list)
    content: list[ReasoningText]
    status: str
    encrypted_content: str | None = omitted()


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class MessageOut(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str
    content: list[OutputText]


class FunctionCallItemOut(ResponseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = Annotated[ReasoningOut | MessageOut | FunctionCallItemOut, Field(discriminator="type")]


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str
    background: bool = False
    error: dict[str, Any] | None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    prompt_cache_key: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: str
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, Any]


def text_format(req: ResponsesRequest) -> dict[str, Any]:
    """The output format the response was held to, as the request gave it (text when none)."""
    fmt = (req.text or {}).get("format")
    return fmt if isinstance(fmt, dict) and fmt.get("type", "text") != "text" else {"type": "text"}


def response_object(
    req: ResponsesRequest,
    *,
    response_id: str,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    incomplete_reason: str | None = None,
) -> ResponseObject:
    """A Response object, echoing the request's settings as the API does."""
    return ResponseObject.model_validate(
        {
            "id": response_id,
            "created_at": created_at,
            "status": status,
            "error": error,
            "incomplete_details": None if incomplete_reason is None else {"reason": incomplete_reason},
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": req.model,
            "output": output,
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key,
            # reasoning.effort and text.verbosity are hints the model cannot be made to follow: accepted (harnesses
            # send them on every call) but not echoed as if applied.
            "reasoning": {"effort": None, "summary": req.reasoning.summary if req.reasoning else None},
            "store": req.stored,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": text_format(req)},
            "tool_choice": req.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }
    )
