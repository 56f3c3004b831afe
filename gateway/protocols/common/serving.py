"""What every protocol's serving shares: the request prologue, sampling defaults, content-part flattening, the
respond and stream shells, SSE framing, and the one tail for an error after a stream began.

A protocol subclasses ``ProtocolServing`` and keeps only its translation: request → ``ChatJob``, results → its
response body, and a ``StreamEncoder`` for its stream events. The shells here give every protocol the same
guarantees: an engine error that happens at once gets a real status code (the first event is pulled before
answering), a stream that breaks later ends with the protocol's own error event and a log line, and the choice
iterators are closed in a ``finally`` whatever the client does, so the service records every call.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from gateway.core.conversation import Message, ToolSpec
from gateway.core.job import ChatJob, ChoiceDelta, ChoiceResult, JsonOutput, PlannedCall, RolloutRef, ToolUse
from gateway.core.service import ChatService
from gateway.engines.base import SamplingParams
from gateway.errors import APIError, BadRequest
from gateway.errors import call_headers as named_calls
from gateway.protocols.common.choices import Event, merge, prefetch
from gateway.protocols.common.wire import ModelRequest
from gateway.state import AppState

log = logging.getLogger("clawgate.serving")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# No max_tokens from the client means "as many as fit": ChatService.plan clips it to the server cap and the context.
UNLIMITED_TOKENS = 1 << 30

Req = TypeVar("Req", bound=ModelRequest)
Other = TypeVar("Other", bound=ModelRequest)


# --- translation helpers -------------------------------------------------------------------------------------
def sampling(
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Iterable[str] | None = None,
    top_logprobs: int = 0,
) -> SamplingParams:
    """Sampling parameters with the defaults every protocol documents (temperature and top_p 1, top_k off)."""
    return SamplingParams(
        max_tokens=max_tokens or UNLIMITED_TOKENS,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=top_k if top_k is not None and top_k > 0 else 0,
        seed=seed,
        stop=tuple(stop or ()),
        top_logprobs=top_logprobs,
    )


class Part(Protocol):
    @property
    def type(self) -> str: ...

    @property
    def text(self) -> str | None: ...


# Content parts that carry media: refused with a message saying so (the served models take text only).
MEDIA_PARTS = frozenset({"image_url", "input_image", "image", "input_audio", "file", "input_file"})


def flatten_text(parts: Iterable[Part], where: str, *, text_types: frozenset[str], media_types: frozenset[str]) -> str:
    """The text of a list of content parts; media parts and unknown types are refused with a 400 naming ``where``.

    A ``refusal`` part (Responses echoes) reads as its refusal text when ``text_types`` admits it.
    """
    out: list[str] = []
    for part in parts:
        if part.type in text_types:
            refusal = getattr(part, "refusal", None) if part.type == "refusal" else None
            out.append(refusal or part.text or "")
        elif part.type in media_types:
            raise BadRequest(f"this model accepts text only; got a content part of type {part.type!r}", param=where)
        else:
            raise BadRequest(f"unsupported content part type {part.type!r}", param=where)
    return "".join(out)


# --- wire helpers --------------------------------------------------------------------------------------------
def sse(data: dict[str, Any], event: str | None = None) -> bytes:
    """One Server-Sent Event: ``data:`` compact JSON, behind an ``event:`` line for typed streams."""
    payload = orjson.dumps(data)
    if event is None:
        return b"data: " + payload + b"\n\n"
    return b"event: " + event.encode() + b"\ndata: " + payload + b"\n\n"


def call_headers(*preps: PlannedCall) -> dict[str, str]:
    """The calls a response holds and their rollouts, so a client can reward or look them up."""
    return named_calls([c for p in preps for c in p.call_ids], [p.rollout_id for p in preps])


async def json_body(request: Request) -> dict[str, Any]:
    body = await request.body()
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise BadRequest("request body must be a JSON object")
    return value


def json_response(body: BaseModel, *preps: PlannedCall) -> Response:
    """A whole response, with the headers naming its calls."""
    return Response(body.model_dump_json(), media_type="application/json", headers=call_headers(*preps))


# --- streams -------------------------------------------------------------------------------------------------
# Each chunk a stream yields is one socket write (one HTTP chunk), so the encoders join what is ready at the same
# moment: the opening events with the first event's (the first event is in hand before the response starts, see
# ``prefetch``), the events of one engine delta, and the final events with the end of the stream. Nothing waits
# for anything that is not there yet: no token is held back.
class Last(bytes):
    """A stream's last events: only the end of the stream follows, and it goes out in the same write."""


async def openai_chunks(
    events: AsyncIterator[Event],
    n: int,
    *,
    first: bytes,
    delta_chunk: Callable[[ChoiceDelta], Awaitable[bytes]],
    end_chunk: Callable[[ChoiceResult], bytes],
    usage_chunk: Callable[[int], bytes],
) -> AsyncIterator[bytes]:
    """The shape of OpenAI's streams (chat completions and completions): ``first`` with the first event's chunk, a
    chunk per delta and one at each choice's end, and once all ``n`` choices have ended the usage chunk (given the
    completion tokens) and the stream's end (``Last``), even when a choice ended without its result."""
    out = first
    completion_tokens = finished = 0
    async for ev in events:
        if isinstance(ev, ChoiceResult):
            completion_tokens += len(ev.token_ids)
            finished += 1
            out += end_chunk(ev)
            if finished == n:  # the last choice's end: only the usage and the stream's end follow
                yield Last(out + usage_chunk(completion_tokens))
                out = b""
                continue
        else:
            out += await delta_chunk(ev)
        if out:
            yield out
            out = b""
    if finished < n:  # no event at all, or a choice without its result: the stream still ends
        yield Last(out + usage_chunk(completion_tokens))


class StreamEncoder(ABC):
    """One response's events → the protocol's stream chunks."""

    # Sent last, after the error event too (OpenAI's ``data: [DONE]``).
    done: bytes = b""

    @abstractmethod
    def encode(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        """The chunks of the whole stream (the final one a ``Last``); exceptions are left to the tail."""

    @abstractmethod
    def error(self, exc: APIError) -> bytes:
        """The protocol's event for an error after the stream began."""


async def guarded(encoder: StreamEncoder, events: AsyncIterator[Event], api: str) -> AsyncIterator[bytes]:
    """The one tail of every stream: an error after the first byte goes out as the protocol's error event (the
    status line is long gone) and is logged; the events are closed whether the stream ended, broke or the client
    went away. The stream ends with one ``Last`` chunk: the encoder's last events (or the error), then ``done``."""
    chunks = encoder.encode(events)
    tail = b""
    try:
        async for chunk in chunks:
            if isinstance(chunk, Last):
                tail += chunk  # what follows is the end of the events, at once: sent with it
                continue
            if tail:  # an encoder that yields after its Last: keep the order
                yield tail
                tail = b""
            yield chunk
    except APIError as exc:
        log.warning("%s stream ended with an error: %s: %s", api, type(exc).__name__, exc.message)
        tail += encoder.error(exc)
    except Exception as exc:  # never let a broken stream end without telling the client why
        log.exception("%s stream failed", api)
        tail += encoder.error(APIError(f"internal error: {exc}"))
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
        await events.aclose()  # type: ignore[attr-defined]
    yield Last(tail + encoder.done)


class EventStreamResponse(StreamingResponse):
    """A stream whose ``Last`` chunk carries the end of the response too: one write (chunk and terminator)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream, and stop at once when the client goes away (the calls are then recorded as cancelled).

        Starlette does this with an anyio task group around the body and a disconnect listener; measured here, that
        costs ~0.1 ms of CPU per response, and one plain task that cancels this one on a disconnect about 0.015.
        """
        this = asyncio.current_task()
        assert this is not None  # an ASGI server runs each request in a task
        gone = False

        async def listen() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            this.cancel()

        # The listener runs only while this task waits; after the last send it is cancelled before it can run, so
        # the disconnect that the server reports once the response is complete never reaches this task.
        listener = asyncio.create_task(listen())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone:
                raise
            this.uncancel()
        finally:
            listener.cancel()
        if self.background is not None:
            await self.background()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            body = bytes(chunk) if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
            if isinstance(chunk, Last):
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# --- the serving base ----------------------------------------------------------------------------------------
class ProtocolServing(ABC, Generic[Req]):
    """One protocol's serving: the prologue and the shells; subclasses translate."""

    api: str  # the capture's name of the protocol: chat | completions | messages | responses
    request_model: type[Req]

    def __init__(self, state: AppState) -> None:
        self.state = state
        self.service: ChatService = state.service

    async def handle(self, request: Request, rollout: RolloutRef) -> Response:
        """The route's whole work: parse and check the request, then serve it."""
        raw, req = await self.parse(request, self.request_model)
        return await self.serve(req, raw, rollout)

    async def parse(self, request: Request, model: type[Other]) -> tuple[dict[str, Any], Other]:
        raw = await json_body(request)
        req = model.model_validate(raw)
        self.state.check_model(req.model)
        return raw, req

    @abstractmethod
    async def serve(self, req: Req, raw: dict[str, Any], rollout: RolloutRef) -> Response: ...

    def job(
        self,
        req: Req,
        raw: dict[str, Any],
        rollout: RolloutRef,
        *,
        stream: bool,
        request_id: str,
        conversation: tuple[list[Message], list[ToolSpec]],
        params: SamplingParams,
        raw_messages: Any = None,
        tool_use: ToolUse | None = None,
        n: int = 1,
        prompt_ids: list[int] | None = None,
        json_output: JsonOutput | None = None,
    ) -> ChatJob:
        """The job of a request: what every protocol fills the same way, and the translation it passes."""
        messages, tools = conversation
        return ChatJob(
            api=self.api,
            model=req.model,
            messages=messages,
            tools=tools,
            n=n,
            params=params,
            rollout=rollout,
            raw_request=raw,
            request_id=request_id,
            raw_messages=raw_messages,
            tool_use=tool_use or ToolUse(),
            stream=stream,
            # A token-level prompt (completions) is answered as plain text: no reasoning or tool-call parsing.
            parse_output=prompt_ids is None,
            prompt_ids=prompt_ids,
            json_output=json_output,
        )

    async def stream(
        self, prep: PlannedCall, iterators: list[AsyncIterator[Event]], encoder: StreamEncoder
    ) -> StreamingResponse:
        events = await prefetch(merge(iterators))
        return EventStreamResponse(
            guarded(encoder, events, self.api),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **call_headers(prep)},
        )
