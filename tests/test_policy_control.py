"""Policy control through the admin API: pin a version (every gateway serves it until unpinned, whatever the
trainer publishes meanwhile), unpin, and ask for a rollback (served at once; the trainer's part is tested with the
trainer). Two gateways on one database show that the pin is not one process's state.

Versions are published with distinct non-zero adapters, and what serves is checked by content after every action: a
greedy completion must be that version's reference ids (base model + its adapter, computed in the test), not only
carry its name."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from tests.policies import PROBE, assert_serves, distinct_references, publish

ADMIN = {"Authorization": "Bearer adm"}


def wait_for(predicate: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def publish_distinct(url: str, adapters: Any, model_dir: Any, versions: range) -> dict[int, list[int]]:
    """Publish ``versions`` with non-zero adapters; returns each one's reference answer to ``PROBE`` (all differ)."""
    paths = {v: publish(url, adapters, model_dir, v, scale=0.5, seeded=True) for v in versions}
    return distinct_references(model_dir, paths, PROBE, 8)


def serves(gw: Any, version: int, refs: dict[int, list[int]]) -> None:
    assert_serves(gw, version, refs, PROBE, ADMIN)


def test_a_pin_holds_on_every_gateway_until_unpinned(gateway_factory, tiny_model_dir, tmp_path):
    adapters = tmp_path / "adapters"
    a = gateway_factory(admin_key="adm", policy_poll_interval=0.1, adapter_dir=adapters)
    b = gateway_factory(
        admin_key="adm", policy_poll_interval=0.1, adapter_dir=adapters, database_url=a.settings.database_url
    )
    url = a.settings.database_url
    refs = publish_distinct(url, adapters, tiny_model_dir, range(2))
    for gw in (a, b):
        wait_for(lambda gw=gw: gw.state.service.policy_version == 1, "v1 served")
    serves(a, 1, refs)

    r = httpx.post(a.v1 + "/policy/pin", json={"version": 0}, headers=ADMIN)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["pinned_version"] == 0 and body["served"] == {"adapter": "policy@v0", "version": 0}, "at once here"
    serves(a, 0, refs)
    wait_for(lambda: b.state.service.policy_version == 0, "the other gateway to follow the pin")
    refs |= publish_distinct(url, adapters, tiny_model_dir, range(2, 3))
    assert len({tuple(ids) for ids in refs.values()}) == 3, refs
    for gw in (a, b):
        # A whole poll of each follower that started after v2 was published (not a sleep that may hold none).
        assert asyncio.run_coroutine_threadsafe(gw.state.policy.sync(), gw.loop).result(timeout=60) == 0
    for gw in (a, b):
        policy = httpx.get(gw.url + "/health").json()["policy"]
        assert (policy["adapter"], policy["version"], policy["pinned_version"]) == ("policy@v0", 0, 0)
        serves(gw, 0, refs)  # v0's weights answer, and every call records the version that served it

    listed = httpx.get(a.v1 + "/policy", headers=ADMIN).json()
    assert [v["version"] for v in listed["versions"]] == [0, 1, 2] and listed["pinned_version"] == 0

    assert httpx.post(a.v1 + "/policy/unpin", headers=ADMIN).json()["pinned_version"] is None
    for gw in (a, b):
        wait_for(lambda gw=gw: gw.state.service.policy_version == 2, "the newest version after the unpin")
        serves(gw, 2, refs)
    assert httpx.get(b.url + "/health").json()["policy"]["pinned_version"] is None


def test_a_rollback_serves_that_version_now_and_waits_for_the_trainer(gateway_factory, tiny_model_dir, tmp_path):
    adapters = tmp_path / "adapters"
    gw = gateway_factory(admin_key="adm", policy_poll_interval=0.1, adapter_dir=adapters)
    refs = publish_distinct(gw.settings.database_url, adapters, tiny_model_dir, range(3))
    wait_for(lambda: gw.state.service.policy_version == 2, "v2 served")
    serves(gw, 2, refs)
    body = httpx.post(gw.v1 + "/policy/rollback", json={"version": 1}, headers=ADMIN).json()
    assert body["rollback_to"] == 1 and body["pinned_version"] == 1 and body["served"]["version"] == 1
    serves(gw, 1, refs)


def test_policy_control_needs_the_admin_key_and_a_published_version(gateway_factory, tiny_model_dir, tmp_path):
    adapters = tmp_path / "adapters"
    gw = gateway_factory(admin_key="adm", policy_poll_interval=0.1, adapter_dir=adapters)
    publish(gw.settings.database_url, adapters, tiny_model_dir, 0)
    for method, path in (("GET", "/policy"), ("POST", "/policy/unpin")):
        assert httpx.request(method, gw.v1 + path).status_code == 401
    r = httpx.post(gw.v1 + "/policy/pin", json={"version": 7}, headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"]["param"] == "version" and "never published" in r.text
    r = httpx.post(gw.v1 + "/policy/rollback", json={"version": -1}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "version"
    assert httpx.get(gw.v1 + "/policy", headers=ADMIN).json()["pinned_version"] is None


def test_the_policy_command_lists_pins_and_rolls_back(gateway_factory, tiny_model_dir, tmp_path, capsys):
    from clawgate.cli import main

    adapters = tmp_path / "adapters"
    gw = gateway_factory(admin_key="adm", policy_poll_interval=0.1, adapter_dir=adapters)
    url = gw.settings.database_url
    refs = publish_distinct(url, adapters, tiny_model_dir, range(2))
    wait_for(lambda: gw.state.service.policy_version == 1, "v1 served")
    serves(gw, 1, refs)

    assert main(["policy", "pin", "0", "--database-url", url]) == 0
    wait_for(lambda: gw.state.service.policy_version == 0, "the gateway to follow the command's pin")
    serves(gw, 0, refs)
    assert main(["policy", "list", "--database-url", url]) == 0
    listed = capsys.readouterr().out
    [row] = [line for line in listed.splitlines() if line.startswith("policy@v0 ")]
    assert row.endswith("current pinned"), listed
    assert main(["policy", "rollback", "1", "--database-url", url]) == 0
    wait_for(lambda: gw.state.service.policy_version == 1, "the rollback target served at once")
    serves(gw, 1, refs)
    assert main(["policy", "list", "--database-url", url]) == 0
    assert "rollback to policy@v1 requested: waiting for the trainer" in capsys.readouterr().out
    assert main(["policy", "unpin", "--database-url", url]) == 0
    wait_for(lambda: httpx.get(gw.url + "/health").json()["policy"]["pinned_version"] is None, "the unpin followed")
    serves(gw, 1, refs)  # the newest version again
    assert main(["policy", "pin", "9", "--database-url", url]) == 2
    assert main(["policy", "pin", "--database-url", url]) == 2
    err = capsys.readouterr().err
    assert "policy version 9 was never published" in err and "needs a VERSION" in err
