"""OpenAI-compatible routes: chat completions, completions, models.

Each route translates the wire request into a ``ChatJob``, lets ``ChatService`` do the work and translates the
results back. Streams are Server-Sent Events; an error after the stream began is sent as an ``{"error": ...}``
event (what the openai SDK raises on), and the call is recorded as failed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.api.deps import ClientAuth, Rollout, State
from gateway.api.streaming import SSE_HEADERS, call_headers, collect_all, json_body, merge, prefetch, sse
from gateway.conversation import Message, ToolCall, ToolSpec
from gateway.engines.base import SamplingParams
from gateway.errors import APIError, BadRequest
from gateway.parsers.base import ParsedOutput, ToolCallDelta
from gateway.protocol.openai import ChatCompletionRequest, ChatMessage, CompletionRequest
from gateway.service import ChatJob, ChatService, ChoiceDelta, ChoiceResult, Prepared, new_id
from gateway.state import AppState

router = APIRouter()


# --- translation in ------------------------------------------------------------------------------------------
def _text(content: str | list[Any] | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    parts: list[str] = []
    for part in content:
        if part.type in ("text", "input_text", "output_text"):
            parts.append(part.text or "")
        elif part.type in ("image_url", "input_image", "image", "input_audio", "file"):
            raise BadRequest(
                f"this model accepts text only; got a content part of type {part.type!r}", param="messages"
            )
        else:
            raise BadRequest(f"unsupported content part type {part.type!r}", param="messages")
    return "".join(parts)


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


def sampling(
    req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None, top_logprobs: int
) -> SamplingParams:
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    return SamplingParams(
        max_tokens=max_tokens or 1 << 30,  # clipped to the server cap and the context window in prepare()
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        seed=req.seed,
        stop=tuple(req.stop or ()),
        top_logprobs=top_logprobs,
    )


# --- translation out -----------------------------------------------------------------------------------------
def _tool_call_dicts(output: ParsedOutput, call_id: str) -> list[dict[str, Any]]:
    return [
        {
            "id": f"call_{call_id[-12:]}{tc.index}",
            "type": "function",
            "function": {"name": tc.name, "arguments": tc.arguments},
        }
        for tc in output.tool_calls
    ]


def _token_logprobs(
    state: AppState, ids: list[int], lps: list[float], tops: list[dict[int, float]] | None
) -> list[dict[str, Any]]:
    tok = state.tokenizer
    out = []
    for i, (tid, lp) in enumerate(zip(ids, lps, strict=False)):
        text = str(tok.decode([tid]))
        entry: dict[str, Any] = {
            "token": text,
            "logprob": lp,
            "bytes": list(text.encode()),
            "top_logprobs": [],
        }
        if tops is not None and i < len(tops):
            for alt, alp in sorted(tops[i].items(), key=lambda kv: -kv[1]):
                alt_text = str(tok.decode([alt]))
                entry["top_logprobs"].append({"token": alt_text, "logprob": alp, "bytes": list(alt_text.encode())})
        out.append(entry)
    return out


def _usage(prep: Prepared, completion_tokens: int) -> dict[str, int]:
    prompt = len(prep.prompt_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }


# --- chat completions ----------------------------------------------------------------------------------------
@router.post("/v1/chat/completions", dependencies=[ClientAuth])
@router.post("/rollouts/{rollout_id}/v1/chat/completions", dependencies=[ClientAuth])
async def chat_completions(request: Request, state: State, rollout: Rollout) -> Response:
    raw = await json_body(request)
    req = ChatCompletionRequest.model_validate(raw)
    state.check_model(req.model)
    tools = [ToolSpec(t.function.name, t.function.description, t.function.parameters) for t in req.tools or []]
    top = req.top_logprobs or 0
    job = ChatJob(
        api="chat",
        model=req.model,
        messages=to_messages(req.messages),
        tools=tools,
        n=req.n,
        params=sampling(req, req.max_completion_tokens or req.max_tokens, top),
        rollout=rollout,
        raw_request=raw,
        parse_tool_calls=req.tool_choice != "none",
        force_tool=req.tool_choice == "required" or isinstance(req.tool_choice, dict),
        force_tool_name=req.tool_choice["function"]["name"] if isinstance(req.tool_choice, dict) else None,
        single_tool_call=req.parallel_tool_calls is False,
        stream=req.stream,
    )
    service = state.service
    prep = await service.prepare(job)
    created = int(time.time())
    iterators = [service.run_choice(prep, i) for i in range(req.n)]
    if not req.stream:
        results = await collect_all(iterators)
        choices = []
        for r in results:
            message: dict[str, Any] = {"role": "assistant", "content": r.output.content}
            if r.output.reasoning is not None:
                message["reasoning_content"] = r.output.reasoning
            if r.output.tool_calls:
                message["tool_calls"] = _tool_call_dicts(r.output, r.call_id)
            choice: dict[str, Any] = {
                "index": r.index,
                "message": message,
                "finish_reason": r.finish_reason,
                "logprobs": None,
            }
            if req.logprobs:
                choice["logprobs"] = {"content": _token_logprobs(state, r.token_ids, r.logprobs, r.top_logprobs)}
            choices.append(choice)
        body = {
            "id": prep.request_id,
            "object": "chat.completion",
            "created": created,
            "model": req.model,
            "choices": choices,
            "usage": _usage(prep, sum(len(r.token_ids) for r in results)),
        }
        return JSONResponse(body, headers=call_headers(prep))
    _, merged = await prefetch(merge(iterators))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return StreamingResponse(
        _chat_stream(state, prep, req, merged, created, include_usage),
        media_type="text/event-stream",
        headers={**SSE_HEADERS, **call_headers(prep)},
    )


async def _chat_stream(
    state: AppState,
    prep: Prepared,
    req: ChatCompletionRequest,
    events: AsyncIterator[ChoiceDelta | ChoiceResult],
    created: int,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    base = {"id": prep.request_id, "object": "chat.completion.chunk", "created": created, "model": req.model}
    if include_usage:
        base["usage"] = None
    for i in range(req.n):
        yield sse(
            {
                **base,
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
        )
    completion_tokens = 0
    tool_ids: dict[tuple[int, int], str] = {}
    try:
        async for ev in events:
            if isinstance(ev, ChoiceResult):
                completion_tokens += len(ev.token_ids)
                yield sse(
                    {
                        **base,
                        "choices": [
                            {
                                "index": ev.index,
                                "delta": {},
                                "logprobs": None,
                                "finish_reason": ev.finish_reason,
                            }
                        ],
                    }
                )
                continue
            delta: dict[str, Any] = {}
            if ev.reasoning:
                delta["reasoning_content"] = ev.reasoning
            if ev.content:
                delta["content"] = ev.content
            if ev.tool_calls:
                delta["tool_calls"] = [_tool_call_delta(prep, ev.index, tc, tool_ids) for tc in ev.tool_calls]
            logprobs = None
            if req.logprobs and ev.token_ids:
                logprobs = {"content": _token_logprobs(state, ev.token_ids, ev.logprobs, ev.top_logprobs)}
            if delta or logprobs:
                yield sse(
                    {
                        **base,
                        "choices": [{"index": ev.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}],
                    }
                )
        if include_usage:
            yield sse({**base, "choices": [], "usage": _usage(prep, completion_tokens)})
    except APIError as exc:
        yield sse(exc.to_dict())
    except Exception as exc:  # never let a broken stream end without telling the client why
        yield sse(APIError(f"internal error: {exc}").to_dict())
    yield b"data: [DONE]\n\n"


def _tool_call_delta(prep: Prepared, choice: int, tc: ToolCallDelta, ids: dict[tuple[int, int], str]) -> dict[str, Any]:
    out: dict[str, Any] = {"index": tc.index}
    key = (choice, tc.index)
    if key not in ids:
        ids[key] = f"call_{prep.call_ids[choice][-12:]}{tc.index}"
        out["id"] = ids[key]
        out["type"] = "function"
        out["function"] = {"name": tc.name, "arguments": tc.arguments}
    else:
        out["function"] = {"arguments": tc.arguments}
    return out


# --- completions ---------------------------------------------------------------------------------------------
@router.post("/v1/completions", dependencies=[ClientAuth])
@router.post("/rollouts/{rollout_id}/v1/completions", dependencies=[ClientAuth])
async def completions(request: Request, state: State, rollout: Rollout) -> Response:
    raw = await json_body(request)
    req = CompletionRequest.model_validate(raw)
    state.check_model(req.model)
    if req.stream and len(req.prompts()) > 1:
        raise BadRequest("streaming supports a single prompt", param="prompt")
    if req.echo and req.logprobs is not None:
        raise BadRequest("echo with logprobs is not supported (prompt logprobs are not computed)", param="echo")
    vocab = len(state.tokenizer)
    service = state.service
    created = int(time.time())
    request_id = new_id("cmpl")
    preps: list[Prepared] = []
    echoes: list[str] = []
    for p in req.prompts():
        if isinstance(p, str):
            ids = await asyncio.to_thread(state.renderer.encode, p)
        else:
            ids = list(p)
            if any(t < 0 or t >= vocab for t in ids):
                raise BadRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not ids:
            raise BadRequest("prompt is empty", param="prompt")
        if req.echo:
            echoes.append(p if isinstance(p, str) else str(state.tokenizer.decode(ids)))
        job = ChatJob(
            api="completions",
            model=req.model,
            messages=[],
            tools=[],
            n=req.n,
            params=sampling(req, req.max_tokens or 16, req.logprobs or 0),
            rollout=rollout,
            raw_request=raw,
            parse_output=False,
            prompt_ids=ids,
            stream=req.stream,
            request_id=request_id,
        )
        preps.append(await service.prepare(job))
    if req.stream:
        prep = preps[0]
        iterators = [service.run_choice(prep, i) for i in range(req.n)]
        _, merged = await prefetch(merge(iterators))
        return StreamingResponse(
            _completion_stream(state, prep, req, merged, created, echoes[0] if echoes else ""),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **call_headers(prep)},
        )
    choices: list[dict[str, Any]] = []
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for pi, prep in enumerate(preps):
        results = await collect_all([service.run_choice(prep, i) for i in range(req.n)])
        for r in results:
            choice: dict[str, Any] = {
                "index": pi * req.n + r.index,
                "text": (echoes[pi] if echoes else "") + (r.output.content or ""),
                "finish_reason": r.finish_reason,
                "logprobs": None,
            }
            if req.logprobs is not None:
                choice["logprobs"] = _completion_logprobs(state, r.token_ids, r.logprobs, r.top_logprobs)
            if req.return_token_ids:
                choice["prompt_token_ids"] = prep.prompt_ids
                choice["token_ids"] = r.token_ids
            choices.append(choice)
            usage["completion_tokens"] += len(r.token_ids)
        usage["prompt_tokens"] += len(prep.prompt_ids)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    body = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": req.model,
        "choices": choices,
        "usage": usage,
    }
    headers = {
        "x-clawgate-call-id": ",".join(c for p in preps for c in p.call_ids),
        "x-clawgate-rollout-id": ",".join(dict.fromkeys(p.rollout_id for p in preps)),
    }
    return JSONResponse(body, headers=headers)


def _completion_logprobs(
    state: AppState, ids: list[int], lps: list[float], tops: list[dict[int, float]] | None
) -> dict[str, Any]:
    tok = state.tokenizer
    tokens = [tok.decode([t]) for t in ids]
    top_list = None
    if tops is not None:
        top_list = [{tok.decode([a]): lp for a, lp in alt.items()} for alt in tops]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_list, "text_offset": offsets}


async def _completion_stream(
    state: AppState,
    prep: Prepared,
    req: CompletionRequest,
    events: AsyncIterator[ChoiceDelta | ChoiceResult],
    created: int,
    echo: str,
) -> AsyncIterator[bytes]:
    base = {"id": prep.request_id, "object": "text_completion", "created": created, "model": req.model}
    if echo:
        for i in range(req.n):
            yield sse({**base, "choices": [{"index": i, "text": echo, "logprobs": None, "finish_reason": None}]})
    completion_tokens = 0
    try:
        async for ev in events:
            if isinstance(ev, ChoiceResult):
                completion_tokens += len(ev.token_ids)
                yield sse(
                    {
                        **base,
                        "choices": [
                            {
                                "index": ev.index,
                                "text": "",
                                "logprobs": None,
                                "finish_reason": ev.finish_reason,
                            }
                        ],
                    }
                )
                continue
            if not ev.content and not ev.token_ids:
                continue
            choice: dict[str, Any] = {
                "index": ev.index,
                "text": ev.content,
                "logprobs": None,
                "finish_reason": None,
            }
            if req.logprobs is not None and ev.token_ids:
                choice["logprobs"] = _completion_logprobs(state, ev.token_ids, ev.logprobs, ev.top_logprobs)
            if req.return_token_ids:
                choice["token_ids"] = ev.token_ids
            yield sse({**base, "choices": [choice]})
        if req.stream_options and req.stream_options.include_usage:
            yield sse({**base, "choices": [], "usage": _usage(prep, completion_tokens)})
    except APIError as exc:
        yield sse(exc.to_dict())
    except Exception as exc:
        yield sse(APIError(f"internal error: {exc}").to_dict())
    yield b"data: [DONE]\n\n"


# --- models --------------------------------------------------------------------------------------------------
@router.get("/v1/models", dependencies=[ClientAuth])
@router.get("/rollouts/{rollout_id}/v1/models", dependencies=[ClientAuth])
async def list_models(state: State) -> dict[str, Any]:
    created = int(state.started_at)
    data = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "clawgate",
            "max_model_len": state.engine.max_model_len,
        }
        for name in sorted(state.model_names)
    ]
    return {"object": "list", "data": data}


@router.get("/v1/models/{model_id:path}", dependencies=[ClientAuth])
async def get_model(model_id: str, state: State) -> dict[str, Any]:
    state.check_model(model_id)
    return {"id": model_id, "object": "model", "created": int(state.started_at), "owned_by": "clawgate"}


__all__ = ["ChatService", "router"]
