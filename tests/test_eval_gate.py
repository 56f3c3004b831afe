"""The evaluation gate of guarded promotion, through HTTP with the local engine and the real task runner: a version
published ``evaluating`` serves only the rollouts pinned to it; the gate runs a held-out suite on it and on the
incumbent and rejects a version that scores lower (no conversation ever reaches it) or lets one that does not
start its canary. The suite's task can only be passed by the incumbent's weights: its verifier compares the
agent's answer with the incumbent's greedy answer, measured first."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from gateway.store import db, policy_versions, promotion
from runner.harnesses import Detection, Harness, HarnessContext, Invocation
from tests.policies import publish
from tests.runner_support import make_tasks, require_bwrap
from trainer import eval_gate
from trainer.eval_gate import EvalGate, GateConfig

ADMIN = {"Authorization": "Bearer adm"}
PROMPT = "Say something."
MAX_TOKENS = 4
SCRIPT = textwrap.dedent(
    f"""
    import json, os, sys, urllib.request
    base, model = sys.argv[1], sys.argv[2]
    body = {{"model": model, "prompt": {PROMPT!r}, "max_tokens": {MAX_TOKENS}, "temperature": 0}}
    request = urllib.request.Request(base + "/completions", json.dumps(body).encode(), {{
        "Content-Type": "application/json", "Authorization": "Bearer " + os.environ["ANSWER_KEY"]}})
    answer = json.load(urllib.request.urlopen(request, timeout=120))["choices"][0]["text"]
    open("answer.txt", "w").write(answer)
    """
)


class AnswerOnce(Harness):
    """A one-call agent: asks the model once and leaves its answer in the workspace for the verifier."""

    name: ClassVar[str] = "answer-once"

    def detect(self) -> Detection:
        return Detection(self.name, True, sys.executable, "test")

    def prepare(self, ctx: HarnessContext) -> Invocation:
        script = ctx.home / "answer.py"
        script.write_text(SCRIPT, encoding="utf-8")
        return Invocation([sys.executable, str(script), ctx.base_url, ctx.model], {"ANSWER_KEY": ctx.api_key})


def wait_for(predicate: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def answer(gw: Any) -> str:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(gw.v1 + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    gw.flush()
    return str(r.json()["choices"][0]["text"])


def versions_served(gw: Any, **filters: Any) -> dict[str, list[int]]:
    """rollout id -> the version of each of its calls, for the rollouts the filters select."""
    listed = httpx.get(f"{gw.v1}/rollouts", params={"limit": 200, **filters}, headers=ADMIN, timeout=30).json()
    out = {}
    for r in listed["data"]:
        detail = httpx.get(f"{gw.v1}/rollouts/{r['id']}?tokens=false", headers=ADMIN, timeout=30).json()
        out[r["id"]] = [c["policy_version"] for c in detail["calls"]]
    return out


@pytest.fixture
def gated(gateway_factory: Any, tiny_model_dir: Path, tmp_path: Path) -> Any:
    """A guarded gateway serving v0, and a gate whose one task passes only with v0's greedy answer."""
    require_bwrap()
    adapters = tmp_path / "adapters"
    gw = gateway_factory(
        adapter_dir=adapters,
        admin_key="adm",
        promotion="guarded",
        policy_poll_interval=0.1,
        canary_check_interval=0.1,
        canary_share=0.5,
        max_tokens=MAX_TOKENS,
    )
    publish(gw.settings.database_url, adapters, tiny_model_dir, 0)
    wait_for(lambda: gw.state.service.policy_version == 0, "v0 served")
    expected = answer(gw)
    task = {
        "id": "say-what-v0-says",
        "instruction": PROMPT,
        "files": {"expected.txt": expected},
        "verifier": 'test "$(cat answer.txt)" = "$(cat expected.txt)"',
    }
    gate = EvalGate(
        GateConfig(make_tasks(tmp_path, task), [AnswerOnce()], gw.url, "adm", n=2, margin=0.05, sandbox="bwrap")
    )
    return gw, gate, adapters, expected


def test_a_version_that_regresses_on_the_suite_is_rejected_before_any_traffic(gated, tiny_model_dir):
    gw, gate, adapters, expected = gated
    url = gw.settings.database_url
    publish(url, adapters, tiny_model_dir, 1, scale=0.5, gated=True)
    engine = db.connect(url)
    try:
        assert policy_versions.stage_of(engine, 1) == "evaluating"
        # Loaded for its pinned rollouts, routed to by no conversation: no canary starts while it is evaluated.
        wait_for(lambda: 1 in gw.state.service.routing.kept, "v1 loaded for evaluation")
        health = httpx.get(gw.url + "/health").json()["policy"]["promotion"]
        assert (health["evaluating"], health["stage"], health["serving_candidate"]) == (1, "evaluating", False)
        for _ in range(6):
            assert answer(gw) == expected
        assert policy_versions.stage_of(engine, 1) == "evaluating"
        assert all(v == [0] for v in versions_served(gw, eval="false").values())

        assert eval_gate.decide(engine, gate, 1, 0) == "rejected"
        [decision] = [d for d in promotion.decisions(engine, version=1) if d.outcome == "rejected"]
        e = decision.evidence
        assert e["candidate"]["n"] == e["incumbent"]["n"] == 2
        assert (e["candidate"]["mean"], e["incumbent"]["mean"], e["margin"]) == (0.0, 1.0, 0.05)
        assert decision.reason.startswith("evaluation gate failed: mean reward 0.000 vs 1.000 (n=2/2")
    finally:
        engine.dispose()
    # Every evaluation rollout was served, on every call, by the version it was pinned to, and nothing else was.
    evaluated = versions_served(gw, eval="true")
    assert sorted(v for calls in evaluated.values() for v in set(calls)) == [0, 0, 1, 1]
    assert all(len(set(calls)) == 1 for calls in evaluated.values())
    assert all(v == [0] for v in versions_served(gw, eval="false").values())
    wait_for(lambda: 1 not in gw.state.service.routing.kept, "the rejected version out of the routing")
    # A rejected version can no longer be evaluated by hand either.
    r = httpx.post(gw.v1 + "/rollouts", json={"eval": True, "policy_version": 1}, headers=ADMIN)
    assert r.status_code == 409 and r.json()["error"]["type"] == "conflict_error", r.text
    assert r.json()["error"]["param"] == "policy_version"
    r = httpx.post(gw.v1 + "/rollouts", json={"policy_version": 7}, headers=ADMIN)
    assert r.status_code == 404 and "never published" in r.json()["error"]["message"], r.text


def test_a_version_that_does_not_regress_goes_on_to_its_canary(gated, tiny_model_dir):
    gw, gate, adapters, _ = gated
    url = gw.settings.database_url
    # The incumbent's own weights again: the suite scores it the same.
    publish(url, adapters, tiny_model_dir, 1, scale=0.0, gated=True)
    engine = db.connect(url)
    try:
        assert eval_gate.decide(engine, gate, 1, 0) == "candidate"
        [passed] = [d for d in promotion.decisions(engine, version=1) if d.outcome == "candidate"]
        assert passed.reason.startswith("evaluation gate passed: mean reward 1.000 vs 1.000 (n=2/2")
        # The gateway then starts its canary as for any candidate.
        wait_for(lambda: policy_versions.stage_of(engine, 1) == "canary", "the canary to start")
        wait_for(lambda: gw.state.service.routing.candidate is not None, "the canary routed")
    finally:
        engine.dispose()


def test_a_gate_that_cannot_measure_says_why_and_leaves_the_version_evaluating(gated, tiny_model_dir, tmp_path):
    gw, _gate, adapters, _ = gated
    url = gw.settings.database_url
    publish(url, adapters, tiny_model_dir, 1, scale=0.5, gated=True)
    (tmp_path / "broken").mkdir()
    broken = make_tasks(tmp_path / "broken", {"id": "t", "instruction": PROMPT, "verifier": "no-such-command"})
    blind = EvalGate(GateConfig(broken, [AnswerOnce()], gw.url, "adm", sandbox="bwrap"))
    engine = db.connect(url)
    try:
        with pytest.raises(eval_gate.GateError, match="no evaluation rollout of policy@v1 was scored: verifier"):
            eval_gate.decide(engine, blind, 1, 0)
        assert policy_versions.stage_of(engine, 1) == "evaluating"
        # Without a gate (a trainer restarted without one) the version goes on, and the decision says why.
        assert eval_gate.decide(engine, None, 1, 0) == "candidate"
        [d] = [d for d in promotion.decisions(engine, version=1) if d.outcome == "candidate"]
        assert d.reason == "no evaluation gate is configured"
    finally:
        engine.dispose()


def test_a_tenant_s_own_version_is_evaluated_on_rollouts_of_its_tenant(gated, tiny_model_dir):
    """acme's first version of its own, published evaluating, is loaded for acme's rollouts pinned to it; the gate
    runs the suite as acme's rollouts on it and on the shared incumbent it is compared with, and rejects it."""
    from gateway.store import lineages

    gw, gate, adapters, _ = gated
    url = gw.settings.database_url
    engine = db.connect(url)
    try:
        lineages.set_own_policy(engine, "acme", True)
        publish(url, adapters, tiny_model_dir, 1, scale=0.5, gated=True, lineage="acme")
        assert policy_versions.stage_of(engine, 1) == "evaluating"
        assert promotion.read_state(engine, "acme").compared_with() == 0

        def acme_evaluating() -> object:
            summary = httpx.get(gw.url + "/health").json()["policy"]["promotion"]
            return (summary.get("lineages") or {}).get("acme", {}).get("evaluating")

        wait_for(lambda: acme_evaluating() == 1, "acme's v1 loaded for evaluation")
        # Another tenant's rollout cannot be pinned to it: it reads as a version never published.
        for tenant in ("beta", None):
            body = {"policy_version": 1, **({"tenant": tenant} if tenant else {})}
            r = httpx.post(gw.v1 + "/rollouts", json=body, headers=ADMIN)
            assert r.status_code == 404 and "never published" in r.json()["error"]["message"], r.text
        assert eval_gate.decide(engine, gate, 1, 0, "acme") == "rejected"
    finally:
        engine.dispose()
    evaluated = versions_served(gw, eval="true", tenant="acme")
    assert sorted(v for calls in evaluated.values() for v in set(calls)) == [0, 0, 1, 1]
    assert versions_served(gw, eval="true", tenant="default") == {}


def test_the_trainer_loop_runs_the_gate_and_goes_on_from_the_incumbent(gated, tiny_model_dir):
    from trainer.config import TrainConfig
    from trainer.loop import promotion_gate
    from trainer.step import Trainer

    gw, gate, adapters, _ = gated
    url = gw.settings.database_url
    engine = db.connect(url)
    try:
        config = TrainConfig(database_url=url, model=str(tiny_model_dir), adapter_dir=adapters, lr=0.0, eval_gate=True)
        trainer = Trainer(config, engine)
        # As if its last step had produced v1: published "evaluating" because the trainer has a gate.
        publish(url, adapters, tiny_model_dir, 1, scale=0.5, gated=config.eval_gate)
        trainer.restore(1)
        trainer.version = 1
        assert promotion_gate(trainer, gate) == (True, "")
        assert policy_versions.stage_of(engine, 1) == "rejected"
        assert trainer.parent == 0
    finally:
        engine.dispose()


def test_train_refuses_an_unusable_gate(tmp_path, capsys):
    from clawgate.cli import main as clawgate

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    code = clawgate(["train", "--database-url", url, "--eval-tasks", str(tmp_path / "missing.jsonl")])
    assert code == 2
    assert "missing.jsonl" in capsys.readouterr().err
    (tmp_path / "t.jsonl").write_text('{"id": "t", "instruction": "x", "verifier": "true"}\n')
    tasks = str(tmp_path / "t.jsonl")
    code = clawgate(["train", "--database-url", url, "--eval-tasks", tasks, "--eval-harness", "nope"])
    assert code == 2
    assert "unknown harness 'nope'" in capsys.readouterr().err
