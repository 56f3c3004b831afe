"""The in-process engine on the tiny model: exact behaviour-policy logprobs, seeded sampling, stops, context
limits, cancellation, batching and LoRA adapters.

Every logprob the engine reports is checked against a teacher-forced float32 recomputation of the same tokens
(one forward over prompt + completion), with the same temperature / top-k / top-p processing: these are the
numbers the trainer uses as behaviour-policy logprobs. The model is random but built from a fixed seed, so the
sampled tokens are the same on every run.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from gateway.engines.base import (  # noqa: E402
    Engine,
    GenerationEnd,
    GenerationRequest,
    SamplingParams,
    TokenDelta,
)
from gateway.engines.local import LocalEngine  # noqa: E402
from gateway.errors import BadRequest, ContextTooLong, EngineUnavailable, NotFound  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOLERANCE = 1e-4


# ---- fixtures and helpers --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[LocalEngine]:
    # One engine for the module. It is not tied to an event loop: each request hands tokens to the loop it was
    # made from, so function-scoped test loops can share it.
    eng = LocalEngine(str(tiny_model_dir))
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt(tiny_tokenizer: Any) -> list[int]:
    text = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    ids: list[int] = tiny_tokenizer.encode(text)
    return ids


def make_adapter(model_dir: Path, out: Path, *, perturb: bool, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)  # lora_A's init
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    if perturb:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def perturbed_adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "perturbed", perturb=True, seed=1)


@pytest.fixture(scope="module")
def zero_adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # PEFT's default init: lora_B = 0, so the adapter adds exactly nothing (like policy v0).
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "zero", perturb=False, seed=2)


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    deltas: int = 0
    end: GenerationEnd | None = None
    arrivals: list[float] = field(default_factory=list)


async def collect(engine: LocalEngine, prompt: list[int], *, adapter: str | None = None, **params: Any) -> Result:
    params.setdefault("max_tokens", 16)
    request = GenerationRequest(request_id="t", prompt_ids=prompt, params=SamplingParams(**params), adapter=adapter)
    result = Result()
    async for event in engine.generate(request):
        assert result.end is None, "an event arrived after GenerationEnd"
        if isinstance(event, TokenDelta):
            assert len(event.token_ids) == len(event.logprobs) == 1
            result.deltas += 1
            result.tokens += event.token_ids
            result.logprobs += event.logprobs
            result.top += event.top_logprobs or []
            result.arrivals.append(time.perf_counter())
        else:
            assert isinstance(event, GenerationEnd)
            result.end = event
    assert result.end is not None, "the stream ended without GenerationEnd"
    return result


def teacher_forced(
    model: Any, prompt: list[int], completion: list[int], *, temperature: float = 1.0, top_p: float = 1.0
) -> Any:
    """Per completion position, the log of the processed distribution ([len(completion), vocab])."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)] / temperature
    if top_p < 1.0:
        # The nucleus: the most likely tokens, in order, up to and including the one whose mass reaches top_p.
        probs = torch.softmax(rows, dim=-1)
        for row, p in zip(rows, probs, strict=True):
            order = torch.argsort(p, descending=True)
            size = int((torch.cumsum(p[order], 0) < top_p).sum()) + 1
            row[order[size:]] = float("-inf")
    return torch.log_softmax(rows, dim=-1)


def at(logprobs: Any, tokens: list[int]) -> list[float]:
    return [float(logprobs[i, t]) for i, t in enumerate(tokens)]


def assert_close(got: list[float], want: list[float], tol: float = TOLERANCE) -> None:
    assert len(got) == len(want)
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst <= tol, f"logprobs differ by up to {worst:.2e}"


# ---- the stream and its logprobs -------------------------------------------------------------------------


def test_is_an_engine(engine: LocalEngine) -> None:
    typed: Engine = engine  # mypy checks the protocol statically, isinstance at runtime
    assert isinstance(typed, Engine)
    assert engine.name == "local"
    assert engine.max_model_len == 40960  # the config's max_position_embeddings


async def test_stream_is_deltas_then_one_end(engine: LocalEngine, prompt: list[int]) -> None:
    result = await collect(engine, prompt, max_tokens=12, seed=7)
    assert result.deltas == len(result.tokens) >= 1
    assert result.end is not None and result.end.prompt_tokens == len(prompt)
    assert result.end.finish_reason in ("stop", "length")
    assert set(result.end.timings) >= {"queue", "prefill", "decode", "total"}


async def test_logprobs_match_teacher_forcing(engine: LocalEngine, reference: Any, prompt: list[int]) -> None:
    result = await collect(engine, prompt, max_tokens=64, seed=3)
    assert len(result.tokens) > 8
    assert_close(result.logprobs, at(teacher_forced(reference, prompt, result.tokens), result.tokens))


async def test_temperature_logprobs_are_of_the_scaled_distribution(
    engine: LocalEngine, reference: Any, prompt: list[int]
) -> None:
    result = await collect(engine, prompt, max_tokens=24, seed=5, temperature=0.7)
    scaled = at(teacher_forced(reference, prompt, result.tokens, temperature=0.7), result.tokens)
    raw = at(teacher_forced(reference, prompt, result.tokens), result.tokens)
    assert_close(result.logprobs, scaled)
    assert max(abs(a - b) for a, b in zip(scaled, raw, strict=True)) > 1e-2  # the check can tell them apart


async def test_top_p_logprobs_are_of_the_renormalized_nucleus(
    engine: LocalEngine, reference: Any, prompt: list[int]
) -> None:
    result = await collect(engine, prompt, max_tokens=24, seed=11, top_p=0.8)
    nucleus = teacher_forced(reference, prompt, result.tokens, top_p=0.8)
    full = teacher_forced(reference, prompt, result.tokens)
    assert_close(result.logprobs, at(nucleus, result.tokens))
    # Every sampled token lies inside its nucleus, and the nucleus really cut part of the vocabulary.
    assert all(lp > float("-inf") for lp in at(nucleus, result.tokens))
    assert bool((nucleus == float("-inf")).any(dim=-1).all())
    assert min(a - b for a, b in zip(at(nucleus, result.tokens), at(full, result.tokens), strict=True)) > 1e-3


async def test_top_k_and_top_logprobs(engine: LocalEngine, reference: Any, prompt: list[int]) -> None:
    result = await collect(engine, prompt, max_tokens=12, seed=2, top_k=5, top_logprobs=3)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + result.tokens])).logits[0].float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(result.tokens)]
    kth = rows.topk(5, dim=-1).values[:, -1:]
    processed = torch.log_softmax(rows.masked_fill(rows < kth, float("-inf")), dim=-1)
    assert_close(result.logprobs, at(processed, result.tokens))
    assert len(result.top) == len(result.tokens)
    for i, (token, top) in enumerate(zip(result.tokens, result.top, strict=True)):
        assert token in rows[i].topk(5).indices.tolist()
        values, ids = processed[i].topk(3)
        assert list(top) == ids.tolist()
        assert_close(list(top.values()), values.tolist())


async def test_greedy_reports_raw_logprobs(engine: LocalEngine, reference: Any, prompt: list[int]) -> None:
    result = await collect(engine, prompt, max_tokens=16, temperature=0.0)
    raw = teacher_forced(reference, prompt, result.tokens)
    assert result.tokens == [int(row.argmax()) for row in raw]
    assert_close(result.logprobs, at(raw, result.tokens))


async def test_seed_reproduces_tokens(engine: LocalEngine, prompt: list[int]) -> None:
    first = await collect(engine, prompt, max_tokens=20, seed=1234)
    again = await collect(engine, prompt, max_tokens=20, seed=1234)
    other = await collect(engine, prompt, max_tokens=20, seed=4321)
    assert first.tokens == again.tokens
    assert first.logprobs == again.logprobs
    assert first.tokens != other.tokens


# ---- stopping --------------------------------------------------------------------------------------------


async def test_max_tokens_ends_with_length(engine: LocalEngine, prompt: list[int]) -> None:
    result = await collect(engine, prompt, max_tokens=5, seed=0)
    assert len(result.tokens) == 5
    assert result.end is not None and result.end.finish_reason == "length" and result.end.stop_reason is None


async def test_stop_token_id_is_the_last_token(engine: LocalEngine, prompt: list[int]) -> None:
    free = await collect(engine, prompt, max_tokens=20, seed=9)
    stop_id = free.tokens[6]
    first = free.tokens.index(stop_id)
    stopped = await collect(engine, prompt, max_tokens=20, seed=9, stop_token_ids=(stop_id,))
    assert stopped.tokens == free.tokens[: first + 1]
    assert stopped.logprobs == free.logprobs[: first + 1]
    assert stopped.end is not None
    assert (stopped.end.finish_reason, stopped.end.stop_reason) == ("stop", stop_id)


async def test_stop_string_ends_after_the_completing_token(
    engine: LocalEngine, prompt: list[int], tiny_tokenizer: Any
) -> None:
    free = await collect(engine, prompt, max_tokens=24, seed=9)

    def text(ids: list[int]) -> str:
        decoded: str = tiny_tokenizer.decode(ids, skip_special_tokens=False)
        return decoded

    # A stop string that spans a token boundary: the end of token 5's text and the start of token 6's.
    left, right = text(free.tokens[5:6]), text(free.tokens[6:7])
    stop = left[-2:] + right[:2]
    assert len(stop) >= 2
    completing = next(k for k in range(1, len(free.tokens) + 1) if stop in text(free.tokens[:k]))
    stopped = await collect(engine, prompt, max_tokens=24, seed=9, stop=("never-matches-xyz", stop))
    assert stopped.tokens == free.tokens[:completing]
    assert stopped.end is not None
    assert (stopped.end.finish_reason, stopped.end.stop_reason) == ("stop", stop)


async def test_eos_ends_generation_and_is_emitted(
    engine: LocalEngine, reference: Any, prompt: list[int], tiny_tokenizer: Any
) -> None:
    eos = {tiny_tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert engine.eos_token_ids == eos
    # The random model ends a turn now and then; some of these seeds do.
    results = await asyncio.gather(*(collect(engine, prompt, max_tokens=48, seed=s) for s in range(16)))
    ended = [r for r in results if r.end is not None and r.end.finish_reason == "stop"]
    assert ended, "no seed produced an end-of-turn token"
    for r in ended:
        assert r.end is not None and r.tokens[-1] in eos and r.end.stop_reason == r.tokens[-1]
        assert not eos & set(r.tokens[:-1])
        assert_close(r.logprobs, at(teacher_forced(reference, prompt, r.tokens), r.tokens))
    for r in results:
        if r not in ended:
            assert r.end is not None and r.end.finish_reason == "length" and len(r.tokens) == 48


# ---- context window and validation -----------------------------------------------------------------------


async def test_context_window(tiny_model_dir: Path) -> None:
    small = LocalEngine(str(tiny_model_dir), max_model_len=32)
    await small.start()
    try:
        assert small.max_model_len == 32
        with pytest.raises(ContextTooLong) as info:
            await collect(small, list(range(100, 132)), max_tokens=1)
        assert info.value.code == "context_length_exceeded" and info.value.status_code == 400
        # One slot left: max_tokens is clipped to it.
        result = await collect(small, list(range(100, 131)), max_tokens=50, seed=0)
        assert len(result.tokens) == 1 and result.end is not None and result.end.finish_reason == "length"
        result = await collect(small, list(range(100, 124)), max_tokens=50, seed=1)
        assert len(result.tokens) == 8 and result.end is not None and result.end.finish_reason == "length"
    finally:
        await small.close()


@pytest.mark.parametrize(
    ("prompt_ids", "params"),
    [
        ([], {}),
        ([1, 2, 999_999], {}),
        ([1, 2, 3], {"max_tokens": 0}),
        ([1, 2, 3], {"top_p": 0.0}),
        ([1, 2, 3], {"temperature": -1.0}),
        ([1, 2, 3], {"top_k": -1}),
    ],
)
async def test_invalid_requests(engine: LocalEngine, prompt_ids: list[int], params: dict[str, Any]) -> None:
    with pytest.raises(BadRequest):
        await collect(engine, prompt_ids, **params)


# ---- cancellation, concurrency, lifecycle ----------------------------------------------------------------


async def test_cancel_frees_the_worker(engine: LocalEngine, prompt: list[int]) -> None:
    stream = engine.generate(GenerationRequest("c", prompt, SamplingParams(max_tokens=100_000, seed=4)))
    received = 0
    async for event in stream:
        assert isinstance(event, TokenDelta)
        received += 1
        if received == 2:
            break
    await stream.aclose()
    following = await asyncio.wait_for(collect(engine, prompt, max_tokens=4, seed=0), timeout=30)
    assert following.end is not None
    # Nothing is left running: no more tokens are produced for the abandoned request.
    produced = engine.stats["generated_tokens"]
    await asyncio.sleep(0.2)
    assert engine.stats["generated_tokens"] == produced
    assert engine.stats["running"] == 0


async def test_concurrent_requests_batch_exactly(engine: LocalEngine, reference: Any, prompt: list[int]) -> None:
    prompts = [prompt, prompt[:7], [*prompt, 300, 301, 302, 303, 304], prompt[4:]]
    steps_before = engine.stats["decode_steps"]
    together = await asyncio.gather(*(collect(engine, p, max_tokens=24, seed=i) for i, p in enumerate(prompts)))
    # They really shared decode steps: one at a time would take a step per token after each first token.
    assert engine.stats["decode_steps"] - steps_before < sum(len(r.tokens) - 1 for r in together)
    for i, (p, result) in enumerate(zip(prompts, together, strict=True)):
        assert result.end is not None
        # Left padding and per-row positions change nothing: same tokens as alone, teacher-forced logprobs.
        alone = await collect(engine, p, max_tokens=24, seed=i)
        assert result.tokens == alone.tokens
        assert_close(result.logprobs, at(teacher_forced(reference, p, result.tokens), result.tokens))


async def test_one_at_a_time_is_fifo(tiny_model_dir: Path, prompt: list[int]) -> None:
    serial = LocalEngine(str(tiny_model_dir), max_batch=1)
    await serial.start()
    try:
        results = await asyncio.gather(*(collect(serial, prompt, max_tokens=6, seed=s) for s in (0, 1, 2)))
        for earlier, later in itertools.pairwise(results):
            assert earlier.arrivals[-1] < later.arrivals[0]
        assert serial.stats["peak_batch"] == 1
    finally:
        await serial.close()


async def test_lifecycle(tiny_model_dir: Path, prompt: list[int]) -> None:
    eng = LocalEngine(str(tiny_model_dir))
    assert not await eng.health()
    with pytest.raises(EngineUnavailable):
        await collect(eng, prompt)
    await eng.start()
    assert await eng.health()
    stream = eng.generate(GenerationRequest("x", prompt, SamplingParams(max_tokens=100_000, seed=0)))
    assert isinstance(await anext(stream), TokenDelta)
    await eng.close()
    # The request in flight is told it was aborted.
    events = [event async for event in stream]
    assert isinstance(events[-1], GenerationEnd) and events[-1].finish_reason == "abort"
    assert not await eng.health()
    with pytest.raises(EngineUnavailable):
        await collect(eng, prompt)


# ---- adapters --------------------------------------------------------------------------------------------


async def test_adapter_changes_logprobs_and_base_stays_base(
    engine: LocalEngine, reference: Any, prompt: list[int], perturbed_adapter: Path, tiny_model_dir: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    name = "policy@v1.perturbed"  # names with dots work although PEFT module names cannot hold them
    await engine.load_adapter(name, str(perturbed_adapter))
    try:
        assert name in await engine.adapters()
        adapted, base, adapted_greedy = await asyncio.gather(
            collect(engine, prompt, adapter=name, max_tokens=16, seed=8),
            collect(engine, prompt, max_tokens=16, seed=8),
            collect(engine, prompt, adapter=name, max_tokens=16, temperature=0.0),
        )
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), str(perturbed_adapter)
        ).eval()
        assert_close(adapted.logprobs, at(teacher_forced(peft_model, prompt, adapted.tokens), adapted.tokens))
        assert_close(
            adapted_greedy.logprobs,
            at(teacher_forced(peft_model, prompt, adapted_greedy.tokens), adapted_greedy.tokens),
        )
        assert_close(base.logprobs, at(teacher_forced(reference, prompt, base.tokens), base.tokens))
        # The adapter moves the distribution: the same tokens are much less/more likely under the base model.
        under_base = at(teacher_forced(reference, prompt, adapted.tokens), adapted.tokens)
        assert max(abs(a - b) for a, b in zip(adapted.logprobs, under_base, strict=True)) > 0.1
    finally:
        await engine.unload_adapter(name)
    assert name not in await engine.adapters()


async def test_zero_adapter_is_identical_to_base(engine: LocalEngine, prompt: list[int], zero_adapter: Path) -> None:
    await engine.load_adapter("policy@v0", str(zero_adapter))
    try:
        with_adapter = await collect(engine, prompt, adapter="policy@v0", max_tokens=24, seed=21)
        without = await collect(engine, prompt, max_tokens=24, seed=21)
        assert with_adapter.tokens == without.tokens
        assert_close(with_adapter.logprobs, without.logprobs, tol=1e-6)
    finally:
        await engine.unload_adapter("policy@v0")


async def test_unknown_and_unloaded_adapters(
    engine: LocalEngine, prompt: list[int], zero_adapter: Path, perturbed_adapter: Path
) -> None:
    with pytest.raises(NotFound):
        await collect(engine, prompt, adapter="no-such-adapter")
    with pytest.raises(NotFound):
        await engine.unload_adapter("no-such-adapter")
    with pytest.raises(BadRequest):
        await engine.load_adapter("broken", str(zero_adapter.parent / "missing"))

    # Two loads of one name from one folder at once (say, a policy follower and an operator): both succeed.
    await asyncio.gather(engine.load_adapter("temp", str(zero_adapter)), engine.load_adapter("temp", str(zero_adapter)))
    await engine.load_adapter("temp", str(zero_adapter) + "/")  # the same folder again: a no-op, as with vLLM
    with pytest.raises(BadRequest):
        await engine.load_adapter("temp", str(perturbed_adapter))  # another folder under a name in use
    assert "temp" in await engine.adapters()
    await engine.unload_adapter("temp")
    assert "temp" not in await engine.adapters()
    with pytest.raises(NotFound):
        await collect(engine, prompt, adapter="temp")
    # The name can be used again after unloading.
    await engine.load_adapter("temp", str(zero_adapter))
    result = await collect(engine, prompt, adapter="temp", max_tokens=3, seed=0)
    assert result.end is not None
    await engine.unload_adapter("temp")


async def test_unload_waits_for_requests_using_the_adapter(
    engine: LocalEngine, prompt: list[int], perturbed_adapter: Path
) -> None:
    await engine.load_adapter("busy", str(perturbed_adapter))
    before = await collect(engine, prompt, adapter="busy", max_tokens=40, seed=3)
    running = asyncio.create_task(collect(engine, prompt, adapter="busy", max_tokens=40, seed=3))
    await asyncio.sleep(0)  # the request is accepted before the unload is
    await engine.unload_adapter("busy")
    result = await running
    # It ran to the end with the adapter in place.
    assert result.tokens == before.tokens
    assert "busy" not in await engine.adapters()
