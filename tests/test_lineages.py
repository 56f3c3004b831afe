"""A policy per tenant: ``acme`` gets a lineage of its own, trained only on acme's turns and served only to acme's
keys; ``beta`` and the environment's keys (the default tenant) share the shared lineage. One trainer takes the
lineages in turn. What each version was trained on is read back from ``trained_turns`` (the step's recorded batch
contents), what served each call from the calls' own records.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import sqlalchemy as sa
import torch
from sqlalchemy.orm import Session

from gateway.store import lineages, policy_control, policy_versions
from gateway.store.db import connect
from gateway.store.models import Call, PolicyVersion, Rollout, TrainedTurn
from gateway.store.policy_versions import SHARED
from tests.test_tenants import ADMIN, CLIENT, SECRET, bearer, new_key
from trainer import loop
from trainer.config import TrainConfig, Trigger
from trainer.plan import StepResult, describe
from trainer.step import Trainer


def chat(gw: Any, key: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 1.0}
    r = httpx.post(f"{gw.v1}/chat/completions", json=body, headers=bearer(key), timeout=60)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    message["content"] = message.get("content") or ""
    return {"call": r.headers["x-clawgate-call-id"], "msg": message}


def conversation(gw: Any, key: str, i: int) -> str:
    """Two turns; the first (which has its next state) is returned, rewarded ``i`` by the admin."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Question {i}?"}]
    first = chat(gw, key, messages)
    chat(gw, key, [*messages, first["msg"], {"role": "user", "content": f"Follow-up {i}."}])
    r = httpx.post(f"{gw.v1}/feedback", json={"call_id": first["call"], "value": float(i)}, headers=bearer(ADMIN))
    assert r.status_code == 201, r.text
    return str(first["call"])


def train_config(model: Any, url: str, tmp_path: Any, **kw: Any) -> TrainConfig:
    """Two steps at most, each as soon as 3 turns of a lineage are ready."""
    trigger = Trigger(min_turns=3, interval=0.1, max_steps=2)
    return TrainConfig(
        model=str(model), database_url=url, adapter_dir=tmp_path / "adapters", lr=1e-2, group_wait=0.0,
        trigger=trigger, **kw,
    )  # fmt: skip


def served_version(url: str, call_id: str) -> int | None:
    db = connect(url)
    try:
        with Session(db) as session:
            return session.scalar(sa.select(Call.policy_version).where(Call.id == call_id))
    finally:
        db.dispose()


def wait_served(gw: Any, key: str, version: int, deadline: float = 30.0) -> str:
    """A new conversation's first call with ``key`` once ``version`` serves it (the follower polls)."""
    end = time.monotonic() + deadline
    while True:
        call = chat(gw, key, [{"role": "user", "content": "Which policy?"}])["call"]
        if served_version(gw.settings.database_url, call) == version:
            return str(call)
        assert time.monotonic() < end, f"policy@v{version} was not served to this key within {deadline}s"
        time.sleep(0.2)


def test_a_tenant_lineage_trains_on_and_serves_only_its_own_tenant(
    gateway_factory, tiny_model_dir, tmp_path, capsys, monkeypatch
):
    from clawgate.cli import main

    gw = gateway_factory(admin_key=ADMIN, api_keys=CLIENT, key_secret=SECRET, policy_poll_interval=0.2)
    url = gw.settings.database_url
    acme = new_key(gw, ADMIN, tenant="acme", role="user")["key"]
    beta = new_key(gw, ADMIN, tenant="beta", role="user")["key"]
    monkeypatch.setenv("CLAWGATE_KEY_SECRET", SECRET)
    assert main(["keys", "policy", "--tenant", "acme", "own", "--database-url", url]) == 0
    assert "a policy of its own" in capsys.readouterr().out
    assert main(["keys", "policy", "--tenant", "Not A Name", "own", "--database-url", url]) == 2
    assert "invalid tenant name" in capsys.readouterr().err

    acme_turns = {conversation(gw, acme, i) for i in range(3)}
    beta_turns = {conversation(gw, beta, i) for i in range(3)}
    db = connect(url)
    try:
        config = train_config(tiny_model_dir, url, tmp_path, max_staleness=8)
        trainer = Trainer(config, db)  # publishes v0, the shared lineage's first version
        results: list[StepResult] = []
        assert loop.run(trainer, stop=threading.Event(), on_step=results.append) == 2
        assert [r.lineage for r in results] == [SHARED, "acme"]
        assert describe(results[1]).startswith(f"step {results[1].step_id} -> policy@v2 (tenant acme)  ")
        with Session(db) as session:
            rows = {v.version: v for v in session.scalars(sa.select(PolicyVersion))}
            batches: dict[int, set[str]] = {}
            for turn in session.scalars(sa.select(TrainedTurn)):
                batches.setdefault(turn.version, set()).add(turn.call_id)
            tenants = dict(session.execute(sa.select(Call.id, Rollout.tenant).join(Rollout)).all())
        # In turn: the shared lineage first (beta's turns), then acme's, from the shared policy's weights then.
        assert [(v, rows[v].lineage) for v in sorted(rows)] == [(0, SHARED), (1, SHARED), (2, "acme")]
        assert rows[2].parent_version == 1 and rows[2].adapter_name == "policy@v2"
        assert batches[1] == beta_turns and batches[2] == acme_turns
        assert {tenants[c] for c in batches[2]} == {"acme"}, "only acme's traffic trains acme's policy"
        assert "acme" not in {tenants[c] for c in batches[1]}, "acme's traffic never trains the shared policy"
        assert policy_versions.lineage_versions(db, "acme") == [2]

        # Served: acme's keys get v2, beta's and the environment's keys the shared v1, never acme's.
        wait_served(gw, acme, 2)
        wait_served(gw, beta, 1)
        for key in (beta, CLIENT):
            for _ in range(3):
                call = chat(gw, key, [{"role": "user", "content": "And now?"}])["call"]
                assert served_version(url, call) == 1

        # The policy API: each version's lineage, each tenant lineage's state. A version names its lineage: pinning
        # acme's v2 pins acme's lineage only; a shared version cannot be pinned for acme.
        policy = httpx.get(f"{gw.v1}/policy", headers=bearer(ADMIN), timeout=30).json()
        assert {v["version"]: v["lineage"] for v in policy["versions"]} == {0: SHARED, 1: SHARED, 2: "acme"}
        assert policy["lineages"]["acme"]["served"]["version"] == 2
        r = httpx.post(f"{gw.v1}/policy/pin", json={"version": 2}, headers=bearer(ADMIN), timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["lineages"]["acme"]["pinned_version"] == 2 and r.json()["pinned_version"] is None
        assert main(["policy", "list", "--database-url", url]) == 0
        listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("policy@v2 ")]
        assert listed and " acme " in listed[0] and listed[0].endswith(" current pinned")
        # The console's versions page: acme's version flagged, pinned in its lineage, unpinned from its row.
        with httpx.Client(base_url=gw.url, timeout=30) as console:
            login = console.post("/dashboard/login", data={"key": ADMIN, "next": "/dashboard/versions"})
            assert login.status_code == 303
            row = console.get("/dashboard/versions").text.split('data-version="2"')[1].split("</tr>")[0]
            assert ">acme</span>" in row and '<span class="flag">pinned</span>' in row and 'class="unpin"' in row
            done = console.post("/dashboard/policy/unpin", data={"version": "2"})
            assert done.status_code == 303 and done.headers["location"] == "/dashboard/versions"
        assert policy_control.read(db, "acme").pinned_version is None
        r = httpx.post(f"{gw.v1}/policy/pin", json={"version": 2}, headers=bearer(ADMIN), timeout=30)
        r = httpx.post(f"{gw.v1}/policy/unpin", json={"tenant": "acme"}, headers=bearer(ADMIN), timeout=30)
        assert r.status_code == 200 and r.json()["lineages"]["acme"]["pinned_version"] is None
        r = httpx.post(f"{gw.v1}/policy/unpin", json={"tenant": "Not A Name"}, headers=bearer(ADMIN), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tenant"
        assert main(["policy", "pin", "1", "--tenant", "acme", "--database-url", url]) == 2
        assert "not a version of tenant acme's policy" in capsys.readouterr().err

        metrics = httpx.get(f"{gw.url}/metrics", timeout=30).text
        assert 'clawgate_lineage_policy_version{tenant="acme"} 2.0' in metrics

        # A rollback in acme's lineage: the trainer republishes v2's weights as acme's v3 and releases acme's pin.
        assert main(["policy", "rollback", "2", "--database-url", url]) == 0
        assert policy_control.read(db, "acme").pinned_version == 2 and policy_control.read(db).pinned_version is None
        assert loop.one_pass(trainer, None, None)[0] is None  # nothing to train: the rollback alone
        with Session(db) as session:
            v3 = session.get(PolicyVersion, 3)
        assert v3 is not None and (v3.lineage, v3.rolled_back_from, v3.stage) == ("acme", 2, "promoted")
        after = policy_control.read(db, "acme")
        assert after.pinned_version is None and after.rollback_to is None

        # A restarted trainer reopens acme's lineage from its newest version (the weights the first one holds).
        assert trainer.lineage == "acme"
        again = Trainer(config, db)
        again.activate("acme")
        assert again.parent == 3
        mine = {n: p for n, p in trainer.policy.named_parameters() if p.requires_grad}
        theirs = {n: p for n, p in again.policy.named_parameters() if p.requires_grad}
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)
        again.activate(SHARED)
        assert again.parent == 1

        # Back on the shared policy: acme's new conversations are served v1 again.
        assert main(["keys", "policy", "--tenant", "acme", "shared", "--database-url", url]) == 0
        assert "shared policy again" in capsys.readouterr().out
        assert lineages.own_policies(db) == []
        wait_served(gw, acme, 1)
    finally:
        db.dispose()


def test_a_tenant_s_first_version_earns_its_tenant_s_traffic_against_the_shared_incumbent(
    gateway_factory, tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """Guarded promotion per lineage: acme's first version is a candidate compared with the shared incumbent, on
    acme's traffic only; the shared lineage's own candidate is another canary, decided apart."""
    import datetime as dt

    from clawgate.cli import main
    from gateway.store import promotion

    gw = gateway_factory(
        admin_key=ADMIN,
        api_keys=CLIENT,
        key_secret=SECRET,
        policy_poll_interval=0.2,
        promotion="guarded",
        canary_share=1.0,
        canary_check_interval=0.2,
    )
    url = gw.settings.database_url
    acme = new_key(gw, ADMIN, tenant="acme", role="user")["key"]
    beta = new_key(gw, ADMIN, tenant="beta", role="user")["key"]
    monkeypatch.setenv("CLAWGATE_KEY_SECRET", SECRET)
    assert main(["keys", "policy", "--tenant", "acme", "own", "--database-url", url]) == 0
    capsys.readouterr()
    db = connect(url)
    try:
        config = train_config(tiny_model_dir, url, tmp_path)
        trainer = Trainer(config, db)  # v0: the first version, promoted
        wait_served(gw, beta, 0)
        for i in range(3):
            conversation(gw, acme, i)
            conversation(gw, beta, i)
        # The shared candidate (v1) blocks only the shared lineage: acme's lineage steps beside it.
        assert loop.run(trainer, stop=threading.Event()) == 2
        assert policy_versions.stage_of(db, 2) in ("candidate", "canary")
        assert policy_versions.lineage_versions(db, "acme") == [2]
        state = promotion.read_state(db, "acme")
        assert state.incumbent is None and state.base is not None and state.base.version == 0
        # The evidence of acme's canary counts acme's calls only, on both arms.
        long_ago = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
        assert len(promotion.evidence(db, 2, 0, long_ago, tenant="acme").errors[1]) == 6  # its two-turn conversations
        assert len(promotion.evidence(db, 2, 0, long_ago).errors[1]) == 13  # and beta's, with its probe

        # Acme's new conversations go to its canary (share 1.0 here); beta's never do.
        wait_served(gw, acme, 2)
        assert promotion.read_state(db, "acme").canary is not None
        for _ in range(3):
            call = chat(gw, beta, [{"role": "user", "content": "Beta again."}])["call"]
            assert served_version(url, call) in (0, 1)
        # `policy status --tenant`: acme's canary against the shared incumbent; the shared status is its own.
        assert main(["policy", "status", "--tenant", "acme", "--json", "--database-url", url]) == 0
        mine = json.loads(capsys.readouterr().out)
        assert (mine["candidate"], mine["stage"], mine["incumbent"]) == (2, "canary", 0) and mine["arms"] is not None
        assert main(["policy", "status", "--json", "--database-url", url]) == 0
        shared = json.loads(capsys.readouterr().out)
        assert shared["candidate"] == 1 and 2 not in {d["version"] for d in shared["decisions"]}
        assert {d["version"] for d in mine["decisions"]} == {2}

        # The trainer waits for acme's candidate too, and an operator decides it in its own lineage.
        assert loop.promotion_gate(trainer, lineage="acme") == (False, "waiting: policy@v2 is in its canary")
        assert main(["policy", "promote", "--tenant", "acme", "--database-url", url]) == 0
        assert "policy@v2 promoted" in capsys.readouterr().out
        assert promotion.read_state(db, "acme").incumbent.version == 2
        assert policy_versions.stage_of(db, 1) in ("candidate", "canary"), "the shared canary is another decision"
        assert loop.promotion_gate(trainer, lineage="acme") == (True, "")
        assert main(["policy", "promote", "--tenant", "beta", "--database-url", url]) == 2
        assert "no version is being evaluated" in capsys.readouterr().err
    finally:
        db.dispose()


def test_a_lineage_beyond_the_engine_s_lora_slots_is_not_served(gateway_factory, tiny_model_dir, tmp_path, caplog):
    """Two tenants with their own policy on an engine that batches two adapters: the shared lineage and acme fit,
    beta is refused with the reason and served the shared policy."""
    gw = gateway_factory(admin_key=ADMIN, api_keys=CLIENT, key_secret=SECRET, policy_poll_interval=0.2)
    url = gw.settings.database_url
    slots = {"http://replica-1": 2}  # what a vLLM server started with --max-loras 2 reports (VLLMEngine.lora_slots)

    async def lora_slots() -> dict[str, int | None]:
        return dict(slots)

    gw.state.engine.lora_slots = lora_slots
    db = connect(url)
    try:
        lineages.set_own_policy(db, "acme", True)
        lineages.set_own_policy(db, "beta", True)
        end = time.monotonic() + 30
        follower = gw.state.policy
        while "beta" not in follower.refused:
            assert time.monotonic() < end, "the follower did not look at the lineages"
            time.sleep(0.1)
        assert set(follower.lineages) == {"acme"}
        assert follower.refused["beta"] == "vLLM's --max-loras is 2, below the 3 adapters served side by side"
        assert "tenant beta's own policy is not served" in caplog.text
        # More slots (a restarted server): beta is opened at the next poll.
        slots["http://replica-1"] = 4
        while "beta" not in follower.lineages:
            assert time.monotonic() < end, "beta's lineage was not opened once there was room"
            time.sleep(0.1)
        assert follower.refused == {}
    finally:
        db.dispose()


def test_lineages_take_turns():
    assert loop.in_turn(["", "acme", "beta"], None) == ["", "acme", "beta"]
    assert loop.in_turn(["", "acme", "beta"], "") == ["acme", "beta", ""]
    assert loop.in_turn(["", "acme", "beta"], "beta") == ["", "acme", "beta"]
    assert loop.in_turn(["", "beta"], "acme") == ["", "beta"], "a lineage gone since: start from the first"


def test_staleness_counts_a_lineage_s_own_versions(tmp_path):
    """The judge skips turns beyond the staleness bound: with lineages, the oldest version still within the bound of
    its own lineage, over all lineages (a busy lineage's versions do not age another's data)."""
    from gateway.store import db as store_db

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    store_db.upgrade(url)
    engine = connect(url)
    try:

        def publish(version: int, lineage: str) -> None:
            with Session(engine) as session, session.begin():
                name = f"policy@v{version}"
                session.add(
                    PolicyVersion(
                        version=version, adapter_name=name, path=name, base_model="tiny", status="published",
                        lineage=lineage,
                    )
                )  # fmt: skip

        for v in range(11):
            publish(v, SHARED)
        with Session(engine) as session:
            assert policy_versions.oldest_within(session, 3) == 7  # as before lineages: newest - bound
        publish(11, "acme")
        publish(12, "acme")
        with Session(engine) as session:
            assert policy_versions.oldest_within(session, 3) is None, "acme has no version beyond the bound yet"
        for v in range(13, 16):
            publish(v, "acme")
        with Session(engine) as session:
            assert policy_versions.oldest_within(session, 3) == 7  # shared: 10-3; acme: [15, 14, 13, 12, 11] -> 12
        assert policy_versions.lineage_versions(engine, "acme") == [15, 14, 13, 12, 11]
    finally:
        engine.dispose()
