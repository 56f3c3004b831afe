"""Anthropic Messages API serving: `POST /v1/messages` (streaming and not) and `POST /v1/messages/count_tokens`.

Claude Code and OpenClaw's anthropic mode speak this protocol. Each request is translated into the internal
``Message``/``ToolSpec`` model, served by ``ChatService`` exactly like a chat completion, and the result is
translated back into Anthropic content blocks (``thinking``, ``text``, ``tool_use``) or their SSE event sequence.

The translation is a handful of small pure functions written here rather than taken from a format-adapter
library (LiteLLM has one): the fields that decide token-in-token-out splicing — how an echoed assistant turn's
text, reasoning and tool calls map onto a ``Message`` — must be under exact control, and the serving path should
not carry a large, network-capable dependency.

Translation rules (request → internal):

- ``system`` (string or text blocks) becomes the first system message; ``role: "system"`` entries inside
  ``messages`` (Claude Code sends them) stay system messages where they are.
- Consecutive messages of the same role form one turn, as the Anthropic API combines them.
- Assistant turns: text blocks → content, ``thinking`` → reasoning, ``tool_use`` → tool calls (input dict as
  JSON arguments); ``redacted_thinking`` is dropped (it is opaque). So an echo of an answer normalizes exactly
  like the answer the service registered (content text; tool call names and arguments), whatever the client did
  to tool-use ids or thinking blocks, and the answer's raw tokens are spliced.
- User turns: each ``tool_result`` becomes a ``tool`` message (``is_error`` prefixes its text with ``Error:``);
  text in the same turn becomes a user message after them.
- Images and documents are refused with a 400: the served models take text only.

Thinking blocks the gateway generates carry a signature naming the call that produced them. Clients replay it
unchanged; it is accepted back and never checked, because reasoning plays no part in recognising an echoed turn
(the raw tokens of the original answer are spliced instead).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from gateway.core.conversation import Message, ToolCall, ToolSpec
from gateway.core.job import ChoiceDelta, ChoiceResult, PlannedCall, RolloutRef, ToolUse
from gateway.core.parsers.base import ParsedOutput, ToolCallDelta
from gateway.errors import APIError, BadRequest
from gateway.ids import new_id
from gateway.protocols.anthropic.wire import (
    ConversationFields,
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    MessageUsage,
    RedactedThinkingBlock,
    TextBlock,
    TextOut,
    ThinkingBlock,
    ThinkingOut,
    TokenCount,
    ToolChoice,
    ToolDef,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    output_format,
)
from gateway.protocols.common.blocks import REASONING, TEXT, BlockStream
from gateway.protocols.common.choices import Event, collect_all
from gateway.protocols.common.serving import Last, ProtocolServing, StreamEncoder, json_response, sampling, sse

log = logging.getLogger("clawgate.serving.messages")

MEDIA_BLOCKS = frozenset({"image", "document", "file", "container_upload"})


# --- translation in ------------------------------------------------------------------------------------------
def _refuse(kind: str, role: str) -> BadRequest:
    if kind in MEDIA_BLOCKS:
        return BadRequest(f"this model accepts text only; got a content block of type {kind!r}", param="messages")
    return BadRequest(f"content blocks of type {kind!r} are not supported in {role} messages", param="messages")


def system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return "\n".join(block.text for block in system)


def _tool_result_text(block: ToolResultBlock) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts: list[str] = []
        for part in content:
            if isinstance(part, TextBlock):
                parts.append(part.text)
            elif part.type == "tool_reference":
                # Tool search results name tools whose schemas are now loaded; all offered tools are already in
                # the prompt, so the name is all the model needs.
                parts.append(str((part.model_extra or {}).get("tool_name", "")))
            else:
                raise _refuse(part.type, "tool_result")
        text = "\n".join(parts)
    return f"Error: {text}" if block.is_error else text


def to_messages(req: ConversationFields, *, final_assistant_ok: bool = False) -> list[Message]:
    """The request's conversation as internal messages (see the module docstring for the rules).

    ``final_assistant_ok``: a conversation may end with an assistant turn (counting tokens); a generation
    request may not.
    """
    out: list[Message] = []
    system = system_text(req.system)
    if system is not None:
        out.append(Message(role="system", content=system))
    # Consecutive same-role messages are one turn (the Anthropic API combines them).
    turns: list[tuple[str, list[Any]]] = []
    for m in req.messages:
        blocks = [TextBlock(text=m.content)] if isinstance(m.content, str) else list(m.content)
        if turns and turns[-1][0] == m.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((m.role, blocks))
    if turns[-1][0] == "assistant" and not final_assistant_ok:
        # Continuing a final assistant message needs the template to leave the turn open; recent Claude models
        # refuse prefill too, so no harness relies on it.
        raise BadRequest("a final assistant message (prefill) is not supported", param="messages")
    tool_names: dict[str, str] = {}
    for role, blocks in turns:
        if role == "assistant":
            out.append(_assistant(blocks, tool_names))
        elif role == "system":
            texts = []
            for block in blocks:
                if not isinstance(block, TextBlock):
                    raise _refuse(block.type, "system")
                texts.append(block.text)
            out.append(Message(role="system", content="\n".join(texts)))
        else:
            out.extend(_user(blocks, tool_names))
    return out


def _assistant(blocks: list[Any], tool_names: dict[str, str]) -> Message:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            if block.text:
                texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            if block.thinking:
                reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            tool_names[block.id] = block.name
            calls.append(ToolCall(block.name, json.dumps(block.input, ensure_ascii=False), block.id))
        elif isinstance(block, RedactedThinkingBlock):
            continue  # encrypted by another provider: nothing a model could read
        else:
            raise _refuse(block.type, "assistant")
    return Message(
        role="assistant",
        content="\n".join(texts) or None,
        reasoning="\n".join(reasoning) or None,
        tool_calls=calls,
    )


def _user(blocks: list[Any], tool_names: dict[str, str]) -> list[Message]:
    out: list[Message] = []
    texts: list[str] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            out.append(
                Message(
                    role="tool",
                    content=_tool_result_text(block),
                    tool_call_id=block.tool_use_id,
                    name=tool_names.get(block.tool_use_id),
                    is_error=bool(block.is_error),
                )
            )
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        else:
            raise _refuse(block.type, "user")
    # A turn of tool results plus text (OpenClaw appends context after results) is the results, then the text.
    if texts or not out:
        out.append(Message(role="user", content="\n".join(texts)))
    return out


def tool_use(choice: ToolChoice | None) -> ToolUse:
    """tool_choice "any"/"tool" forces a call (its opening is appended to the prompt), disable_parallel_tool_use
    stops the answer after its first call, "none" leaves tool-call syntax as text."""
    if choice is None:
        return ToolUse()
    return ToolUse(
        parse=choice.type != "none",
        force=choice.type in ("any", "tool"),
        name=choice.name if choice.type == "tool" else None,
        single=bool(choice.disable_parallel_tool_use),
    )


def to_tools(tools: list[ToolDef] | None) -> list[ToolSpec]:
    specs: list[ToolSpec] = []
    for tool in tools or []:
        if tool.input_schema is None or not tool.name:
            # Server tools (web search, code execution ...) run at Anthropic; the served model cannot use them.
            log.info("ignoring tool %r of type %r: no input_schema", tool.name, tool.type)
            continue
        # Deferred tools (defer_loading) are offered like the others: the template has no notion of deferral,
        # and a tools list that stays the same across turns keeps splicing possible.
        specs.append(ToolSpec(tool.name, tool.description, tool.input_schema))
    return specs


# --- translation out -----------------------------------------------------------------------------------------
def tool_use_id(call_id: str, index: int) -> str:
    return f"toolu_{call_id[-24:]}{index}"


def thinking_signature(call_id: str) -> str:
    """An opaque token naming the call that produced a thinking block (accepted back, never verified)."""
    return base64.b64encode(f"clawgate:{call_id}".encode()).decode()


def show_thinking(req: MessagesRequest) -> bool:
    # `display: "omitted"` asks for thinking blocks that carry only their signature.
    return not (req.thinking is not None and req.thinking.display == "omitted")


def stop_reason(result: ChoiceResult) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a finished choice."""
    if result.finish_reason == "tool_calls":
        return "tool_use", None
    if result.finish_reason == "length":
        return "max_tokens", None
    if result.stop_sequence is not None:
        return "stop_sequence", result.stop_sequence
    return "end_turn", None


def content_blocks(output: ParsedOutput, call_id: str, thinking_text: bool) -> list[ThinkingOut | TextOut | ToolUseOut]:
    blocks: list[ThinkingOut | TextOut | ToolUseOut] = []
    if output.reasoning is not None:
        thinking = output.reasoning if thinking_text else ""
        blocks.append(ThinkingOut(thinking=thinking, signature=thinking_signature(call_id)))
    if output.content:
        blocks.append(TextOut(text=output.content))
    for tc in output.tool_calls:
        blocks.append(ToolUseOut(id=tool_use_id(call_id, tc.index), name=tc.name, input=_input(tc.arguments)))
    return blocks


def _input(arguments: str) -> dict[str, Any]:
    # The parser hands over arguments that decode to a JSON object; keep a non-object visible rather than lose it.
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def usage(prep: PlannedCall, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": len(prep.prompt_ids),
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


class ContentBlocks(BlockStream):
    """A choice's deltas → content-block events: each run of reasoning, text or one tool call is a block, opened
    with ``content_block_start`` and closed (thinking: after its ``signature_delta``) when the next begins."""

    def __init__(self, call_id: str, thinking_text: bool) -> None:
        super().__init__()
        self.call_id = call_id
        self.thinking_text = thinking_text
        self.index = -1

    def _delta(self, delta: dict[str, Any]) -> bytes:
        data = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return sse(data, "content_block_delta")

    def open_block(self, kind: str, call: ToolCallDelta | None) -> list[bytes]:
        self.index += 1
        block: dict[str, Any]
        if kind == REASONING:
            block = {"type": "thinking", "thinking": "", "signature": ""}
        elif kind == TEXT:
            block = {"type": "text", "text": ""}
        else:
            assert call is not None
            block_id = tool_use_id(self.call_id, call.index)
            block = {"type": "tool_use", "id": block_id, "name": call.name or "", "input": {}}
        data = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [sse(data, "content_block_start")]

    def extend_block(self, kind: str, text: str) -> list[bytes]:
        if kind == REASONING:
            return [self._delta({"type": "thinking_delta", "thinking": text})] if self.thinking_text else []
        if kind == TEXT:
            return [self._delta({"type": "text_delta", "text": text})]
        return [self._delta({"type": "input_json_delta", "partial_json": text})]

    def close_block(self, kind: str) -> list[bytes]:
        out: list[bytes] = []
        if kind == REASONING:
            out.append(self._delta({"type": "signature_delta", "signature": thinking_signature(self.call_id)}))
        out.append(sse({"type": "content_block_stop", "index": self.index}, "content_block_stop"))
        return out

    def starts_call(self, call: ToolCallDelta) -> bool:
        # A call's first delta names it; its later deltas only extend the arguments.
        return call.name is not None


class MessageStream(StreamEncoder):
    """A choice's events → the Messages stream: ``message_start``, the content blocks, ``message_delta`` with the
    stop reason, ``message_stop``; an error after the start is an ``error`` event."""

    def __init__(self, prep: PlannedCall, model: str, thinking_text: bool) -> None:
        self.prep = prep
        self.model = model
        self.blocks = ContentBlocks(prep.call_ids[0], thinking_text)

    async def encode(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        prep = self.prep
        message: dict[str, Any] = {
            "id": prep.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(prep, 0),
        }
        # The opening events go out with the first event's (see base.py on writes).
        out = sse({"type": "message_start", "message": message}, "message_start") + sse({"type": "ping"}, "ping")
        async for ev in events:
            if isinstance(ev, ChoiceDelta):
                out += b"".join(self.blocks.feed(ev))
                if out:
                    yield out
                    out = b""
                continue
            out += b"".join(self.blocks.close())
            reason, sequence = stop_reason(ev)
            use = {"input_tokens": len(prep.prompt_ids), "output_tokens": len(ev.token_ids)}
            delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": use}
            yield Last(out + sse(delta, "message_delta") + sse({"type": "message_stop"}, "message_stop"))
            out = b""
        if out:
            yield out

    def error(self, exc: APIError) -> bytes:
        return sse(exc.to_anthropic(), "error")


# --- serving -------------------------------------------------------------------------------------------------
class MessagesServing(ProtocolServing[MessagesRequest]):
    api = "messages"
    request_model = MessagesRequest

    async def serve(self, req: MessagesRequest, raw: dict[str, Any], rollout: RolloutRef) -> Response:
        # The `thinking` config is accepted as a hint: whether the model reasons is up to the model and its template.
        params = sampling(req.max_tokens, req.temperature, req.top_p, req.top_k, stop=req.stop_sequences)
        job = self.job(
            req, raw, rollout, stream=req.stream, request_id=new_id("msg", sep="_"),
            conversation=(to_messages(req), to_tools(req.tools)), params=params, raw_messages=raw.get("messages"),
            tool_use=tool_use(req.tool_choice), json_output=output_format(req.output_config),
        )  # fmt: skip
        prep = await self.service.plan(job)
        choices = [self.service.run_choice(prep, 0)]
        thinking_text = show_thinking(req)
        if req.stream:
            return await self.stream(prep, choices, MessageStream(prep, req.model, thinking_text))
        [result] = await collect_all(choices)
        reason, sequence = stop_reason(result)
        body = MessageResponse(
            id=prep.request_id,
            model=req.model,
            content=content_blocks(result.output, result.call_id, thinking_text),
            stop_reason=reason,
            stop_sequence=sequence,
            usage=MessageUsage(**usage(prep, len(result.token_ids))),
        )
        return json_response(body, prep)

    async def count_tokens(self, request: Request) -> TokenCount:
        """The prompt length the same conversation would have in a fresh ``/v1/messages`` call."""
        _, req = await self.parse(request, CountTokensRequest)
        messages, tools = to_messages(req, final_assistant_ok=True), to_tools(req.tools)
        ids = await asyncio.to_thread(self.state.renderer.render_fresh, messages, tools)
        return TokenCount(input_tokens=len(ids))
