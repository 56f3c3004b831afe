"""The local engine's worker thread: continuous batching, prefill, decode steps and event delivery.

The worker owns every piece of torch state; the engine hands it requests (``LocalSequence``) and adapter commands
through a thread-safe inbox. Each loop iteration runs the adapter commands that can run, admits waiting requests
(FIFO; a batch holds one adapter, and an unbatchable model one request), takes one decode step for the whole
batch, then hands the step's events to their event loops in one wake-up per loop. A decode step is: forward →
mask the rows under a grammar (``_mask``: fill their bitmasks, apply them, note the rows left a single token) →
draw each row's token, or take its single allowed one → advance each matcher past its token.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from gateway.core.detokenize import IncrementalDetokenizer
from gateway.core.stops import StopTrimmer
from gateway.engines import kv_batch
from gateway.engines.adapters import AdapterCommand, ModelAdapters, resolve
from gateway.engines.base import FinishReason, GenerationEnd, GenerationEvent, GenerationRequest, TokenDelta
from gateway.engines.grammar import Grammars, consume
from gateway.engines.sampling import apply_bitmasks, forced_draw, forced_tokens, sample_token
from gateway.errors import APIError, EngineError, EngineUnavailable, NotFound

logger = logging.getLogger("gateway.engines.local")

# Prompt tokens decoded in front of the completion so the first generated token decodes with its leading space
# (sentencepiece tokenizers drop it when a token is decoded on its own).
_DECODE_CONTEXT = 5

SHUTDOWN = object()


@dataclass(eq=False)
class LocalSequence:
    """One request, shared between the event loop (events, cancelled) and the worker (everything else)."""

    request: GenerationRequest
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[GenerationEvent | APIError]
    submitted: float
    # Set by the consumer when it stops listening; the worker checks it before every step.
    cancelled: bool = False
    # Worker-side state.
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None  # with stops: the completion text, for stop strings
    stops: StopTrimmer | None = None
    generated: int = 0
    next_token: int = -1  # sampled but not yet fed to the model
    cached: int = 0  # tokens of this row in the KV cache
    done: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    matcher: Any = None  # structured output: the grammar's matcher (llguidance), advanced past every sampled token

    @property
    def adapter(self) -> str | None:
        return self.request.adapter


class LocalWorker:
    """Runs on the engine's worker thread (``run``); everything here but the inbox is touched by that thread only."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        device: torch.device,
        max_batch: int,
        num_threads: int,
        eos_token_ids: frozenset[int],
        uses_logits_to_keep: bool,
        inbox: queue.SimpleQueue[object],
        stats: dict[str, int],
        grammars: Grammars | None = None,
    ) -> None:
        self._model = model
        self._grammars = grammars
        self._tokenizer = tokenizer
        self.device = device
        self.max_batch = max_batch
        self.num_threads = num_threads
        self.eos_token_ids = eos_token_ids
        self._uses_logits_to_keep = uses_logits_to_keep
        self._inbox = inbox
        self._stats = stats
        self._waiting: deque[LocalSequence] = deque()
        self._running: list[LocalSequence] = []
        self._commands: list[AdapterCommand] = []
        self._outbox: list[tuple[LocalSequence, GenerationEvent | APIError]] = []
        self._cache: Any = None
        self._batch_adapter: str | None = None
        self._model_adapters = ModelAdapters()
        self._batchable = True

    def run(self) -> None:
        """The worker thread: until shutdown, run adapter commands, admit requests and take one decode step."""
        # OpenMP thread counts are per calling thread: this sets the engine's intra-op threads only.
        torch.set_num_threads(self.num_threads)
        with torch.inference_mode():
            while True:
                idle = not self._running and not self._waiting and not self._commands
                if not self._drain_inbox(block=idle):
                    break
                try:
                    self._run_commands()
                    self._admit()
                    if self._running:
                        self._decode_step()
                except Exception as exc:  # a failed forward must not kill the worker
                    logger.exception("local engine step failed")
                    self._fail_running(EngineError(f"local engine error: {exc}"))
                finally:
                    self._stats["running"], self._stats["waiting"] = len(self._running), len(self._waiting)
                    self._flush()
        self._shutdown()
        self._flush()

    def _drain_inbox(self, *, block: bool) -> bool:
        """Move everything in the inbox to the worker's queues; False once shutdown is requested."""
        items: list[object] = []
        if block:
            items.append(self._inbox.get())
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        running = True
        for item in items:
            if item is SHUTDOWN:
                running = False
            elif isinstance(item, LocalSequence):
                self._waiting.append(item)
            elif isinstance(item, AdapterCommand):
                self._commands.append(item)
        return running

    def _shutdown(self) -> None:
        for seq in [*self._running, *self._waiting]:
            if not seq.cancelled:
                self._post(seq, GenerationEnd(finish_reason="abort", prompt_tokens=len(seq.request.prompt_ids)))
        self._running.clear()
        self._waiting.clear()
        self._cache = None
        leftovers = [*self._commands]
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, AdapterCommand):
                leftovers.append(item)
            elif isinstance(item, LocalSequence):
                self._post(item, EngineUnavailable("the local engine is shutting down"))
        for command in leftovers:
            resolve(command, EngineUnavailable("the local engine is shutting down"))
        self._commands.clear()

    def _adapter_in_use(self, name: str) -> bool:
        return any(seq.adapter == name for seq in (*self._running, *self._waiting))

    def _run_commands(self) -> None:
        """Apply adapter commands between steps, so they never race a forward pass."""
        self._commands = self._model_adapters.run(self._model, self._commands, self._adapter_in_use)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_batch:
            seq = self._waiting[0]
            if seq.cancelled:
                self._waiting.popleft()
                continue
            if self._running and (not self._batchable or seq.adapter != self._batch_adapter):
                break
            self._waiting.popleft()
            try:
                self._prefill(seq)
            except Exception as exc:
                logger.exception("prefill failed for %s", seq.request.request_id)
                self._post(seq, EngineError(f"local engine error: {exc}"))
            # The first token goes out before the next request's prefill starts.
            self._flush()

    def _prefill(self, seq: LocalSequence) -> None:
        from transformers import DynamicCache

        request = seq.request
        params = request.params
        started = time.perf_counter()
        seq.timings["queue"] = started - seq.submitted
        if request.adapter is not None and request.adapter not in self._model_adapters:
            self._post(seq, NotFound(f"adapter {request.adapter!r} is not loaded", param="model"))
            return
        self._model_adapters.apply(self._model, request.adapter)
        generator = torch.Generator(device=self.device)
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        seq.generator = generator
        if params.stop:
            # Decoded after a few prompt tokens, so the first generated token keeps its leading space (SentencePiece
            # drops it from a token decoded on its own); special tokens count, as in vLLM's stop matching.
            seq.detokenizer = IncrementalDetokenizer(
                self._tokenizer, skip_special_tokens=False, context_ids=request.prompt_ids[-_DECODE_CONTEXT:]
            )
            seq.stops = StopTrimmer(params.stop)

        cache = DynamicCache(config=self._model.config)
        input_ids = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {"logits_to_keep": 1} if self._uses_logits_to_keep else {}
        out = self._model(input_ids=input_ids, past_key_values=cache, use_cache=True, **kwargs)
        seq.cached = len(request.prompt_ids)
        self._stats["requests"] += 1
        logits = out.logits[:1, -1].float()
        seq.timings["prefill"] = time.perf_counter() - started
        forced = self._mask([seq], logits)
        self._emit(seq, logits[0], forced.get(0))
        if seq.done:
            return
        if not self._running:
            self._cache = cache
            self._batch_adapter = request.adapter
            self._batchable = kv_batch.is_batchable(cache)
        else:
            kv_batch.append_row(self._cache, cache)
        self._running.append(seq)
        self._stats["peak_batch"] = max(self._stats["peak_batch"], len(self._running))

    def _drop_rows(self, keep: list[int]) -> None:
        """Keep only the given batch rows of the cache."""
        if not keep:
            self._cache = None
            return
        kv_batch.keep_rows(self._cache, keep, [self._running[i].cached for i in keep], self.device)

    def _decode_step(self) -> None:
        live = [i for i, seq in enumerate(self._running) if not seq.cancelled]
        if len(live) < len(self._running):
            self._drop_rows(live)
            self._running = [self._running[i] for i in live]
            if not self._running:
                return
        self._model_adapters.apply(self._model, self._batch_adapter)
        rows = self._running
        length = self._cache.get_seq_length()
        input_ids, position_ids, attention_mask = kv_batch.decode_inputs(
            [seq.next_token for seq in rows], [seq.cached for seq in rows], length, self.device
        )
        out = self._model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            past_key_values=self._cache,
            use_cache=True,
        )
        self._stats["decode_steps"] += 1
        logits = out.logits[:, -1].float()
        forced = self._mask(rows, logits)
        for i, seq in enumerate(rows):
            seq.cached += 1
            self._emit(seq, logits[i], forced.get(i))
        if any(seq.done for seq in rows):
            keep = [i for i, seq in enumerate(rows) if not seq.done]
            self._drop_rows(keep)
            self._running = [rows[i] for i in keep]

    def _mask(self, rows: list[LocalSequence], logits: torch.Tensor) -> dict[int, int]:
        """Mask the logits (``[len(rows), vocab]``) of the rows under a grammar to what it allows next, all rows in
        one go. Sampled from that masked distribution, a token's recorded logprob is the masked one.

        Returns the rows whose grammar allows a single token next, with that token: most steps of a JSON answer's
        keys, punctuation and enum values on a small vocabulary. Those rows are not drawn from (``forced_draw``),
        so their logits are left as they are."""
        constrained = [(seq.matcher, i) for i, seq in enumerate(rows) if seq.matcher is not None]
        if not constrained:
            return {}
        assert self._grammars is not None
        masks = self._grammars.bitmasks(constrained, len(rows))
        indices = [i for _, i in constrained]
        forced = {i: token for i, token in forced_tokens(masks, indices).items() if token < logits.shape[-1]}
        drawn = [i for i in indices if i not in forced]
        if drawn:
            apply_bitmasks(masks, logits, drawn)
        return forced

    def _emit(self, seq: LocalSequence, logits: torch.Tensor, forced: int | None = None) -> None:
        """Sample the next token of ``seq`` from its (already masked) logits, or take the ``forced`` one its grammar
        alone allows, send it, and finish the sequence if it stops here."""
        params = seq.request.params
        if forced is not None:
            token, logprob, top = forced_draw(forced, params)
            self._stats["forced_tokens"] += 1
        else:
            token, logprob, top = sample_token(logits, params, seq.generator)
        if seq.matcher is not None:
            consume(seq.matcher, token)
        seq.generated += 1
        seq.next_token = token
        self._stats["generated_tokens"] += 1
        self._post(seq, TokenDelta(token_ids=[token], logprobs=[logprob], top_logprobs=[top] if top else None))
        reason: FinishReason | None = None
        stop_reason: str | int | None = None
        if token in self.eos_token_ids or token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        elif seq.stops is not None and (matched := self._stop_string(seq, token)) is not None:
            reason, stop_reason = "stop", matched
        elif seq.generated >= seq.max_tokens:
            reason = "length"
        if reason is None:
            return
        seq.done = True
        now = time.perf_counter()
        seq.timings["decode"] = now - seq.submitted - seq.timings["queue"] - seq.timings["prefill"]
        seq.timings["total"] = now - seq.submitted
        self._post(
            seq,
            GenerationEnd(
                finish_reason=reason,
                stop_reason=stop_reason,
                prompt_tokens=len(seq.request.prompt_ids),
                timings=dict(seq.timings),
            ),
        )

    @staticmethod
    def _stop_string(seq: LocalSequence, token: int) -> str | None:
        """The stop string that ``token`` completes, if any."""
        assert seq.detokenizer is not None and seq.stops is not None
        seq.stops.feed(seq.detokenizer.add([token]))
        return seq.stops.stopped

    def _post(self, seq: LocalSequence, event: GenerationEvent | APIError) -> None:
        if not seq.cancelled:
            self._outbox.append((seq, event))

    def _flush(self) -> None:
        """Hand queued events to their event loops: one wake-up per loop per step, not one per token."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[LocalSequence, GenerationEvent | APIError]]] = {}
        for seq, event in self._outbox:
            by_loop.setdefault(seq.loop, []).append((seq, event))
        self._outbox = []
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the consumer's event loop is closed: nobody is listening
                for seq, _ in batch:
                    seq.cancelled = True

    def _fail_running(self, error: APIError) -> None:
        for seq in self._running:
            seq.done = True
            self._post(seq, error)
        self._running = []
        self._cache = None


def _deliver(batch: list[tuple[LocalSequence, GenerationEvent | APIError]]) -> None:
    for seq, event in batch:
        seq.events.put_nowait(event)
