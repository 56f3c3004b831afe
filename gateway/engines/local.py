"""In-process engine: transformers (+ PEFT LoRA adapters) in one worker thread, for CPU development, the demo
and tests.

Why a hand-written decoding loop instead of ``model.generate``: the gateway records the logprob of every sampled
token as the behaviour-policy logprob for training, so the logprob must come from exactly the distribution the
token was drawn from. Each step applies ``logits / temperature → top-k → top-p → softmax`` and draws from that
distribution with the request's own ``torch.Generator``; the reported logprob is the log of that processed
distribution at the drawn id (temperature 0 is greedy and reports the raw softmax).

Threading: all torch work (prefill, decode, adapter loading and switching) happens in one dedicated worker thread,
never on the event loop. Requests and adapter commands reach it through a thread-safe inbox; events go back to
each request's ``asyncio.Queue`` through ``loop.call_soon_threadsafe``, one ``TokenDelta`` per sampled token, sent
right after the step that sampled it (one loop wake-up per step carries the tokens of every row in the batch). A
consumer that stops iterating sets a cancel flag that the worker checks before every step.

Batching: continuous. A request is prefilled alone (batch 1, so its first token sees no padding), then its KV cache
is left-padded and concatenated onto the running batch; every decode step feeds one token per row with per-row
position ids and a padding mask, and finished or cancelled rows are dropped between steps. Requests are admitted
in FIFO order and a batch only holds requests for the same adapter (``None`` = base model): when the head of the
queue wants a different adapter, admission pauses until the batch drains, so nobody is starved. Models whose cache
is not a plain ``DynamicCache`` of full-attention layers (sliding windows, linear attention) are served one request
at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
import warnings
from collections import deque
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from gateway.engines.base import (
    FinishReason,
    GenerationEnd,
    GenerationEvent,
    GenerationRequest,
    SamplingParams,
    TokenDelta,
)
from gateway.errors import (
    APIError,
    BadRequest,
    ContextTooLong,
    EngineError,
    EngineUnavailable,
    NotFound,
)

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Below this temperature sampling is greedy (the same threshold vLLM uses).
_GREEDY_EPS = 1e-5
# Chat models end a turn with one of these even when generation_config names only one of them.
_EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")
# Prompt tokens decoded in front of the completion so the first generated token decodes with its leading space
# (sentencepiece tokenizers drop it when a token is decoded on its own).
_DECODE_CONTEXT = 5


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, float, dict[int, float] | None]:
    """Draw one token from ``logits`` (shape ``[vocab]``, float32) and return ``(id, logprob, top_logprobs)``.

    The logprob is taken from the same processed distribution the id was drawn from. Top-p keeps the smallest
    prefix of the sorted distribution whose mass reaches ``top_p`` (the token that crosses it is kept).
    """
    if params.temperature < _GREEDY_EPS:
        logprobs = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
    else:
        scores = logits / params.temperature
        if 0 < params.top_k < scores.numel():
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            drop = mass_before >= params.top_p
            drop[0] = False
            scores = scores.scatter(0, order[drop], float("-inf"))
        logprobs = torch.log_softmax(scores, dim=-1)
        token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
    top: dict[int, float] | None = None
    if params.top_logprobs > 0:
        values, ids = torch.topk(logprobs, min(params.top_logprobs, logprobs.numel()))
        top = {int(i): float(v) for v, i in zip(values.tolist(), ids.tolist(), strict=True) if v > float("-inf")}
    return token, float(logprobs[token]), top


class _StopStrings:
    """Finds stop strings in the completion text, decoding only the tail at each step.

    Incremental detokenization as in vLLM: decode ``ids[prefix:]`` and ``ids[prefix:read]`` and take the
    difference as new text, holding back while the tail is an incomplete UTF-8 sequence (U+FFFD).
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], prompt_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._stops = stops
        self._longest = max(len(s) for s in stops)
        self._ids = list(prompt_ids[-_DECODE_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self._tail = ""  # the last (longest - 1) characters of completion text already searched

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(ids, skip_special_tokens=False)
        return text

    def feed(self, token: int) -> str | None:
        """Add one generated token; return the stop string it completes, if any."""
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        new_text = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        # Only matches that end inside the new text are new; earlier ones were already reported.
        window = self._tail + new_text
        found: tuple[int, str] | None = None
        for stop in self._stops:
            at = window.find(stop)
            if at >= 0 and (found is None or at < found[0]):
                found = (at, stop)
        self._tail = window[-(self._longest - 1) :] if self._longest > 1 else ""
        return found[1] if found else None


@dataclass(eq=False)
class _Sequence:
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
    stop_strings: _StopStrings | None = None
    generated: int = 0
    next_token: int = -1  # sampled but not yet fed to the model
    cached: int = 0  # tokens of this row in the KV cache
    done: bool = False
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def adapter(self) -> str | None:
        return self.request.adapter


@dataclass(eq=False)
class _AdapterCommand:
    kind: Literal["load", "unload"]
    name: str
    path: str
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[None]


_SHUTDOWN = object()


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

        self._model: Any = None
        self._tokenizer: Any = None
        self._thread: threading.Thread | None = None
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._closing = False
        # Adapter names visible to requests (event-loop side); the worker tracks what the model actually holds.
        self._adapter_names: set[str] = set()
        self._adapter_busy: set[str] = set()  # being loaded or unloaded
        self._adapter_paths: dict[str, str] = {}  # name -> the folder it was loaded from
        self._adapter_loads: dict[str, asyncio.Future[None]] = {}  # loads in progress, by name

        # Worker-only state.
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._commands: list[_AdapterCommand] = []
        self._outbox: list[tuple[_Sequence, GenerationEvent | APIError]] = []
        self._cache: Any = None
        self._batch_adapter: str | None = None
        self._applied_adapter: str | None = None
        self._applied_valid = False
        self._internal_names: dict[str, str] = {}
        self._adapter_ids = itertools.count()
        self._batchable = True
        self._uses_logits_to_keep = False
        self._stats = dict.fromkeys(
            ("requests", "generated_tokens", "decode_steps", "peak_batch", "running", "waiting"), 0
        )

    # ---- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is not None:
            return
        await asyncio.to_thread(self._load)
        self._closing = False
        self._thread = threading.Thread(target=self._worker, name="clawgate-local-engine", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        thread = self._thread
        if thread is None:
            return
        self._closing = True
        self._inbox.put(_SHUTDOWN)
        await asyncio.to_thread(thread.join)
        self._thread = None
        self._model = self._tokenizer = self._cache = None
        # A restart loads a fresh model without adapters.
        self._adapter_names.clear()
        self._adapter_paths.clear()
        self._internal_names.clear()
        self._applied_valid = False

    async def health(self) -> bool:
        return self._model is not None and self._thread is not None and self._thread.is_alive()

    @property
    def stats(self) -> dict[str, int]:
        """Counters since start (requests, generated_tokens, decode_steps, peak_batch) and the current
        running and waiting request counts, as the worker last saw them."""
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
        self.eos_token_ids = frozenset(_eos_ids(model, tokenizer))
        self._uses_logits_to_keep = "logits_to_keep" in _forward_parameters(model)
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
        seq = self._submit(request)
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

    def _submit(self, request: GenerationRequest) -> _Sequence:
        if self._model is None or self._thread is None or self._closing:
            raise EngineUnavailable("the local engine is not running")
        params = request.params
        prompt = request.prompt_ids
        _validate_params(params)
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
        seq = _Sequence(
            request=request,
            max_tokens=min(params.max_tokens, remaining),
            loop=asyncio.get_running_loop(),
            events=asyncio.Queue(),
            submitted=time.perf_counter(),
        )
        self._inbox.put(seq)
        return seq

    # ---- adapters --------------------------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter in ``path`` as ``name``. As with vLLM, loading the same name from the same folder
        again is a no-op (it waits for that load if it is still running); another folder under a name in use is
        refused."""
        if self._model is None or self._closing:
            raise EngineUnavailable("the local engine is not running")
        if not name:
            raise BadRequest("the adapter name is empty", param="name")
        folder = str(Path(path).resolve())
        if name in self._adapter_paths and self._adapter_paths[name] == folder:
            pending = self._adapter_loads.get(name)
            if pending is not None:
                await asyncio.shield(pending)
            if name in self._adapter_names:
                return
        if name in self._adapter_names or name in self._adapter_busy:
            raise BadRequest(f"adapter {name!r} is already loaded (from another folder)", param="name")
        if not (Path(path) / "adapter_config.json").is_file():
            raise BadRequest(f"no PEFT adapter (adapter_config.json) in {path!r}", param="path")
        self._adapter_busy.add(name)
        self._adapter_paths[name] = folder
        done = self._adapter_loads[name] = asyncio.get_running_loop().create_future()
        try:
            await self._command("load", name, path)
            self._adapter_names.add(name)
        except BaseException:
            del self._adapter_paths[name]
            raise
        finally:
            self._adapter_busy.discard(name)
            del self._adapter_loads[name]
            done.set_result(None)

    async def unload_adapter(self, name: str) -> None:
        if name not in self._adapter_names:
            raise NotFound(f"adapter {name!r} is not loaded", param="name")
        # Hidden at once so no new request picks it; requests already accepted for it still finish.
        self._adapter_names.discard(name)
        self._adapter_paths.pop(name, None)
        self._adapter_busy.add(name)
        try:
            await self._command("unload", name, "")
        finally:
            self._adapter_busy.discard(name)

    async def adapters(self) -> list[str]:
        return sorted(self._adapter_names)

    async def _command(self, kind: Literal["load", "unload"], name: str, path: str) -> None:
        if self._thread is None or self._closing:
            raise EngineUnavailable("the local engine is not running")
        loop = asyncio.get_running_loop()
        command = _AdapterCommand(kind=kind, name=name, path=path, loop=loop, done=loop.create_future())
        self._inbox.put(command)
        await command.done

    # ---- worker thread ---------------------------------------------------------------------------------------

    def _worker(self) -> None:
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
            if item is _SHUTDOWN:
                running = False
            elif isinstance(item, _Sequence):
                self._waiting.append(item)
            elif isinstance(item, _AdapterCommand):
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
            if isinstance(item, _AdapterCommand):
                leftovers.append(item)
            elif isinstance(item, _Sequence):
                self._post(item, EngineUnavailable("the local engine is shutting down"))
        for command in leftovers:
            _resolve(command, EngineUnavailable("the local engine is shutting down"))
        self._commands.clear()

    def _adapter_in_use(self, name: str) -> bool:
        return any(seq.adapter == name for seq in (*self._running, *self._waiting))

    def _run_commands(self) -> None:
        """Apply adapter commands between steps, so they never race a forward pass.

        An unload waits until no accepted request uses the adapter any more; later commands for the same name
        wait behind it so they keep their order.
        """
        deferred: list[_AdapterCommand] = []
        blocked: set[str] = set()
        for command in self._commands:
            if command.name in blocked or (command.kind == "unload" and self._adapter_in_use(command.name)):
                deferred.append(command)
                blocked.add(command.name)
                continue
            try:
                if command.kind == "load":
                    self._load_adapter(command.name, command.path)
                else:
                    self._unload_adapter(command.name)
            except Exception as exc:
                logger.exception("adapter %s of %r failed", command.kind, command.name)
                _resolve(command, BadRequest(f"could not {command.kind} adapter {command.name!r}: {exc}"))
            else:
                _resolve(command, None)
            finally:
                # Injecting or deleting LoRA layers resets which adapter is active and enabled.
                self._applied_valid = False
        self._commands = deferred

    def _load_adapter(self, name: str, path: str) -> None:
        model = self._model
        # PEFT module names cannot hold every string a client may use as an adapter name (dots, say), so the
        # model holds each adapter under a fresh internal name.
        internal = f"clawgate_{next(self._adapter_ids)}"
        try:
            with _quiet_adapter_loading():
                info = model.load_adapter(path, adapter_name=internal)
            # transformers lists the other adapters' weights as missing too; only this adapter's count.
            marker = f".{internal}."
            problems = [
                *sorted(k for k in info.missing_keys if marker in k),
                *sorted(info.unexpected_keys),
                *(str(k[0]) for k in info.mismatched_keys),
                *info.error_msgs,
            ]
            if problems:
                raise ValueError(f"the adapter does not fit the model: {', '.join(problems[:5])}")
        except Exception:
            # A failed load can leave half-injected layers behind.
            if internal in getattr(model, "peft_config", {}):
                with contextlib.suppress(Exception):
                    model.delete_adapter(internal)
            raise
        model.eval()
        self._internal_names[name] = internal

    def _unload_adapter(self, name: str) -> None:
        internal = self._internal_names.pop(name)
        self._model.delete_adapter(internal)

    def _apply_adapter(self, name: str | None) -> None:
        if self._applied_valid and self._applied_adapter == name:
            return
        model = self._model
        if name is None:
            if getattr(model, "_hf_peft_config_loaded", False):
                model.disable_adapters()
        else:
            model.enable_adapters()
            model.set_adapter(self._internal_names[name])
        self._applied_adapter, self._applied_valid = name, True

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

    def _prefill(self, seq: _Sequence) -> None:
        from transformers import DynamicCache

        request = seq.request
        params = request.params
        started = time.perf_counter()
        seq.timings["queue"] = started - seq.submitted
        if request.adapter is not None and request.adapter not in self._internal_names:
            self._post(seq, NotFound(f"adapter {request.adapter!r} is not loaded", param="model"))
            return
        self._apply_adapter(request.adapter)
        generator = torch.Generator(device=self.device)
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        seq.generator = generator
        if params.stop:
            seq.stop_strings = _StopStrings(self._tokenizer, params.stop, request.prompt_ids)

        cache = DynamicCache(config=self._model.config)
        input_ids = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {"logits_to_keep": 1} if self._uses_logits_to_keep else {}
        out = self._model(input_ids=input_ids, past_key_values=cache, use_cache=True, **kwargs)
        seq.cached = len(request.prompt_ids)
        self._stats["requests"] += 1
        logits = out.logits[0, -1].float()
        seq.timings["prefill"] = time.perf_counter() - started
        self._emit(seq, logits)
        if seq.done:
            return
        if not self._running:
            self._cache = cache
            self._batch_adapter = request.adapter
            self._batchable = all(type(layer).__name__ == "DynamicLayer" for layer in cache.layers)
        else:
            self._merge_cache(cache)
        self._running.append(seq)
        self._stats["peak_batch"] = max(self._stats["peak_batch"], len(self._running))

    def _merge_cache(self, cache: Any) -> None:
        """Append a batch-1 cache as a new row, left-padding whichever side is shorter."""
        length = max(self._cache.get_seq_length(), cache.get_seq_length())
        for mine, theirs in zip(self._cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, length), _left_pad(theirs.keys, length)], dim=0)
            mine.values = torch.cat([_left_pad(mine.values, length), _left_pad(theirs.values, length)], dim=0)

    def _drop_rows(self, keep: list[int]) -> None:
        """Keep only the given batch rows and cut cache columns that are padding in every remaining row."""
        if not keep:
            self._cache = None
            return
        length = self._cache.get_seq_length()
        start = length - max(self._running[i].cached for i in keep)
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]

    def _decode_step(self) -> None:
        live = [i for i, seq in enumerate(self._running) if not seq.cancelled]
        if len(live) < len(self._running):
            self._drop_rows(live)
            self._running = [self._running[i] for i in live]
            if not self._running:
                return
        self._apply_adapter(self._batch_adapter)
        rows = self._running
        length = self._cache.get_seq_length()
        input_ids = torch.tensor([[seq.next_token] for seq in rows], dtype=torch.long, device=self.device)
        # Rows are right-aligned in the cache, so a row's position is simply how many tokens it has cached.
        cached = torch.tensor([seq.cached for seq in rows], dtype=torch.long, device=self.device)
        attention_mask = None
        if any(seq.cached != length for seq in rows):
            columns = torch.arange(length + 1, device=self.device)
            attention_mask = (columns[None, :] >= (length - cached)[:, None]).long()
        out = self._model(
            input_ids=input_ids,
            position_ids=cached[:, None],
            attention_mask=attention_mask,
            past_key_values=self._cache,
            use_cache=True,
        )
        self._stats["decode_steps"] += 1
        logits = out.logits[:, -1].float()
        for i, seq in enumerate(rows):
            seq.cached += 1
            self._emit(seq, logits[i])
        if any(seq.done for seq in rows):
            keep = [i for i, seq in enumerate(rows) if not seq.done]
            self._drop_rows(keep)
            self._running = [rows[i] for i in keep]

    def _emit(self, seq: _Sequence, logits: torch.Tensor) -> None:
        """Sample the next token of ``seq``, send it, and finish the sequence if it stops here."""
        params = seq.request.params
        token, logprob, top = sample_token(logits, params, seq.generator)
        seq.generated += 1
        seq.next_token = token
        self._stats["generated_tokens"] += 1
        self._post(seq, TokenDelta(token_ids=[token], logprobs=[logprob], top_logprobs=[top] if top else None))
        reason: FinishReason | None = None
        stop_reason: str | int | None = None
        if token in self.eos_token_ids or token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        elif seq.stop_strings is not None and (matched := seq.stop_strings.feed(token)) is not None:
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

    def _post(self, seq: _Sequence, event: GenerationEvent | APIError) -> None:
        if not seq.cancelled:
            self._outbox.append((seq, event))

    def _flush(self) -> None:
        """Hand queued events to their event loops: one wake-up per loop per step, not one per token."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Sequence, GenerationEvent | APIError]]] = {}
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


def _validate_params(params: SamplingParams) -> None:
    if params.max_tokens < 1:
        raise BadRequest("max_tokens must be at least 1", param="max_tokens")
    if params.temperature < 0:
        raise BadRequest("temperature must be non-negative", param="temperature")
    if not 0 < params.top_p <= 1:
        raise BadRequest("top_p must be in (0, 1]", param="top_p")
    if params.top_k < 0:
        raise BadRequest("top_k must be non-negative (0 disables it)", param="top_k")
    if params.top_logprobs < 0:
        raise BadRequest("top_logprobs must be non-negative", param="top_logprobs")
    if any(not s for s in params.stop):
        raise BadRequest("stop strings must be non-empty", param="stop")


def _deliver(batch: list[tuple[_Sequence, GenerationEvent | APIError]]) -> None:
    for seq, event in batch:
        seq.events.put_nowait(event)


def _left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Pad a ``[batch, heads, seq, dim]`` cache tensor with zeros on the left of the sequence axis."""
    missing = length - tensor.shape[-2]
    return F.pad(tensor, (0, 0, missing, 0)) if missing > 0 else tensor


def _resolve(command: _AdapterCommand, error: APIError | None) -> None:
    def settle() -> None:
        if command.done.done():
            return
        if error is None:
            command.done.set_result(None)
        else:
            command.done.set_exception(error)

    with contextlib.suppress(RuntimeError):  # the caller's loop is gone
        command.loop.call_soon_threadsafe(settle)


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


@contextlib.contextmanager
def _quiet_adapter_loading() -> Iterator[None]:
    """Silence what transformers and PEFT print for every additional adapter: a load report listing the other
    adapters' weights as missing, and a warning that the model holds several adapters (both are intended here;
    real problems are checked from the returned load info)."""
    report_logger = logging.getLogger("transformers.integrations.peft")
    report_filter = _DropLoadReport()
    report_logger.addFilter(report_filter)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
            yield
    finally:
        report_logger.removeFilter(report_filter)


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos is not None:
        ids.update(int(i) for i in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for token in _EOS_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == token:
            ids.add(token_id)
    return ids


def _forward_parameters(model: Any) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)
