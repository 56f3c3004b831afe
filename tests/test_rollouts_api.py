"""The rollout lifecycle over HTTP: create → serve through its base_url with its own key → reward → finish →
inspect; per-rollout keys reach only their own rollout."""

from __future__ import annotations

import itertools

import httpx
import openai
import pytest

ADMIN = "admin-secret-key"
MESSAGES = [{"role": "system", "content": "Agent."}, {"role": "user", "content": "Begin."}]


@pytest.fixture
def gw(gateway_factory):
    return gateway_factory(admin_key=ADMIN, api_keys="client-key")


def admin(gw) -> httpx.Client:
    return httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)


def create(gw, **body) -> dict:
    r = admin(gw).post("/v1/rollouts", json={"task_id": "t1", "harness": "sdk", **body})
    assert r.status_code == 201, r.text
    return r.json()


def drive(base_url: str, key: str, turns: int) -> list[str]:
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    messages = list(MESSAGES)
    ids = []
    for turn in range(turns):
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=8, seed=turn)
        ids.append(raw.headers["x-clawgate-call-id"])
        messages += [
            {"role": "assistant", "content": raw.parse().choices[0].message.content or ""},
            {"role": "user", "content": f"step {turn}"},
        ]
    return ids


def test_rollout_lifecycle_end_to_end(gw):
    run_lifecycle(gw)


def run_lifecycle(gw) -> dict:
    """Create → 5 turns through the rollout's base_url → reward → finish → read → tree; returns the rollout."""
    ro = create(gw, metadata={"seed": 1})
    assert ro["base_url"] == f"{gw.url}/rollouts/{ro['id']}/v1"
    assert ro["api_key"].startswith("cgr-") and ro["group"] == "t1::sdk" and ro["status"] == "open"
    call_ids = drive(ro["base_url"], ro["api_key"], 5)
    key = {"Authorization": f"Bearer {ro['api_key']}"}
    r = httpx.post(f"{gw.url}/v1/rollouts/{ro['id']}/reward", json={"value": 0.75, "source": "verifier"}, headers=key)
    assert r.status_code == 201 and r.json()["value"] == 0.75
    r = httpx.post(f"{gw.url}/v1/rollouts/{ro['id']}/finish", json={"status": "completed"}, headers=key)
    assert r.status_code == 200 and r.json()["status"] == "completed"
    detail = httpx.get(f"{gw.url}/v1/rollouts/{ro['id']}", headers=key).json()
    assert [c["id"] for c in detail["calls"]] == call_ids
    assert detail["reward"] == 0.75 and detail["task_id"] == "t1" and detail["metadata"] == {"seed": 1}
    calls = detail["calls"]
    assert all(c["status"] == "ok" and len(c["completion_logprobs"]) == len(c["completion_token_ids"]) for c in calls)
    # One path: every call's prompt extends the previous call's prompt + completion.
    for prev, cur in itertools.pairwise(calls):
        full = prev["prompt_token_ids"] + prev["completion_token_ids"]
        assert cur["prompt_token_ids"][: len(full)] == full
        assert cur["render_mode"] == "spliced"
    tree = httpx.get(f"{gw.url}/v1/rollouts/{ro['id']}/tree", headers=key).json()
    report = tree["report"]
    assert tree["reward"] == 0.75 and tree["filtered"] == []
    assert report["leaves"] == 1 and report["kept_calls"] == 5
    assert report["trainable_tokens"] == sum(len(c["completion_token_ids"]) for c in calls)
    last = calls[-1]
    assert report["tree_tokens"] == len(last["prompt_token_ids"]) + len(last["completion_token_ids"])
    page = admin(gw).get("/v1/rollouts", params={"task_id": "t1"}).json()["data"]
    [listed] = [r for r in page if r["id"] == ro["id"]]
    assert listed["reward"] == 0.75 and listed["calls"] == 5, "the list shows each rollout's reward and size"
    assert listed["prompt_tokens"] == sum(len(c["prompt_token_ids"]) for c in calls)
    assert listed["completion_tokens"] == sum(len(c["completion_token_ids"]) for c in calls)
    assert listed["policy_versions"] == sorted({c["policy_version"] for c in calls if c["policy_version"] is not None})
    return ro


def test_rollout_keys_are_scoped(gw):
    a, b = create(gw), create(gw)
    key_a = {"Authorization": f"Bearer {a['api_key']}"}
    # A's key cannot serve, reward, finish or read under B.
    with pytest.raises(openai.PermissionDeniedError):
        drive(b["base_url"], a["api_key"], 1)
    for method, path, body in (("POST", "reward", {"value": 1}), ("POST", "finish", {}), ("GET", "", None)):
        url = f"{gw.url}/v1/rollouts/{b['id']}" + (f"/{path}" if path else "")
        r = httpx.request(method, url, json=body, headers=key_a)
        assert r.status_code == 403, (path, r.text)
    # ... nor list rollouts, create them or post feedback.
    assert httpx.get(f"{gw.url}/v1/rollouts", headers=key_a).status_code == 403
    assert httpx.post(f"{gw.url}/v1/rollouts", json={}, headers=key_a).status_code == 403
    # A rollout key on the plain /v1 path (no rollout addressed) is refused too.
    assert (
        httpx.post(
            f"{gw.url}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES}, headers=key_a
        ).status_code
        == 403
    )
    # Rewards need a key: none, or a client key, is 401.
    assert httpx.post(f"{gw.url}/v1/rollouts/{a['id']}/reward", json={"value": 1}).status_code == 401
    assert (
        httpx.post(
            f"{gw.url}/v1/rollouts/{a['id']}/reward", json={"value": 1}, headers={"Authorization": "Bearer client-key"}
        ).status_code
        == 401
    )
    # The admin key can do everything.
    assert admin(gw).post(f"/v1/rollouts/{b['id']}/reward", json={"value": 1}).status_code == 201


def test_validation_and_not_found(gw):
    a = admin(gw)
    assert a.post("/v1/rollouts/ro-missing/reward", json={"value": 1}).status_code == 404
    r = a.post("/v1/rollouts/ro-missing/reward", json={"value": "high"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    ro = create(gw)
    assert a.post(f"/v1/rollouts/{ro['id']}/finish", json={"status": "done"}).status_code == 400
    assert a.post(f"/v1/rollouts/{ro['id']}/finish", json={"status": "failed"}).status_code == 200
    r = a.post(f"/v1/rollouts/{ro['id']}/finish", json={"status": "completed"})
    assert r.status_code == 400 and "already failed" in r.json()["error"]["message"]


def test_list_filters_and_pagination(gw):
    ids = [create(gw, task_id=f"task-{i % 2}")["id"] for i in range(5)]
    a = admin(gw)
    page1 = a.get("/v1/rollouts", params={"limit": 2}).json()
    page2 = a.get("/v1/rollouts", params={"limit": 2, "cursor": page1["next_cursor"]}).json()
    page3 = a.get("/v1/rollouts", params={"limit": 2, "cursor": page2["next_cursor"]}).json()
    seen = [r["id"] for p in (page1, page2, page3) for r in p["data"]]
    assert sorted(seen) == sorted(ids) and len(set(seen)) == 5 and page3["next_cursor"] is None
    only = a.get("/v1/rollouts", params={"task_id": "task-0"}).json()["data"]
    assert {r["task_id"] for r in only} == {"task-0"} and len(only) == 3
    assert a.get("/v1/rollouts", params={"cursor": "!!"}).status_code == 400


def test_feedback_by_call_and_response_id(gw):
    client = openai.OpenAI(base_url=gw.v1, api_key="client-key", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=4, n=2)
    resp = raw.parse()
    a = admin(gw)
    by_response = a.post("/v1/feedback", json={"response_id": resp.id, "value": 1.0})
    assert by_response.status_code == 201 and len(by_response.json()["data"]) == 2
    call_id = raw.headers["x-clawgate-call-id"].split(",")[0]
    by_call = a.post("/v1/feedback", json={"call_id": call_id, "value": -1.0}).json()["data"]
    assert by_call[0]["call_id"] == call_id and by_call[0]["rollout_id"] == raw.headers["x-clawgate-rollout-id"]
    assert a.post("/v1/feedback", json={"value": 1.0}).status_code == 400
    assert a.post("/v1/feedback", json={"call_id": "nope", "value": 1.0}).status_code == 404
    assert (
        httpx.post(
            f"{gw.url}/v1/feedback",
            json={"call_id": call_id, "value": 1},
            headers={"Authorization": "Bearer client-key"},
        ).status_code
        == 401
    )


def test_idle_sessions_are_closed_explicit_rollouts_are_not(gateway_factory):
    import time

    gw = gateway_factory(admin_key=ADMIN, session_idle_timeout=0.5)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    implicit = httpx.post(gw.v1 + "/chat/completions", json=body).headers["x-clawgate-rollout-id"]
    session = httpx.post(gw.v1 + "/chat/completions", json=body, headers={"session-id": "abc"})
    explicit = httpx.post(gw.v1 + "/chat/completions", json=body, headers={"X-Rollout-Id": "mine"})
    assert session.headers["x-clawgate-rollout-id"] == "codex-abc"
    a = admin(gw)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        statuses = {r["id"]: r["status"] for r in a.get("/v1/rollouts").json()["data"]}
        if statuses.get(implicit) == "completed" and statuses.get("codex-abc") == "completed":
            break
        time.sleep(0.1)
    assert statuses[implicit] == "completed" and statuses["codex-abc"] == "completed"
    assert statuses[explicit.headers["x-clawgate-rollout-id"]] == "open"


def test_conversation_resumed_after_idle_close_starts_a_new_rollout(gateway_factory):
    import time

    gw = gateway_factory(admin_key=ADMIN, session_idle_timeout=0.4)
    client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)
    first = client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=6, seed=1)
    old = first.headers["x-clawgate-rollout-id"]
    a = admin(gw)
    deadline = time.monotonic() + 10
    while a.get(f"/v1/rollouts/{old}").json()["status"] != "completed" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert a.get(f"/v1/rollouts/{old}").json()["status"] == "completed"
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": first.parse().choices[0].message.content or ""},
        {"role": "user", "content": "again"},
    ]
    second = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=4)
    new = second.headers["x-clawgate-rollout-id"]
    assert new != old
    calls = a.get(f"/v1/rollouts/{new}").json()["calls"]
    # Still token-exact: the new rollout's first call splices the raw ids of the closed one's answer.
    assert calls[0]["render_mode"] == "spliced" and calls[0]["parent_call_id"] == first.headers["x-clawgate-call-id"]
    assert len(a.get(f"/v1/rollouts/{old}").json()["calls"]) == 1


def test_tree_and_export_commands(gw, capsys, tmp_path):
    import json

    from clawgate.cli import main

    ro = run_lifecycle(gw)
    url = gw.settings.database_url
    assert main(["tree", ro["id"], "--database-url", url]) == 0
    text = capsys.readouterr().out
    assert ro["id"] in text and "reward=0.75" in text
    assert main(["tree", ro["id"], "--json", "--database-url", url]) == 0
    assert json.loads(capsys.readouterr().out)["report"]["leaves"] == 1
    assert main(["tree", "ro-none", "--database-url", url]) == 1
    out = tmp_path / "export.jsonl"
    assert main(["export", "--out", str(out), "--status", "completed", "--database-url", url]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == [ro["id"]]
    assert lines[0]["reward"] == 0.75 and lines[0]["tree"]["report"]["leaves"] == 1
    assert len(lines[0]["calls"]) == 5 and lines[0]["calls"][0]["prompt_token_ids"]
    assert all(c["counterfactual_group"] is None for c in lines[0]["calls"]), "no siblings were drawn"


def test_export_carries_each_turns_counterfactual_group(gateway_factory, tmp_path):
    import json

    from clawgate.cli import main
    from gateway.store import counterfactuals
    from gateway.store.counterfactuals import SiblingScore
    from gateway.store.db import connect
    from tests.secret_corpus import corpus
    from tests.test_counterfactuals import settle

    gw = gateway_factory(admin_key=ADMIN, policy_follow=False, counterfactuals=2)
    url = gw.settings.database_url
    ro = create(gw)
    [task_call] = drive(ro["base_url"], ro["api_key"], 1)  # a rollout the client names: no siblings

    def everyday(content: str) -> str:
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8}
        r = httpx.post(gw.v1 + "/chat/completions", json={**body, "temperature": 1.0}, timeout=60)
        assert r.status_code == 200, r.text
        settle(gw)  # its siblings are drawn before the next live call could preempt them
        return r.headers["x-clawgate-call-id"]

    plain = everyday("Name a colour.")
    token = next(p for p in corpus() if p.name == "github token")
    held = everyday(f"Why does this fail? {token.line}")
    store = connect(url)
    groups = {c: counterfactuals.group_of(store, c) for c in (plain, held)}
    assert all(g is not None and len(g.siblings) == 2 for g in groups.values())
    stored = groups[plain].siblings  # type: ignore[union-attr]
    assert counterfactuals.record_scores(store, plain, 0.5, {stored[0].id: SiblingScore(0.25, {"reason": "short"})})
    store.dispose()

    def exported(*flags: str) -> dict[str, dict]:
        out = tmp_path / f"export{len(flags)}.jsonl"
        assert main(["export", "--out", str(out), *flags, "--database-url", url]) == 0
        return {c["id"]: c for line in out.read_text().splitlines() for c in json.loads(line)["calls"]}

    calls = exported()
    assert calls[task_call]["counterfactual_group"] is None
    group = calls[plain]["counterfactual_group"]
    assert group["k"] == 2 and group["served_reward"] == 0.5 and group["redacted"] is False
    assert [s["id"] for s in group["siblings"]] == [s.id for s in stored]
    for got, sibling in zip(group["siblings"], stored, strict=True):
        assert got["counterfactual"] is True and got["id"] not in calls, "marked, and no call"
        assert got["completion_token_ids"] == sibling.completion_ids.tolist()
        assert got["completion_logprobs"] == pytest.approx(sibling.completion_logprobs.tolist())
        assert got["finish_reason"] == sibling.finish_reason and got["finish_reason"] in ("stop", "length")
        assert got["completion_tokens"] == len(sibling.completion_ids)
    assert [s["reward"] for s in group["siblings"]] == [0.25, None], "the scored sibling, and one not scored"
    assert group["siblings"][0]["details"] == {"reason": "short"}
    # The served prompt held a credential that a sibling may repeat: their ids read -1, exact with --raw.
    assert calls[held]["secrets"]
    exact = [s.completion_ids.tolist() for s in groups[held].siblings]  # type: ignore[union-attr]
    assert calls[held]["counterfactual_group"]["redacted"] is True
    assert [s["completion_token_ids"] for s in calls[held]["counterfactual_group"]["siblings"]] == [
        [-1] * len(ids) for ids in exact
    ]
    raw = exported("--raw")[held]["counterfactual_group"]
    assert raw["redacted"] is False and [s["completion_token_ids"] for s in raw["siblings"]] == exact
    bare = exported("--no-tokens")[plain]["counterfactual_group"]["siblings"]
    assert [s["id"] for s in bare] == [s.id for s in stored] and not any("completion_token_ids" in s for s in bare)
