"""OpenAI chat-completions and completions wire models: requests, whole responses and the model list.

Stream chunks are not models: one is built per token, and a model per chunk costs more than it documents.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gateway.core.job import JsonOutput
from gateway.protocols.common.wire import ModelRequest, ResponseModel, TolerantModel, omitted


class ContentPart(TolerantModel):
    type: str
    text: str | None = None


class FunctionCallIn(TolerantModel):
    name: str
    # Harnesses send a JSON string (the standard) but some send an object.
    arguments: str | dict[str, Any] = ""


class ToolCallIn(TolerantModel):
    id: str | None = None
    type: str = "function"
    function: FunctionCallIn


class ChatMessage(TolerantModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    # Alternative spelling used by some clients (OpenRouter, newer vLLM).
    reasoning: str | None = None


class FunctionDef(TolerantModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(TolerantModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(TolerantModel):
    include_usage: bool = False


class SamplingFields(ModelRequest):
    """Fields shared by chat completions and completions."""

    model: str
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: object) -> object:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        if len(stops) > 16:
            raise ValueError("at most 16 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # text, json_object or json_schema: a JSON format is decoded under its grammar (gateway/core/structured.py).
    response_format: dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("response_format")
    @classmethod
    def _check_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        json_output(value)
        return value

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if isinstance(self.tool_choice, dict):
            fn = self.tool_choice.get("function") or {}
            name = fn.get("name") if isinstance(fn, dict) else None
            if not name:
                raise ValueError("tool_choice object needs function.name")
            if not any(t.function.name == name for t in self.tools or []):
                raise ValueError(f"tool_choice names a function that is not in tools: {name!r}")
        return self


def json_output(response_format: dict[str, Any] | None) -> JsonOutput | None:
    """The JSON output a chat ``response_format`` asks for (None: plain text); ValueError for a malformed one."""
    fmt = response_format or {}
    spec = fmt.get("json_schema") if fmt.get("type") == "json_schema" else None
    if spec is not None and not isinstance(spec, dict):
        raise ValueError("response_format json_schema must be an object with a schema")
    return JsonOutput.of(fmt, (spec or {}).get("schema"), "response_format")


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    # vLLM extension: return prompt and completion token ids.
    return_token_ids: bool = False

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and value and isinstance(value[0], list) and any(not p for p in value):
            raise ValueError("token prompts must not be empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)  # type: ignore[arg-type]


# --- responses -----------------------------------------------------------------------------------------------


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(ResponseModel):
    content: list[TokenLogprob]


class FunctionCallOut(ResponseModel):
    name: str
    arguments: str


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = omitted()
    tool_calls: list[ToolCallOut] | None = omitted()


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None = None
    # vLLM extension (return_token_ids).
    prompt_token_ids: list[int] | None = omitted()
    token_ids: list[int] | None = omitted()


class Completion(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "clawgate"
    max_model_len: int | None = omitted()


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
