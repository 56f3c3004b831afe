"""Token-in-token-out: a multi-turn conversation echoed back the way harnesses do keeps every earlier answer as
the raw sampled ids; the stored prompt of call k+1 begins with prompt_k + completion_k exactly; drift stays 0."""

from __future__ import annotations

import itertools
import json
import time

import openai
import sqlalchemy as sa

from gateway.store import codec, repo
from gateway.store.db import connect
from tests.fakes import ScriptedEngine

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command",
            "parameters": {
                "type": "object",
                "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"}},
            },
        },
    }
]


def stored_calls(gw, rollout_id: str):
    gw.flush()
    engine = connect(gw.settings.database_url)
    with sa.orm.Session(engine) as session:
        rows = repo.calls_for_rollout(session, rollout_id)
        out = [(r, repo.full_prompt_ids(session, r), codec.unpack_ids(r.completion_ids)) for r in rows]
    engine.dispose()
    return out


def drift_count(gw) -> float:
    return gw.state.metrics.drift._value.get()


def assert_chain(chain) -> None:
    for (prev, prev_prompt, prev_completion), (row, prompt, _) in itertools.pairwise(chain):
        assert prompt[: len(prev_prompt) + len(prev_completion)] == prev_prompt + prev_completion, (
            f"call {row.id} does not extend {prev.id}"
        )
        assert row.parent_call_id == prev.id
        assert row.render_mode == "spliced"


def test_six_turns_real_engine_text_echo(shared_gateway):
    """Real local engine: the harness trims, merges and splits content parts of echoed answers."""
    client = openai.OpenAI(base_url=shared_gateway.v1, api_key="x", max_retries=0)
    drift0 = drift_count(shared_gateway)
    messages = [
        {"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": "Start the task."},
    ]
    rollout = None
    for turn in range(6):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=12, temperature=1.0, seed=100 + turn
        )
        resp = raw.parse()
        rid = raw.headers["x-clawgate-rollout-id"]
        rollout = rollout or rid
        assert rid == rollout, "implicit session must follow the conversation"
        text = resp.choices[0].message.content or ""
        # Echo the way harnesses do: whitespace trimmed, content split into parts.
        echoed = text.strip()
        half = len(echoed) // 2
        content = (
            [{"type": "text", "text": echoed[:half]}, {"type": "text", "text": echoed[half:]}] if turn % 2 else echoed
        )
        messages.append({"role": "assistant", "content": content})
        messages.append({"role": "user", "content": f"Continue with step {turn + 2}."})
    chain = stored_calls(shared_gateway, rollout)
    assert len(chain) == 6
    assert chain[0][0].render_mode == "fresh"
    assert_chain(chain)
    assert drift_count(shared_gateway) == drift0


def test_six_turns_tool_calls_reasoning_rewritten(gateway_factory, tiny_tokenizer):
    """Answers with reasoning and tool calls, echoed with ids rewritten, reasoning dropped and arguments
    re-serialized (other key order and spacing): still spliced from raw ids, never re-tokenized."""
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer)
    client = openai.OpenAI(base_url=gw.url + "/rollouts/ro-tito/v1", api_key="x", max_retries=0)
    messages: list[dict] = [
        {"role": "system", "content": "Agent."},
        {"role": "user", "content": "List files."},
    ]
    for turn in range(6):
        if turn < 5:
            engine.push(
                f"<think>\nI should run step {turn}.\n</think>\n\n<tool_call>\n"
                f'{{"name": "run", "arguments": {{"cmd": "ls -{turn}",  "timeout": {turn}}}}}\n</tool_call>'
            )
        else:
            engine.push("All done.")
        resp = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=64)
        msg = resp.choices[0].message
        if turn < 5:
            assert resp.choices[0].finish_reason == "tool_calls"
            assert msg.reasoning_content if hasattr(msg, "reasoning_content") else True
            [tc] = msg.tool_calls
            args = json.loads(tc.function.arguments)
            assert args == {"cmd": f"ls -{turn}", "timeout": turn}
            new_id = tc.id.replace("_", "")  # OpenClaw rewrites call_abc -> callabc
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": new_id,
                            "type": "function",
                            "function": {
                                "name": "run",
                                "arguments": json.dumps(dict(reversed(list(args.items())))),
                            },
                        }
                    ],
                }
            )
            messages.append({"role": "tool", "tool_call_id": new_id, "content": f"file{turn}.txt"})
        else:
            assert msg.content == "All done."
    chain = stored_calls(gw, "ro-tito")
    assert len(chain) == 6
    assert_chain(chain)
    assert drift_count(gw) == 0
    # The reasoning the harness dropped is still in the prompt, as the raw tokens that were generated.
    last_prompt = chain[-1][1]
    assert tiny_tokenizer.decode(last_prompt).count("I should run step") == 5
    # The engine received exactly those prompts.
    assert [r.prompt_ids for r in engine.requests] == [c[1] for c in chain]


def test_edited_history_is_drift_not_splice(gateway_factory, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer)
    client = openai.OpenAI(base_url=gw.url + "/rollouts/ro-drift/v1", api_key="x", max_retries=0)
    engine.push("First answer.")
    messages = [{"role": "user", "content": "Hi."}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=16)
    engine.push("Second answer.")
    # The harness rewrote the user turn before our answer (e.g. compaction): our answer can't be spliced.
    edited = [
        {"role": "user", "content": "Hi, edited."},
        {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "More."},
    ]
    client.chat.completions.create(model="tiny", messages=edited, max_tokens=16)
    chain = stored_calls(gw, "ro-drift")
    assert [c[0].render_mode for c in chain] == ["fresh", "drifted"]
    assert drift_count(gw) == 1


def test_splice_survives_a_gateway_restart(gateway_factory, tiny_tokenizer, tmp_path):
    """After a restart the in-memory index is empty: the parent is found in the database by its tail hash."""
    from gateway.store import db
    from tests.conftest import stop_gateway

    url = f"sqlite:///{tmp_path / 'restart.db'}"
    db.upgrade(url)
    for rollout in ("ro-restart", None):
        engine = ScriptedEngine(tiny_tokenizer)
        gw1 = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, database_url=url)
        base = gw1.url + (f"/rollouts/{rollout}/v1" if rollout else "/v1")
        engine.push('<tool_call>\n{"name": "run", "arguments": {"cmd": "pwd"}}\n</tool_call>')
        messages = [{"role": "user", "content": f"Where am I? {rollout}"}]
        first = openai.OpenAI(base_url=base, api_key="x", max_retries=0).chat.completions.with_raw_response.create(
            model="tiny", messages=messages, tools=TOOLS
        )
        tc = first.parse().choices[0].message.tool_calls[0]
        gw1.flush()
        stop_gateway(gw1)

        engine2 = ScriptedEngine(tiny_tokenizer)
        gw2 = gateway_factory(engine=engine2, tokenizer=tiny_tokenizer, database_url=url)
        engine2.push("Done.")
        messages += [
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "x1", "type": "function", "function": {"name": "run", "arguments": '{"cmd":"pwd"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "x1", "content": "/"},
        ]
        base2 = gw2.url + (f"/rollouts/{rollout}/v1" if rollout else "/v1")
        second = openai.OpenAI(base_url=base2, api_key="x", max_retries=0).chat.completions.with_raw_response.create(
            model="tiny", messages=messages, tools=TOOLS
        )
        rid = first.headers["x-clawgate-rollout-id"]
        assert second.headers["x-clawgate-rollout-id"] == rid
        chain = stored_calls(gw2, rid)
        assert [c[0].render_mode for c in chain] == ["fresh", "spliced"]
        assert chain[1][1][: len(chain[0][1]) + len(chain[0][2])] == chain[0][1] + chain[0][2]
        assert tc.function.name == "run"


def test_a_turn_forgotten_by_the_memory_window_is_spliced_from_the_database(gateway_factory, tiny_tokenizer):
    """The session index keeps a turn only for CLAWGATE_SESSION_CACHE_IDLE; the session itself stays open for the
    idle timeout, and a turn that comes after the memory window continues it exactly, from the database."""
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, session_cache_idle=0.5, session_idle_timeout=600)
    client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)
    engine.push("First answer.")
    messages = [{"role": "user", "content": "Remember this."}]
    first = client.chat.completions.with_raw_response.create(model="tiny", messages=messages)
    rid = first.headers["x-clawgate-rollout-id"]
    gw.flush()
    time.sleep(1.0)
    # Another conversation's call: adding it evicts the turns idle for longer than the memory window.
    engine.push("Other.")
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Something else."}])
    assert len(gw.state.index) == 1, "the first conversation's turn is no longer held in memory"
    engine.push("Second answer.")
    messages += [{"role": "assistant", "content": "First answer."}, {"role": "user", "content": "Go on."}]
    second = client.chat.completions.with_raw_response.create(model="tiny", messages=messages)
    assert second.headers["x-clawgate-rollout-id"] == rid
    chain = stored_calls(gw, rid)
    assert [c[0].render_mode for c in chain] == ["fresh", "spliced"]
    assert_chain(chain)
    assert drift_count(gw) == 0
