"""Structured outputs on the local engine: forced tool calls and JSON formats decoded under a grammar.

The tiny model is random: left alone it never writes valid JSON (checked below), so every answer that parses and
validates here does so because of the grammar. Answers are drawn as ``n`` choices of one request (one prefill,
one batch).
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import jsonschema
import openai
import pytest
import sqlalchemy as sa

from gateway.store import codec
from gateway.store.db import connect
from tests.conftest import module_gateway

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"type": "string", "enum": ["metric", "imperial"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
READ = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "pattern": "^/[a-z]{1,12}$"},
        "lines": {"type": "integer", "minimum": 1, "maximum": 500},
    },
    "required": ["path"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "read_file", "parameters": READ}},
]
SCHEMAS = {"get_weather": WEATHER, "read_file": READ}
ANSWER = {
    "type": "object",
    "properties": {
        "verdict": {"type": "boolean"},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "$defs_user": {"$ref": "#/$defs/user"},
    },
    "required": ["verdict", "score", "tags", "$defs_user"],
    "additionalProperties": False,
    "$defs": {
        "user": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["id"],
            "additionalProperties": False,
        }
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
N = 10  # choices per request; five requests make the 50 answers each check wants


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, tiny_model_dir):
    yield from module_gateway(tmp_path_factory.mktemp("gw-structured"), tiny_model_dir, max_tokens=400)


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0)


def choices(client, rounds: int = 5, **kwargs):
    out = []
    for seed in range(rounds):
        reply = client.chat.completions.create(
            model="tiny", messages=MESSAGES, n=N, seed=seed, temperature=1.0, **{"max_tokens": 160, **kwargs}
        )
        out += reply.choices
    return out


def test_without_a_grammar_the_random_model_writes_no_json(client):
    texts = [c.message.content or "" for c in choices(client, rounds=1)]
    assert len(texts) == N and all(texts)
    parsed = 0
    for text in texts:
        try:
            json.loads(text)
            parsed += 1
        except ValueError:
            pass
    assert parsed == 0


def test_fifty_required_calls_parse_and_match_their_tool(client):
    got = choices(client, tools=TOOLS, tool_choice="required", max_tokens=400)
    assert len(got) == 5 * N
    for choice in got:
        assert choice.finish_reason == "tool_calls", choice
        assert not choice.message.content
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.function.name in SCHEMAS
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_fifty_named_calls_call_that_function(client):
    named = {"type": "function", "function": {"name": "read_file"}}
    got = choices(client, tools=TOOLS, tool_choice=named)
    assert len(got) == 5 * N
    for choice in got:
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.function.name == "read_file"
        jsonschema.validate(json.loads(call.function.arguments), READ)


def concurrently(send, count: int = 50) -> list:
    with ThreadPoolExecutor(max_workers=N) as pool:
        return list(pool.map(send, range(count)))


def test_fifty_forced_calls_through_the_responses_api(gateway):
    tools = [{"type": "function", **t["function"]} for t in TOOLS]

    def send(seed: int) -> dict:
        body = {"model": "tiny", "input": MESSAGES[0]["content"], "tools": tools, "tool_choice": "required",
                "max_output_tokens": 400, "seed": seed}  # fmt: skip
        reply = httpx.post(f"{gateway.v1}/responses", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()

    for response in concurrently(send):
        assert response["status"] == "completed", response
        calls = [item for item in response["output"] if item["type"] == "function_call"]
        assert calls and all(item["type"] in ("function_call", "reasoning") for item in response["output"])
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_fifty_forced_calls_through_the_anthropic_api(gateway):
    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]

    def send(i: int):
        choice = {"type": "any"} if i % 2 else {"type": "tool", "name": "get_weather"}
        return choice, client.messages.create(
            model="tiny", max_tokens=400, messages=MESSAGES, tools=tools, tool_choice=choice
        )

    for choice, message in concurrently(send):
        assert message.stop_reason == "tool_use", message
        uses = [block for block in message.content if block.type == "tool_use"]
        assert uses and all(block.type in ("tool_use", "thinking") for block in message.content)
        for use in uses:
            assert choice["type"] == "any" or use.name == "get_weather"
            jsonschema.validate(use.input, SCHEMAS[use.name])


def test_json_schema_answers_through_the_responses_and_anthropic_apis(gateway):
    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0)

    def responses(seed: int) -> str:
        fmt = {"type": "json_schema", "name": "verdict", "schema": ANSWER, "strict": True}
        body = {"model": "tiny", "input": "judge", "text": {"format": fmt}, "max_output_tokens": 160, "seed": seed}
        reply = httpx.post(f"{gateway.v1}/responses", json=body, timeout=120).json()
        assert reply["text"]["format"] == fmt
        return reply["output"][-1]["content"][0]["text"]

    def messages(seed: int) -> str:
        config = {"format": {"type": "json_schema", "schema": ANSWER}}
        message = client.messages.create(
            model="tiny", max_tokens=160, messages=MESSAGES, extra_body={"output_config": config}
        )
        return message.content[-1].text

    for text in concurrently(responses, 10) + concurrently(messages, 10):
        jsonschema.validate(json.loads(text), ANSWER)


def test_one_call_when_parallel_calls_are_off(client):
    got = choices(client, rounds=2, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert all(len(c.message.tool_calls) == 1 for c in got)


def test_fifty_json_schema_answers_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": ANSWER, "strict": True}}
    got = choices(client, response_format=fmt)
    assert len(got) == 5 * N
    for choice in got:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), ANSWER)


def test_json_object_answers_are_objects_or_cut_objects(client, tiny_tokenizer):
    """A random model's strings rarely end (a closing quote is one token of 2,048), so most answers run to
    max_tokens: each one is then a prefix of a JSON object (every byte of it accepted by the object grammar), and
    one that ended is an object."""
    from gateway.core.structured import json_grammar
    from gateway.engines.grammar import Grammars

    grammars = Grammars(tiny_tokenizer)
    got = choices(client, rounds=2, response_format={"type": "json_object"}, max_tokens=48)
    for choice in got:
        text = choice.message.content
        assert text.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert choice.finish_reason == "length"
            matcher = grammars.matcher(json_grammar(None))
            assert matcher.consume_tokens(tiny_tokenizer.encode(text, add_special_tokens=False)), text


def test_a_streamed_forced_call_arrives_as_a_call(client):
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", stream=True, seed=3, max_tokens=400
    )
    names, arguments, content, finish = [], "", "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.function.name:
                names.append(call.function.name)
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and not content and names
    assert names[0] in SCHEMAS


def test_a_call_cut_by_max_tokens_is_a_partial_call_not_markup(client):
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=6, seed=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name and "<tool_call>" not in call.function.arguments


def test_the_grammar_cache_is_counted_on_metrics(gateway, client):
    def value(name: str) -> float:
        text = httpx.get(f"{gateway.url}/metrics", timeout=30).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    compiled, hits = value("clawgate_grammar_compile_seconds_count"), value("clawgate_grammar_cache_hits_total")
    for seed in range(3):
        client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt, seed=seed, max_tokens=16)
    assert value("clawgate_grammar_compile_seconds_count") == compiled + 1
    assert value("clawgate_grammar_cache_hits_total") == hits + 2


def test_tool_choice_none_never_calls(client):
    got = choices(client, rounds=1, tools=TOOLS, tool_choice="none")
    assert all(not c.message.tool_calls for c in got)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
         "response_format", "objec"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}}}},
         "response_format", "look-around"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}],
          "tool_choice": "required"}, "tool_choice", "if"),
    ],
)  # fmt: skip
def test_a_format_that_cannot_be_enforced_is_a_400_naming_it(gateway, body, param, words):
    reply = httpx.post(
        f"{gateway.v1}/chat/completions", json={"model": "tiny", "messages": MESSAGES, **body}, timeout=30
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error


def stored_call(gateway, request_id: str) -> dict:
    """The stored call of a request's first choice."""
    gateway.flush()
    engine = connect(gateway.settings.database_url)
    with engine.connect() as conn:
        query = sa.text("SELECT * FROM calls WHERE request_id = :r AND choice_index = 0")
        row = conn.execute(query, {"r": request_id}).mappings().one()
    engine.dispose()
    return dict(row)


def masked_logprobs(
    model_dir, prompt: list[int], ids: list[int], grammar: str, *, engine: str = "local"
) -> tuple[list[float], list[float]]:
    """Each completion token's logprob under the grammar's mask, and without it, from a plain forward of the model.
    A finished grammar allows the engine's end tokens: the local engine's every end-of-turn token, vLLM's guidance
    backend the tokenizer's EOS token alone."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gateway.end_of_turn import end_token_ids
    from gateway.engines.grammar import Grammars
    from gateway.engines.sampling import mask_logits

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if engine == "local":
        ends = end_token_ids(tokenizer, model.generation_config.eos_token_id)
    else:
        ends = frozenset([tokenizer.eos_token_id])
    grammars = Grammars(tokenizer, vocab_size=model.config.vocab_size, eos_ids=ends)
    matcher = grammars.matcher(grammar)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[*prompt, *ids]])).logits[0, len(prompt) - 1 : -1].float()
    masked, unmasked = [], []
    for row_logits, token in zip(logits, ids, strict=True):
        unmasked.append(float(torch.log_softmax(row_logits, -1)[token]))
        mask_logits(grammars.allowed(matcher), row_logits)
        masked.append(float(torch.log_softmax(row_logits, -1)[token]))
        assert matcher.consume_token(token)
    return masked, unmasked


def test_batch_bitmasks_mask_each_constrained_row_as_its_own_mask_does(tiny_model_dir):
    """The local engine masks a decode batch at once (``Grammars.bitmasks`` + ``apply_bitmasks``): each constrained
    row ends as masking it alone would leave it, a free row is untouched, ids past the grammar's vocabulary go."""
    import torch
    from transformers import AutoTokenizer

    from gateway.core.structured import json_grammar
    from gateway.engines.grammar import Grammars
    from gateway.engines.sampling import apply_bitmasks, mask_logits

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    grammars = Grammars(tokenizer)
    first = grammars.matcher(json_grammar({"type": "object", "properties": {"a": {"type": "integer"}}}))
    second = grammars.matcher(json_grammar({"type": "array", "items": {"type": "boolean"}}))
    assert second.consume_token(tokenizer.encode("[", add_special_tokens=False)[0])
    logits = torch.randn(3, grammars.vocab_size + 5)
    expected = logits.clone()
    mask_logits(grammars.allowed(first), expected[0])
    mask_logits(grammars.allowed(second), expected[2])
    apply_bitmasks(grammars.bitmasks([(first, 0), (second, 2)], 3), logits, [0, 2])
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[1]).all() and not torch.isfinite(logits[0]).all()
    assert torch.isinf(logits[2, grammars.vocab_size :]).all()


def test_batch_masks_and_single_token_rows_match_a_row_by_row_reference():
    """``apply_bitmasks`` (one unpack and fill for the whole batch) and ``forced_tokens`` (the rows a mask leaves one
    token) against masking and counting each row on its own, on 400 seeded random batches: empty masks, one bit
    (the sign bit of a word too), several bits in one word, full masks, random words, any subset of rows, logits
    as wide as the masks or wider."""
    import numpy as np
    import torch

    from gateway.engines.sampling import apply_bitmasks, forced_tokens, mask_logits

    rng = np.random.default_rng(0)
    words, forced_seen = 4, 0
    for _ in range(400):
        batch = int(rng.integers(1, 9))
        masks = rng.integers(-(2**31), 2**31, size=(batch, words), dtype=np.int64).astype(np.int32)
        for i in range(batch):
            kind = rng.integers(5)
            if kind == 0:
                masks[i] = 0
            elif kind in (1, 2):  # one allowed token, at any bit of any word
                masks[i] = 0
                masks[i, rng.integers(words)] = np.array(1 << int(rng.integers(32)), dtype=np.int64).astype(np.int32)
            elif kind == 3:  # two tokens of one word
                masks[i] = 0
                masks[i, rng.integers(words)] = 0b101 << int(rng.integers(29))
            elif rng.integers(2):
                masks[i] = -1
        rows = sorted(int(r) for r in rng.choice(batch, size=int(rng.integers(1, batch + 1)), replace=False))
        logits = torch.randn(batch, words * 32 + int(rng.choice([0, 5])))
        expected = logits.clone()
        want_forced = {}
        for i in rows:
            allowed = np.unpackbits(masks[i].view(np.uint8), bitorder="little").astype(bool)
            mask_logits(allowed, expected[i])
            if allowed.sum() == 1:
                want_forced[i] = int(np.flatnonzero(allowed)[0])
        apply_bitmasks(masks, logits, rows)
        assert torch.equal(logits, expected)
        assert forced_tokens(masks, rows) == want_forced
        forced_seen += len(want_forced)
    assert forced_seen > 100


async def test_constrained_and_free_requests_sharing_a_batch_get_what_each_gets_alone(tiny_model_dir, tiny_tokenizer):
    """Constrained and free requests join a running batch, queue for a place, leave it at their own lengths, one
    is cancelled midway: each gets the tokens and logprobs it gets alone (the batch masks only its constrained
    rows, each with its own grammar). Every answer validates, and a step whose grammar allowed a single token is
    exactly a step taken without a draw: logprob 0, counted in the engine's ``forced_tokens``."""
    import asyncio
    import contextlib

    import numpy as np

    from gateway.core.structured import json_grammar
    from gateway.engines.base import Constraint, GenerationEnd, GenerationRequest, SamplingParams, TokenDelta
    from gateway.engines.grammar import Grammars
    from gateway.engines.local import LocalEngine

    prompt = list(
        tiny_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    # (schema, max_tokens); the free ones stop at different lengths, so rows leave the batch at different steps.
    plan = [(WEATHER, 120), (None, 9), (READ, 120), (None, 30), (ANSWER, 160), (WEATHER, 120), (None, 17), (READ, 120)]
    cancelled = 5
    engine = LocalEngine(str(tiny_model_dir), max_batch=4)
    await engine.start()
    try:
        started = asyncio.Event()

        def request(i: int) -> GenerationRequest:
            schema, max_tokens = plan[i]
            constraint = Constraint("json", json_grammar(schema)) if schema is not None else None
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=100 + i, constraint=constraint)
            return GenerationRequest(f"r{i}", prompt, params)

        async def run(i: int, *, stop_after: int | None = None) -> tuple[list[int], list[float], str | None]:
            tokens: list[int] = []
            logprobs: list[float] = []
            finish = None
            async with contextlib.aclosing(engine.generate(request(i))) as events:
                async for event in events:
                    if isinstance(event, TokenDelta):
                        tokens += event.token_ids
                        logprobs += event.logprobs
                        if len(tokens) >= 3:
                            started.set()
                        if stop_after is not None and len(tokens) >= stop_after:
                            break
                    elif isinstance(event, GenerationEnd):
                        finish = event.finish_reason
            return tokens, logprobs, finish

        async def later(i: int) -> tuple[list[int], list[float], str | None]:
            await started.wait()  # joins a batch that is already decoding
            return await run(i, stop_after=4 if i == cancelled else None)

        together = await asyncio.gather(*(run(i) if i < 2 else later(i) for i in range(len(plan))))
        assert engine.stats["peak_batch"] == 4
        forced_before = engine.stats["forced_tokens"]
        alone = [await run(i) for i in range(len(plan))]
        forced_alone = engine.stats["forced_tokens"] - forced_before
    finally:
        await engine.close()

    grammars = Grammars(tiny_tokenizer, vocab_size=engine.vocab_size, eos_ids=engine.eos_token_ids)
    forced = 0
    for i, ((schema, _), (tokens, logprobs, finish), (want, want_logprobs, _)) in enumerate(
        zip(plan, together, alone, strict=True)
    ):
        if i == cancelled:
            assert tokens == want[: len(tokens)] and len(tokens) == 4
            continue
        assert tokens == want
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
        if schema is None:
            assert all(p < 0 for p in want_logprobs)
            continue
        assert finish == "stop"
        jsonschema.validate(json.loads(tiny_tokenizer.decode(tokens, skip_special_tokens=True)), schema)
        matcher = grammars.matcher(json_grammar(schema))
        for token, logprob in zip(want, want_logprobs, strict=True):
            allowed = grammars.allowed(matcher)
            assert allowed[token]
            if allowed.sum() == 1:
                assert logprob == 0.0
                forced += 1
            else:
                assert logprob < 0
            assert matcher.consume_token(token)
    matcher = grammars.matcher(json_grammar(plan[cancelled][0]))
    for token in alone[cancelled][0]:
        forced += int(np.count_nonzero(grammars.allowed(matcher)) == 1)
        assert matcher.consume_token(token)
    assert forced > 0 and forced_alone == forced


def test_a_constrained_answer_records_the_masked_logprobs_and_is_marked(client, gateway, tiny_model_dir):
    """The recorded logprob of each token is the one of the masked distribution it was drawn from: recomputed here
    with a plain forward of the model and the grammar's masks, independently of the engine."""
    from gateway.core.structured import json_grammar

    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt, seed=7, max_tokens=64)
    jsonschema.validate(json.loads(reply.choices[0].message.content), WEATHER)
    row = stored_call(gateway, reply.id)
    assert row["constrained"] in (True, 1)
    prompt = codec.unpack_ids(row["prompt_delta"])
    ids, recorded = codec.unpack_ids(row["completion_ids"]), codec.unpack_logprobs(row["completion_logprobs"])
    masked, unmasked = masked_logprobs(tiny_model_dir, prompt, ids, json_grammar(WEATHER))
    assert recorded == pytest.approx(masked, abs=2e-3)
    # The mask mattered: unmasked, the same tokens are far less likely.
    assert sum(masked) - sum(unmasked) > 5


@pytest.fixture(scope="module")
def thinking_gateway(tmp_path_factory, tiny_model_dir):
    """The tiny model with a template whose generation prompt opens a <think> block, as Qwen3's thinking ones do."""
    model_dir = tmp_path_factory.mktemp("thinking") / "tiny-thinking"
    shutil.copytree(tiny_model_dir, model_dir)
    template = model_dir / "chat_template.jinja"
    text = template.read_text()
    opening = "{{- '<|im_start|>assistant\\n' -}}"
    assert text.count(opening) == 2  # an assistant turn, and the generation prompt (last)
    head, _, tail = text.rpartition(opening)
    template.write_text(
        head
        + opening
        + "{%- if enable_thinking is not defined or enable_thinking -%}{{- '<think>\\n' -}}{%- endif -%}"
        + tail
    )
    yield from module_gateway(tmp_path_factory.mktemp("gw-thinking"), model_dir, max_tokens=400)


def test_a_thinking_template_is_closed_before_a_grammars_answer(thinking_gateway):
    client = openai.OpenAI(base_url=thinking_gateway.v1, api_key="unused", max_retries=0)
    free = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, seed=0)
    assert free.choices[0].message.model_extra.get("reasoning_content")  # the template does open a block
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt, seed=0, n=4)
    for choice in reply.choices:
        assert not choice.message.model_extra.get("reasoning_content")
        jsonschema.validate(json.loads(choice.message.content), WEATHER)
    forced = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=0, n=4, max_tokens=400
    )
    for choice in forced.choices:
        assert not choice.message.content and not choice.message.model_extra.get("reasoning_content")
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    row = stored_call(thinking_gateway, reply.id)
    prompt_tail = codec.unpack_ids(row["prompt_delta"])[-8:]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(thinking_gateway.settings.model)
    assert tokenizer.decode(prompt_tail).endswith("<think>\n\n</think>\n\n")
