"""The gateway in front of a real vLLM server (CPU build, tiny model): the core flows through the openai SDK, and
the check that the ids and logprobs the gateway stored are exactly what vLLM sampled."""

from __future__ import annotations

import itertools
import json
import time

import httpx
import openai
import pytest
import sqlalchemy as sa

from gateway.store import codec, repo
from gateway.store.db import connect
from gateway.store.models import Call

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colors."}]


@pytest.fixture
def gw(gateway_factory, vllm_server):
    return gateway_factory(engine="vllm", vllm_url=vllm_server.url, vllm_model="tiny", max_tokens=32)


def stored(gw, where: str, params: dict | None = None):
    gw.flush()
    engine = connect(gw.settings.database_url)
    with sa.orm.Session(engine) as session:
        calls = session.scalars(
            sa.select(Call).where(sa.text(where)).params(**(params or {})).order_by(Call.started_at)
        ).all()
        out = [
            (
                c,
                repo.full_prompt_ids(session, c),
                codec.unpack_ids(c.completion_ids),
                codec.unpack_logprobs(c.completion_logprobs),
            )
            for c in calls
        ]
    engine.dispose()
    return out


def test_stored_tokens_and_logprobs_equal_what_vllm_sampled(gw, vllm_server):
    client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, max_tokens=16, seed=7, temperature=0.8, logprobs=True
    )
    resp = raw.parse()
    [(call, prompt, ids, lps)] = stored(gw, "id = :i", {"i": raw.headers["x-clawgate-call-id"]})
    assert call.status == "ok" and call.engine == "vllm"
    assert [t.logprob for t in resp.choices[0].logprobs.content] == pytest.approx(lps, abs=1e-6)
    # Ask vLLM directly for the same prompt ids and seed: it samples the same tokens with the same logprobs.
    direct = httpx.post(
        vllm_server.url + "/v1/completions",
        json={
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 16,
            "seed": 7,
            "temperature": 0.8,
            "logprobs": 1,
            "return_token_ids": True,
            "skip_special_tokens": False,
        },
        timeout=60,
    ).json()
    choice = direct["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    assert ids[: len(choice["token_ids"])] == choice["token_ids"]
    assert lps[: len(choice["token_ids"])] == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-5)


def test_core_flows_via_vllm(gw):
    client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8)
    assert resp.choices[0].finish_reason in ("stop", "length") and resp.usage.completion_tokens >= 1
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    assert next(c.usage for c in chunks if c.usage).completion_tokens >= 1
    two = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, n=2, seed=1)
    assert sorted(c.index for c in two.choices) == [0, 1]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    offered = client.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, tools=tools, max_tokens=4
    )
    assert offered.parse().choices[0].finish_reason in ("stop", "length", "tool_calls")
    [(_, prompt, _, _)] = stored(gw, "id = :i", {"i": offered.headers["x-clawgate-call-id"]})
    assert '"name": "f"' in gw.state.tokenizer.decode(prompt)  # the tool reached the model
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 6000}])
    assert err.value.body["code"] == "context_length_exceeded"


def test_stop_sequences_via_vllm(gw):
    client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)
    for seed in range(20):
        text = (
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, seed=seed)
            .choices[0]
            .message.content
            or ""
        )
        if len(text.strip()) >= 6:
            break
    else:
        pytest.fail("no seed produced 6 characters of text to stop in")
    stop = text.strip()[3:5]
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, seed=seed, stop=[stop])
    out = resp.choices[0].message.content or ""
    assert stop not in out and text.startswith(out)
    assert resp.choices[0].finish_reason == "stop"


def test_tito_chain_via_vllm(gw):
    client = openai.OpenAI(base_url=gw.url + "/rollouts/ro-vllm-tito/v1", api_key="x", max_retries=0)
    messages = list(MESSAGES)
    for turn in range(4):
        resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, seed=turn)
        messages += [
            {"role": "assistant", "content": (resp.choices[0].message.content or "").strip()},
            {"role": "user", "content": f"and {turn}?"},
        ]
    chain = stored(gw, "rollout_id = 'ro-vllm-tito'")
    assert len(chain) == 4
    for (_, p0, c0, _), (call, p1, _, _) in itertools.pairwise(chain):
        assert p1[: len(p0) + len(c0)] == p0 + c0
        assert call.render_mode == "spliced"
    assert gw.state.metrics.drift._value.get() == 0


def test_structured_outputs_via_vllm(gateway_factory, vllm_server, tiny_model_dir):
    """Forced calls and JSON schema answers through vLLM's structured outputs: 50 of each parse and validate (the
    random model writes no JSON by itself, see tests/test_structured.py), and a constrained answer's recorded
    logprobs are the masked distribution's, recomputed here from a plain forward and the grammar's masks."""
    import jsonschema

    from gateway.core.structured import json_grammar
    from tests.test_structured import ANSWER, SCHEMAS, TOOLS, WEATHER, masked_logprobs

    gw = gateway_factory(engine="vllm", vllm_url=vllm_server.url, vllm_model="tiny", max_tokens=400)
    client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": ANSWER}}
    calls, answers = [], []
    for seed in range(5):
        reply = client.chat.completions.create(
            model="tiny", messages=ask, tools=TOOLS, tool_choice="required", n=10, seed=seed, max_tokens=400
        )
        calls += reply.choices
        reply = client.chat.completions.create(model="tiny", messages=ask, response_format=fmt, n=10, seed=seed)
        answers += reply.choices
    for choice in calls:
        assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    for choice in answers:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), ANSWER)

    weather = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    reply = client.chat.completions.create(model="tiny", messages=ask, response_format=weather, seed=1, max_tokens=64)
    [(call, prompt, ids, recorded)] = stored(gw, "request_id = :r", {"r": reply.id})
    assert call.constrained
    masked, unmasked = masked_logprobs(tiny_model_dir, prompt, ids, json_grammar(WEATHER), engine="vllm")
    assert recorded == pytest.approx(masked, abs=2e-3)
    assert sum(masked) - sum(unmasked) > 5


def test_a_client_that_goes_away_stops_the_generation_in_vllm(gateway_factory, vllm_server):
    """Client → gateway → vLLM: closing the stream at the gateway ends the call as cancelled and stops vLLM
    (by an explicit abort: vLLM alone may notice the gateway's disconnect only much later)."""
    gw = gateway_factory(engine="vllm", vllm_url=vllm_server.url, vllm_model="tiny", max_tokens=4096)
    engine = gw.state.engine
    client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)
    budget = 600
    for seed in range(5):  # a seed whose whole generation runs to the budget (no EOS on the way)
        full = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=budget, seed=seed)
        if full.choices[0].finish_reason == "length":
            break
    else:
        pytest.fail("every seed sampled an EOS before the budget")
    # The streamed request asks for far more than the budget the seed was checked on: its first `budget` tokens are
    # the same (seeded) and end-of-text free, and the rest takes vLLM CPU tens of seconds, so the generation is
    # still running when the gateway notices the client left, however loaded the machine is.
    stream_budget = 3000
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": stream_budget, "seed": seed, "stream": True}
    with httpx.stream("POST", gw.url + "/rollouts/ro-gone-vllm/v1/chat/completions", json=body, timeout=60) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks >= 3:
                break
    for _ in range(200):
        rows = stored(gw, "rollout_id = 'ro-gone-vllm'")
        if rows:
            break
        time.sleep(0.05)
    [(call, _, ids, _)] = rows
    assert call.status == "cancelled" and 0 < len(ids) < stream_budget
    for _ in range(100):  # the abort runs in the background of the gateway
        if engine.aborts_sent:
            break
        time.sleep(0.05)
    assert engine.aborts_sent == 1


@pytest.mark.slow
def test_vllm_killed_mid_stream_fails_cleanly_and_the_gateway_recovers_by_itself(
    gateway_factory, vllm_python, tiny_model_dir, tiny_tokenizer, tmp_path
):
    """kill -9 of vLLM under concurrent streams: each cut stream ends with an error event and is recorded failed
    (never ok, so never trained on); meanwhile /health says the engine is down and new calls get a clean 503; when
    vLLM is back on its address the gateway serves again with no restart."""
    import os
    import signal
    import threading

    from gateway.engines.vllm_server import VLLMServer
    from tests.test_engine_vllm import PROMPT_TEXT

    prompt = tiny_tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)

    # A long window: the tiny model writes ~2,000 tokens/s, and a 4k window can be done before its first chunk
    # reaches the client; 32k tokens keep every stream running for seconds after it began.
    window = 32_768
    server = VLLMServer(
        vllm_python,
        tiny_model_dir,
        served_model_name="tiny",
        dtype="float32",
        max_model_len=window,
        log_path=tmp_path / "vllm.log",
    )
    server.start(timeout=240)
    try:
        gw = gateway_factory(engine="vllm", vllm_url=server.url, vllm_model="tiny", max_tokens=window)
        streams = 4
        started = threading.Barrier(streams + 1, timeout=120)
        results: dict[str, str] = {}

        def client(i: int) -> None:
            # This prompt and seed sample no end-of-text for thousands of tokens (see test_engine_vllm).
            body = {"model": "tiny", "prompt": prompt, "max_tokens": window - 64, "seed": 1, "stream": True}
            outcome, seen = "incomplete", 0
            with httpx.stream("POST", gw.v1 + "/completions", json=body, timeout=120) as r:
                call_id = r.headers["x-clawgate-call-id"]
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    seen += 1
                    if seen == 1:
                        started.wait()
                    # The error event (a [DONE] may follow it); a generated text may say "error" too.
                    if line != "data: [DONE]" and "error" in json.loads(line.removeprefix("data: ")):
                        outcome = "error"
                    elif line == "data: [DONE]" and outcome != "error":
                        outcome = "done"
            results[call_id] = outcome

        threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        started.wait()
        assert server._process is not None
        os.killpg(server._process.pid, signal.SIGKILL)
        for t in threads:
            t.join(120)
        assert len(results) == streams and "incomplete" not in results.values(), results
        assert "error" in results.values(), f"no stream was still running at the kill: {results}"

        health = httpx.get(gw.url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["engine"]["state"] == "down"
        down = httpx.post(gw.v1 + "/chat/completions", json={"model": "tiny", "messages": MESSAGES}, timeout=60)
        assert down.status_code == 503 and down.json()["error"]["type"] == "service_unavailable", down.text

        server.stop()
        server.start(timeout=240)  # same address
        deadline = time.monotonic() + 60
        while httpx.get(gw.url + "/health", timeout=30).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        back = httpx.post(
            gw.v1 + "/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4}, timeout=60
        )
        assert back.status_code == 200, back.text
    finally:
        server.stop()
    rows = {c.id: c.status for c, *_ in stored(gw, "1 = 1")}
    for call_id, outcome in results.items():
        assert rows[call_id] == ("ok" if outcome == "done" else "failed"), (call_id, outcome, rows[call_id])
    assert rows[back.headers["x-clawgate-call-id"]] == "ok"
    assert list(rows.values()).count("ok") == list(results.values()).count("done") + 1
