"""OpenAI Responses API serving (`POST /v1/responses`), the only protocol Codex CLI speaks.

The request's input items become the internal ``Message`` list, its function tools ``ToolSpec``s, and
``ChatService`` does the rest, as for chat completions. The translation is written here as small functions rather
than borrowed from a format-adapter library, for exact control over what token-in-token-out depends on (which
items form one assistant turn, reasoning, tool-call ids) and to keep network-capable dependencies out of the hot
path.

Echoes: a harness that sends ``store: false`` re-sends our earlier output items, often with new ids, the
reasoning kept only as ``encrypted_content``. Every run of consecutive assistant-side items (reasoning, assistant
messages, function and custom tool calls) is one assistant turn, so an echoed answer becomes exactly the message
the service registered (its text and its calls' names and arguments) and its raw tokens are spliced.

Streaming sends the standard typed events (``event: <type>`` + JSON with a ``sequence_number``), items in the
order their text arrives. A response cut by the token limit still ends with ``response.completed``, its status
``incomplete``: harnesses treat a ``response.incomplete`` event as a failed request and retry it, which cannot
help when the limit is the gateway's. An error after the stream began ends it with ``response.failed``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi.responses import Response

from gateway.core.conversation import Message, ToolCall, ToolSpec
from gateway.core.job import ChoiceDelta, ChoiceResult, PlannedCall, ResponseCapture, RolloutRef, ToolUse
from gateway.core.parsers.base import ParsedOutput, ToolCallDelta
from gateway.core.response_store import Found, ResponseStore
from gateway.errors import APIError, BadRequest, RateLimited
from gateway.ids import new_id
from gateway.protocols.common.blocks import REASONING, TEXT, BlockStream
from gateway.protocols.common.choices import Event, collect_all
from gateway.protocols.common.serving import (
    MEDIA_PARTS,
    Last,
    ProtocolServing,
    StreamEncoder,
    flatten_text,
    json_response,
    sampling,
    sse,
)
from gateway.protocols.responses.wire import (
    ContentPart,
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    ToolIn,
    decode_reasoning,
    function_call_item,
    message_item,
    output_text_part,
    reasoning_item,
    response_object,
    usage,
)

log = logging.getLogger("clawgate.serving.responses")


def _item_id(prefix: str) -> str:
    return new_id(prefix, sep="_", length=32)


ENCRYPTED_REASONING = "reasoning.encrypted_content"
# A tool output item whose status says the call did not complete: the harness marks a failed tool call.
FAILED_OUTPUT_STATUSES = frozenset({"incomplete", "failed"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal"})


# --- translation in ------------------------------------------------------------------------------------------
def _text(content: str | list[ContentPart], where: str) -> str:
    if isinstance(content, str):
        return content
    return flatten_text(content, where, text_types=TEXT_PARTS, media_types=MEDIA_PARTS)


def _reasoning_text(item: ReasoningItem) -> str | None:
    """The readable reasoning an item carries: its full text, our own encoded text, or else its summary."""
    if item.content:
        text = "".join(p.text or "" for p in item.content if p.type in ("reasoning_text", "text"))
        if text:
            return text
    if item.encrypted_content:
        decoded = decode_reasoning(item.encrypted_content)
        if decoded:
            return decoded
    summary = "\n\n".join(p.text for p in item.summary if p.text)
    return summary or None


def _join(first: str | None, second: str | None, sep: str) -> str | None:
    if first is None:
        return second
    if second is None:
        return first
    return first + sep + second


def to_messages(items: Sequence[InputItem]) -> list[Message]:
    """Input items → internal messages; each run of consecutive assistant-side items is one assistant turn."""
    out: list[Message] = []
    turn: Message | None = None  # the assistant turn being assembled
    skipped: list[str] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        assistant_side = isinstance(item, ReasoningItem | FunctionCallItem | CustomToolCallItem) or (
            isinstance(item, MessageItem) and item.role == "assistant"
        )
        if assistant_side and turn is None:
            turn = Message(role="assistant")
            out.append(turn)
        elif not assistant_side:
            turn = None
        if isinstance(item, ReasoningItem):
            assert turn is not None
            turn.reasoning = _join(turn.reasoning, _reasoning_text(item), "\n\n")
        elif isinstance(item, MessageItem):
            text = _text(item.content, f"{where}.content")
            if turn is not None:
                turn.content = _join(turn.content, text, "\n")
            else:
                role = "system" if item.role == "developer" else item.role
                out.append(Message(role=role, content=text))
        elif isinstance(item, FunctionCallItem):
            assert turn is not None
            args = item.arguments
            arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            turn.tool_calls.append(ToolCall(name=item.name, arguments=arguments, id=item.call_id))
        elif isinstance(item, CustomToolCallItem):
            assert turn is not None
            # A free-form tool's input is raw text, carried as the call's arguments verbatim.
            turn.tool_calls.append(ToolCall(name=item.name, arguments=item.input, id=item.call_id))
        elif isinstance(item, FunctionCallOutputItem | CustomToolCallOutputItem):
            content = _text(item.output, f"{where}.output")
            failed = item.status in FAILED_OUTPUT_STATUSES
            out.append(Message(role="tool", content=content, tool_call_id=item.call_id, is_error=failed))
        else:
            skipped.append(item.type)
    if skipped:
        log.info("responses: ignoring input items the model cannot use: %s", ", ".join(sorted(set(skipped))))
    # A reasoning item we cannot read (another provider's encrypted blob) alone makes no turn.
    return [m for m in out if m.role != "assistant" or m.content is not None or m.reasoning or m.tool_calls]


def to_tools(tools: Sequence[ToolIn] | None) -> list[ToolSpec]:
    specs: list[ToolSpec] = []
    ignored: list[str] = []
    for tool in tools or []:
        if tool.type == "function" and tool.name:
            specs.append(ToolSpec(tool.name, tool.description, tool.parameters))
        else:
            ignored.append(f"{tool.type}:{tool.name}" if tool.name else tool.type)
    if ignored:
        # Hosted tools (web search, file search), namespaces and free-form tools need a runtime or a grammar we
        # do not have; offering them would invite calls nobody can serve.
        log.info("responses: ignoring tools the model cannot call: %s", ", ".join(ignored))
    return specs


async def _history(responses: ResponseStore, response_id: str, tenant: str) -> list[Message]:
    found = await responses.find(response_id, tenant)
    if not isinstance(found, Found):
        return list(found)
    if found is Found.UNSTORED:
        raise BadRequest(
            f"Previous response with id '{response_id}' was created with store=false and cannot be continued; "
            "send the full input instead.",
            param="previous_response_id",
        )
    raise BadRequest(
        f"Previous response with id '{response_id}' not found.",
        param="previous_response_id",
    )


# --- translation out -----------------------------------------------------------------------------------------
class _Answer:
    """Ids and token counts of one answer, shared by the streaming and non-streaming paths."""

    def __init__(self) -> None:
        self.answer_started = False
        self.saw_reasoning = False
        self.pre_answer_tokens = 0
        self.call_ids: dict[int, str] = {}

    def observe(self, delta: ChoiceDelta) -> None:
        if self.answer_started:
            return
        if delta.content or delta.tool_calls:
            self.answer_started = True
            return
        self.saw_reasoning |= bool(delta.reasoning)
        self.pre_answer_tokens += len(delta.token_ids)

    @property
    def reasoning_tokens(self) -> int:
        # Tokens before the first answer text, when they made reasoning (the think tags included).
        return self.pre_answer_tokens if self.saw_reasoning else 0

    def call_id(self, index: int) -> str:
        if index not in self.call_ids:
            self.call_ids[index] = _item_id("call")
        return self.call_ids[index]

    def message(self, output: ParsedOutput) -> Message:
        """The answer as the conversation continues it (what the service registered, plus reasoning and ids)."""
        return Message(
            role="assistant",
            content=output.content,
            reasoning=output.reasoning,
            tool_calls=[ToolCall(tc.name, tc.arguments, id=self.call_id(tc.index)) for tc in output.tool_calls],
        )


def _output_items(answer: _Answer, output: ParsedOutput, encrypted: bool) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if output.reasoning is not None:
        items.append(reasoning_item(_item_id("rs"), output.reasoning, encrypted=encrypted))
    if output.content is not None or not (output.reasoning or output.tool_calls):
        items.append(message_item(_item_id("msg"), output.content or ""))
    for tc in output.tool_calls:
        items.append(function_call_item(_item_id("fc"), answer.call_id(tc.index), tc.name, tc.arguments))
    return items


def _status(result: ChoiceResult) -> tuple[str, str | None]:
    if result.finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


def _remember(
    responses: ResponseStore,
    req: ResponsesRequest,
    response_id: str,
    conversation: list[Message],
    answer: Message,
    tenant: str,
) -> None:
    if req.stored:
        responses.put(response_id, [*conversation, answer], tenant)
    else:
        responses.mark_unstored(response_id, tenant)


class OutputItems(BlockStream, StreamEncoder):
    """One response's events → Responses stream events (``event: <type>`` + JSON with a ``sequence_number``),
    opening an output item whenever the kind of text changes."""

    def __init__(
        self,
        req: ResponsesRequest,
        prep: PlannedCall,
        created_at: int,
        responses: ResponseStore,
        conversation: list[Message],
        answer: _Answer,
    ) -> None:
        super().__init__()
        self.req = req
        self.prep = prep
        self.response_id = prep.request_id
        self.created_at = created_at
        self.responses = responses
        self.conversation = conversation
        self.answer = answer
        self.encrypted = req.wants(ENCRYPTED_REASONING)
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.item: dict[str, Any] = {}
        self.text: list[str] = []
        self.tool_index = -1

    def event(self, type_: str, **fields: Any) -> bytes:
        data = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(data, type_)

    def response(self, status: str, **fields: Any) -> dict[str, Any]:
        return response_object(
            self.req,
            response_id=self.response_id,
            created_at=self.created_at,
            status=status,
            output=list(self.output),
            **fields,
        ).model_dump()

    async def encode(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        snapshot = self.response("in_progress")
        # The opening events go out with the first event's (see base.py on writes).
        out = self.event("response.created", response=snapshot) + self.event("response.in_progress", response=snapshot)
        async for ev in events:
            if isinstance(ev, ChoiceResult):
                # Stored before the client hears of completion, so an immediate continuation finds it.
                tenant = self.prep.job.rollout.tenant
                answer = self.answer.message(ev.output)
                _remember(self.responses, self.req, self.response_id, self.conversation, answer, tenant)
                yield Last(out + b"".join(self.finish(ev)))
                out = b""
            else:
                self.answer.observe(ev)
                out += b"".join(self.feed(ev))
                if out:
                    yield out
                    out = b""
        if out:
            yield out

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def open_block(self, kind: str, call: ToolCallDelta | None) -> list[bytes]:
        if kind == REASONING:
            item = {**reasoning_item(_item_id("rs"), "", encrypted=False), "content": [], "status": "in_progress"}
        elif kind == TEXT:
            item = message_item(_item_id("msg"), None, status="in_progress")
        else:
            assert call is not None
            self.tool_index = call.index
            call_id = self.answer.call_id(call.index)
            item = function_call_item(_item_id("fc"), call_id, call.name or "", "", status="in_progress")
        self.item, self.text = item, []
        out = [self.event("response.output_item.added", output_index=len(self.output), item=item)]
        if kind == REASONING:
            part = {"type": "reasoning_text", "text": ""}
            out.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        elif kind == TEXT:
            part = output_text_part("")
            out.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def extend_block(self, kind: str, text: str) -> list[bytes]:
        self.text.append(text)
        if kind == REASONING:
            return [self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)]
        if kind == TEXT:
            where = self._where()
            return [self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])]
        return [self.event("response.function_call_arguments.delta", **self._where(), delta=text)]

    def close_block(self, kind: str) -> list[bytes]:
        text = "".join(self.text)
        where = self._where()
        out: list[bytes] = []
        if kind == REASONING:
            done = reasoning_item(self.item["id"], text, encrypted=self.encrypted)
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            part = {"type": "reasoning_text", "text": text}
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        elif kind == TEXT:
            done = message_item(self.item["id"], text)
            out.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=output_text_part(text)))
        else:
            done = {**self.item, "arguments": text, "status": "completed"}
            out.append(self.event("response.function_call_arguments.done", **where, arguments=text))
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=done))
        self.output.append(done)
        self.item, self.text = {}, []
        return out

    def starts_call(self, call: ToolCallDelta) -> bool:
        return call.index != self.tool_index

    def finish(self, result: ChoiceResult) -> list[bytes]:
        out = self.close()
        if not self.output:  # nothing at all was generated: still answer with a (blank) message
            out += self.open(TEXT)
            out += self.close()
        status, reason = _status(result)
        use = usage(len(self.prep.prompt_ids), len(result.token_ids), self.answer.reasoning_tokens)
        final = self.response(status, usage=use, incomplete_reason=reason)
        out.append(self.event("response.completed", response=final))
        return out

    def error(self, exc: APIError) -> bytes:
        self.kind = None  # an unfinished item is not part of a failed response
        code = "rate_limit_exceeded" if isinstance(exc, RateLimited) else "server_error"
        final = self.response("failed", error={"code": code, "message": exc.message})
        return self.event("response.failed", response=final)


# --- serving -------------------------------------------------------------------------------------------------
class ResponsesServing(ProtocolServing[ResponsesRequest]):
    api = "responses"
    request_model = ResponsesRequest

    async def serve(self, req: ResponsesRequest, raw: dict[str, Any], rollout: RolloutRef) -> Response:
        responses = self.state.responses
        previous = req.previous_response_id
        conversation = await _history(responses, previous, rollout.tenant) if previous else []
        history = len(conversation)
        if isinstance(req.input, str):
            conversation.append(Message(role="user", content=req.input))
        elif req.input is not None:
            conversation += to_messages(req.input)
        messages = ([Message(role="system", content=req.instructions)] if req.instructions else []) + conversation
        if not messages:
            raise BadRequest("input is empty", param="input")
        tool_choice = req.tool_choice
        forced_name = tool_choice.get("name") if isinstance(tool_choice, dict) else None
        params = sampling(req.max_output_tokens, req.temperature, req.top_p, seed=req.seed)
        tool_use = ToolUse.openai(tool_choice, forced_name, req.parallel_tool_calls)
        answer = _Answer()
        job = self.job(
            req, raw, rollout, stream=req.stream, request_id=_item_id("resp"),
            conversation=(messages, to_tools(req.tools)), params=params, raw_messages=raw.get("input"),
            tool_use=tool_use, json_output=req.json_output(),
        )  # fmt: skip
        # Committed with the call, so any gateway process can continue this response.
        job.response = ResponseCapture(
            req.previous_response_id, req.stored, conversation[history:], answer.message, rollout.tenant
        )
        prep = await self.service.plan(job)
        created_at = int(time.time())
        choices = [self.service.run_choice(prep, 0)]
        if req.stream:
            return await self.stream(prep, choices, OutputItems(req, prep, created_at, responses, conversation, answer))
        [result] = await collect_all(choices, answer.observe)
        _remember(responses, req, prep.request_id, conversation, answer.message(result.output), rollout.tenant)
        status, reason = _status(result)
        body = response_object(
            req,
            response_id=prep.request_id,
            created_at=created_at,
            status=status,
            output=_output_items(answer, result.output, req.wants(ENCRYPTED_REASONING)),
            usage=usage(len(prep.prompt_ids), len(result.token_ids), answer.reasoning_tokens),
            incomplete_reason=reason,
        )
        return json_response(body, prep)
