"""The reward worker: every turn of everyday traffic judged once its next state is known (or its rollout closed),
through LiteLLM against a judge server, exactly once — with outages, unusable answers, concurrency limits and
two workers racing."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.store import judgements
from gateway.store.db import connect
from gateway.store.models import Judgement, Reward
from rewards.functions import RewardFunctionError, interpret, load
from rewards.judge import NO_NEXT_STATE, Judge
from rewards.turns import tokenizer_decode
from rewards.worker import RewardWorker, WorkerConfig
from tests.fakes import ScriptedEngine
from tests.judge_server import JudgeServer, section

ADMIN = {"Authorization": "Bearer adm"}


def chat(gw: Any, engine: ScriptedEngine, messages: list[dict[str, Any]], answer: str) -> tuple[str, dict[str, Any]]:
    engine.push(answer)
    r = httpx.post(gw.v1 + "/chat/completions", json={"model": "tiny", "messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    return r.headers["x-clawgate-call-id"], r.json()["choices"][0]["message"]


def conversations(gw: Any, engine: ScriptedEngine, n: int) -> list[tuple[str, str, str]]:
    """``n`` two-turn conversations; (first call, second call, rollout id) of each."""
    out = []
    for i in range(n):
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Task {i}: list the files."}]
        first, answer = chat(gw, engine, messages, f"Here are the files of task {i}.")
        messages += [answer, {"role": "user", "content": f"Thanks! Now task {i} part two."}]
        second, _ = chat(gw, engine, messages, f"Part two of task {i} is done.")
        out.append((first, second, ""))
    gw.flush()
    db = connect(gw.settings.database_url)
    try:
        with Session(db) as session:
            from gateway.store.models import Call

            rollout_of = dict(session.execute(sa.select(Call.id, Call.rollout_id)).all())
    finally:
        db.dispose()
    return [(a, b, rollout_of[a]) for a, b, _ in out]


def finish(gw: Any, rollout_id: str) -> None:
    r = httpx.post(f"{gw.url}/v1/rollouts/{rollout_id}/finish", json={"status": "completed"}, headers=ADMIN)
    assert r.status_code == 200, r.text


def worker_for(db: sa.Engine, tokenizer: Any, server: JudgeServer | None, **config: Any) -> RewardWorker:
    judge = None if server is None else Judge("openai/test-judge", api_base=server.url, api_key="k", timeout=10)
    defaults: dict[str, Any] = {
        "concurrency": 4,
        "interval": 0.05,
        "min_backoff": 0.1,
        "max_backoff": 0.4,
        "retry_delay": 0.05,
    }
    functions = config.pop("functions", None)
    return RewardWorker(
        db, tokenizer_decode(tokenizer), judge=judge, functions=functions, config=WorkerConfig(**{**defaults, **config})
    )


def rows(db: sa.Engine, model: Any) -> list[Any]:
    with Session(db) as session:
        return list(session.scalars(sa.select(model)))


def score_by_reply(messages: list[dict[str, Any]]) -> str:
    reply = section(messages, "reply")
    return json.dumps({"score": 0.9 if "task 1" in reply else 0.2, "reason": f"judged {len(reply)} characters"})


@pytest.fixture
def setup(gateway_factory, tiny_tokenizer, store_url):
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, admin_key="adm", database_url=store_url)
    db = connect(store_url)
    yield gw, engine, db
    db.dispose()


def test_each_turn_is_judged_once_when_its_next_state_is_known(setup, tiny_tokenizer):
    gw, engine, db = setup
    convs = conversations(gw, engine, 3)
    with JudgeServer(score_by_reply) as server:
        worker = worker_for(db, tiny_tokenizer, server)
        assert asyncio.run(worker.run_once()) == 3, "only the first turns have a next state yet"
        firsts = {a for a, _, _ in convs}
        judged = {r.call_id: r for r in rows(db, Reward)}
        assert set(judged) == firsts
        for i, (first, _, rollout) in enumerate(convs):
            reward = judged[first]
            assert reward.source == "judge" and reward.rollout_id == rollout
            assert reward.value == (0.9 if i == 1 else 0.2)
            assert reward.details["reason"].startswith("judged") and reward.details["had_next_state"] is True
            assert reward.details["prompt_tokens"] == 100 and reward.details["completion_tokens"] == 20
        prompts = [r["messages"] for r in server.requests]
        assert all("Thanks! Now task" in section(m, "next_state") for m in prompts), "the next state is shown"
        assert all("<|im_start|>user" in m[-1]["content"] for m in prompts), "special tokens show the turn structure"

        assert asyncio.run(worker.run_once()) == 0, "nothing is judged twice"
        assert len(server.requests) == 3
        for _, _, rollout in convs:
            finish(gw, rollout)
        assert asyncio.run(worker.run_once()) == 3, "a closed rollout's last turn is judged without a next state"
        last = [r["messages"] for r in server.requests[3:]]
        assert all(section(m, "next_state") == NO_NEXT_STATE for m in last)
    verdicts = rows(db, Judgement)
    assert len(verdicts) == 6 and {v.status for v in verdicts} == {"done"}
    assert {v.had_next_state for v in verdicts if v.call_id in firsts} == {True}
    assert {v.had_next_state for v in verdicts if v.call_id not in firsts} == {False}
    assert len(rows(db, Reward)) == 6
    assert worker.stats.judged == 6 and worker.stats.prompt_tokens == 600


def test_turns_of_task_runs_are_not_judged(setup, tiny_tokenizer):
    gw, engine, db = setup
    ro = httpx.post(gw.url + "/v1/rollouts", json={"task_id": "t", "harness": "sdk"}, headers=ADMIN).json()
    engine.push("An answer.")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}]}
    headers = {"Authorization": f"Bearer {ro['api_key']}"}
    assert httpx.post(ro["base_url"] + "/chat/completions", json=body, headers=headers).status_code == 200
    finish(gw, ro["id"])
    with JudgeServer(score_by_reply) as server:
        assert asyncio.run(worker_for(db, tiny_tokenizer, server).run_once()) == 0
        assert server.requests == [], "task runs learn from their verifier, not from the judge"


def test_the_judge_concurrency_limit_holds(setup, tiny_tokenizer):
    gw, engine, db = setup
    convs = conversations(gw, engine, 4)
    for _, _, rollout in convs:
        finish(gw, rollout)
    with JudgeServer(score_by_reply, delay=0.4) as server:
        worker = worker_for(db, tiny_tokenizer, server, concurrency=3)
        assert asyncio.run(worker.run_once()) == 8
    assert server.max_in_flight == 3, "the limit is used and never exceeded"


def run_in_background(worker: RewardWorker) -> tuple[threading.Thread, Any]:
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(worker.run(stop))

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return thread, lambda: loop.call_soon_threadsafe(stop.set)


def test_a_judge_outage_loses_nothing_and_judges_nothing_twice(setup, tiny_tokenizer, caplog):
    gw, engine, db = setup
    convs = conversations(gw, engine, 3)
    server = JudgeServer(score_by_reply)  # not started: connections are refused
    worker = worker_for(db, tiny_tokenizer, server)
    caplog.set_level(logging.WARNING, logger="clawgate.judge")
    thread, stop = run_in_background(worker)
    try:
        deadline = time.monotonic() + 30
        while worker.stats.outages < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.stats.outages >= 6, "the worker kept trying while the judge was down"
        assert worker.stats.verdicts == 0 and rows(db, Reward) == []
        waiting = rows(db, Judgement)
        assert waiting and {j.status for j in waiting} == {"running"}, "turns wait; none is given up"
        assert {j.attempts for j in waiting} == {0}, "an outage is not the turn's fault"
        outage_lines = [r for r in caplog.records if "judge unreachable" in r.getMessage()]
        assert 1 <= len(outage_lines) <= 2, "one line when the outage starts, not one per failed call"
        server.start()
        deadline = time.monotonic() + 30
        while worker.stats.verdicts < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop()
        thread.join(timeout=30)
        server.stop()
    assert worker.stats.verdicts == 3
    judged = [r.call_id for r in rows(db, Reward)]
    assert sorted(judged) == sorted(a for a, _, _ in convs), "every turn once"
    assert len(server.requests) == 3, "no turn was judged twice after the recovery"
    assert any("recovered after" in r.getMessage() for r in caplog.records)


def test_unparseable_answers_are_retried_then_given_up(setup, tiny_tokenizer, caplog):
    gw, engine, db = setup
    conversations(gw, engine, 2)
    caplog.set_level(logging.WARNING, logger="clawgate.judge")
    with JudgeServer(lambda m: "I cannot grade this.") as server:
        worker = worker_for(db, tiny_tokenizer, server, max_attempts=3)
        assert asyncio.run(worker.run_once()) == 2
        assert len(server.requests) == 6, "three attempts per turn"
    assert worker.stats.unparseable_answers == 6 and worker.stats.given_up == 2
    verdicts = rows(db, Judgement)
    assert {v.status for v in verdicts} == {"unparseable"} and {v.attempts for v in verdicts} == {3}
    assert all("no score" in (v.error or "") for v in verdicts)
    assert rows(db, Reward) == [], "no reward is invented for an unusable answer"
    assert sum("unparseable judge answer" in r.getMessage() for r in caplog.records) == 6


def test_two_workers_record_one_verdict_per_turn(setup, tiny_tokenizer):
    gw, engine, db = setup
    convs = conversations(gw, engine, 5)
    for _, _, rollout in convs:
        finish(gw, rollout)
    with JudgeServer(score_by_reply, delay=0.05) as server:
        a, b = (
            worker_for(db, tiny_tokenizer, server, concurrency=2),
            worker_for(db, tiny_tokenizer, server, concurrency=2),
        )

        async def both() -> list[int]:
            return list(await asyncio.gather(a.run_once(), b.run_once()))

        counts = asyncio.run(both())
    assert sum(counts) == 10 and all(counts), f"both worked, the turns split between them: {counts}"
    rewards = rows(db, Reward)
    assert len(rewards) == 10 and len({r.call_id for r in rewards}) == 10
    assert len(server.requests) == 10


def test_an_expired_claim_cannot_record_a_second_verdict(setup, tiny_tokenizer):
    gw, engine, db = setup
    (first, _, rollout), *_ = conversations(gw, engine, 1)
    assert judgements.claim(db, first, rollout, "token-a", lease_seconds=0.0) == 0
    time.sleep(0.01)
    assert judgements.claim(db, first, rollout, "token-b", lease_seconds=60.0) == 0, "the lease ran out: taken over"
    assert judgements.claim(db, first, rollout, "token-c", lease_seconds=60.0) is None, "a live claim is not"
    late = judgements.finish(
        db, first, rollout, "token-a", status="done", rewards=[judgements.NewReward(1.0, "judge", None)]
    )
    assert late is False and rows(db, Reward) == []
    assert judgements.finish(
        db, first, rollout, "token-b", status="done", rewards=[judgements.NewReward(0.5, "judge", None)]
    )
    assert [r.value for r in rows(db, Reward)] == [0.5]


FUNCTIONS = """
def length(turn):
    return {"reward": min(len(turn.reply_token_ids) / 10, 1.0), "details": {"tokens": len(turn.reply_token_ids)}}

def mentions_thanks(turn):
    if turn.next_state is None:
        return None
    return "Thanks" in turn.next_state

def broken(turn):
    raise RuntimeError("bug in the user's function")
"""


def test_reward_functions_run_per_turn_beside_the_judge(setup, tiny_tokenizer, tmp_path):
    gw, engine, db = setup
    convs = conversations(gw, engine, 2)
    path = tmp_path / "my_rewards.py"
    path.write_text(FUNCTIONS)
    functions = [load(f"{path}:{name}") for name in ("length", "mentions_thanks", "broken")]
    with JudgeServer(score_by_reply) as server:
        worker = worker_for(db, tiny_tokenizer, server, functions=functions)
        assert asyncio.run(worker.run_once()) == 2
    by_source: dict[str, list[Reward]] = {}
    for r in rows(db, Reward):
        by_source.setdefault(r.source, []).append(r)
    assert sorted(by_source) == sorted(["judge", f"function:{path}:length", f"function:{path}:mentions_thanks"])
    assert {r.call_id for r in by_source[f"function:{path}:mentions_thanks"]} == {a for a, _, _ in convs}
    assert all(r.value == 1.0 for r in by_source[f"function:{path}:mentions_thanks"])
    assert all(r.details["tokens"] > 0 for r in by_source[f"function:{path}:length"])
    assert worker.stats.function_errors == 2
    assert all("bug in the user's function" in (v.error or "") for v in rows(db, Judgement))


def test_reward_functions_alone_need_no_judge(setup, tiny_tokenizer, tmp_path):
    gw, engine, db = setup
    conversations(gw, engine, 1)
    path = tmp_path / "only.py"
    path.write_text(FUNCTIONS)
    worker = worker_for(db, tiny_tokenizer, None, functions=[load(f"{path}:mentions_thanks")])
    assert asyncio.run(worker.run_once()) == 1
    assert [(r.source, r.value) for r in rows(db, Reward)] == [(f"function:{path}:mentions_thanks", 1.0)]


def test_reward_function_specs_and_return_values_are_checked(tmp_path):
    with pytest.raises(RewardFunctionError, match="expected module:function"):
        load("no_colon")
    with pytest.raises(RewardFunctionError, match="no file"):
        load(f"{tmp_path / 'missing.py'}:f")
    with pytest.raises(RewardFunctionError, match="import failed"):
        load("no_such_module_anywhere:f")
    with pytest.raises(RewardFunctionError, match="is not a function"):
        load("json:nothing_here")
    assert load("math:sqrt").source == "function:math:sqrt"
    assert interpret(True, "f").value == 1.0 and interpret(0, "f").value == 0.0
    assert interpret(None, "f") is None and interpret({"reward": None}, "f") is None
    assert interpret({"reward": 0.5, "details": {"a": 1}}, "f").details == {"a": 1}
    for bad in ("high", float("nan"), [1.0], {"score": 1}):
        with pytest.raises(RewardFunctionError):
            interpret(bad, "f")


def test_the_judge_command_refuses_to_run_without_a_judge_or_function(sqlite_url, capsys):
    from clawgate.cli import main

    assert main(["judge", "--database-url", sqlite_url]) == 2
    assert "nothing to judge with: set --judge-model" in capsys.readouterr().err


def test_the_judge_command_names_a_missing_key_variable(sqlite_url, capsys, monkeypatch):
    from clawgate.cli import main

    monkeypatch.delenv("NO_SUCH_JUDGE_KEY", raising=False)
    args = [
        "judge",
        "--database-url",
        sqlite_url,
        "--judge-model",
        "openai/x",
        "--judge-api-key-env",
        "NO_SUCH_JUDGE_KEY",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "NO_SUCH_JUDGE_KEY is not set" in err


def test_judge_once_then_read_the_reasons(setup, tiny_model_dir, monkeypatch, capsys):
    from clawgate.cli import main

    gw, engine, _ = setup
    (first, second, rollout), *_ = conversations(gw, engine, 1)
    monkeypatch.setenv("TEST_JUDGE_KEY", "secret-value-never-printed")
    with JudgeServer(score_by_reply) as server:
        code = main(
            [
                "judge",
                "--once",
                "--model",
                str(tiny_model_dir),
                "--database-url",
                gw.settings.database_url,
                "--judge-model",
                "openai/test-judge",
                "--judge-api-base",
                server.url,
                "--judge-api-key-env",
                "TEST_JUDGE_KEY",
            ]
        )
    assert code == 0
    captured = capsys.readouterr()
    assert "judge: 1 verdicts (1 judged, mean score 0.200)" in captured.err
    assert "secret-value-never-printed" not in captured.out + captured.err
    assert main(["turns", "--database-url", gw.settings.database_url, "--json"]) == 0
    rows_out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    by_call = {r["call_id"]: r for r in rows_out}
    assert by_call[first]["judge_status"] == "done" and by_call[first]["rewards"] == {"judge": 0.2}
    assert by_call[first]["judge_reason"].startswith("judged") and by_call[first]["next_call_id"] == second
    assert by_call[second]["state"].startswith("awaiting its next state; not judged; not trained yet")
    assert main(["turns", rollout, "--database-url", gw.settings.database_url]) == 0
    text = capsys.readouterr().out
    assert f"{first}  rollout {rollout}" in text and "judge: judged" in text


def test_judge_once_with_the_judge_down_exits_and_leaves_the_turns(setup, tiny_model_dir, capsys, monkeypatch):
    from clawgate.cli import main

    monkeypatch.setenv("TEST_JUDGE_KEY", "k")
    gw, engine, db = setup
    conversations(gw, engine, 1)
    down = f"http://127.0.0.1:{JudgeServer(score_by_reply).port}/v1"  # nothing listens there
    args = ["judge", "--once", "--model", str(tiny_model_dir), "--database-url", gw.settings.database_url]
    assert (
        main([*args, "--judge-model", "openai/x", "--judge-api-base", down, "--judge-api-key-env", "TEST_JUDGE_KEY"])
        == 1
    )
    assert "the judge cannot be reached" in capsys.readouterr().err
    assert rows(db, Reward) == [] and {j.status for j in rows(db, Judgement)} == {"running"}
