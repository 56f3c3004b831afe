"""The engine interface: token ids in, token ids and sampled-token logprobs out.

An engine knows nothing about chat formats or tools; the gateway renders prompts to ids before it calls one
and parses the text afterwards. Two implementations: ``vllm`` (HTTP client to a vLLM server) and ``local``
(in-process transformers + PEFT, for CPU development, the demo and tests).

Streaming contract: ``generate`` is an async iterator that yields zero or more ``TokenDelta`` and then exactly
one ``GenerationEnd``; every sampled token appears in exactly one delta, with its logprob under the
distribution it was sampled from (after temperature/top-k/top-p processing). Errors are raised as
``gateway.errors.APIError`` subclasses. Closing the iterator early (``aclose``) aborts the generation.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class Constraint:
    """What every sampled token must keep possible: a grammar in llguidance's Lark dialect (JSON parts as
    ``%json`` schemas; see gateway/core/structured.py). Tokens are sampled from the model's distribution masked to
    the tokens the grammar allows, and the recorded logprob is that masked distribution's."""

    kind: Literal["json", "tool_call"]
    grammar: str


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k (never the transformers default of 50: logprobs must match sampling)
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings; the engine stops after the token that completes one
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end generation (besides the model's EOS ids)
    top_logprobs: int = 0  # alternatives per position to report (0: only the sampled token's logprob)
    constraint: Constraint | None = None  # structured output: the grammar the answer must match


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None  # name of a loaded LoRA adapter; None runs the base model
    # False when nobody watches tokens arrive: an engine may then generate in one piece (cheaper over HTTP);
    # it still yields one TokenDelta with every token, then the GenerationEnd.
    stream: bool = True
    # The rollout the call belongs to: an engine behind a router sends it as the session key, so that every call
    # of a rollout lands on the replica that holds its prefix cache.
    session_id: str | None = None
    # vLLM's request priority under `--scheduling-policy priority` (larger: scheduled later, preempted first); 0 is
    # every live call's, and the only value vLLM accepts under its default FCFS policy. The local engine ignores it.
    priority: int = 0


@dataclass(slots=True)
class TokenDelta:
    token_ids: list[int]
    logprobs: list[float]  # one per token: log p(sampled token)
    # One dict per token when top_logprobs > 0: token id -> logprob of the top alternatives.
    top_logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class GenerationEnd:
    finish_reason: FinishReason
    # What ended it: the stop string, or the stop/EOS token id; None for length.
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    # Engine-side timings in seconds, when the engine reports them.
    timings: dict[str, float] = field(default_factory=dict)


GenerationEvent = TokenDelta | GenerationEnd


@runtime_checkable
class Engine(Protocol):
    """What the gateway needs from a serving engine."""

    name: str  # "local" or "vllm"
    max_model_len: int  # context window in tokens (prompt + completion)

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    # Closing the generator before its GenerationEnd (the client went away) must stop the generation.
    def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationEvent, None]: ...

    # Loading a name again from the same folder is a no-op; from another folder, BadRequest.
    async def load_adapter(self, name: str, path: str) -> None: ...

    async def unload_adapter(self, name: str) -> None: ...

    async def adapters(self) -> list[str]: ...

    # One greedy token through adapter ``name`` on every instance that serves it (each replica behind a router):
    # raises when one cannot answer.
    async def verify_adapter(self, name: str, prompt_ids: list[int]) -> None: ...

    async def health(self) -> bool: ...


async def answer_once(engine: Engine, name: str, prompt_ids: list[int]) -> None:
    """One greedy token through adapter ``name``: ``verify_adapter`` for an engine with one instance."""
    request = GenerationRequest(
        f"probe-{name}-{time.monotonic_ns()}",
        list(prompt_ids) or [0],
        SamplingParams(max_tokens=1, temperature=0.0),
        name,
        stream=False,
    )
    ended = False
    async for event in engine.generate(request):
        ended = ended or isinstance(event, GenerationEnd)
    if not ended:
        raise RuntimeError(f"the probe through {name} ended without an answer")
