"""The gateway's side of the hot swap: published versions are loaded, verified, routed to, marked current, and
retired; calls record the version that served them; a broken version is skipped; in-flight calls keep theirs."""

from __future__ import annotations

import threading
import time

import httpx
import sqlalchemy as sa

from gateway.store.db import connect
from tests.fakes import SlowEngine
from tests.policies import publish

ADMIN = {"Authorization": "Bearer adm"}


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def chat(gw, content: str = "hello", **extra) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 12, **extra}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=60)
    r.raise_for_status()
    return r


def served_versions(gw, response: httpx.Response) -> list[tuple[str | None, int | None]]:
    gw.flush()
    rollout = response.headers["x-clawgate-rollout-id"]
    calls = httpx.get(f"{gw.v1}/rollouts/{rollout}", headers=ADMIN, params={"tokens": "false"}).json()["calls"]
    return [(c["adapter"], c["policy_version"]) for c in calls]


def db_versions(url: str) -> dict[int, tuple[str, bool, bool]]:
    engine = connect(url)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT version, status, is_current, current_at FROM policy_versions")).all()
    engine.dispose()
    return {r[0]: (r[1], bool(r[2]), r[3] is not None) for r in rows}


def test_gateway_follows_published_versions(gateway_factory, tiny_model_dir, tmp_path, store_url):
    adapters = tmp_path / "adapters"
    gw = gateway_factory(
        admin_key="adm", policy_poll_interval=0.2, policy_keep_loaded=2, adapter_dir=adapters, database_url=store_url
    )
    url = gw.settings.database_url
    # Nothing published: the base model serves, and calls say so.
    first = chat(gw)
    assert served_versions(gw, first) == [(None, None)]
    policy = httpx.get(gw.url + "/health").json()["policy"]
    assert (policy["adapter"], policy["version"], policy["state"], policy["last_error"]) == (None, None, "ok", None)

    publish(url, adapters, tiny_model_dir, 0)
    wait_for(lambda: gw.state.service.policy_version == 0, what="policy@v0 to be served")
    greedy = {"temperature": 0.0, "seed": 1}
    on_v0 = chat(gw, "same prompt", **greedy)
    assert served_versions(gw, on_v0) == [("policy@v0", 0)]
    assert db_versions(url)[0] == ("loaded", True, True)

    publish(url, adapters, tiny_model_dir, 1, scale=0.5)
    wait_for(lambda: gw.state.service.policy_version == 1, what="policy@v1 to be served")
    on_v1 = chat(gw, "same prompt", **greedy)
    assert served_versions(gw, on_v1) == [("policy@v1", 1)]
    # The adapter really is in the forward pass: greedy answers to one prompt differ between v0 and v1.
    assert on_v1.json()["choices"][0]["message"]["content"] != on_v0.json()["choices"][0]["message"]["content"]
    versions = db_versions(url)
    assert versions[1] == ("loaded", True, True) and versions[0][1] is False, "exactly one current version"

    publish(url, adapters, tiny_model_dir, 2, scale=0.5)
    wait_for(lambda: gw.state.service.policy_version == 2, what="policy@v2 to be served")
    # Only the newest `policy_keep_loaded` versions stay loaded; the oldest is unloaded and marked retired.
    wait_for(lambda: db_versions(url)[0][0] == "retired", what="policy@v0 to be retired")
    loaded = gw.state.policy.loaded
    assert list(loaded) == [1, 2]
    metrics = httpx.get(gw.url + "/metrics").text
    assert "clawgate_policy_version 2.0" in metrics
    assert "clawgate_policy_swaps_total 3.0" in metrics
    assert "clawgate_policy_swap_seconds_count 3.0" in metrics


def test_a_broken_version_is_skipped_and_serving_goes_on(gateway_factory, tiny_model_dir, tmp_path):
    adapters = tmp_path / "adapters"
    gw = gateway_factory(admin_key="adm", policy_poll_interval=0.2, adapter_dir=adapters)
    url = gw.settings.database_url
    publish(url, adapters, tiny_model_dir, 0)
    wait_for(lambda: gw.state.service.policy_version == 0, what="policy@v0")
    bad = publish(url, adapters, tiny_model_dir, 1)
    wait_for(lambda: gw.state.service.policy_version == 1, what="policy@v1")
    # v2's weights are unreadable: it is reported and skipped, v1 keeps serving, and v3 is taken up later.
    publish(url, adapters, tiny_model_dir, 2, broken=True)
    wait_for(lambda: 2 in gw.state.policy.failed, what="policy@v2 to be rejected")
    assert gw.state.service.policy_version == 1
    assert served_versions(gw, chat(gw)) == [("policy@v1", 1)]
    metrics = httpx.get(gw.url + "/metrics").text
    assert "clawgate_policy_swap_failures_total 1.0" in metrics
    assert "clawgate_policy_staleness 1.0" in metrics, "v2 is the newest published, v1 serves"
    publish(url, adapters, tiny_model_dir, 3)
    wait_for(lambda: gw.state.service.policy_version == 3, what="policy@v3")
    assert "clawgate_policy_staleness 0.0" in httpx.get(gw.url + "/metrics").text
    assert bad.exists()


def test_in_flight_calls_keep_their_version(gateway_factory, tiny_tokenizer, tiny_model_dir, tmp_path):
    adapters = tmp_path / "adapters"
    engine = SlowEngine(tiny_tokenizer)
    gw = gateway_factory(
        engine, tiny_tokenizer, admin_key="adm", policy_poll_interval=0.1, policy_keep_loaded=1, adapter_dir=adapters
    )
    url = gw.settings.database_url
    publish(url, adapters, tiny_model_dir, 0)
    wait_for(lambda: gw.state.service.policy_version == 0, what="policy@v0")
    engine.push("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen")
    result: dict[str, httpx.Response] = {}

    def slow_call() -> None:
        result["r"] = chat(gw, "long", stream=True, max_tokens=40)

    thread = threading.Thread(target=slow_call)
    thread.start()
    wait_for(lambda: gw.state.service.adapter_in_flight.get("policy@v0", 0) == 1, what="the stream to start")
    publish(url, adapters, tiny_model_dir, 1)
    wait_for(lambda: gw.state.service.policy_version == 1, what="policy@v1")
    # New calls go to v1 at once, but v0 stays loaded while the stream that started on it runs.
    assert served_versions(gw, chat(gw)) == [("policy@v1", 1)]
    assert "policy@v0" in engine.loaded and "policy@v0" not in engine.unloaded
    thread.join(timeout=30)
    assert result["r"].status_code == 200 and "data: [DONE]" in result["r"].text
    assert served_versions(gw, result["r"]) == [("policy@v0", 0)]
    wait_for(lambda: "policy@v0" in engine.unloaded, what="policy@v0 to be unloaded after its last call")
    assert sorted(engine.loaded) == ["policy@v1"]
