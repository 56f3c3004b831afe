"""Counterfactual groups: siblings drawn for served turns off the critical path, never seen by a client nor spliced,
recorded with the exact tokens and logprobs the engine sampled, capped, judged on the siblings' terms, and trained
in a group normalized per prompt."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from typing import Any

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
import torch
from sqlalchemy.orm import Session

from gateway.core import counterfactuals as drawer_module
from gateway.store import counterfactuals, judgements
from gateway.store import turns as store_turns
from gateway.store.db import connect
from gateway.store.models import Call, Counterfactual, CounterfactualGroup, TrainedTurn
from gateway.store.training_data import load_turns, turn_trees
from rewards.functions import RewardFunction
from rewards.report import turn_rows
from rewards.turns import TurnView, load_group, load_turn, tokenizer_decode
from rewards.worker import RewardWorker, WorkerConfig
from tests.test_api_openai import TOOLS
from trainer.advantages import ZERO_VARIANCE, group_advantages, turn_advantages
from trainer.config import TrainConfig
from trainer.step import Trainer

ADMIN = {"Authorization": "Bearer adm"}
K = 3


def chat(gw: Any, messages: list[dict[str, Any]], **extra: Any) -> tuple[str, str, dict[str, Any]]:
    """One served call: (its call id, its rollout id, the answer message)."""
    body = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 1.0, **extra}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    assert len(data["choices"]) == 1, "the client gets its own answer only"
    message = data["choices"][0]["message"]
    message["content"] = message.get("content") or ""
    return r.headers["x-clawgate-call-id"], r.headers["x-clawgate-rollout-id"], message


def settle(gw: Any) -> None:
    """Wait until every group offered so far was drawn and recorded (or dropped)."""
    drawer = gw.state.service.counterfactuals
    asyncio.run_coroutine_threadsafe(drawer.idle(), gw.loop).result(timeout=120)
    gw.flush()


def metric(gw: Any, line_start: str) -> float:
    for line in httpx.get(gw.url + "/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture
def gw(gateway_factory: Any) -> Any:
    return gateway_factory(admin_key="adm", policy_follow=False, counterfactuals=K)


def test_siblings_are_recorded_with_the_logprobs_they_were_sampled_with(gw, tiny_model_dir):
    call_id, _, _ = chat(gw, [{"role": "user", "content": "Name a colour."}])
    settle(gw)
    db = connect(gw.settings.database_url)
    group = counterfactuals.group_of(db, call_id)
    assert group is not None and group.k == K and len(group.siblings) == K
    turn = judgements.recorded_turn(db, call_id)
    assert turn is not None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = turn.prompt.tolist()
    for sibling in group.siblings:
        ids = sibling.completion_ids.tolist()
        assert ids, "a sibling is an answer"
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0].float()
        rows = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(ids)], dim=-1)
        expected = [float(rows[i, t]) for i, t in enumerate(ids)]
        assert sibling.completion_logprobs.tolist() == pytest.approx(expected, abs=2e-4)
        assert sibling.policy_version == turn.policy_version
    assert metric(gw, "clawgate_counterfactuals_drawn_total") == K
    db.dispose()


def test_siblings_are_never_served_nor_spliced(gw):
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say something."}]
    served, rollout, answer = chat(gw, messages)
    settle(gw)
    db = connect(gw.settings.database_url)
    group = counterfactuals.group_of(db, served)
    assert group is not None and group.siblings
    with Session(db) as session:
        call_ids = set(session.scalars(sa.select(Call.id)))
        assert call_ids == {served}, "siblings are no calls: nothing can continue or serve them"
    tokenizer = gw.state.tokenizer
    sibling_text = tokenizer.decode(group.siblings[0].completion_ids.tolist(), skip_special_tokens=True)
    # A client continuing its own answer is spliced onto the served call.
    follow, follow_rollout, _ = chat(gw, [*messages, answer, {"role": "user", "content": "More."}])
    # A client sending a sibling's text as if it had been the answer is not spliced onto anything of ours.
    echoed = {"role": "assistant", "content": sibling_text + " (edited)"}
    other, _, _ = chat(gw, [*messages, echoed, {"role": "user", "content": "More."}])
    settle(gw)
    with Session(db) as session:
        follow_row, other_row = session.get(Call, follow), session.get(Call, other)
        assert follow_row is not None and other_row is not None
        assert follow_row.parent_call_id == served and follow_row.render_mode == "spliced"
        assert follow_rollout == rollout
        sibling_ids = {s.id for s in group.siblings}
        assert other_row.parent_call_id not in sibling_ids and other_row.render_mode != "spliced"
        assert session.get(Call, served).next_call_id == follow  # type: ignore[union-attr]
        parents = set(session.scalars(sa.select(Call.parent_call_id)))
        assert not parents & sibling_ids
    db.dispose()


def test_only_the_admin_key_reads_the_siblings_on_the_rollout_api(gateway_factory):
    """``GET /v1/rollouts/{id}`` carries each call's counterfactual group for the global admin key only: a client's
    key (the environment's, a tenant's admin key, the rollout's own) reads the calls without it."""
    gw = gateway_factory(admin_key="adm", api_keys="client-key", policy_follow=False, counterfactuals=K)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12}
    served = httpx.post(
        gw.v1 + "/chat/completions", json=body, headers={"Authorization": "Bearer client-key"}, timeout=60
    )
    assert served.status_code == 200, served.text
    settle(gw)

    def read(rollout_id: str, key: str) -> httpx.Response:
        return httpx.get(f"{gw.url}/v1/rollouts/{rollout_id}", headers={"Authorization": f"Bearer {key}"}, timeout=30)

    everyday = served.headers["x-clawgate-rollout-id"]
    [call] = read(everyday, "adm").json()["calls"]
    group = call["counterfactual_group"]
    assert group["k"] == K and [s["counterfactual"] for s in group["siblings"]] == [True] * K
    assert all(s["message"] is not None for s in group["siblings"])
    assert read(everyday, "client-key").status_code == 401
    r = httpx.post(gw.url + "/v1/admin/keys", json={"tenant": "default", "role": "admin"}, headers=ADMIN, timeout=30)
    assert r.status_code == 201, r.text
    [call] = read(everyday, r.json()["key"]).json()["calls"]
    assert "counterfactual_group" not in call, "a tenant's admin key is a client's"
    ro = httpx.post(gw.url + "/v1/rollouts", json={"task_id": "t", "harness": "sdk"}, headers=ADMIN, timeout=30).json()
    own = {"Authorization": f"Bearer {ro['api_key']}"}
    assert httpx.post(ro["base_url"] + "/chat/completions", json=body, headers=own, timeout=60).status_code == 200
    assert "counterfactual_group" in read(ro["id"], "adm").json()["calls"][0]
    assert "counterfactual_group" not in read(ro["id"], ro["api_key"]).json()["calls"][0]


def test_the_cap_holds_and_drops_are_counted(gateway_factory, monkeypatch):
    gw = gateway_factory(admin_key="adm", policy_follow=False, counterfactuals=2, counterfactual_max_pending=1)
    drawer = gw.state.service.counterfactuals
    busy = {"live": 1}
    monkeypatch.setattr(drawer_module, "IDLE_WAIT_S", 60.0)
    drawer.live = lambda: busy["live"]  # a live call holds the engine: the first group waits for it
    first, _, _ = chat(gw, [{"role": "user", "content": "One."}])
    chat(gw, [{"role": "user", "content": "Two."}])
    chat(gw, [{"role": "user", "content": "Three."}])
    assert drawer.pending == 1, "one group pending at most"
    assert metric(gw, 'clawgate_counterfactuals_dropped_total{reason="cap"}') == 4, "two turns' two siblings each"
    busy["live"] = 0
    settle(gw)
    db = connect(gw.settings.database_url)
    with Session(db) as session:
        assert set(session.scalars(sa.select(Counterfactual.call_id))) == {first}
    assert metric(gw, "clawgate_counterfactuals_drawn_total") == 2
    db.dispose()


def test_live_traffic_that_stays_cuts_the_group_short_and_every_sibling_is_counted(gateway_factory, monkeypatch):
    gw = gateway_factory(admin_key="adm", policy_follow=False, counterfactuals=3)
    drawer = gw.state.service.counterfactuals
    monkeypatch.setattr(drawer_module, "IDLE_WAIT_S", 0.5)
    seen = {"n": 0}

    def live() -> int:
        # Live traffic arrives while the siblings generate, and stays.
        seen["n"] += 1
        return 1 if seen["n"] > 8 else 0

    drawer.live = live
    call_id, _, _ = chat(gw, [{"role": "user", "content": "Tell me a long story about the sea and ships."}])
    settle(gw)
    db = connect(gw.settings.database_url)
    group = counterfactuals.group_of(db, call_id)
    preempted = metric(gw, 'clawgate_counterfactuals_dropped_total{reason="preempted"}')
    busy = metric(gw, 'clawgate_counterfactuals_dropped_total{reason="busy"}')
    drawn = 0 if group is None else len(group.siblings)
    assert preempted >= 1, "a live call cuts the siblings in flight short"
    assert drawn + busy == 3, "every sibling asked for is drawn whole or counted as dropped for want of an idle moment"
    db.dispose()


def test_siblings_cut_short_are_drawn_again_in_the_next_idle_moment(gateway_factory):
    gw = gateway_factory(admin_key="adm", policy_follow=False, counterfactuals=3)
    drawer = gw.state.service.counterfactuals
    engine, started, live_until = drawer.engine, [], []

    class Counting:
        name = engine.name

        def generate(self, request: Any) -> Any:
            started.append(request.request_id)
            return engine.generate(request)

    def live() -> int:
        # One live call arrives once the group's three siblings run together, and is done 0.3 s later.
        if len(started) == 3 and not live_until:
            live_until.append(time.monotonic() + 0.3)
        return 1 if live_until and time.monotonic() < live_until[0] else 0

    drawer.engine, drawer.live = Counting(), live
    call_id, _, _ = chat(gw, [{"role": "user", "content": "Tell me a long story about the sea and ships."}])
    settle(gw)
    db = connect(gw.settings.database_url)
    group = counterfactuals.group_of(db, call_id)
    assert len(started) == 6 and group is not None, "three started together, cut short, then three again"
    assert sorted(s.id for s in group.siblings) == sorted(started[3:]), "the second draws were kept whole"
    assert metric(gw, 'clawgate_counterfactuals_dropped_total{reason="preempted"}') == 3
    assert metric(gw, 'clawgate_counterfactuals_dropped_total{reason="busy"}') == 0
    db.dispose()


# --- advantages -------------------------------------------------------------------------------------------------
def test_group_advantages_are_per_prompt_and_the_rest_keep_the_batch_baseline():
    rewards = {"a": 0.3, "b": 0.0, "c": 1.0, "d": 0.9}
    keys = dict.fromkeys(rewards, "api:chat")
    groups = {"a": {"a": 1.0, "a1": 0.0, "a2": 0.5}, "d": {"d": 0.2, "d1": 0.2}}
    result = turn_advantages(rewards, keys, groups)
    in_group = group_advantages(groups["a"], dict.fromkeys(groups["a"], "g"))
    for member in ("a", "a1", "a2"):
        assert result.advantages[member] == pytest.approx(in_group.advantages[member])
    assert result.advantages["a"] > 0, "its own reward (0.3) is below the batch's; within its group it is the best"
    assert result.advantages["c"] == pytest.approx(-result.advantages["b"]) and result.advantages["c"] > 0
    assert result.skipped == {"d": ZERO_VARIANCE}, "a group without variance says so under its served turn"
    assert "d1" not in result.advantages


def test_the_trainer_trains_a_group_normalized_within_its_prompt(gw, tiny_model_dir, tmp_path):
    turns = []
    for i in range(3):
        turns.append(chat(gw, [{"role": "user", "content": f"Question {i}?"}]))
        settle(gw)  # a live call would preempt the siblings still being drawn
    db = connect(gw.settings.database_url)
    for (call_id, rollout, _), value in zip(turns, (0.3, 0.0, 1.0), strict=True):
        r = httpx.post(gw.url + "/v1/feedback", json={"call_id": call_id, "value": value}, headers=ADMIN)
        assert r.status_code == 201, r.text
        r = httpx.post(f"{gw.url}/v1/rollouts/{rollout}/finish", json={"status": "completed"}, headers=ADMIN)
        assert r.status_code == 200, r.text
    grouped = turns[0][0]
    group = counterfactuals.group_of(db, grouped)
    assert group is not None and len(group.siblings) == K
    scores = {s.id: counterfactuals.SiblingScore(v) for s, v in zip(group.siblings, (0.0, 0.5, 0.5), strict=True)}
    assert counterfactuals.record_scores(db, grouped, 1.0, scores)
    # The step budget counts answers: the grouped turn is its own and its 3 scored siblings'.
    backlog = store_turns.backlog(db, 0, await_judge=False)
    assert (backlog.ready, backlog.answers) == (3, 6)
    newest_first = [turns[2][0], turns[1][0], grouped]
    for limit, taken in ((1, 1), (5, 2), (6, 3)):
        assert store_turns.ready_turns(db, 0, limit, await_judge=False) == newest_first[:taken], limit
    (data,) = [t for t in load_turns(db, [grouped]) if t.call_id == grouped]
    ((_, tree),) = turn_trees(db, [data], siblings=True)
    generators = {n.generator for n in tree.nodes if n.trainable.any()}
    assert generators <= {grouped, *scores} and generators & set(scores), "the siblings are branches of the tree"
    config = TrainConfig(
        model=str(tiny_model_dir), database_url=gw.settings.database_url, adapter_dir=tmp_path / "a", lr=1e-2
    )
    result = Trainer(config, db).step()
    assert result is not None and result.trained_turns == 3
    with Session(db) as session:
        trained = {t.call_id: t.advantage for t in session.scalars(sa.select(TrainedTurn))}
    expected = group_advantages(
        group_rewards := {grouped: 1.0, **{k: v.value for k, v in scores.items()}}, dict.fromkeys(group_rewards, "g")
    ).advantages[grouped]
    assert trained[grouped] == pytest.approx(expected)
    assert trained[turns[2][0]] == pytest.approx(-trained[turns[1][0]]) and trained[turns[2][0]] > 0
    db.dispose()


# --- judging ----------------------------------------------------------------------------------------------------
def test_the_worker_scores_the_group_without_next_state(gw):
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hello?"}]
    call_id, _, answer = chat(gw, messages)
    settle(gw)
    chat(gw, [*messages, answer, {"role": "user", "content": "And then?"}])  # the first turn's next state
    settle(gw)
    seen: list[TurnView] = []

    def length(turn: TurnView) -> float:
        seen.append(turn)
        return float(len(turn.reply_token_ids))

    db = connect(gw.settings.database_url)
    worker = RewardWorker(
        db,
        tokenizer_decode(gw.state.tokenizer),
        functions=[RewardFunction("length", length)],
        config=WorkerConfig(interval=0.05),
    )
    assert asyncio.run(worker.run_once()) == 1
    group = counterfactuals.group_of(db, call_id)
    assert group is not None and group.judged_at is not None
    assert group.served_reward is not None and all(s.reward is not None for s in group.siblings)
    assert [s.reward for s in group.siblings] == [float(len(s.completion_ids)) for s in group.siblings]
    with_next = [t for t in seen if t.next_state is not None]
    assert [t.call_id for t in with_next] == [call_id], "the served answer's own verdict sees its next state"
    members = [t for t in seen if t.next_state is None]
    assert sorted(t.call_id for t in members) == sorted([call_id, *(s.id for s in group.siblings)])
    assert metric(gw, "clawgate_counterfactuals_judged") == K
    assert asyncio.run(worker.run_once()) == 0, "a group is scored once"
    (row,) = [r for r in turn_rows(db) if r["call_id"] == call_id]
    assert row["group_reward"] == group.served_reward
    assert [s["reward"] for s in row["siblings"]] == [s.reward for s in group.siblings], "`clawgate turns` shows them"
    db.dispose()


def test_the_judge_waits_for_a_group_being_drawn_and_a_draw_past_its_deadline_lets_it_go(gw, monkeypatch):
    drawer = gw.state.service.counterfactuals
    busy = {"live": 1}
    drawer.live = lambda: busy["live"]  # live traffic holds the engine: the first group waits for an idle moment
    monkeypatch.setattr(drawer_module, "IDLE_WAIT_S", 60.0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hello?"}]
    call_id, _, answer = chat(gw, messages)
    chat(gw, [*messages, answer, {"role": "user", "content": "And then?"}])  # the first turn's next state
    gw.flush()
    db = connect(gw.settings.database_url)

    def judgeable() -> set[str]:
        return {c for c, _ in judgements.candidates(db, 10, exclude=set())}

    assert call_id not in judgeable(), "its group is being drawn: the judge waits for the siblings"
    busy["live"] = 0
    settle(gw)
    group = counterfactuals.group_of(db, call_id)
    assert group is not None and len(group.siblings) == K
    assert call_id in judgeable()

    # A draw that outlasts its deadline gives the rest up and lets the judge go on without waiting for it.
    monkeypatch.setattr(drawer_module, "DRAW_DEADLINE_S", 1.5)
    busy["live"] = 1
    late, _, _ = chat(gw, [{"role": "user", "content": "Late?"}])
    settle(gw)
    assert metric(gw, 'clawgate_counterfactuals_dropped_total{reason="late"}') == K
    group = counterfactuals.group_of(db, late)
    assert group is not None and group.siblings == [], "the group says K were asked for and none was drawn"
    with Session(db) as session:
        assert session.get(CounterfactualGroup, late).drawing_until is None, "closed as soon as the draw ended"
    db.dispose()


def test_siblings_recorded_after_their_turns_verdict_are_not_kept(gw):
    from gateway.store.counterfactuals import DrawnSibling, NewGroup, open_group, record_group
    from gateway.store.models import Judgement

    call_id, rollout_id, _ = chat(gw, [{"role": "user", "content": "Hi."}])
    settle(gw)
    db = connect(gw.settings.database_url)
    with Session(db) as session, session.begin():  # a second served turn, opened and judged before its siblings
        session.query(Counterfactual).filter_by(call_id=call_id).delete()
        session.query(CounterfactualGroup).filter_by(call_id=call_id).delete()
        session.add(Judgement(call_id=call_id, rollout_id=rollout_id, status="done"))
    soon = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=30)
    assert open_group(db, call_id, rollout_id, 1, soon)
    assert not open_group(db, call_id, rollout_id, 1, soon), "one group per served call"
    group = NewGroup(
        call_id, rollout_id, 1, None, None, "local", [DrawnSibling("cf-late", [1, 2], [-0.1, -0.2], "stop")]
    )
    assert not record_group(db, group), "the judge already scored the turn alone: nothing would score them"
    with Session(db) as session:
        assert session.get(Counterfactual, "cf-late") is None
    db.dispose()


def test_vllm_gets_the_siblings_priority_and_live_calls_none():
    from gateway.engines.base import GenerationRequest, SamplingParams
    from gateway.engines.vllm_wire import completion_body

    def body(priority: int) -> dict[str, Any]:
        request = GenerationRequest("r", [1, 2], SamplingParams(max_tokens=4), priority=priority)
        return completion_body(request, model="m", max_model_len=0, eos_token_ids=())

    assert body(10)["priority"] == 10
    assert "priority" not in body(0), "a live call's body is as before (vLLM under FCFS refuses other priorities)"


def test_tokens_a_group_shares_get_the_mean_of_its_advantages():
    from gateway.store.training_data import TURN_TREE
    from prefix_tree import CallView, build_tree
    from trainer.batch import pack_trees
    from trainer.credit import CreditTable

    def view(cid: str, completion: list[int], t: float) -> CallView:
        return CallView(cid, [1, 2, 3], completion, [-1.0] * len(completion), started_at=t, status="ok")

    tree = build_tree([view("served", [10, 11, 12], 0.0), view("sib", [10, 13], 1.0)], TURN_TREE)
    credit = {"served": 1.0, "sib": -0.5}
    (batch,) = pack_trees([tree], "tree", 4096)
    adv = CreditTable([tree], [credit]).for_batch(batch)
    got = dict(zip(batch.targets[batch.trainable].tolist(), adv[batch.trainable].tolist(), strict=True))
    assert got == {10: 0.25, 11: 1.0, 12: 1.0, 13: -0.5}, "the shared first token counts once, with the mean"


@pytest.mark.parametrize("secrets", ["exclude", "mask", "drop"])
def test_siblings_are_read_as_their_call_is_parsed_and_scanned(gateway_factory, tiny_tokenizer, secrets):
    """A sibling that calls a tool finishes "tool_calls" with the call parsed; one that holds a credential has its
    spans recorded, redacted for the judge and kept out of the loss as a served call's would be (with ``drop``, its
    tokens and text are gone before anything is stored)."""
    from gateway.credentials.tokens import filler_token
    from gateway.store.training_data import sibling_views
    from prefix_tree import CallView
    from tests.fakes import ScriptedEngine
    from tests.secret_corpus import corpus

    key = next(p for p in corpus(0) if p.name == "openai key")
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(
        engine=engine,
        tokenizer=tiny_tokenizer,
        admin_key="adm",
        policy_follow=False,
        counterfactuals=K,
        secrets=secrets,
        max_tokens=128,
    )
    engine.push("Sure.")
    engine.push('<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>')
    leak = engine.push(f"Set it: {key.line}")
    engine.push("Plain words.")
    call_id, _, message = chat(gw, [{"role": "user", "content": "List the files."}], tools=TOOLS, max_tokens=80)
    assert message["content"] == "Sure." and not message.get("tool_calls")
    settle(gw)
    db = connect(gw.settings.database_url)
    group = counterfactuals.group_of(db, call_id)
    assert group is not None and len(group.siblings) == K
    [tool] = [s for s in group.siblings if s.message["tool_calls"]]
    [plain] = [s for s in group.siblings if s.message["content"] == "Plain words."]
    [secret] = [s for s in group.siblings if s not in (tool, plain)]
    assert tool.finish_reason == "tool_calls" and tool.secret_spans == ()
    assert tool.message["tool_calls"] == [{"name": "read_file", "arguments": json.dumps({"path": "a.txt"})}]
    assert plain.message == {"content": "Plain words.", "reasoning": None, "tool_calls": []}
    assert plain.secret_spans == () and plain.finish_reason == "stop"
    assert secret.secret_spans, "the sibling's credential was found"
    [(kind, start, end)] = secret.secret_spans
    assert kind == "OpenAI Token", kind
    decoded = tiny_tokenizer.decode(secret.completion_ids[start:end].tolist())
    if secrets == "drop":
        filler = filler_token(tiny_tokenizer)
        assert key.value not in tiny_tokenizer.decode(secret.completion_ids.tolist())
        assert set(secret.completion_ids[start:end].tolist()) == {filler} and key.value not in json.dumps(
            secret.message
        )
    else:
        assert secret.completion_ids.tolist() == leak and key.value in decoded
    # Exported (``clawgate export``, the admin's rollout read), a sibling's message goes too, unless its text held
    # a credential: then only with raw.
    exported = {s["id"]: s["message"] for s in counterfactuals.group_record(group)["siblings"]}
    assert exported == {tool.id: tool.message, plain.id: plain.message, secret.id: None}
    [raw] = [s["message"] for s in counterfactuals.group_record(group, raw=True)["siblings"] if s["id"] == secret.id]
    assert raw == secret.message and (key.value in json.dumps(raw)) == (secrets != "drop")
    # The judge reads the group with the credential redacted.
    turn = load_turn(db, call_id, tokenizer_decode(tiny_tokenizer))
    views = load_group(db, turn, tokenizer_decode(tiny_tokenizer))
    assert [v.call_id for v in views] == [call_id, *(s.id for s in group.siblings)]
    [judged] = [v for v in views if v.call_id == secret.id]
    assert key.value not in judged.reply and "Set it:" in judged.reply
    # Scored, the siblings train as calls would: the credential's tokens (mask) or the whole answer stay out.
    counterfactuals.record_scores(db, call_id, 0.5, {s.id: counterfactuals.SiblingScore(0.1) for s in group.siblings})
    group = counterfactuals.group_of(db, call_id)
    served = CallView(call_id, turn_prompt(db, call_id), [1], [0.0], 0.0, "ok")
    untrained = {v.id: v.untrained for v in sibling_views(served, group, secrets)}
    whole = ((0, len(secret.completion_ids)),)
    assert untrained == {tool.id: (), secret.id: ((start, end),) if secrets == "mask" else whole, plain.id: ()}


def test_a_held_prompt_hides_every_siblings_message_and_one_never_scanned_keeps_it():
    message = {"content": "Plain words.", "reasoning": None, "tool_calls": []}
    ids, logprobs = np.array([5, 6], dtype=np.uint32), np.zeros(2, dtype=np.float32)
    siblings = [
        counterfactuals.Sibling(i, ids, logprobs, "stop", None, None, None, message, spans)
        for i, spans in (("unscanned", None), ("clean", ()))
    ]
    group = counterfactuals.Group("served", 2, None, None, siblings)

    def messages(**flags: bool) -> list[Any]:
        return [s["message"] for s in counterfactuals.group_record(group, **flags)["siblings"]]

    assert messages() == [message, message], "secrets off: nothing was scanned, nothing to hide"
    # The served call held a credential a sibling may repeat from the shared prompt, where its own scan cannot see it.
    assert messages(held=True) == messages(held=True, with_tokens=False) == [None, None]
    assert messages(held=True, raw=True) == [message, message]


def turn_prompt(db: sa.Engine, call_id: str) -> list[int]:
    turn = judgements.recorded_turn(db, call_id)
    assert turn is not None
    return turn.prompt.tolist()
