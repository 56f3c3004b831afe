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

from gateway.errors import BadRequest
from gateway.ids import new_id
from gateway.job import ChoiceResult, Prepared, RolloutRef
from gateway.protocol.openai import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, Usage
from gateway.service import ChatService
from gateway.serving.base import Last, ProtocolServing, json_response, sampling, sse
from gateway.serving.chat import OpenAIStream, usage
from gateway.serving.choices import Event, collect_all

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
        preps: list[Prepared] = []
        echoes: list[str] = []
        for p in prompts:
            ids, echo = await self.service.raw_prompt(p, echo=req.echo, param="prompt")
            echoes.append(echo)
            job = self.job(
                req, raw, rollout, stream=req.stream, request_id=request_id, conversation=([], []), params=params,
                n=req.n, prompt_ids=ids,
            )  # fmt: skip
            preps.append(await self.service.prepare(job))
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
        self, req: CompletionRequest, prep: Prepared, index: int, echo: str, r: ChoiceResult
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

    def __init__(self, service: ChatService, prep: Prepared, req: CompletionRequest, created: int, echo: str) -> None:
        self.service = service
        self.prep = prep
        self.req = req
        self.echo = echo
        self.base = {"id": prep.request_id, "object": "text_completion", "created": created, "model": req.model}

    async def encode(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        req = self.req
        out = b""  # the echo goes out with the first event's chunk (see base.py on writes)
        if self.echo:
            for i in range(req.n):
                choice = {"index": i, "text": self.echo, "logprobs": None, "finish_reason": None}
                out += sse({**self.base, "choices": [choice]})
        completion_tokens = finished = 0
        async for ev in events:
            if isinstance(ev, ChoiceResult):
                completion_tokens += len(ev.token_ids)
                finished += 1
                end = {"index": ev.index, "text": "", "logprobs": None, "finish_reason": ev.finish_reason}
                out += sse({**self.base, "choices": [end]})
                if finished == req.n:  # the last choice's end: only the usage and the stream's end follow
                    yield Last(out + self._usage(completion_tokens))
                    out = b""
                    continue
            elif ev.content or ev.token_ids:
                chunk: dict[str, Any] = {"index": ev.index, "text": ev.content, "logprobs": None, "finish_reason": None}
                if req.logprobs is not None and ev.token_ids:
                    chunk["logprobs"] = await completion_logprobs(
                        self.service, ev.token_ids, ev.logprobs, ev.top_logprobs
                    )
                if req.return_token_ids:
                    chunk["token_ids"] = ev.token_ids
                out += sse({**self.base, "choices": [chunk]})
            if out:
                yield out
                out = b""
        if finished < req.n:  # no event at all, or a choice without its result: the stream still ends
            yield Last(out + self._usage(completion_tokens))

    def _usage(self, completion_tokens: int) -> bytes:
        if not (self.req.stream_options and self.req.stream_options.include_usage):
            return b""
        return sse({**self.base, "choices": [], "usage": usage(len(self.prep.prompt_ids), completion_tokens)})
