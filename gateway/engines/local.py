"""In-process engine: transformers (+ PEFT LoRA adapters) in one worker thread, for CPU development, the demo
and tests.

Why a hand-written decoding loop instead of ``model.generate``: the logprob of every sampled token is the
behaviour-policy logprob for training, so it must come from exactly the distribution the token was drawn from
(``gateway.engines.sampling``).

Threading: all torch work (prefill, decode, adapter loading and switching) happens in one dedicated worker thread
(``gateway.engines.local_worker``), never on the event loop. Requests and adapter commands reach it through a
thread-safe inbox; events go back to each request's ``asyncio.Queue`` through ``loop.call_soon_threadsafe``, one
``TokenDelta`` per sampled token, sent right after the step that sampled it (one loop wake-up per step carries the
tokens of every row in the batch). A consumer that stops iterating sets a cancel flag that the worker checks
before every step.

Batching: continuous (``gateway.engines.kv_batch``): a request is prefilled alone, then its KV cache joins the
running batch; finished or cancelled rows are dropped between steps. Requests are admitted in FIFO order and a
batch only holds requests for the same adapter (``None`` = base model; ``gateway.engines.adapters``): when the
head of the queue wants a different adapter, admission pauses until the batch drains, so nobody is starved.
Models whose cache is not a plain ``DynamicCache`` of full-attention layers (sliding windows, linear attention)
are served one request at a time.

Stop strings are matched on the incrementally detokenized completion (``gateway.core.detokenize``) by the same
``StopTrimmer`` the service uses on the client's text; the ids that end a turn come from
``gateway.end_of_turn``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncGenerator
from typing import Any

import torch

from gateway.end_of_turn import end_token_ids
from gateway.engines.adapters import AdapterCommand, AdapterNames, CommandKind
from gateway.engines.base import GenerationEnd, GenerationEvent, GenerationRequest, answer_once
from gateway.engines.grammar import Grammars
from gateway.engines.local_worker import SHUTDOWN, LocalSequence, LocalWorker
from gateway.engines.sampling import validate_params
from gateway.errors import APIError, BadRequest, ContextTooLong, EngineUnavailable, NotFound

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LocalEngine:
    """The ``Engine`` protocol on an in-process transformers model (see the module docstring)."""

    name = "local"

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        max_model_len: int | None = None,
        device: str = "cpu",
        max_batch: int = 8,
        num_threads: int | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.model_path = model_path
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_batch = max_batch
        # Leave a core to the event loop: torch's OpenMP threads spin while waiting, and with every core busy the
        # loop thread's per-token work stalls them (measured 6x slower decoding on 2 cores).
        self.num_threads = num_threads or max(1, (os.cpu_count() or 1) - 1)
        self._requested_max_model_len = max_model_len
        # Known once the model config is read in start().
        self.max_model_len = max_model_len or 0
        self.eos_token_ids: frozenset[int] = frozenset()
        self.vocab_size = 0
        self.grammars: Grammars | None = None  # structured outputs: built with the tokenizer

        self._model: Any = None
        self._tokenizer: Any = None
        self._thread: threading.Thread | None = None
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._closing = False
        # Adapter names visible to requests (event-loop side); the worker tracks what the model actually holds.
        self._adapter_names = AdapterNames()

        self._worker: LocalWorker | None = None
        self._uses_logits_to_keep = False
        self._stats = dict.fromkeys(
            ("requests", "generated_tokens", "forced_tokens", "decode_steps", "peak_batch", "running", "waiting"), 0
        )

    # ---- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is not None:
            return
        await asyncio.to_thread(self._load)
        self._closing = False
        self._worker = LocalWorker(
            self._model,
            self._tokenizer,
            device=self.device,
            max_batch=self.max_batch,
            num_threads=self.num_threads,
            eos_token_ids=self.eos_token_ids,
            uses_logits_to_keep=self._uses_logits_to_keep,
            inbox=self._inbox,
            stats=self._stats,
            grammars=self.grammars,
        )
        self._thread = threading.Thread(target=self._worker.run, name="clawgate-local-engine", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        thread = self._thread
        if thread is None:
            return
        self._closing = True
        self._inbox.put(SHUTDOWN)
        await asyncio.to_thread(thread.join)
        self._thread = self._worker = None
        self._model = self._tokenizer = None
        # A restart loads a fresh model without adapters.
        self._adapter_names.clear()

    async def health(self) -> bool:
        return self._model is not None and self._thread is not None and self._thread.is_alive()

    @property
    def stats(self) -> dict[str, int]:
        """Counters since start (requests, generated_tokens, forced_tokens: the generated tokens a grammar left
        no choice but, taken without a draw; decode_steps, peak_batch) and the current running and waiting request
        counts, as the worker last saw them."""
        return dict(self._stats)

    def _load(self) -> None:
        # transformers is imported here, in the loading thread, because importing it takes seconds.
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model: Any = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=_DTYPES[self.dtype])
        model.to(self.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        config = model.config.get_text_config(decoder=True)
        limit = getattr(config, "max_position_embeddings", None)
        if self._requested_max_model_len is not None:
            self.max_model_len = self._requested_max_model_len
        elif limit is not None:
            self.max_model_len = int(limit)
        else:
            raise ValueError("the model config has no max_position_embeddings; pass max_model_len")
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.eos_token_ids = end_token_ids(tokenizer, model.generation_config.eos_token_id)
        self._uses_logits_to_keep = "logits_to_keep" in _forward_parameters(model)
        self.grammars = Grammars(tokenizer, vocab_size=self.vocab_size, eos_ids=self.eos_token_ids)
        self._model, self._tokenizer = model, tokenizer
        logger.info(
            "local engine loaded %s (%s, max_model_len %d, eos %s)",
            self.model_path,
            self.dtype,
            self.max_model_len,
            sorted(self.eos_token_ids),
        )

    # ---- requests --------------------------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationEvent, None]:
        matcher = None
        if request.params.constraint is not None and self.grammars is not None:
            # Compiled off the event loop and off the worker (a cache hit is a copy).
            matcher = await asyncio.to_thread(self.grammars.matcher, request.params.constraint.grammar)
        seq = self._submit(request, matcher)
        try:
            while True:
                event = await seq.events.get()
                if isinstance(event, APIError):
                    raise event
                yield event
                if isinstance(event, GenerationEnd):
                    return
        finally:
            # A consumer that stops early (client disconnect, aclose, task cancellation) ends the generation.
            seq.cancelled = True

    def _submit(self, request: GenerationRequest, matcher: Any = None) -> LocalSequence:
        if self._model is None or self._thread is None or self._closing:
            raise EngineUnavailable("the local engine is not running")
        params = request.params
        prompt = request.prompt_ids
        validate_params(params)
        if not prompt:
            raise BadRequest("the prompt is empty", param="prompt")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise BadRequest(f"prompt token ids must lie in [0, {self.vocab_size})", param="prompt")
        if params.stop and self._tokenizer is None:
            raise BadRequest("stop strings need a tokenizer", param="stop")
        remaining = self.max_model_len - len(prompt)
        if remaining < 1:
            raise ContextTooLong(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt)} tokens, which leaves no room for a completion."
            )
        if request.adapter is not None and request.adapter not in self._adapter_names:
            raise NotFound(f"adapter {request.adapter!r} is not loaded", param="model", code="model_not_found")
        seq = LocalSequence(
            request=request,
            max_tokens=min(params.max_tokens, remaining),
            loop=asyncio.get_running_loop(),
            events=asyncio.Queue(),
            submitted=time.perf_counter(),
            # Set before the worker can see the sequence: it may prefill it as soon as it is in the inbox.
            matcher=matcher,
        )
        self._inbox.put(seq)
        return seq

    # ---- adapters --------------------------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter in ``path`` as ``name`` (see ``AdapterNames.load``)."""
        if self._model is None or self._closing:
            raise EngineUnavailable("the local engine is not running")
        await self._adapter_names.load(name, path, self._command)

    async def unload_adapter(self, name: str) -> None:
        await self._adapter_names.unload(name, self._command)

    async def adapters(self) -> list[str]:
        return self._adapter_names.sorted()

    async def verify_adapter(self, name: str, prompt_ids: list[int]) -> None:
        await answer_once(self, name, prompt_ids)

    async def _command(self, kind: CommandKind, name: str, path: str) -> None:
        if self._thread is None or self._closing:
            raise EngineUnavailable("the local engine is not running")
        loop = asyncio.get_running_loop()
        command = AdapterCommand(kind=kind, name=name, path=path, loop=loop, done=loop.create_future())
        self._inbox.put(command)
        await command.done


def _forward_parameters(model: Any) -> set[str]:
    return set(inspect.signature(model.forward).parameters)
