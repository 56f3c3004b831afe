"""Completions (`POST /v1/completions`): raw prompts (text or token ids) in, plain text out.

No chat rendering, splicing or output parsing: each prompt is one job whose prompt is its own tokens
(tokenizing, the vocabulary check and the echo text run in the service, off the event loop). A request of
several prompts answers them all in one body, the choices numbered prompt by prompt; a stream serves one prompt.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response

from gateway.core.job import ChoiceDelta, ChoiceResult, PlannedCall, RolloutRef
from gateway.core.service import ChatService
from gateway.errors import BadRequest
from gateway.ids import new_id
from gateway.protocols.common.choices import Event, collect_all
from gateway.protocols.common.serving import ProtocolServing, json_response, openai_chunks, sampling, sse
from gateway.protocols.openai.chat import OpenAIStream, usage
from gateway.protocols.openai.wire import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, Usage

DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for completions


async def completion_logprobs(
    service: ChatService, ids: list[int], lps: list[float], tops: list[dict[int, float]] | None
) -> dict[str, Any]:
    """Completions-style logprobs: parallel lists of tokens, their logprobs, alternatives and text offsets."""
    tokens, alternatives = await service.token_texts(ids, tops)
    top_list = None if alternatives is None else [dict(alt) for alt in alternatives]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_list, "text_offset": offsets}


class CompletionsServing(ProtocolServing[CompletionRequest]):
    api = "completions"
    request_model = CompletionRequest

    async def serve(self, req: CompletionRequest, raw: dict[str, Any], rollout: RolloutRef) -> Response:
        prompts = req.prompts()
        if req.stream and len(prompts) > 1:
            raise BadRequest("streaming supports a single prompt", param="prompt")
        if req.echo and req.logprobs is not None:
            raise BadRequest("echo with logprobs is not supported (prompt logprobs are not computed)", param="echo")
        max_tokens, top = req.max_tokens or DEFAULT_MAX_TOKENS, req.logprobs or 0
        params = sampling(max_tokens, req.temperature, req.top_p, req.top_k, req.seed, req.stop, top_logprobs=top)
        created = int(time.time())
        request_id = new_id("cmpl")
        preps: list[PlannedCall] = []
        echoes: list[str] = []
        for p in prompts:
            ids, echo = await self.service.raw_prompt(p, echo=req.echo, param="prompt")
            echoes.append(echo)
            job = self.job(
                req, raw, rollout, stream=req.stream, request_id=request_id, conversation=([], []), params=params,
                n=req.n, prompt_ids=ids,
            )  # fmt: skip
            preps.append(await self.service.plan(job))
        if req.stream:
            prep = preps[0]
            iterators = [self.service.run_choice(prep, i) for i in range(req.n)]
            return await self.stream(prep, iterators, TextStream(self.service, prep, req, created, echoes[0]))
        choices: list[CompletionChoice] = []
        prompt_tokens = completion_tokens = 0
        for pi, prep in enumerate(preps):
            results = await collect_all([self.service.run_choice(prep, i) for i in range(req.n)])
            for r in results:
                choices.append(await self._choice(req, prep, pi * req.n + r.index, echoes[pi], r))
                completion_tokens += len(r.token_ids)
            prompt_tokens += len(prep.prompt_ids)
        body = Completion(
            id=request_id,
            created=created,
            model=req.model,
            choices=choices,
            usage=Usage(**usage(prompt_tokens, completion_tokens)),
        )
        return json_response(body, *preps)

    async def _choice(
        self, req: CompletionRequest, prep: PlannedCall, index: int, echo: str, r: ChoiceResult
    ) -> CompletionChoice:
        logprobs = None
        if req.logprobs is not None:
            lps = await completion_logprobs(self.service, r.token_ids, r.logprobs, r.top_logprobs)
            logprobs = CompletionLogprobs.model_validate(lps)
        return CompletionChoice(
            index=index,
            text=echo + (r.output.content or ""),
            finish_reason=r.finish_reason,
            logprobs=logprobs,
            prompt_token_ids=prep.prompt_ids if req.return_token_ids else None,
            token_ids=r.token_ids if req.return_token_ids else None,
        )


class TextStream(OpenAIStream):
    """The choices' events → ``text_completion`` chunk events (the echo first, when asked for)."""

    def __init__(
        self, service: ChatService, prep: PlannedCall, req: CompletionRequest, created: int, echo: str
    ) -> None:
        self.service = service
        self.prep = prep
        self.req = req
        self.echo = echo
        self.base = {"id": prep.request_id, "object": "text_completion", "created": created, "model": req.model}

    def encode(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        first = b""  # the echo goes out with the first event's chunk (see base.py on writes)
        if self.echo:
            for i in range(self.req.n):
                choice = {"index": i, "text": self.echo, "logprobs": None, "finish_reason": None}
                first += sse({**self.base, "choices": [choice]})
        return openai_chunks(
            events,
            self.req.n,
            first=first,
            delta_chunk=self._delta_chunk,
            end_chunk=self._end_chunk,
            usage_chunk=self._usage,
        )

    def _end_chunk(self, ev: ChoiceResult) -> bytes:
        end = {"index": ev.index, "text": "", "logprobs": None, "finish_reason": ev.finish_reason}
        return sse({**self.base, "choices": [end]})

    async def _delta_chunk(self, ev: ChoiceDelta) -> bytes:
        if not (ev.content or ev.token_ids):
            return b""
        req = self.req
        chunk: dict[str, Any] = {"index": ev.index, "text": ev.content, "logprobs": None, "finish_reason": None}
        if req.logprobs is not None and ev.token_ids:
            chunk["logprobs"] = await completion_logprobs(self.service, ev.token_ids, ev.logprobs, ev.top_logprobs)
        if req.return_token_ids:
            chunk["token_ids"] = ev.token_ids
        return sse({**self.base, "choices": [chunk]})

    def _usage(self, completion_tokens: int) -> bytes:
        if not (self.req.stream_options and self.req.stream_options.include_usage):
            return b""
        return sse({**self.base, "choices": [], "usage": usage(len(self.prep.prompt_ids), completion_tokens)})
