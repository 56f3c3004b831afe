"""Training on turns of everyday traffic: when a turn is ready, what its reward is, the batch baseline, token credit
per turn, and exactly-once consumption across trainer restarts and SIGKILLs."""

from __future__ import annotations

import time
from typing import Any

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
import torch
from sqlalchemy.orm import Session

from gateway.store import turns
from gateway.store.db import connect
from gateway.store.models import Call, Judgement, PolicyVersion, TrainedTurn
from prefix_tree import CallView, build_tree
from tests.fakes import ScriptedEngine
from tests.test_trainer_daemon import Daemon, recorded_versions, train_cmd
from trainer import lora
from trainer.advantages import SINGLETON, ZERO_VARIANCE, batch_advantages
from trainer.batch import pack_trees
from trainer.config import TrainConfig
from trainer.credit import CreditTable, node_table
from trainer.ppo import branch_gae
from trainer.step import Trainer

ADMIN = {"Authorization": "Bearer adm"}


# --- pure ---------------------------------------------------------------------------------------------------------
def test_batch_advantages_normalize_per_harness_and_skip_what_has_no_baseline():
    rewards = {"a": 1.0, "b": 0.0, "c": 0.5, "d": 0.5, "e": 0.7, "f": 0.2, "g": 0.9}
    keys = {"a": "claude-code", "b": "claude-code", "c": "codex", "d": "codex", "e": "api:chat"}
    keys["f"] = keys["g"] = "openclaw"
    result = batch_advantages(rewards, keys)
    # (r − mean) / (std + 1e-6) with std = 0.5
    assert result.advantages["a"] == pytest.approx(0.5 / 0.500001) == -result.advantages["b"]
    assert result.skipped == {"c": ZERO_VARIANCE, "d": ZERO_VARIANCE, "e": SINGLETON}
    assert result.advantages["g"] > 0 > result.advantages["f"], "normalized within openclaw only"
    assert batch_advantages({"x": 1.0}, {"x": "h"}).advantages == {}, "a batch of one carries no signal"
    dr = batch_advantages(rewards, keys, scale_by_std=False)
    assert dr.advantages["a"] == pytest.approx(0.5) and dr.advantages["g"] == pytest.approx(0.35)


def _tree(calls: list[CallView]):
    from gateway.store.training_data import TURN_TREE

    return build_tree(calls, TURN_TREE)


def _view(cid: str, prompt: list[int], completion: list[int], t: float) -> CallView:
    return CallView(cid, prompt, completion, [-1.0] * len(completion), started_at=t, status="ok", policy_version=0)


def test_each_token_gets_the_advantage_of_the_turn_that_generated_it():
    a = _view("a", [1, 2, 3], [10, 11], 0.0)
    b = _view("b", [1, 2, 3, 10, 11, 4, 5], [20, 21, 22], 1.0)  # continues a: a's completion is in its prompt
    c = _view("c", [1, 2, 3, 10, 11, 6], [30], 2.0)  # a sibling branch after a
    tree = _tree([a, b, c])
    credit = {"a": 2.0, "b": -1.0, "c": 0.5}
    table = node_table(tree, credit)
    by_generator = {n.generator: table[n.id] for n in tree.nodes if n.generator}
    assert by_generator == credit
    assert all(table[n.id] == 0 for n in tree.nodes if not n.trainable.any()), "context carries no advantage"
    (batch,) = pack_trees([tree], "tree", 4096)
    adv = CreditTable([tree], [credit]).for_batch(batch)
    targets = batch.targets[batch.trainable].tolist()
    got = dict(zip(targets, adv[batch.trainable].tolist(), strict=True))
    assert got == {10: 2.0, 11: 2.0, 20: -1.0, 21: -1.0, 22: -1.0, 30: 0.5}, "a's tokens counted once, with a's credit"
    assert sorted(targets) == [10, 11, 20, 21, 22, 30]
    # A broadcast credit (a task rollout) reaches every trained token.
    whole = CreditTable([tree], [0.25]).for_batch(batch)
    assert set(whole[batch.trainable].tolist()) == {0.25}
    with pytest.raises(ValueError, match="no advantage"):
        node_table(tree, {"a": 1.0})


def test_gae_over_turns_gives_each_turn_its_own_episode():
    a = _view("a", [1, 2], [10, 11], 0.0)
    b = _view("b", [1, 2, 10, 11, 3], [20, 21], 1.0)
    tree = _tree([a, b])
    values = {(n.id, n.depth + i): 0.0 for n in tree.nodes for i in np.flatnonzero(n.trainable)}
    (branch,) = branch_gae(tree, {"a": 1.0, "b": -1.0}, values, gamma=1.0, lam=1.0)
    assert branch.advantages.tolist() == [1.0, 1.0, -1.0, -1.0], "b's reward does not flow back into a's tokens"
    (whole,) = branch_gae(tree, 1.0, values, gamma=1.0, lam=1.0)
    assert whole.advantages.tolist() == [1.0, 1.0, 1.0, 1.0], "a rollout reward reaches every token"


# --- readiness and rewards in the store --------------------------------------------------------------------------
def chat(gw: Any, engine: ScriptedEngine | None, messages: list[dict[str, Any]], answer: str = "ok") -> dict[str, Any]:
    if engine is not None:
        engine.push(answer)
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 1.0}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    message["content"] = message.get("content") or ""
    return {"call": r.headers["x-clawgate-call-id"], "rollout": r.headers["x-clawgate-rollout-id"], "msg": message}


def two_turns(gw: Any, engine: ScriptedEngine | None, i: int) -> tuple[str, str, str]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Question {i}?"}]
    first = chat(gw, engine, messages, f"Answer {i}.")
    messages += [first["msg"], {"role": "user", "content": f"Follow-up {i}."}]
    second = chat(gw, engine, messages, f"Second answer {i}.")
    assert first["rollout"] == second["rollout"], "one implicit conversation"
    return first["call"], second["call"], first["rollout"]


def feedback(gw: Any, call_id: str, value: float, source: str | None = None) -> None:
    body: dict[str, Any] = {"call_id": call_id, "value": value}
    if source:
        body["source"] = source
    r = httpx.post(gw.url + "/v1/feedback", json=body, headers=ADMIN)
    assert r.status_code == 201, r.text


def ready(db: sa.Engine, await_judge: bool = False) -> set[str]:
    return set(turns.ready_turns(db, 0, 1000, await_judge=await_judge))


@pytest.fixture
def scripted(gateway_factory, tiny_tokenizer, store_url):
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, admin_key="adm", database_url=store_url)
    db = connect(store_url)
    yield gw, engine, db
    db.dispose()


def test_a_turn_is_ready_once_rewarded_with_its_next_state_known(scripted):
    gw, engine, db = scripted
    first, second, rollout = two_turns(gw, engine, 0)
    gw.flush()
    assert ready(db) == set(), "no reward, nothing to train"
    feedback(gw, first, 1.0)
    feedback(gw, second, 0.0)
    assert ready(db) == {first}, "the second turn waits for its next state (its session goes on)"
    backlog = turns.backlog(db, 0, await_judge=False)
    assert (backlog.ready, backlog.awaiting_next_state) == (1, 1)
    metrics = httpx.get(gw.url + "/metrics").text
    assert "clawgate_turns_ready 1.0" in metrics and 'clawgate_turns_waiting{for="next_state"} 1.0' in metrics
    r = httpx.post(f"{gw.url}/v1/rollouts/{rollout}/finish", json={"status": "completed"}, headers=ADMIN)
    assert r.status_code == 200
    assert ready(db) == {first, second}, "a closed rollout's last turn needs no next state"


def test_turns_wait_for_the_judge_when_one_runs(scripted):
    gw, engine, db = scripted
    first, _, _ = two_turns(gw, engine, 0)
    feedback(gw, first, 1.0)
    assert ready(db, await_judge=True) == set(), "the judge's score may still come"
    assert turns.backlog(db, 0, await_judge=True).awaiting_judge == 1
    with Session(db) as session, session.begin():
        session.add(Judgement(call_id=first, rollout_id=_rollout_of(db, first), status="running", attempts=1))
    assert ready(db, await_judge=True) == set(), "a verdict in progress is not final"
    with Session(db) as session, session.begin():
        session.get(Judgement, first).status = "unparseable"  # type: ignore[union-attr]
    assert ready(db, await_judge=True) == {first}, "a final verdict without a score lets the other rewards train"


def _rollout_of(db: sa.Engine, call_id: str) -> str:
    with Session(db) as session:
        return str(session.get(Call, call_id).rollout_id)  # type: ignore[union-attr]


def test_a_turn_reward_sums_the_latest_value_of_each_source(scripted):
    gw, engine, db = scripted
    first, second, rollout = two_turns(gw, engine, 0)
    feedback(gw, first, 1.0)
    feedback(gw, first, -1.0)  # the user changed their mind: the latest feedback counts
    feedback(gw, first, 0.25, source="judge")
    with Session(db) as session:
        rewards = turns.turn_rewards(session, [first, second])
    assert rewards[first].sources == {"feedback": -1.0, "judge": 0.25} and rewards[first].value == -0.75
    assert second not in rewards
    # A rollout-level reward on a conversation without a task reaches every turn not trained yet, once it completed.
    r = httpx.post(f"{gw.url}/v1/rollouts/{rollout}/reward", json={"value": 2.0}, headers=ADMIN)
    assert r.status_code == 201
    with Session(db) as session:
        assert second not in turns.turn_rewards(session, [second]), "not before the rollout completed"
    httpx.post(f"{gw.url}/v1/rollouts/{rollout}/finish", json={"status": "completed"}, headers=ADMIN)
    with Session(db) as session:
        rewards = turns.turn_rewards(session, [first, second])
    assert rewards[second].sources == {"rollout": 2.0} and rewards[first].value == pytest.approx(1.25)
    assert ready(db) == {first, second}


def test_task_runs_are_not_turns(scripted):
    gw, engine, db = scripted
    ro = httpx.post(gw.url + "/v1/rollouts", json={"task_id": "t", "harness": "sdk"}, headers=ADMIN).json()
    engine.push("x")
    headers = {"Authorization": f"Bearer {ro['api_key']}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}]}
    call = httpx.post(ro["base_url"] + "/chat/completions", json=body, headers=headers).headers["x-clawgate-call-id"]
    feedback(gw, call, 1.0)
    httpx.post(f"{gw.url}/v1/rollouts/{ro['id']}/finish", json={"status": "completed"}, headers=ADMIN)
    assert ready(db) == set(), "a rollout with a group trains on its rollout-level reward, by GRPO"


# --- the trainer on turns ----------------------------------------------------------------------------------------
def trained_turns(url: str) -> dict[str, tuple[int, float | None, float | None]]:
    db = connect(url)
    try:
        with Session(db) as session:
            return {t.call_id: (t.version, t.reward, t.advantage) for t in session.scalars(sa.select(TrainedTurn))}
    finally:
        db.dispose()


def config(model: Any, url: str, adapters: Any, **kw: Any) -> TrainConfig:
    return TrainConfig(model=str(model), database_url=url, adapter_dir=adapters, lr=1e-2, max_staleness=8, **kw)


def test_turns_are_trained_once_across_trainer_restarts(gateway_factory, tiny_model_dir, tmp_path):
    gw = gateway_factory(admin_key="adm", policy_follow=False)
    url, adapters = gw.settings.database_url, tmp_path / "adapters"
    calls = [two_turns(gw, None, i) for i in range(3)]
    for i, (first, second, _) in enumerate(calls):
        feedback(gw, first, float(i))  # 0, 1, 2: variance within the batch
        feedback(gw, second, 5.0)  # no next state yet: not ready
    db = connect(url)
    trainer = Trainer(config(tiny_model_dir, url, adapters), db)
    result = trainer.step()
    assert result is not None and result.turns == 3 and result.trained_turns == 3 and result.rollouts == 0
    assert result.metrics["turn_reward_mean"] == pytest.approx(1.0)
    first_step = trained_turns(url)
    assert set(first_step) == {c[0] for c in calls}
    advantages = [first_step[c[0]][2] for c in calls]
    assert advantages[0] < 0 < advantages[2], "a batch baseline: above the batch mean is good"
    assert [first_step[c[0]][1] for c in calls] == [0.0, 1.0, 2.0]
    v0 = lora.version_path(adapters, 0) / "adapter_model.safetensors"
    v1 = lora.version_path(adapters, 1) / "adapter_model.safetensors"
    from safetensors.torch import load_file

    before, after = load_file(v0), load_file(v1)
    assert any(not torch.equal(before[k], after[k]) for k in before), "the LoRA moved"
    assert trainer.step() is None, "nothing is ready twice"

    # Restart: a new trainer resumes from v1 and trains only what became ready since.
    for _, _, rollout in calls:
        httpx.post(f"{gw.url}/v1/rollouts/{rollout}/finish", json={"status": "completed"}, headers=ADMIN)
    extra = two_turns(gw, None, 9)
    feedback(gw, extra[0], 0.0)
    restarted = Trainer(config(tiny_model_dir, url, adapters), db)
    assert restarted.version == 1
    result = restarted.step()
    assert result is not None and result.version == 2 and result.turns == 4
    # The three second turns share reward 5.0 with one 0.0: all in one batch key ("api:chat").
    after_restart = trained_turns(url)
    assert set(after_restart) == {c[0] for c in calls} | {c[1] for c in calls} | {extra[0]}
    assert all(after_restart[c[0]][0] == 1 for c in calls), "turns of the first step stay with version 1"
    assert restarted.step() is None
    db.dispose()


def test_turns_have_their_own_cap_and_once_applies_the_minimums_it_is_given(
    gateway_factory, tiny_model_dir, tmp_path, capsys
):
    from clawgate.cli import main as clawgate

    gw = gateway_factory(admin_key="adm", policy_follow=False)
    url, adapters = gw.settings.database_url, tmp_path / "adapters"
    for i in range(3):
        first, _, _ = two_turns(gw, None, i)
        feedback(gw, first, float(i))
    once = ["train", "--once", "--model", str(tiny_model_dir), "--database-url", url, "--adapter-dir", str(adapters)]
    # Three turns are ready; a one-shot run told to need five trains nothing and says why.
    assert clawgate([*once, "--min-turns", "5", "--min-rollouts", "1", "--min-groups", "1"]) == 1
    assert "nothing to train on (waiting: 0/1 rollouts ready, 0/1 groups with two or more; 3/5 turns ready" in (
        capsys.readouterr().err
    )
    db = connect(url)
    try:
        # --max-rollouts caps task runs only: two of the three turns are trained, as --max-turns says.
        result = Trainer(config(tiny_model_dir, url, adapters, max_rollouts=1, max_turns=2), db).step()
        assert result is not None and result.turns == 2 and result.rollouts == 0
    finally:
        db.dispose()


def test_turns_without_variance_are_consumed_untrained_and_reported(gateway_factory, tiny_model_dir, tmp_path):
    gw = gateway_factory(admin_key="adm", policy_follow=False)
    url, adapters = gw.settings.database_url, tmp_path / "adapters"
    firsts = [two_turns(gw, None, i)[0] for i in range(2)]
    for call in firsts:
        feedback(gw, call, 1.0)
    db = connect(url)
    result = Trainer(config(tiny_model_dir, url, adapters), db).step()
    db.dispose()
    assert result is not None and result.trained_turns == 0 and result.turns == 2
    assert result.skipped == {firsts[0]: ZERO_VARIANCE, firsts[1]: ZERO_VARIANCE}
    assert result.metrics["turns_skipped"] == 2
    assert {c: v[2] for c, v in trained_turns(url).items()} == {firsts[0]: None, firsts[1]: None}


def test_the_critic_trains_turns_too(gateway_factory, tiny_model_dir, tmp_path):
    gw = gateway_factory(admin_key="adm", policy_follow=False)
    url, adapters = gw.settings.database_url, tmp_path / "adapters"
    firsts = [two_turns(gw, None, i)[0] for i in range(2)]
    feedback(gw, firsts[0], 1.0)
    feedback(gw, firsts[1], 1.0)  # no variance: the batch baseline would skip them, the critic trains them
    db = connect(url)
    trainer = Trainer(config(tiny_model_dir, url, adapters, advantage="critic"), db)
    assert trainer.config.algorithm == "ppo"
    result = trainer.step()
    db.dispose()
    assert result is not None and result.trained_turns == 2
    consumed = trained_turns(url)
    assert all(consumed[c][2] is not None and consumed[c][2] > 0 for c in firsts), "V=0 at first: A = r > 0"
    assert (lora.version_path(adapters, 1) / "value_head.safetensors").exists()


def test_stale_turns_are_consumed_without_a_judge_verdict(gateway_factory, tiny_model_dir, tmp_path):
    gw = gateway_factory(admin_key="adm", policy_follow=False)
    url, adapters = gw.settings.database_url, tmp_path / "adapters"
    old = two_turns(gw, None, 0)  # served by v0; its turns wait for a judge that never comes
    fresh = two_turns(gw, None, 1)
    feedback(gw, fresh[0], 1.0)
    db = connect(url)
    trainer = Trainer(config(tiny_model_dir, url, adapters, await_judge=True), db)
    with Session(db) as session, session.begin():  # as if ten versions were published since it was served
        for v in range(1, 11):
            name = lora.version_name(v)
            session.add(PolicyVersion(version=v, adapter_name=name, path=name, base_model="tiny", status="retired"))
    trainer.version = 10
    with Session(db) as session, session.begin():
        session.execute(sa.update(Call).where(Call.id.in_(fresh[:2])).values(policy_version=10))
        session.add(Judgement(call_id=fresh[0], rollout_id=fresh[2], status="done", attempts=0))
    result = trainer.step()
    db.dispose()
    assert result is not None and result.version == 11
    consumed = trained_turns(url)
    assert old[0] in consumed and old[1] in consumed, "stale turns leave the backlog, ready or not"
    assert result.skipped[old[0]].startswith("stale: served by policy@v0, 10 versions behind")
    assert fresh[0] in consumed and fresh[1] not in consumed


def test_sigkill_mid_step_trains_every_turn_exactly_once(gateway_factory, tiny_model_dir, tmp_path):
    gw = gateway_factory(admin_key="adm", policy_follow=False)
    url, adapters = gw.settings.database_url, tmp_path / "adapters"
    made: list[str] = []
    landed: list[bool] = []
    for round_, delay in enumerate([0.0, 0.2, 0.4]):
        for i in range(3):
            first, _, _ = two_turns(gw, None, round_ * 10 + i)
            feedback(gw, first, float(i))
            made.append(first)
        daemon = Daemon(train_cmd(tiny_model_dir, url, adapters, "--min-turns", "3"))
        try:
            landed.append(daemon.kill_in_step(url, delay))
        finally:
            daemon.stop()
    daemon = Daemon(train_cmd(tiny_model_dir, url, adapters, "--min-turns", "1", "--group-wait", "0"))
    try:
        deadline = time.monotonic() + 180
        while set(trained_turns(url)) != set(made):
            assert time.monotonic() < deadline, daemon.output
            time.sleep(0.2)
    finally:
        daemon.stop()
    assert landed[0], f"kills inside a step: {landed}"
    assert len(trained_turns(url)) == len(made), "every turn trained exactly once"
    versions = recorded_versions(url)
    assert versions == list(range(len(versions)))
    assert lora.versions(adapters) == versions


def test_the_daemon_says_what_turns_wait_for(gateway_factory, tiny_model_dir, tmp_path):
    gw = gateway_factory(admin_key="adm", policy_follow=False)
    url, adapters = gw.settings.database_url, tmp_path / "adapters"
    first, _, _ = two_turns(gw, None, 0)
    feedback(gw, first, 1.0)
    daemon = Daemon(train_cmd(tiny_model_dir, url, adapters, "--min-turns", "4", "--await-judge"))
    try:
        daemon.wait_line("0/4 turns ready, 1 await their next state, 1 await the judge")
    finally:
        daemon.stop()


def test_a_turn_longer_than_a_forward_pass_is_set_aside_not_stuck(gateway_factory, tiny_model_dir, tmp_path):
    """A path longer than --max-tokens-per-bin cannot be packed (truncating it would train on a context the model
    never saw): it is consumed untrained with the reason, and the rest of the step trains."""
    gw = gateway_factory(admin_key="adm", policy_follow=False)
    url, adapters = gw.settings.database_url, tmp_path / "adapters"
    short = [two_turns(gw, None, i) for i in range(3)]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Question " + "again " * 80}]
    first = chat(gw, None, messages)
    chat(gw, None, [*messages, first["msg"], {"role": "user", "content": "More?"}])
    for i, (call, _, _) in enumerate(short):
        feedback(gw, call, float(i))
    feedback(gw, first["call"], 3.0)
    db = connect(url)
    try:
        with Session(db) as session:
            lengths = dict(session.execute(sa.select(Call.id, Call.prompt_len + Call.completion_len)).all())
        budget = max(lengths[c] for c, _, _ in short)
        assert lengths[first["call"]] > budget
        trainer = Trainer(config(tiny_model_dir, url, adapters, max_tokens_per_bin=budget), db)
        result = trainer.step()
    finally:
        db.dispose()
    assert result is not None and result.trained_turns == 3 and result.metrics["too_long"] == 1.0
    reason = f"too long: a path of {lengths[first['call']]:,} tokens exceeds --max-tokens-per-bin {budget:,}"
    assert result.skipped[first["call"]] == reason
    consumed = trained_turns(url)
    assert consumed[first["call"]][2] is None, "consumed untrained"
    assert all(consumed[c][2] is not None for c, _, _ in short)
