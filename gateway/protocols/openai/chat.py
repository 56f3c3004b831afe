"""Chat completions (`POST /v1/chat/completions`): request → ``ChatJob``, results → completion or chunk stream.

Streams are Server-Sent Events of ``chat.completion.chunk`` objects ended by ``data: [DONE]``; an error after the
stream began is sent as an ``{"error": ...}`` event (what the openai SDK raises on), and the call is recorded as
failed.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response

from gateway.core.conversation import Message, ToolCall, ToolSpec
from gateway.core.job import ChoiceDelta, ChoiceResult, PlannedCall, RolloutRef, ToolUse
from gateway.core.parsers.base import ParsedToolCall, ToolCallDelta
from gateway.core.service import ChatService
from gateway.errors import APIError
from gateway.ids import new_id
from gateway.protocols.common.choices import Event, collect_all
from gateway.protocols.common.serving import (
    MEDIA_PARTS,
    ProtocolServing,
    StreamEncoder,
    flatten_text,
    json_response,
    openai_chunks,
    sampling,
    sse,
)
from gateway.protocols.openai.wire import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    ChoiceLogprobs,
    ContentPart,
    FunctionCallOut,
    ToolCallOut,
    Usage,
    json_output,
)

TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
CHAT_MEDIA_PARTS = MEDIA_PARTS - {"input_file"}


# --- translation in ------------------------------------------------------------------------------------------
def _text(content: str | list[ContentPart] | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return flatten_text(content, "messages", text_types=TEXT_PARTS, media_types=CHAT_MEDIA_PARTS)


def to_messages(messages: list[ChatMessage]) -> list[Message]:
    out: list[Message] = []
    for m in messages:
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        calls = [
            ToolCall(
                name=tc.function.name,
                arguments=tc.function.arguments
                if isinstance(tc.function.arguments, str)
                else json.dumps(tc.function.arguments, ensure_ascii=False),
                id=tc.id,
            )
            for tc in m.tool_calls or []
        ]
        out.append(
            Message(
                role=role,  # type: ignore[arg-type]
                content=_text(m.content),
                reasoning=m.reasoning_content or m.reasoning,
                tool_calls=calls,
                tool_call_id=m.tool_call_id,
                name=m.name,
            )
        )
    return out


def to_tools(req: ChatCompletionRequest) -> list[ToolSpec]:
    return [ToolSpec(t.function.name, t.function.description, t.function.parameters) for t in req.tools or []]


# --- translation out -----------------------------------------------------------------------------------------
def tool_call_id(call_id: str, index: int) -> str:
    return f"call_{call_id[-12:]}{index}"


def _tool_call(call_id: str, tc: ParsedToolCall) -> ToolCallOut:
    function = FunctionCallOut(name=tc.name, arguments=tc.arguments)
    return ToolCallOut(id=tool_call_id(call_id, tc.index), function=function)


async def token_logprobs(
    service: ChatService, ids: list[int], lps: list[float], tops: list[dict[int, float]] | None
) -> list[dict[str, Any]]:
    """Chat-style logprobs: an entry per token, with its bytes and its top alternatives, most likely first."""
    texts, alternatives = await service.token_texts(ids, tops)
    out = []
    for i, (text, lp) in enumerate(zip(texts, lps, strict=False)):
        entry: dict[str, Any] = {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
        if alternatives is not None and i < len(alternatives):
            for alt_text, alp in sorted(alternatives[i], key=lambda kv: -kv[1]):
                entry["top_logprobs"].append({"token": alt_text, "logprob": alp, "bytes": list(alt_text.encode())})
        out.append(entry)
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# --- serving -------------------------------------------------------------------------------------------------
class ChatServing(ProtocolServing[ChatCompletionRequest]):
    api = "chat"
    request_model = ChatCompletionRequest

    async def serve(self, req: ChatCompletionRequest, raw: dict[str, Any], rollout: RolloutRef) -> Response:
        top = req.top_logprobs or 0
        max_tokens = req.max_completion_tokens or req.max_tokens
        tool_choice = req.tool_choice
        forced_name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        conversation = to_messages(req.messages), to_tools(req)
        params = sampling(max_tokens, req.temperature, req.top_p, req.top_k, req.seed, req.stop, top_logprobs=top)
        tool_use = ToolUse.openai(tool_choice, forced_name, req.parallel_tool_calls)
        job = self.job(
            req, raw, rollout, stream=req.stream, request_id=new_id("chatcmpl"), conversation=conversation,
            params=params, raw_messages=raw.get("messages"), tool_use=tool_use, n=req.n,
            json_output=json_output(req.response_format),
        )  # fmt: skip
        prep = await self.service.plan(job)
        created = int(time.time())
        iterators = [self.service.run_choice(prep, i) for i in range(req.n)]
        if req.stream:
            return await self.stream(prep, iterators, ChunkStream(self.service, prep, req, created))
        results = await collect_all(iterators)
        return json_response(await self._completion(req, prep, results, created), prep)

    async def _completion(
        self, req: ChatCompletionRequest, prep: PlannedCall, results: list[ChoiceResult], created: int
    ) -> ChatCompletion:
        choices = []
        for r in results:
            calls = [_tool_call(r.call_id, tc) for tc in r.output.tool_calls]
            message = AssistantMessage(
                content=r.output.content, reasoning_content=r.output.reasoning, tool_calls=calls or None
            )
            logprobs = None
            if req.logprobs:
                content = await token_logprobs(self.service, r.token_ids, r.logprobs, r.top_logprobs)
                logprobs = ChoiceLogprobs.model_validate({"content": content})
            choices.append(ChatChoice(index=r.index, message=message, finish_reason=r.finish_reason, logprobs=logprobs))
        return ChatCompletion(
            id=prep.request_id,
            created=created,
            model=req.model,
            choices=choices,
            usage=Usage(**usage(len(prep.prompt_ids), sum(len(r.token_ids) for r in results))),
        )


class OpenAIStream(StreamEncoder):
    """The OpenAI streams' frame: ``data:`` events, ``{"error": ...}`` for an error, ``data: [DONE]`` last."""

    done = b"data: [DONE]\n\n"

    def error(self, exc: APIError) -> bytes:
        return sse(exc.to_dict())


class ChunkStream(OpenAIStream):
    """The choices' events → ``chat.completion.chunk`` events."""

    def __init__(self, service: ChatService, prep: PlannedCall, req: ChatCompletionRequest, created: int) -> None:
        self.service = service
        self.prep = prep
        self.req = req
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.base: dict[str, Any] = {
            "id": prep.request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model,
        }
        if self.include_usage:
            self.base["usage"] = None
        self.tool_ids: dict[tuple[int, int], str] = {}

    def _chunk(self, index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**self.base, "choices": [choice]})

    def encode(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        # The role chunks go out with the first event's chunk (see base.py on writes).
        first = b"".join(self._chunk(i, {"role": "assistant", "content": ""}) for i in range(self.req.n))
        return openai_chunks(
            events,
            self.req.n,
            first=first,
            delta_chunk=self._delta_chunk,
            end_chunk=lambda ev: self._chunk(ev.index, {}, finish=ev.finish_reason),
            usage_chunk=self._usage,
        )

    async def _delta_chunk(self, ev: ChoiceDelta) -> bytes:
        delta: dict[str, Any] = {}
        if ev.reasoning:
            delta["reasoning_content"] = ev.reasoning
        if ev.content:
            delta["content"] = ev.content
        if ev.tool_calls:
            delta["tool_calls"] = [self._tool_call_delta(ev.index, tc) for tc in ev.tool_calls]
        logprobs = None
        if self.req.logprobs and ev.token_ids:
            content = await token_logprobs(self.service, ev.token_ids, ev.logprobs, ev.top_logprobs)
            logprobs = {"content": content}
        return self._chunk(ev.index, delta, logprobs) if delta or logprobs else b""

    def _usage(self, completion_tokens: int) -> bytes:
        if not self.include_usage:
            return b""
        return sse({**self.base, "choices": [], "usage": usage(len(self.prep.prompt_ids), completion_tokens)})

    def _tool_call_delta(self, choice: int, tc: ToolCallDelta) -> dict[str, Any]:
        out: dict[str, Any] = {"index": tc.index}
        key = (choice, tc.index)
        if key not in self.tool_ids:
            self.tool_ids[key] = tool_call_id(self.prep.call_ids[choice], tc.index)
            out["id"] = self.tool_ids[key]
            out["type"] = "function"
            out["function"] = {"name": tc.name, "arguments": tc.arguments}
        else:
            out["function"] = {"arguments": tc.arguments}
        return out
