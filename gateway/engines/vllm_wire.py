"""The wire format of vLLM's (0.32) completions API: the request body the gateway sends, and how its answers
(streamed chunks, whole completions, error bodies, failed connections) read back as gateway events and errors.

Pure functions of their inputs, so the engine (``gateway.engines.vllm``) only does the HTTP. vLLM is asked for
the sampled ids (``return_token_ids``) and their logprobs with ids as keys (``return_tokens_as_token_ids``); its
own text output is ignored, because the gateway detokenizes the ids itself. vLLM still detokenizes internally
(stop strings are matched on its text), with ``skip_special_tokens`` off so a stop string is matched on the same
text the local engine matches it on.

Behaviour of vLLM 0.32 this relies on, checked against a running server:

- ``choices[].token_ids`` holds every sampled id, including the EOS or stop token that ended the generation
  (vLLM only leaves it out of the *text*); the token that completes a stop string is the last one sent, and
  tokens sampled after it in the same step are dropped. So no id has to be appended here.
- ``stop_reason`` is ``null`` when the model's primary EOS id (the tokenizer's ``eos_token_id``) ended the
  generation, the id for any other stop token, the string for a stop string. ``GenerationEnd.stop_reason``
  reports the last sampled id in the first case, as the local engine does.
- Logprobs are processed (after temperature, top-k and top-p) only when the server runs with
  ``--logprobs-mode processed_logprobs`` (``VLLMServer`` passes it); at temperature 0 they are the raw,
  unscaled logprobs. Tokens outside the top-k/top-p set have logprob -inf, which vLLM serializes as -9999.0;
  such alternatives are dropped from ``top_logprobs``.
- ``logprobs: N`` returns the sampled token plus the N most likely ones, so ``top_logprobs`` keeps the N best.
- A prompt of exactly ``max_model_len`` tokens is rejected as "max_tokens must be at least 1", and
  ``max_tokens > max_model_len`` is a 400, while a smaller ``max_tokens`` that does not fit is silently
  clamped. The body therefore checks the prompt length and clamps ``max_tokens`` itself, like the local
  engine.
- Without ``--generation-config vllm`` the server fills unset sampling fields (repetition penalty, min_p, …)
  from the model's ``generation_config.json``; every field that changes the distribution is sent explicitly.

Errors map onto ``gateway.errors``: a 400 about the context length → ``ContextTooLong``, other 400/422 →
``BadRequest``, 404 → ``NotFound``, 429 → ``RateLimited``, 503 → ``EngineUnavailable``, other statuses →
``EngineError``; connection failures (refused, cut, a connect that hangs) → ``EngineUnavailable``, a read that
stalls → ``EngineTimeout``. An error event
inside the stream carries the status vLLM would have answered with (some inputs are validated only after the
stream began) and maps the same way when it is a 4xx; anything else there → ``EngineError``.

The one answer read here that is not a completion's: a server's ``--max-loras`` (LoRA adapters one batch may hold),
which vLLM 0.32 serves over HTTP only as the ``max_lora`` label of its ``vllm:lora_requests_info`` gauge on
``/metrics`` (``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``: declared when LoRA is on, sampled in
``record`` from the scheduler's stats, so a server that has not run an engine step yet lists the gauge without a
sample). ``/server_info`` would say too, but only in dev mode (``VLLM_SERVER_DEV_MODE``).
"""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import orjson

from gateway.engines.base import FinishReason, GenerationEnd, GenerationRequest, TokenDelta
from gateway.errors import (
    APIError,
    BadRequest,
    ContextTooLong,
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    NotFound,
    RateLimited,
)

# vLLM writes -inf logprobs (tokens removed by top-k/top-p) as this value, since JSON has no infinity.
_VLLM_NEG_INF = -9999.0
_TOKEN_ID_PREFIX = "token_id:"
FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    # Only produced with `repetition_detection`, which this client never sets.
    "repetition": "stop",
}
_CONTEXT_MARKERS = ("maximum context length", "too long")
LORA_INFO = "vllm:lora_requests_info"
_MAX_LORA = re.compile(r'[{,]max_lora="(\d+)"')


def completion_body(
    request: GenerationRequest, *, model: str, max_model_len: int, eos_token_ids: tuple[int, ...]
) -> dict[str, Any]:
    """The streamed ``/v1/completions`` body for ``request``: ids in, sampled ids and their logprobs out.

    ``max_model_len`` 0 means unknown (no length check); ``eos_token_ids`` are always sent as stop ids.
    """
    params = request.params
    prompt = request.prompt_ids
    if not prompt:
        raise BadRequest("the prompt is empty", param="prompt")
    max_tokens = params.max_tokens
    if max_model_len:
        remaining = max_model_len - len(prompt)
        if remaining < 1:
            raise ContextTooLong(
                f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{len(prompt)} tokens, which leaves no room for a completion."
            )
        max_tokens = min(max_tokens, remaining)
    stop_token_ids = list(dict.fromkeys((*eos_token_ids, *params.stop_token_ids)))
    body: dict[str, Any] = {
        "model": request.adapter or model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        # 0 disables top-k in vLLM as here (-1 is accepted too).
        "top_k": params.top_k,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "stop": list(params.stop),
        "stop_token_ids": stop_token_ids,
        "logprobs": params.top_logprobs,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "stream": True,
        "stream_options": {"include_usage": True},
        # vLLM appends a random suffix internally, so a repeated id cannot collide there.
        "request_id": request.request_id,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if request.priority:
        body["priority"] = request.priority
    if params.constraint is not None:
        # An llguidance Lark grammar (``%json`` and token references): vLLM's "auto" backend hands what xgrammar
        # cannot read to guidance. The mask is applied to the logits before sampling, so the processed logprobs
        # are the masked distribution's, as the local engine records them.
        body["structured_outputs"] = {"grammar": params.constraint.grammar}
    return body


def take_events(pending: bytearray) -> list[dict[str, Any]]:
    """The stream events whose lines are complete in ``pending`` (removed from it), ``[DONE]`` left out.

    Lines are split here rather than with aiohttp's ``readline``, which refuses a line longer than its buffer
    (one event can carry many tokens with their top logprobs).
    """
    end = pending.rfind(b"\n")
    if end < 0:
        return []
    lines = pending[:end].split(b"\n")
    del pending[: end + 1]
    events = []
    for line in lines:
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            continue
        try:
            events.append(orjson.loads(payload))
        except orjson.JSONDecodeError as exc:
            raise EngineError(f"vLLM sent an unreadable stream event: {bytes(payload[:200])!r}") from exc
    return events


class StreamReader:
    """What a completion said so far: ``feed`` it a stream's bytes as they arrive (or ``read`` a whole answer),
    ``end`` once the body ended."""

    def __init__(self, top_logprobs: int, prompt_tokens: int) -> None:
        self.top_logprobs = top_logprobs
        self.prompt_tokens = prompt_tokens
        self.finish: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.timings: dict[str, float] = {}
        self.last_token: int | None = None
        self._pending = bytearray()

    def feed(self, piece: bytes) -> tuple[TokenDelta | None, APIError | None]:
        """The tokens of the events completed by ``piece``, as one delta, and the error an event carried.

        Events that arrived together become one delta: when the gateway falls behind, it catches up with one
        stream chunk and one socket write for all of them. Tokens sent before an error event come with it.
        """
        self._pending += piece
        arrived: TokenDelta | None = None
        for chunk in take_events(self._pending):
            if "error" in chunk:
                return arrived, stream_error(chunk)
            delta = self.read(chunk)
            if delta is not None:
                arrived = delta if arrived is None else _join(arrived, delta)
        return arrived, None

    def read(self, chunk: dict[str, Any]) -> TokenDelta | None:
        """The tokens of one completion object (a stream event, or a whole unstreamed answer); its finish and
        usage are kept for ``end``."""
        arrived: TokenDelta | None = None
        for choice in chunk.get("choices") or ():
            delta = token_delta(choice, self.top_logprobs)
            if delta is not None:
                arrived = delta if arrived is None else _join(arrived, delta)
                self.last_token = delta.token_ids[-1]
            if choice.get("finish_reason") is not None:
                self.finish = FINISH_REASONS.get(choice["finish_reason"], "stop")
                self.stop_reason = choice.get("stop_reason")
        usage = chunk.get("usage")
        if usage:
            self.prompt_tokens = int(usage.get("prompt_tokens", self.prompt_tokens))
            self.timings = timings(chunk.get("metrics"))
        return arrived

    def end(self) -> GenerationEnd:
        """The generation's end, once the body ended (an error if vLLM never said how it finished)."""
        if self.finish is None:
            raise EngineError("vLLM ended its answer without a finish reason")
        stop_reason = self.stop_reason
        if self.finish == "stop" and stop_reason is None:
            # The primary EOS id: vLLM reports no stop_reason for it, but it is the last id it sent.
            stop_reason = self.last_token
        return GenerationEnd(self.finish, stop_reason, self.prompt_tokens, self.timings)


def _join(first: TokenDelta, then: TokenDelta) -> TokenDelta:
    """Two consecutive deltas as one (``first`` is extended in place)."""
    first.token_ids += then.token_ids
    first.logprobs += then.logprobs
    if first.top_logprobs is not None and then.top_logprobs is not None:
        first.top_logprobs += then.top_logprobs
    return first


def token_delta(choice: dict[str, Any], top_logprobs: int) -> TokenDelta | None:
    token_ids = [int(t) for t in choice.get("token_ids") or ()]
    if not token_ids:
        return None
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs") or []
    if len(values) != len(token_ids):
        raise EngineError(f"vLLM sent {len(token_ids)} token ids with {len(values)} logprobs")
    tops: list[dict[int, float]] | None = None
    if top_logprobs > 0:
        tops = []
        for step in logprobs.get("top_logprobs") or [None] * len(token_ids):
            candidates = [
                (int(key.removeprefix(_TOKEN_ID_PREFIX)), float(value))
                for key, value in (step or {}).items()
                if value > _VLLM_NEG_INF
            ]
            # The sampled token is listed too, even when it is not among the best `top_logprobs`.
            candidates.sort(key=lambda item: item[1], reverse=True)
            tops.append(dict(candidates[:top_logprobs]))
    return TokenDelta(token_ids=token_ids, logprobs=[float(v) for v in values], top_logprobs=tops)


def timings(metrics: dict[str, Any] | None) -> dict[str, float]:
    """Per-request timings in seconds, present when the server runs with ``--enable-per-request-metrics``."""
    if not metrics:
        return {}
    names = {"queue_time_ms": "queue", "time_to_first_token_ms": "prefill", "generation_time_ms": "decode"}
    return {name: float(metrics[key]) / 1000 for key, name in names.items() if metrics.get(key) is not None}


def _error_message(payload: Any) -> str:
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if "detail" in payload:  # FastAPI's own errors (unknown route, body validation)
            return str(payload["detail"])
    return str(payload)


def error_from_response(status: int, body: bytes, path: str) -> APIError:
    """The gateway's error for vLLM's answer ``status`` with ``body`` to a request for ``path``."""
    payload: Any
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        payload = body.decode(errors="replace")
    message = _error_message(payload)
    if status == 404 and message == "Not Found":
        message = (
            f"vLLM has no route {path} (runtime LoRA loading needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True on the server)"
        )
    return _error_for(status, message, payload)


def stream_error(chunk: dict[str, Any]) -> APIError:
    """An error event inside a 200 stream: vLLM validates some inputs (token ids outside the vocabulary, for
    one) only once the stream has begun, and then sends the status it would have answered with as ``code``."""
    code = chunk.get("error", {}).get("code") if isinstance(chunk.get("error"), dict) else None
    message = _error_message(chunk)
    if isinstance(code, int) and 400 <= code < 500:
        return _error_for(code, message, chunk)
    return EngineError(f"vLLM failed during generation: {message}")


def _error_for(status: int, message: str, payload: Any) -> APIError:
    if status in (400, 422):
        if any(marker in message.lower() for marker in _CONTEXT_MARKERS):
            return ContextTooLong(message)
        param = payload.get("error", {}).get("param") if isinstance(payload, dict) else None
        return BadRequest(message, param=param if isinstance(param, str) else None)
    if status == 404:
        return NotFound(message, param="model", code="model_not_found")
    if status == 429:
        return RateLimited(message)
    if status == 503:
        return EngineUnavailable(f"vLLM is unavailable: {message}")
    if status in (401, 403):
        # The harness's credentials are fine; the gateway's key for vLLM is not.
        return EngineError(f"vLLM refused the gateway's credentials ({status}): {message}")
    return EngineError(f"vLLM answered {status}: {message}")


def transport_error(base_url: str, exc: aiohttp.ClientError | TimeoutError, path: str | None = None) -> APIError:
    """A failed connection or read: a refused or hanging connect is an unavailable engine, a stall a timeout."""
    on = f" on {path}" if path else ""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return EngineUnavailable(f"vLLM at {base_url} did not accept a connection")
    if isinstance(exc, TimeoutError):  # a read that waited longer than the timeout (aiohttp's are TimeoutErrors)
        return EngineTimeout(f"vLLM at {base_url} timed out{on}: {type(exc).__name__}")
    return EngineUnavailable(f"vLLM at {base_url} is unreachable{on}: {exc!r}")


def max_loras_of(metrics: str) -> int | None:
    """The ``--max-loras`` a vLLM server's ``/metrics`` text reports; None when it has no ``vllm:lora_requests_info``
    sample (LoRA off, or no engine step yet: then the gauge is declared, ``LORA_INFO in metrics``)."""
    for line in metrics.splitlines():
        if line.startswith(LORA_INFO + "{") and (found := _MAX_LORA.search(line)) is not None:
            return int(found.group(1))
    return None
