"""Structured outputs: what a grammar costs per token, per schema, and how often a schema is compiled again.

Printed:
- compile: cold compile time of the forced-call grammar of each captured harness's tool set (Claude Code, Codex,
  OpenClaw: tests' fixtures) and of a JSON schema answer, then the time of a cache hit;
- cache: hit rate of the gateway's grammar cache over requests that cycle through a few tool sets;
- decode on the in-process engine: time per generated token under two JSON schemas against the same requests
  without one (side by side, same batch, same lengths), and the mask's own time per token;
- with ``--vllm``: the same per-token comparison through a vLLM CPU server (from ``.venv-vllm``).

Goal (issue: structured outputs): the grammar adds at most 10% to decode time.

    .venv/bin/python bench/structured.py
    .venv/bin/python bench/structured.py --vllm
    .venv/bin/python bench/structured.py --vllm --hidden-size 1024 --layers 8   # a larger model: longer steps

The grammar's cost per token does not grow with the model, the step's time does: on the tiny model (a step of about
a millisecond) the percentage is the worst case.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.core.conversation import ToolSpec  # noqa: E402
from gateway.core.job import ChatJob, JsonOutput, RolloutRef, ToolUse  # noqa: E402
from gateway.core.parsers.hermes import HermesParser  # noqa: E402
from gateway.core.structured import Structured, json_grammar  # noqa: E402
from gateway.engines.base import Constraint, GenerationEnd, GenerationRequest, SamplingParams, TokenDelta  # noqa: E402
from gateway.engines.grammar import Grammars  # noqa: E402

FIXTURES = ROOT.parent / "shared" / "fixtures" / "harness-requests"
HARNESS_FILES = {
    "claude-code": "claude-code/01-first-turn-messages.json",
    "codex": "codex/01-first-turn-responses-custom-model.json",
    "openclaw": "openclaw/01-chat-completions-after-tool-result.json",
}
# Bounded values: the random tiny model never ends an unbounded string or number by itself.
ANSWER = {
    "type": "object",
    "properties": {
        "verdict": {"type": "boolean"},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["verdict", "score", "city", "tags"],
    "additionalProperties": False,
}
# Free text inside JSON: after its first few tokens almost every step is a real draw among most of the vocabulary.
NOTE = {
    "type": "object",
    "properties": {"note": {"type": "string"}},
    "required": ["note"],
    "additionalProperties": False,
}


def harness_tools(name: str) -> list[ToolSpec]:
    """The tools a captured harness request offers, whatever its API's spelling."""
    body = json.loads((FIXTURES / HARNESS_FILES[name]).read_text())["body"]
    tools = []
    for tool in body.get("tools") or []:
        fn = tool.get("function", tool)
        schema = fn.get("parameters") or fn.get("input_schema")
        if fn.get("name") and isinstance(schema, dict):
            tools.append(ToolSpec(fn["name"], parameters=schema))
    return tools


def job(tools: list[ToolSpec], json_output: JsonOutput | None = None) -> ChatJob:
    return ChatJob(
        api="chat", model="m", messages=[], tools=tools, n=1, params=SamplingParams(max_tokens=1),
        rollout=RolloutRef(), raw_request={}, request_id="r", tool_use=ToolUse(force=bool(tools)),
        json_output=json_output,
    )  # fmt: skip


def compile_figures(tokenizer: Any) -> None:
    print("compile (cold, then a cache hit):")
    structured = Structured(HermesParser, tokenizer)
    for name in HARNESS_FILES:
        tools = harness_tools(name)
        forced = HermesParser.forced_call_prefix(None) or ""
        grammar = structured.constraint(job(tools), forced)
        assert grammar is not None
        cold = Grammars(tokenizer)
        t0 = time.perf_counter()
        cold.check(grammar.grammar, "tool_choice")
        t1 = time.perf_counter()
        cold.matcher(grammar.grammar)
        t2 = time.perf_counter()
        print(f"  {name:12s} {len(tools):2d} tools, {len(grammar.grammar):6,d} chars: "
              f"{(t1 - t0) * 1e3:7.2f} ms cold, {(t2 - t1) * 1e3:5.3f} ms hit")  # fmt: skip
    cold = Grammars(tokenizer)
    t0 = time.perf_counter()
    cold.check(json_grammar(ANSWER), "response_format")
    print(f"  json schema answer: {(time.perf_counter() - t0) * 1e3:.2f} ms cold")


def cache_figures(tokenizer: Any, requests: int = 300) -> None:
    structured = Structured(HermesParser, tokenizer)
    sets = [harness_tools(name) for name in HARNESS_FILES]
    forced = HermesParser.forced_call_prefix(None) or ""

    async def run() -> None:
        for i in range(requests):
            grammar = structured.constraint(job(sets[i % len(sets)]), forced)
            assert grammar is not None
            await structured.check(grammar, "tool_choice")

    asyncio.run(run())
    stats = structured.grammars.stats
    total = stats["hits"] + stats["compiles"]
    print(f"cache: {requests} requests over {len(sets)} tool sets: {stats['compiles']} compiled, "
          f"hit rate {stats['hits'] / total:.1%} of compilations asked for")  # fmt: skip


async def generate_all(
    engine: Any, prompt: list[int], constraint: Constraint | None, tokens: list[int], seeds: list[int] | None = None
) -> tuple[list[int], float]:
    """One request per entry of ``tokens`` (its max_tokens), all at once, request ``i`` seeded with ``seeds[i]``
    (default ``i``); returns the tokens each generated and the seconds per token after the first, averaged over
    the requests. The decode time is the engine's own (first token to last, prefill excluded) where it reports
    one: vLLM streams a short completion in one to four chunks, so arrival times say little about its steps."""

    async def one(i: int) -> tuple[int, float]:
        seed = seeds[i] if seeds is not None else i
        params = SamplingParams(max_tokens=tokens[i], temperature=1.0, seed=seed, constraint=constraint)
        request = GenerationRequest(f"b{i}-{time.monotonic_ns()}", prompt, params)
        count, first, end, decode = 0, None, None, None
        async for event in engine.generate(request):
            if isinstance(event, TokenDelta):
                count += len(event.token_ids)
                first = first or time.perf_counter()
            elif isinstance(event, GenerationEnd):
                end = time.perf_counter()
                decode = event.timings.get("decode")
        assert first is not None and end is not None
        return count, decode if decode is not None else end - first

    results = await asyncio.gather(*(one(i) for i in range(len(tokens))))
    return [c for c, _ in results], statistics.mean(s / max(c - 1, 1) for c, s in results)


async def full_length_seeds(engine: Any, prompt: list[int], lengths: list[int], tries: int = 30) -> list[int]:
    """Seeds under which free requests, all at once, each run to their whole ``lengths`` entry. Left alone, the
    random model now and then samples an end token early (seed 4 of 8 did, after 8 of 32 tokens): the free batch
    would then run a row short for most of its steps, and the grammar would be charged for the difference."""
    seeds = list(range(len(lengths)))
    for _ in range(tries):
        got, _ = await generate_all(engine, prompt, None, lengths, seeds)
        short = [i for i, (n, want) in enumerate(zip(got, lengths, strict=True)) if n < want]
        if not short:
            return seeds
        for i in short:
            seeds[i] += len(lengths)  # stays distinct from the other rows' seeds
    raise RuntimeError(f"no seeds found under which free requests run to {lengths} tokens")


async def decode_figures(engine: Any, tokenizer: Any, label: str, rounds: int = 7) -> None:
    """Per-token decode time with and without a grammar, one request alone and eight at once, under two schemas:
    ``ANSWER``, whose keys, punctuation and enums leave most steps a single allowed token, and ``NOTE``, one free
    string, where nearly every step is a real draw (the in-process engine takes a single allowed token without
    drawing, so the first schema's figure includes that saving and the second shows the mask's cost alone).

    Constrained answers end where their JSON ends, at different lengths; each free request is then given the
    length its constrained twin had, and a seed under which it runs to that length (``full_length_seeds``), so
    both batches hold the same rows at every step and the difference is the grammar's own cost. The two kinds
    alternate, so both see the same machine load, and the percentage is the median of the rounds' own ratios; a
    round whose lengths came out different (an engine that does not reproduce a seed's tokens exactly) is run
    again rather than counted."""
    prompt = list(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Judge the answer."}], add_generation_prompt=True, tokenize=True, return_dict=False
    ))  # fmt: skip
    schemas = {"a JSON schema": ANSWER, "a one-string JSON schema": NOTE}
    await generate_all(engine, prompt, None, [8] * 8)  # warm-up
    for schema in schemas.values():
        await generate_all(engine, prompt, Constraint("json", json_grammar(schema)), [8] * 8)
    for name, schema in schemas.items():
        constraint = Constraint("json", json_grammar(schema))
        for n in (1, 8):
            free: list[float] = []
            held: list[float] = []
            seeds: dict[tuple[int, ...], list[int]] = {}
            redone = forced = 0
            while len(held) < rounds:
                before = engine_stat(engine, "forced_tokens")
                lengths, held_seconds = await generate_all(engine, prompt, constraint, [40] * n)
                forced += engine_stat(engine, "forced_tokens") - before
                if tuple(lengths) not in seeds:
                    seeds[tuple(lengths)] = await full_length_seeds(engine, prompt, lengths)
                got, free_seconds = await generate_all(engine, prompt, None, lengths, seeds[tuple(lengths)])
                if got != lengths:
                    redone += 1
                    if redone > 3 * rounds:
                        raise RuntimeError("free requests keep ending before their constrained twins")
                    continue
                held.append(held_seconds)
                free.append(free_seconds)
            a, b = statistics.median(free), statistics.median(held)
            # The median of each round's own ratio: a slow spell of the machine hits both runs of a round alike.
            ratio = statistics.median(h / f for h, f in zip(held, free, strict=True))
            notes = [f"{sum(lengths)} tokens a round", f"{rounds} rounds"]
            if forced:
                notes.append(f"{forced / (rounds + redone) / sum(lengths):.0%} of them forced")
            if redone:
                notes.append(f"{redone} run again")
            print(f"decode, {label}, {n} at once: {a * 1e3:.2f} ms/token free, {b * 1e3:.2f} ms/token under {name} "
                  f"({ratio - 1:+.1%}; {', '.join(notes)})")  # fmt: skip


def engine_stat(engine: Any, name: str) -> int:
    """A counter of the in-process engine's (0 for an engine without it)."""
    return int(getattr(engine, "stats", {}).get(name, 0))


def mask_figures(tokenizer: Any, vocab_size: int) -> None:
    """The in-process engine's mask work for one row, token by token of a valid answer: fill the bitmask, apply it
    to the logits, find whether it allows a single token, advance the matcher."""
    import torch

    from gateway.engines.grammar import consume
    from gateway.engines.sampling import apply_bitmasks, forced_tokens

    grammars = Grammars(tokenizer, vocab_size=vocab_size)
    matcher = grammars.matcher(json_grammar(ANSWER))
    text = json.dumps({"verdict": True, "score": 7, "city": "Oslo", "tags": ["a", "c"]}, separators=(", ", ": "))
    ids = tokenizer.encode(text, add_special_tokens=False)
    logits = torch.zeros(1, vocab_size)
    times = []
    for token in ids:
        t0 = time.perf_counter()
        masks = grammars.bitmasks([(matcher, 0)], 1)
        apply_bitmasks(masks, logits, [0])
        forced_tokens(masks, [0])
        consume(matcher, token)
        times.append(time.perf_counter() - t0)
    print(f"mask: first token {times[0] * 1e3:.2f} ms, then a median {statistics.median(times[1:]) * 1e6:.0f} µs per "
          f"token (fill, apply, single-token check, advance; vocabulary {vocab_size:,})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm", action="store_true", help="also through a vLLM CPU server from .venv-vllm")
    ap.add_argument("--hidden-size", type=int, default=128, help="of the locally built model (default: the tiny one)")
    ap.add_argument("--layers", type=int, default=2, help="of the locally built model")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from clawgate.tiny_model import build_tiny_model
    from gateway.engines.local import LocalEngine

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        build_tiny_model(model_dir, seed=0, hidden_size=args.hidden_size, num_layers=args.layers)
        print(f"model: hidden size {args.hidden_size}, {args.layers} layers")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        compile_figures(tokenizer)
        cache_figures(tokenizer)

        async def local() -> int:
            engine = LocalEngine(str(model_dir), max_batch=8)
            await engine.start()
            try:
                await decode_figures(engine, tokenizer, "in-process engine")
                return engine.vocab_size
            finally:
                await engine.close()

        vocab = asyncio.run(local())
        mask_figures(tokenizer, vocab)
        if args.vllm:
            vllm_figures(model_dir, tokenizer)


def vllm_figures(model_dir: Path, tokenizer: Any) -> None:
    from gateway.engines.vllm import VLLMEngine
    from gateway.engines.vllm_server import VLLMServer, find_vllm_python

    python = find_vllm_python(None)
    if python is None:
        sys.exit("no vLLM interpreter: ./dev setup-vllm")
    with VLLMServer(python, model_dir, served_model_name="tiny", enable_lora=False) as server:

        async def run() -> None:
            engine = VLLMEngine(server.url, model="tiny", eos_token_ids=[tokenizer.eos_token_id])
            await engine.start()
            try:
                # More rounds: the server's processes share the machine's cores with this one.
                await decode_figures(engine, tokenizer, "vLLM CPU server", rounds=15)
            finally:
                await engine.close()

        asyncio.run(run())


if __name__ == "__main__":
    main()
