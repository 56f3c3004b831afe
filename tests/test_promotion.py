"""Guarded promotion through HTTP with the local engine: a candidate serves a canary share of new conversations beside
the incumbent, and a simulated user's feedback (which depends on the version that served each turn) gets it rejected
or promoted; conversations stay on one version, gateways agree, a restart resumes the canary, a pin overrides it,
an adapter that cannot load is rejected, and the trainer goes on from the incumbent after a rejection."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from gateway.promotion.routing import in_canary
from gateway.store import db, policy_versions, promotion
from tests.policies import publish

ADMIN = {"Authorization": "Bearer adm"}
GUARDED = {
    "admin_key": "adm",
    "promotion": "guarded",
    "policy_poll_interval": 0.1,
    "canary_check_interval": 0.1,
    "canary_share": 0.5,
    "max_tokens": 3,
}


def wait_for(predicate: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@dataclass
class User:
    """A simulated user: runs two-turn conversations and scores each answer by the version that served it."""

    score: dict[int, float]  # mean feedback per version
    noise: float = 0.1
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    versions: dict[str, list[int]] = field(default_factory=dict)  # rollout id -> version of each turn
    sent: dict[str, list[float]] = field(default_factory=dict)  # rollout id -> when each turn was sent (epoch s)

    def converse(self, gws: list[Any], rollout_id: str | None = None, turns: int = 2) -> str:
        """One conversation; turn i goes to ``gws[i % len(gws)]``. Returns its rollout id."""
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"question {self.rng.random():.6f}"}]
        headers = {} if rollout_id is None else {"X-Rollout-Id": rollout_id}
        for turn in range(turns):
            gw = gws[turn % len(gws)]
            body = {"model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0}
            sent = time.time()
            r = httpx.post(gw.v1 + "/chat/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 200, r.text
            rid, call_id = r.headers["x-clawgate-rollout-id"], r.headers["x-clawgate-call-id"]
            gw.flush()
            version = served_version(gw, rid, call_id)
            self.versions.setdefault(rid, []).append(version)
            self.sent.setdefault(rid, []).append(sent)
            value = self.score[version] + self.rng.gauss(0.0, self.noise)
            f = httpx.post(gw.v1 + "/feedback", json={"call_id": call_id, "value": value}, headers=ADMIN)
            assert f.status_code == 201, f.text
            answer = r.json()["choices"][0]["message"]["content"]
            messages = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "and?"}]
        return rid


def assert_one_arm_per_conversation(user: User, candidate: int, share: float, decided_at: float | None) -> None:
    """Each conversation was served by the arm the hash gives its id, on every turn, as long as the canary ran; a
    turn sent after the decision (or within a second of it: routing follows at the next poll) may already be on
    the incumbent, and a conversation begun after it is not the canary's."""
    for rid, versions in user.versions.items():
        expected = candidate if in_canary(rid, candidate, share) else 0  # v0: the incumbent in these tests
        for version, sent in zip(versions, user.sent[rid], strict=True):
            if decided_at is not None and sent >= decided_at - 1.0:
                continue
            assert version == expected, (rid, versions)
        if decided_at is None:
            assert len(set(versions)) == 1, (rid, versions)


def served_version(gw: Any, rollout_id: str, call_id: str) -> int:
    detail = httpx.get(f"{gw.v1}/rollouts/{rollout_id}?tokens=false", headers=ADMIN, timeout=30).json()
    [call] = [c for c in detail["calls"] if c["id"] == call_id]
    return int(call["policy_version"])


def stage(url: str, version: int) -> str | None:
    engine = db.connect(url)
    try:
        return policy_versions.stage_of(engine, version)
    finally:
        engine.dispose()


def decisions(url: str, version: int) -> list[Any]:
    engine = db.connect(url)
    try:
        return promotion.decisions(engine, version=version)
    finally:
        engine.dispose()


def converse_until_decided(user: User, gw: Any, version: int, conversations: int = 60) -> Any:
    """Conversations until ``version``'s canary is decided; its stage and its one decision row then agree."""
    url = gw.settings.database_url
    for _ in range(conversations):
        user.converse([gw])
        if stage(url, version) != "canary":
            break
    [decision] = [d for d in decisions(url, version) if d.outcome in ("promoted", "rejected")]
    assert stage(url, version) == decision.outcome
    return decision


def start_canary(gateway_factory: Any, tiny_model_dir: Path, tmp_path: Path, **overrides: Any) -> Any:
    """A guarded gateway serving v0 (the first version: promoted at once) with v1 (non-zero weights) in its canary."""
    adapters = tmp_path / "adapters"
    gw = gateway_factory(adapter_dir=adapters, **{**GUARDED, **overrides})
    url = gw.settings.database_url
    publish(url, adapters, tiny_model_dir, 0)
    wait_for(lambda: gw.state.service.policy_version == 0, "v0 served")
    assert stage(url, 0) == "promoted", "the first version has nothing to be compared with"
    publish(url, adapters, tiny_model_dir, 1, scale=0.5)
    # Published as a candidate under guarded promotion (the gateway may already have started its canary).
    assert stage(url, 1) in ("candidate", "canary")
    wait_for(lambda: gw.state.service.routing.candidate is not None, "the canary to start")
    assert gw.state.service.policy_version == 0, "the incumbent still serves everything else"
    return gw


def test_a_candidate_users_score_lower_is_rejected_and_its_exposure_stays_within_the_share(
    gateway_factory, tiny_model_dir, tmp_path
):
    gw = start_canary(gateway_factory, tiny_model_dir, tmp_path, canary_min_turns=12, promotion_margin=0.1)
    url = gw.settings.database_url
    user = User(score={0: 1.0, 1: 0.5}, noise=0.2)
    decision = converse_until_decided(user, gw, 1)
    assert decision.outcome == "rejected"
    assert decision.reason.startswith("evidence: the candidate is worse"), decision.reason
    ev = decision.evidence
    assert ev["candidate"]["n"] >= 12 and ev["incumbent"]["n"] >= 12 and ev["upper"] < 0
    assert ev["candidate"]["mean"] < ev["incumbent"]["mean"] and ev["margin"] == 0.1

    # Every turn of a conversation was served by one version, and the arm is the hash's answer for its id.
    assert_one_arm_per_conversation(user, 1, 0.5, decision.created_at.timestamp())
    exposed = sum(1 for v in user.versions.values() if v[0] == 1) / len(user.versions)
    n = len(user.versions)
    assert abs(exposed - 0.5) <= 3 * (0.25 / n) ** 0.5 + 1 / n, (exposed, n)

    # After the rejection everything goes to the incumbent, and the decision is final: late feedback for the
    # rejected arm is recorded but changes nothing.
    wait_for(lambda: gw.state.service.routing.candidate is None, "the candidate to leave the routing")
    fresh = User(score={0: 1.0, 1: 0.5}, rng=random.Random(1))
    for _ in range(4):
        fresh.converse([gw])
    assert all(v == [0, 0] for v in fresh.versions.values())
    rejected_call = next(iter(rid for rid, v in user.versions.items() if v[0] == 1))
    detail = httpx.get(f"{gw.v1}/rollouts/{rejected_call}?tokens=false", headers=ADMIN).json()
    late = httpx.post(gw.v1 + "/feedback", json={"call_id": detail["calls"][0]["id"], "value": 5.0}, headers=ADMIN)
    assert late.status_code == 201
    time.sleep(0.3)
    assert stage(url, 1) == "rejected" and len(decisions(url, 1)) == 2  # canary started, rejected

    health = httpx.get(gw.url + "/health").json()["policy"]["promotion"]
    assert health["mode"] == "guarded" and health["incumbent"] == 0 and health["candidate"] is None
    policy = httpx.get(gw.v1 + "/policy", headers=ADMIN).json()
    assert [(v["version"], v["stage"]) for v in policy["versions"]] == [(0, "promoted"), (1, "rejected")]
    assert [d["outcome"] for d in policy["promotion"]["decisions"]] == ["rejected", "canary", "promoted"]


def test_a_candidate_scored_the_same_is_promoted_and_then_serves_new_conversations(
    gateway_factory, tiny_model_dir, tmp_path
):
    gw = start_canary(gateway_factory, tiny_model_dir, tmp_path, canary_min_turns=10, promotion_margin=0.3)
    user = User(score={0: 0.5, 1: 0.5}, noise=0.1)
    decision = converse_until_decided(user, gw, 1)
    assert decision.outcome == "promoted"
    assert decision.reason.startswith("evidence: not worse"), decision.reason
    assert decision.evidence["lower"] > -0.3 and decision.incumbent_version == 0
    wait_for(lambda: gw.state.service.policy_version == 1, "the promoted version to become the incumbent")
    fresh = User(score={0: 0.5, 1: 0.5}, rng=random.Random(2))
    for _ in range(4):
        fresh.converse([gw])
    assert all(v == [1, 1] for v in fresh.versions.values())


def test_two_gateways_agree_on_every_assignment_and_a_restart_resumes_the_canary(
    gateway_factory, tiny_model_dir, tmp_path
):
    # No decision while the two gateways run (the minimum sample is out of reach).
    a = start_canary(gateway_factory, tiny_model_dir, tmp_path, canary_min_turns=10_000)
    url = a.settings.database_url
    b = gateway_factory(adapter_dir=tmp_path / "adapters", database_url=url, **{**GUARDED, "canary_min_turns": 10_000})
    wait_for(lambda: b.state.service.routing.candidate is not None, "the second gateway to route the canary")
    user = User(score={0: 1.0, 1: 0.0}, noise=0.05)
    for i in range(16):
        # Named conversations, their turns alternating between the gateways (as a load balancer may send them).
        user.converse([a, b] if i % 2 else [b, a], rollout_id=f"conv-{i}")
    for rid, versions in user.versions.items():
        assert len(set(versions)) == 1 and versions[0] == (1 if in_canary(rid, 1, 0.5) else 0), (rid, versions)
    assert {v[0] for v in user.versions.values()} == {0, 1}, "both arms served"
    engine = db.connect(url)
    try:
        started = promotion.read_state(engine).canary
    finally:
        engine.dispose()
    assert started is not None and started.version == 1 and started.canary_share == 0.5

    # A restart: the gateways go, a new one (with a reachable minimum sample) comes up on the same database. It
    # resumes the same canary (same start, same share, the evidence gathered before) and decides on that evidence
    # alone, without new traffic.
    for gw in (a, b):
        gw.server.should_exit = True
        gw._thread.join(timeout=60)
    c = gateway_factory(adapter_dir=tmp_path / "adapters", database_url=url, **{**GUARDED, "canary_min_turns": 8})
    wait_for(lambda: stage(url, 1) == "rejected", "the restarted gateway to decide on the stored evidence")
    decision = next(d for d in decisions(url, 1) if d.outcome == "rejected")
    assert decision.evidence["candidate"]["n"] >= 8 and decision.decided_by == c.state.policy.gateway_id
    canary_start = next(d for d in decisions(url, 1) if d.outcome == "canary")
    assert canary_start.created_at == started.stage_at, "one canary, started once"


def test_a_pin_overrides_the_canary_and_nothing_is_decided_while_it_holds(gateway_factory, tiny_model_dir, tmp_path):
    gw = start_canary(gateway_factory, tiny_model_dir, tmp_path, canary_min_turns=4, canary_share=1.0)
    url = gw.settings.database_url
    r = httpx.post(gw.v1 + "/policy/pin", json={"version": 0}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["canary"] is None
    user = User(score={0: 1.0, 1: 0.0})
    for _ in range(6):  # every conversation would go to the candidate (share 1.0) but for the pin
        user.converse([gw])
    assert all(v == [0, 0] for v in user.versions.values())
    assert stage(url, 1) == "canary", "no decision while pinned"
    httpx.post(gw.v1 + "/policy/unpin", headers=ADMIN).raise_for_status()
    wait_for(lambda: gw.state.service.routing.candidate is not None, "the canary to resume")
    user.converse([gw])
    assert list(user.versions.values())[-1] == [1, 1]


def test_a_candidate_whose_adapter_cannot_load_is_rejected_with_its_reason(gateway_factory, tiny_model_dir, tmp_path):
    adapters = tmp_path / "adapters"
    gw = gateway_factory(adapter_dir=adapters, **GUARDED)
    url = gw.settings.database_url
    publish(url, adapters, tiny_model_dir, 0)
    wait_for(lambda: gw.state.service.policy_version == 0, "v0 served")
    publish(url, adapters, tiny_model_dir, 1, scale=0.5, broken=True)
    wait_for(lambda: stage(url, 1) == "rejected", "the broken candidate to be rejected")
    [decision] = [d for d in decisions(url, 1) if d.outcome == "rejected"]
    assert decision.reason.startswith("load failed"), decision.reason
    user = User(score={0: 1.0, 1: 0.0})
    for _ in range(3):
        user.converse([gw])
    assert all(v == [0, 0] for v in user.versions.values()), "the incumbent serves on; no call failed"


def test_operator_promote_and_reject_and_cli_status(gateway_factory, tiny_model_dir, tmp_path, capsys):
    from clawgate.cli import main

    gw = start_canary(gateway_factory, tiny_model_dir, tmp_path, canary_min_turns=10_000)
    url = gw.settings.database_url
    User(score={0: 1.0, 1: 0.0}).converse([gw])
    assert main(["policy", "status", "--database-url", url]) == 0
    out = capsys.readouterr().out
    assert "promotion: guarded" in out and "incumbent: policy@v0" in out
    assert "candidate: policy@v1 (canary, 50% of new conversations)" in out and "verdict now: wait" in out

    assert main(["policy", "promote", "5", "--database-url", url]) == 2
    assert "policy@v5 is not being evaluated, a candidate or in a canary" in capsys.readouterr().err
    r = httpx.post(gw.v1 + "/policy/reject", json={"version": 0}, headers=ADMIN)
    assert r.status_code == 409 and r.json()["error"]["param"] == "version"
    assert main(["policy", "reject", "--database-url", url]) == 0
    assert "policy@v1 rejected" in capsys.readouterr().out
    assert stage(url, 1) == "rejected"
    wait_for(lambda: gw.state.service.routing.candidate is None, "the rejected candidate to leave the routing")

    publish(url, tmp_path / "adapters", tiny_model_dir, 2, scale=0.5)
    wait_for(lambda: gw.state.service.routing.candidate is not None, "v2's canary")
    r = httpx.post(gw.v1 + "/policy/promote", json={}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["served"]["version"] == 2, "promoted by hand: the incumbent at once on this gateway"
    assert main(["policy", "status", "--json", "--database-url", url]) == 0
    status = __import__("json").loads(capsys.readouterr().out)
    assert status["incumbent"] == 2 and status["candidate"] is None
    assert [(d["version"], d["outcome"], d["reason"]) for d in status["decisions"][:2]] == [
        (2, "promoted", "operator"),
        (2, "canary", "canary started"),
    ]


def test_after_a_rejection_the_trainer_goes_on_from_the_incumbents_weights(tmp_path, tiny_model_dir):
    from trainer import lora
    from trainer.config import TrainConfig
    from trainer.loop import promotion_gate
    from trainer.step import Trainer

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    db.upgrade(url)
    engine = db.connect(url)
    promotion.set_mode(engine, "guarded")
    adapters = tmp_path / "adapters"
    trainer = Trainer(TrainConfig(database_url=url, model=str(tiny_model_dir), adapter_dir=adapters, lr=0.0), engine)
    assert policy_versions.stage_of(engine, 0) == "promoted"
    # A candidate with other weights, held by the trainer as if its last step had produced it.
    publish(url, adapters, tiny_model_dir, 1, scale=0.5)
    trainer.restore(1)
    trainer.version = 1
    v0 = load_file(str(lora.version_path(adapters, 0) / "adapter_model.safetensors"))
    v1 = load_file(str(lora.version_path(adapters, 1) / "adapter_model.safetensors"))
    assert any(not torch.equal(v0[k], v1[k]) for k in v0)

    assert promotion_gate(trainer) == (False, "waiting: policy@v1 is a candidate")
    promotion.decide_by_operator(engine, "reject", 1)
    assert promotion_gate(trainer) == (True, "")
    assert trainer.parent == 0
    held = {k: v.detach().cpu() for k, v in lora.lora_parameters(trainer.policy).items()}
    for name, tensor in held.items():
        stored = next(v for k, v in v0.items() if k.replace(".weight", "") in name.replace(".default", ""))
        assert torch.equal(tensor, stored), name

    # The next published version names the incumbent as its parent (and, at lr 0, holds exactly its weights).
    result = trainer._publish(
        lora.Manifest(version=2, base_model=str(tiny_model_dir), parent_version=trainer.parent),
        step=None,
        consumed={},
        metrics={},
    )
    assert result == 0
    v2 = load_file(str(lora.version_path(adapters, 2) / "adapter_model.safetensors"))
    assert all(torch.equal(v2[k], v0[k]) for k in v0)

    # A trainer restarted now resumes from the newest version not rejected.
    promotion.decide_by_operator(engine, "reject", 2)
    again = Trainer(TrainConfig(database_url=url, model=str(tiny_model_dir), adapter_dir=adapters, lr=0.0), engine)
    assert (again.version, again.parent) == (2, 0)
    engine.dispose()


@pytest.mark.parametrize("mode", ["immediate", None])
def test_immediate_promotion_serves_every_version_at_once(gateway_factory, tiny_model_dir, tmp_path, mode):
    adapters = tmp_path / "adapters"
    gw = gateway_factory(adapter_dir=adapters, admin_key="adm", policy_poll_interval=0.1, promotion=mode)
    url = gw.settings.database_url
    for v in (0, 1):
        publish(url, adapters, tiny_model_dir, v, scale=0.5 * v)
        assert stage(url, v) == "promoted"
    wait_for(lambda: gw.state.service.policy_version == 1, "v1 served to all traffic")
    assert gw.state.service.routing.candidate is None
    assert httpx.get(gw.url + "/health").json()["policy"]["promotion"]["mode"] == "immediate"
