"""Tenants: keys in the database (hashed, shown once, revoked everywhere within a second) and isolation.

A gateway on the in-process tiny model with two tenants, ``acme`` and ``beta``, each with an admin and a user key
from the database, beside the global admin key and an environment client key (the default tenant). The isolation
test walks the app's whole route list: every route is classified below, so a new route without a tenant decision
fails it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest
import sqlalchemy as sa

from gateway.store.db import connect
from tests.online import UpProcess
from tests.test_retention import age, count, orphans

ADMIN = "global-admin-key"
CLIENT = "env-client-key"
SECRET = "tenant-key-server-secret"
MESSAGES = [{"role": "user", "content": "Hello there."}]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def new_key(gw: Any, by: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{gw.url}/v1/admin/keys", json=body, headers=bearer(by), timeout=30)
    assert r.status_code == 201, r.text
    return dict(r.json())


@pytest.fixture
def gw(gateway_factory, postgres_url):
    return gateway_factory(database_url=postgres_url, admin_key=ADMIN, api_keys=CLIENT, key_secret=SECRET)


@pytest.fixture
def keys(gw) -> dict[str, str]:
    return {
        f"{tenant}-{role}": new_key(gw, ADMIN, tenant=tenant, role=role)["key"]
        for tenant in ("acme", "beta")
        for role in ("admin", "user")
    }


def chat(gw: Any, key: str, messages: list[dict[str, Any]], **headers: str) -> httpx.Response:
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "seed": 1}
    return httpx.post(f"{gw.v1}/chat/completions", json=body, headers={**bearer(key), **headers}, timeout=60)


# -- keys ---------------------------------------------------------------------------------------------------------


def test_keys_are_stored_hashed_shown_once_and_managed_by_the_command_and_the_api(
    gw, postgres_url, capsys, monkeypatch
):
    from clawgate.cli import main

    monkeypatch.setenv("CLAWGATE_KEY_SECRET", SECRET)
    url = ["--database-url", postgres_url]
    assert main(["keys", "create", "--tenant", "acme", "--role", "admin", "--name", "ops", "--json", *url]) == 0
    created = json.loads(capsys.readouterr().out)
    acme_admin = created["key"]
    assert acme_admin.startswith("cgk-") and created["tenant"] == "acme" and created["role"] == "admin"
    assert main(["keys", "create", "--tenant", "acme", "--expires", "30d", *url]) == 0
    out = capsys.readouterr()
    acme_user = out.out.strip()
    assert acme_user.startswith("cgk-") and "shown this once" in out.err
    # The API: a tenant admin creates its own tenant's keys (the tenant is implied), never another's.
    second = new_key(gw, acme_admin, role="user", name="ci")
    assert second["tenant"] == "acme" and second["key"].startswith("cgk-")
    beta = new_key(gw, ADMIN, tenant="beta")
    refused = httpx.post(f"{gw.url}/v1/admin/keys", json={"tenant": "beta"}, headers=bearer(acme_admin))
    assert refused.status_code == 403 and refused.json()["error"]["param"] == "tenant"

    # Only an HMAC of each key is in the database: no column holds a key or its secret part.
    plain = [acme_admin, acme_user, second["key"], beta["key"]]
    engine = connect(postgres_url)
    with engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM api_keys"))]
    engine.dispose()
    assert len(rows) == 4
    stored = " ".join(str(v) for row in rows for v in row.values())
    for key in plain:
        assert key not in stored and key.rsplit("-", 1)[1] not in stored
    by_id = {row["id"]: row for row in rows}
    for key in plain:
        row = by_id[key.split("-")[1]]
        assert row["key_hash"] == hmac.new(SECRET.encode(), key.encode(), hashlib.sha256).hexdigest()

    # Each key works for serving; listing never shows a key; a tenant admin lists its own tenant's keys only.
    for key in plain:
        assert chat(gw, key, MESSAGES).status_code == 200
    listed = httpx.get(f"{gw.url}/v1/admin/keys", headers=bearer(acme_admin)).json()["data"]
    assert {k["tenant"] for k in listed} == {"acme"} and len(listed) == 3 and all("key" not in k for k in listed)
    assert len(httpx.get(f"{gw.url}/v1/admin/keys", headers=bearer(ADMIN)).json()["data"]) == 4
    assert main(["keys", "list", "--tenant", "beta", "--json", *url]) == 0
    assert [k["id"] for k in json.loads(capsys.readouterr().out)] == [beta["id"]]

    # Revoked from the command line: this gateway refuses it within its cache's TTL (0.5 s).
    assert main(["keys", "revoke", acme_user.split("-")[1], *url]) == 0
    assert "revoked key" in capsys.readouterr().out
    time.sleep(0.6)
    r = chat(gw, acme_user, MESSAGES)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # A tenant admin cannot revoke another tenant's key: it reads "not found", as an unknown id does.
    other = httpx.post(f"{gw.url}/v1/admin/keys/{beta['id']}/revoke", headers=bearer(acme_admin))
    unknown = httpx.post(f"{gw.url}/v1/admin/keys/0123456789ab/revoke", headers=bearer(acme_admin))
    assert other.status_code == unknown.status_code == 404
    assert chat(gw, beta["key"], MESSAGES).status_code == 200
    assert main(["keys", "list", "--revoked", "--json", *url]) == 0
    assert sum(k["revoked_at"] is not None for k in json.loads(capsys.readouterr().out)) == 1

    # Bad input, in the API's error format and from the command.
    for body, param in (
        ({"tenant": "Not A Name"}, "tenant"),
        ({"tenant": "acme", "role": "owner"}, "role"),
        ({"tenant": "acme", "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
        ({"tenant": "acme", "scope": "all"}, "scope"),
    ):
        r = httpx.post(f"{gw.url}/v1/admin/keys", json=body, headers=bearer(ADMIN))
        assert r.status_code == 400, (body, r.text)
        assert param in json.dumps(r.json()["error"]), (body, r.text)
    assert main(["keys", "revoke", "0123456789ab", *url]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["keys", "create", "--tenant", "Bad Name", *url]) == 2
    assert "invalid tenant name" in capsys.readouterr().err


def test_unknown_malformed_expired_and_revoked_keys_are_refused_in_each_apis_shape(gw, keys, postgres_url):
    expiring = new_key(gw, ADMIN, tenant="acme", expires_at="2099-01-01T00:00:00Z")
    revoked = new_key(gw, ADMIN, tenant="acme")
    for key in (expiring["key"], revoked["key"]):
        assert chat(gw, key, MESSAGES).status_code == 200
    engine = connect(postgres_url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE api_keys SET expires_at = now() - interval '1 second' WHERE id = :i"),
                     {"i": expiring["id"]})  # fmt: skip
    engine.dispose()
    assert httpx.post(f"{gw.url}/v1/admin/keys/{revoked['id']}/revoke", headers=bearer(ADMIN)).status_code == 200
    time.sleep(0.6)
    wrong_secret = keys["acme-user"][:-4] + ("AAAA" if not keys["acme-user"].endswith("AAAA") else "BBBB")
    bad = {
        "unknown": "cgk-0123456789ab-" + "A" * 43,
        "malformed": "cgk-not-a-key",
        "wrong secret": wrong_secret,
        "expired": expiring["key"],
        "revoked": revoked["key"],
    }
    for what, key in bad.items():
        r = chat(gw, key, MESSAGES)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (what, r.text)
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0).messages.create(
                model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
        admin_route = httpx.get(f"{gw.url}/v1/rollouts", headers=bearer(key))
        assert admin_route.status_code == 401, (what, admin_route.text)
    # A user key is no admin key; a tenant admin key is not the global one.
    assert httpx.get(f"{gw.url}/v1/rollouts", headers=bearer(keys["acme-user"])).status_code == 403
    assert httpx.get(f"{gw.url}/v1/policy", headers=bearer(keys["acme-admin"])).status_code == 403
    # The environment's client key serves as the default tenant.
    ok = chat(gw, CLIENT, MESSAGES)
    assert ok.status_code == 200
    rollout = ok.headers["x-clawgate-rollout-id"]
    assert httpx.get(f"{gw.url}/v1/rollouts/{rollout}", headers=bearer(ADMIN)).json()["tenant"] == "default"


@pytest.fixture
def second_process(gw, postgres_url, tiny_model_dir, tmp_path):
    """`clawgate serve` in a child process on the same Postgres as ``gw``: its base URL."""
    from tests.conftest import free_port

    port = free_port()
    other = UpProcess(
        env={
            "CLAWGATE_DATABASE_URL": postgres_url,
            "CLAWGATE_MODEL": str(tiny_model_dir),
            "CLAWGATE_SERVED_MODEL_NAME": "tiny",
            "CLAWGATE_MAX_TOKENS": "64",
            "CLAWGATE_ADMIN_KEY": ADMIN,
            "CLAWGATE_API_KEYS": CLIENT,
            "CLAWGATE_KEY_SECRET": SECRET,
            "CLAWGATE_DATA_DIR": str(tmp_path / "other"),
            "CLAWGATE_LOG_LEVEL": "warning",
        },
        cwd=tmp_path,
        command="serve",
        args=["--port", str(port)],
    )
    other.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert other.proc.poll() is None and time.monotonic() < deadline, other.output
            time.sleep(0.3)
        yield url
    finally:
        assert other.stop() in (0, -15), other.output


def test_a_revoked_key_is_refused_by_a_second_gateway_process_within_a_second(gw, keys, second_process):
    key = keys["beta-user"]
    with httpx.Client(base_url=second_process, headers=bearer(key), timeout=10) as client:
        for _ in range(5):  # the second process has the key in its cache
            assert client.get("/v1/models").status_code == 200
        r = httpx.post(f"{gw.url}/v1/admin/keys/{key.split('-')[1]}/revoke", headers=bearer(ADMIN))
        assert r.status_code == 200
        revoked_at = time.monotonic()
        while client.get("/v1/models").status_code == 200:
            assert time.monotonic() - revoked_at < 5, "the second process still takes the revoked key"
            time.sleep(0.02)
        refused_after = time.monotonic() - revoked_at
        print(f"revoked key refused by the second process after {refused_after * 1000:.0f} ms")
        assert refused_after < 1.0
        assert client.get("/v1/models", headers=bearer(keys["beta-admin"])).status_code == 200


# -- quotas ---------------------------------------------------------------------------------------------------------


def test_quotas_hold_across_two_gateway_processes_with_429_and_retry_after(gw, keys, second_process):
    urls = [gw.url, second_process]
    admin = bearer(ADMIN)
    # beta: 6 requests a minute over all its keys; one acme key: 10 tokens a minute (a call's prompt alone passes it).
    r = httpx.post(f"{gw.url}/v1/admin/quotas", json={"tenant": "beta", "requests_per_minute": 6}, headers=admin)
    assert r.status_code == 200 and r.json()["requests_per_minute"] == 6, r.text
    acme_key = new_key(gw, keys["acme-admin"], tokens_per_minute=10)
    assert acme_key["tokens_per_minute"] == 10
    time.sleep(1.5)  # both processes have read the limits (once a second)

    def call(url: str, key: str) -> httpx.Response:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
        return httpx.post(f"{url}/v1/chat/completions", json=body, headers=bearer(key), timeout=60)

    # Three calls on each process, the two keys of beta sharing the tenant's quota.
    for i, url in enumerate(urls):
        for n in range(3):
            r = call(url, keys["beta-user" if n % 2 else "beta-admin"])
            assert r.status_code == 200, (i, n, r.text)
        time.sleep(0.8)  # each process's counts reach the other
    for url in urls:
        r = call(url, keys["beta-user"])
        assert r.status_code == 429, r.text
        assert (
            r.json()["error"]["type"] == "rate_limit_error" and "6 requests per minute" in r.json()["error"]["message"]
        )
        assert 1 <= int(r.headers["retry-after"]) <= 120
        with pytest.raises(anthropic.RateLimitError) as refused:  # the Anthropic API's own shape
            anthropic.Anthropic(base_url=url, api_key=keys["beta-user"], max_retries=0).messages.create(
                model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
        assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "rate_limit_error"
    # Another tenant is not limited by beta's quota; the key's token quota stops that key after its first call.
    assert call(second_process, keys["acme-user"]).status_code == 200
    assert call(gw.url, acme_key["key"]).status_code == 200
    time.sleep(0.8)
    for url in urls:
        r = call(url, acme_key["key"])
        assert r.status_code == 429 and "this key's quota of 10 tokens per minute" in r.json()["error"]["message"]
    assert call(second_process, keys["acme-user"]).status_code == 200
    metrics = httpx.get(f"{gw.url}/metrics").text
    assert 'clawgate_calls_refused_total{reason="quota"}' in metrics

    # The usage as an operator sees it; a tenant admin sees its own tenant's only, and cannot raise its quota.
    listed = httpx.get(f"{gw.url}/v1/admin/quotas", headers=admin).json()["data"]
    beta = next(q for q in listed if q["tenant"] == "beta" and q["key_id"] is None)
    assert beta["requests_per_minute"] == 6 and beta["usage"]["requests"] >= 6
    own = httpx.get(f"{gw.url}/v1/admin/quotas", headers=bearer(keys["acme-admin"])).json()["data"]
    assert {q["tenant"] for q in own} == {"acme"}
    raised = httpx.post(
        f"{gw.url}/v1/admin/quotas", json={"tenant": "beta", "requests_per_minute": 1000},
        headers=bearer(keys["beta-admin"]),
    )  # fmt: skip
    assert raised.status_code == 403
    other = httpx.post(
        f"{gw.url}/v1/admin/quotas", json={"key_id": acme_key["id"], "tokens_per_minute": None},
        headers=bearer(keys["beta-admin"]),
    )  # fmt: skip
    assert other.status_code == 404
    # Removed: both processes serve beta again within a sync interval.
    r = httpx.post(f"{gw.url}/v1/admin/quotas", json={"tenant": "beta", "requests_per_minute": None}, headers=admin)
    assert r.status_code == 200 and r.json()["requests_per_minute"] is None
    time.sleep(1.5)
    assert all(call(url, keys["beta-user"]).status_code == 200 for url in urls)


def test_the_sliding_window_and_an_outage_of_the_database(tmp_path):
    from gateway.errors import RateLimited
    from gateway.store import db
    from gateway.store.quotas import Limits, set_limits, usage
    from gateway.tenants.principal import Principal
    from gateway.tenants.quotas import QuotaBook, seconds_until_below, window_estimate

    # The window's arithmetic: the previous minute slides out linearly.
    assert window_estimate(60, 0, 30) == 30 and window_estimate(60, 10, 45) == 25
    assert seconds_until_below(60, 0, 30, 15) == pytest.approx(15)  # 60 * (1 - t/60) <= 15 at t = 45
    assert seconds_until_below(0, 10, 20, 4) == pytest.approx(40 + 36)  # in the next minute, 10 * (1 - t/60) <= 4

    now = [6_000_000.0]  # a minute's start
    sqlite = f"sqlite:///{tmp_path / 'q.db'}"
    db.upgrade(sqlite)
    # A database nothing answers on: every exchange fails, and the limits hold on this process's own counts.
    down = db.connect("postgresql://nobody@127.0.0.1:9/none", connect_timeout_s=1)
    book = QuotaBook(down, clock=lambda: now[0])
    book.limits = {"tenant:t": Limits(requests_per_minute=3)}
    user = Principal(tenant="t", role="user")
    for _ in range(3):
        assert book.admit(user) is not None
    with pytest.raises(RateLimited) as refused:
        book.admit(user)
    assert refused.value.retry_after == 80  # this minute: 3; a third of them must slide out of the next one
    assert book.admit(Principal(tenant="other", role="user")) is None  # no limit: nothing counted

    import asyncio

    from sqlalchemy.exc import SQLAlchemyError

    with pytest.raises(SQLAlchemyError):
        asyncio.run(book.sync())
    with pytest.raises(RateLimited):  # the counts were kept
        book.admit(user)
    # The database is back (with the limit the test set in memory): what was counted during the outage is written.
    book.db = db.connect(sqlite)
    set_limits(book.db, tenant="t", requests_per_minute=3)
    asyncio.run(book.sync())
    minute = int(now[0] // 60)
    assert usage(book.db, ["tenant:t"], [minute]) == {("tenant:t", minute): (3, 0)}
    # Half of the next minute later, half of the previous minute's 3 requests are still in the window.
    now[0] += 90
    assert book.admit(user) is not None  # 1.5 + 0 + 1 <= 3
    book.db.dispose()
    down.dispose()


# -- isolation over every route -------------------------------------------------------------------------------------

# Each route of the app, by method and path, and what a tenant may do there:
#   serving   - a client key's route; a rollout of another tenant named in its path or X-Rollout-Id reads 404
#   no-data   - a client key's route that reads no tenant's data (models, token counting)
#   rollout   - one rollout's data: another tenant's admin key gets 404, the same answer as for an unknown id
#   tenant    - an admin route that lists or writes several records: a tenant admin sees and touches its own only
#   global    - what all tenants share (the policy, the API schema): the global admin key only
#   schema    - the API's schema and its pages: no tenant's records (the global admin key only in production)
#   console   - the operator console's pages of what all tenants share: the global admin's only
#   console-tenant - the console's rollouts: a tenant admin signed in sees its own tenant's only
#   public    - health, metrics and the console's sign-in form: no tenant's records
ROUTES: dict[tuple[str, str], str] = {
    ("POST", "/v1/chat/completions"): "serving",
    ("POST", "/rollouts/{rollout_id}/v1/chat/completions"): "serving",
    ("POST", "/v1/completions"): "serving",
    ("POST", "/rollouts/{rollout_id}/v1/completions"): "serving",
    ("POST", "/v1/messages"): "serving",
    ("POST", "/rollouts/{rollout_id}/v1/messages"): "serving",
    ("POST", "/v1/responses"): "serving",
    ("POST", "/rollouts/{rollout_id}/v1/responses"): "serving",
    ("GET", "/v1/models"): "no-data",
    ("GET", "/rollouts/{rollout_id}/v1/models"): "no-data",
    ("GET", "/v1/models/{model_id:path}"): "no-data",
    ("POST", "/v1/messages/count_tokens"): "no-data",
    ("POST", "/rollouts/{rollout_id}/v1/messages/count_tokens"): "no-data",
    ("POST", "/v1/rollouts/{rollout_id}/reward"): "rollout",
    ("POST", "/v1/rollouts/{rollout_id}/finish"): "rollout",
    ("GET", "/v1/rollouts/{rollout_id}"): "rollout",
    ("GET", "/v1/rollouts/{rollout_id}/tree"): "rollout",
    ("POST", "/v1/rollouts"): "tenant",
    ("GET", "/v1/rollouts"): "tenant",
    ("POST", "/v1/feedback"): "tenant",
    ("POST", "/v1/admin/forget"): "tenant",
    ("POST", "/v1/admin/keys"): "tenant",
    ("GET", "/v1/admin/keys"): "tenant",
    ("POST", "/v1/admin/keys/{key_id}/revoke"): "tenant",
    ("POST", "/v1/admin/quotas"): "tenant",
    ("GET", "/v1/admin/quotas"): "tenant",
    ("GET", "/v1/policy"): "global",
    ("POST", "/v1/policy/pin"): "global",
    ("POST", "/v1/policy/unpin"): "global",
    ("POST", "/v1/policy/rollback"): "global",
    ("POST", "/v1/policy/promote"): "global",
    ("POST", "/v1/policy/reject"): "global",
    ("GET", "/openapi.json"): "schema",
    ("GET", "/docs"): "schema",
    ("GET", "/redoc"): "schema",
    ("GET", "/dashboard"): "console",
    ("GET", "/dashboard/rewards"): "console",
    ("GET", "/dashboard/steps"): "console",
    ("GET", "/dashboard/rollouts"): "console-tenant",
    ("GET", "/dashboard/rollouts/{rollout_id}"): "console-tenant",
    ("GET", "/dashboard/versions"): "console",
    ("POST", "/dashboard/policy/{action}"): "console",
    ("GET", "/health"): "public",
    ("GET", "/metrics"): "public",
    ("GET", "/dashboard/login"): "public",
    ("POST", "/dashboard/login"): "public",
    ("POST", "/dashboard/logout"): "public",
}


def app_routes(app: Any) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()

    def walk(routes: Any) -> None:
        for route in routes:
            if hasattr(route, "path"):
                found.update((method, route.path) for method in (route.methods or ()) if method != "HEAD")
            else:  # an included router
                walk(route.original_router.routes if hasattr(route, "original_router") else route.routes)

    walk(app.routes)
    return found


def fill(path: str, **values: str) -> str:
    for name, value in values.items():
        path = path.replace("{" + name + "}", value)
    return path


def body_for(path: str) -> dict[str, Any]:
    if path.endswith("/chat/completions"):
        return {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
    if path.endswith("/completions"):
        return {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
    if path.endswith("/messages") or path.endswith("/count_tokens"):
        return {"model": "tiny", "max_tokens": 4, "messages": MESSAGES}
    if path.endswith("/responses"):
        return {"model": "tiny", "input": "Hello", "max_output_tokens": 4}
    if path.endswith("/reward"):
        return {"value": 1.0}
    if path.endswith("/finish"):
        return {"status": "completed"}
    return {}


def same_answer(theirs: httpx.Response, unknown: httpx.Response, their_id: str, unknown_id: str) -> bool:
    """Whether the refusal for another tenant's id is the one for an id that does not exist (nothing tells them
    apart)."""
    return theirs.status_code == unknown.status_code and theirs.text.replace(their_id, "<id>") == unknown.text.replace(
        unknown_id, "<id>"
    )


def test_every_route_keeps_tenants_apart(gw, keys):
    missing = app_routes(gw.app) - set(ROUTES)
    assert not missing, f"routes with no tenant decision (classify them in ROUTES): {sorted(missing)}"
    assert not set(ROUTES) - app_routes(gw.app), "ROUTES names routes the app no longer has"

    # acme's records: an explicit rollout (with a call), a session rollout, a stored response, a call.
    created = httpx.post(f"{gw.url}/v1/rollouts", json={"task_id": "t"}, headers=bearer(keys["acme-admin"])).json()
    acme_rollout = created["id"]
    served = chat(gw, created["api_key"], MESSAGES, **{"X-Rollout-Id": acme_rollout})
    assert served.status_code == 200 and created["tenant"] == "acme"
    acme_call = served.headers["x-clawgate-call-id"]
    session = chat(gw, keys["acme-user"], MESSAGES, **{"X-Rollout-Id": "acme-session-1"})
    assert session.status_code == 200
    gw.flush()
    unknown = "ro-nonexistent0000"
    beta_admin, beta_user, acme_admin = (
        bearer(keys["beta-admin"]),
        bearer(keys["beta-user"]),
        bearer(keys["acme-admin"]),
    )
    checked: dict[str, int] = {}
    for (method, path), kind in sorted(ROUTES.items()):
        checked[kind] = checked.get(kind, 0) + 1
        body = body_for(path)
        if kind == "serving":
            # A rollout of another tenant, in the path or in X-Rollout-Id, reads "not found".
            for target in (acme_rollout, "acme-session-1"):
                if "{rollout_id}" in path:
                    r = httpx.request(method, gw.url + fill(path, rollout_id=target), json=body, headers=beta_user)
                else:
                    r = httpx.request(method, gw.url + path, json=body, headers={**beta_user, "X-Rollout-Id": target})
                assert r.status_code == 404, (path, target, r.text)
                assert target in r.text and "not found" in r.text, (path, r.text)
            # The same route serves beta's own rollout.
            own = "beta-own-" + path.strip("/").replace("/", "-").replace("{rollout_id}", "x")
            if "{rollout_id}" in path:
                r = httpx.request(method, gw.url + fill(path, rollout_id=own), json=body, headers=beta_user, timeout=60)
            else:
                r = httpx.request(
                    method, gw.url + path, json=body, headers={**beta_user, "X-Rollout-Id": own}, timeout=60
                )
            assert r.status_code == 200, (path, r.text)
        elif kind == "no-data":
            url = gw.url + fill(path, rollout_id=acme_rollout, **{"model_id:path": "tiny"})
            r = httpx.request(method, url, json=body or None, headers=beta_user)
            assert r.status_code == 200 and acme_rollout not in r.text, (path, r.text)
        elif kind == "rollout":
            theirs = httpx.request(method, gw.url + fill(path, rollout_id=acme_rollout), json=body, headers=beta_admin)
            none = httpx.request(method, gw.url + fill(path, rollout_id=unknown), json=body, headers=beta_admin)
            assert theirs.status_code == 404, (path, theirs.text)
            assert same_answer(theirs, none, acme_rollout, unknown), (path, theirs.text, none.text)
            user = httpx.request(method, gw.url + fill(path, rollout_id=acme_rollout), json=body, headers=beta_user)
            assert user.status_code == 403, (path, user.text)
            if method == "GET":  # its own tenant's admin reads it
                mine = httpx.get(gw.url + fill(path, rollout_id=acme_rollout), headers=acme_admin)
                assert mine.status_code == 200 and mine.json()["rollout_id" if path.endswith("tree") else "id"] == (
                    acme_rollout
                )
        elif kind == "global":
            r = httpx.request(method, gw.url + path, json=body or None, headers=beta_admin)
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only", (path, r.text)
            if method == "GET":
                assert httpx.get(gw.url + path, headers=bearer(ADMIN)).status_code == 200, path
        elif kind in ("console", "console-tenant"):  # without a session: to the sign-in form
            url = gw.url + fill(path, rollout_id=acme_rollout, action="pin")
            r = httpx.request(method, url, headers=beta_admin, follow_redirects=False)
            assert r.status_code == 303 and "/dashboard/login" in r.headers["location"], (path, r.status_code)
            assert acme_rollout not in r.text
        elif kind in ("public", "schema"):
            r = httpx.request(method, gw.url + path, headers=beta_admin)
            assert r.status_code < 500 and acme_rollout not in r.text and acme_call not in r.text, (path, r.text)
    assert checked["serving"] == 8 and checked["rollout"] == 4 and checked["global"] == 6

    # The console: a tenant's user key does not sign in; its admin key does, and sees its tenant's rollouts only.
    form = {"key": keys["beta-user"], "next": "/dashboard"}
    assert httpx.post(f"{gw.url}/dashboard/login", data=form, follow_redirects=False).status_code == 401
    console = httpx.Client(base_url=gw.url, timeout=30)
    signed_in = console.post("/dashboard/login", data={"key": keys["beta-admin"], "next": "/dashboard"})
    assert signed_in.status_code == 303 and signed_in.headers["location"] == "/dashboard/rollouts"
    beta_own = "beta-own-v1-chat-completions"
    for (method, path), kind in ROUTES.items():
        url = fill(path, rollout_id=acme_rollout, action="pin")
        if kind == "console":
            r = console.request(method, url)
            assert r.status_code == 403 and acme_rollout not in r.text, (path, r.status_code)
        elif kind == "console-tenant" and "{rollout_id}" in path:
            theirs, none = console.get(url), console.get(fill(path, rollout_id=unknown))
            assert theirs.status_code == 404 and same_answer(theirs, none, acme_rollout, unknown), path
            assert console.get(fill(path, rollout_id=beta_own)).status_code == 200
        elif kind == "console-tenant":
            page = console.get(url)
            assert page.status_code == 200 and beta_own in page.text, path
            assert acme_rollout not in page.text and "acme-session-1" not in page.text
    everything = httpx.Client(base_url=gw.url, timeout=30)
    everything.post("/dashboard/login", data={"key": ADMIN, "next": "/dashboard"})
    assert acme_rollout in everything.get("/dashboard/rollouts").text

    # The tenant routes, one by one.
    listed = httpx.get(f"{gw.url}/v1/rollouts", headers=beta_admin).json()["data"]
    assert listed and all(r["tenant"] == "beta" for r in listed)
    assert httpx.get(f"{gw.url}/v1/rollouts?tenant=acme", headers=beta_admin).json()["data"] == []
    everyone = httpx.get(f"{gw.url}/v1/rollouts?limit=500", headers=bearer(ADMIN)).json()["data"]
    assert {acme_rollout, "acme-session-1"} <= {r["id"] for r in everyone}
    assert {r["tenant"] for r in everyone} == {"acme", "beta"}
    r = httpx.post(f"{gw.url}/v1/rollouts", json={"tenant": "acme"}, headers=beta_admin)
    assert r.status_code == 403 and r.json()["error"]["param"] == "tenant"
    theirs = httpx.post(f"{gw.url}/v1/feedback", json={"call_id": acme_call, "value": 1}, headers=beta_admin)
    none = httpx.post(f"{gw.url}/v1/feedback", json={"call_id": "call-nonexistent", "value": 1}, headers=beta_admin)
    assert theirs.status_code == none.status_code == 404
    assert same_answer(theirs, none, acme_call, "call-nonexistent"), (theirs.text, none.text)
    for response_id in (served.json()["id"], session.json()["id"]):
        r = httpx.post(f"{gw.url}/v1/feedback", json={"response_id": response_id, "value": 1}, headers=beta_admin)
        assert r.status_code == 404, r.text
    assert (
        httpx.post(f"{gw.url}/v1/feedback", json={"call_id": acme_call, "value": 1}, headers=acme_admin).status_code
        == 201
    )
    forget = httpx.post(
        f"{gw.url}/v1/admin/forget", json={"rollouts": [acme_rollout], "calls": [acme_call], "tenants": ["acme"]},
        headers=beta_admin,
    )  # fmt: skip
    assert forget.status_code == 200 and sum(forget.json()["deleted"].values()) == 0
    assert set(forget.json()["not_found"]) == {acme_rollout, acme_call, "acme"}
    detail = httpx.get(f"{gw.url}/v1/rollouts/{acme_rollout}", headers=acme_admin).json()
    assert len(detail["calls"]) == 1 and len(detail["rewards"]) == 1
    assert {k["tenant"] for k in httpx.get(f"{gw.url}/v1/admin/keys", headers=beta_admin).json()["data"]} == {"beta"}
    # Rollout keys stay within their rollout, and a tenant user key reads no admin route.
    other = httpx.get(f"{gw.url}/v1/rollouts/acme-session-1", headers=bearer(created["api_key"]))
    assert other.status_code == 403
    assert httpx.post(f"{gw.url}/v1/admin/keys", json={}, headers=beta_user).status_code == 403
    # Revoking the tenant admin's key ends its console session.
    beta_admin_id = keys["beta-admin"].split("-")[1]
    assert httpx.post(f"{gw.url}/v1/admin/keys/{beta_admin_id}/revoke", headers=bearer(ADMIN)).status_code == 200
    ended = console.get("/dashboard/rollouts", follow_redirects=False)
    assert ended.status_code == 303 and "/dashboard/login" in ended.headers["location"]


def test_a_conversation_never_continues_across_tenants(gw, keys):
    # acme's conversation; acme continuing it joins its rollout (the control), beta sending the same turns does not.
    first = chat(gw, keys["acme-user"], MESSAGES)
    answer = first.json()["choices"][0]["message"]["content"] or ""
    rollout = first.headers["x-clawgate-rollout-id"]
    longer = [*MESSAGES, {"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    same = chat(gw, keys["acme-user"], longer)
    assert same.headers["x-clawgate-rollout-id"] == rollout, "acme's own continuation joins its conversation"
    crossed = chat(gw, keys["beta-user"], longer)
    assert crossed.status_code == 200 and crossed.headers["x-clawgate-rollout-id"] != rollout
    gw.flush()
    admin = bearer(ADMIN)
    beta_rollout = httpx.get(f"{gw.url}/v1/rollouts/{crossed.headers['x-clawgate-rollout-id']}", headers=admin).json()
    assert beta_rollout["tenant"] == "beta"
    assert all(c["parent_call_id"] is None for c in beta_rollout["calls"]), beta_rollout["calls"]
    assert len(httpx.get(f"{gw.url}/v1/rollouts/{rollout}", headers=admin).json()["calls"]) == 2

    # previous_response_id: beta cannot continue acme's response; the answer is the one for an unknown id.
    acme = openai.OpenAI(base_url=gw.v1, api_key=keys["acme-user"], max_retries=0)
    beta = openai.OpenAI(base_url=gw.v1, api_key=keys["beta-user"], max_retries=0)
    stored = acme.responses.create(model="tiny", input="Remember this.", max_output_tokens=4)
    assert acme.responses.create(
        model="tiny", input="Go on.", previous_response_id=stored.id, max_output_tokens=4
    ).id.startswith("resp")
    with pytest.raises(openai.BadRequestError) as theirs:
        beta.responses.create(model="tiny", input="Go on.", previous_response_id=stored.id, max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as unknown:
        beta.responses.create(model="tiny", input="Go on.", previous_response_id="resp_unknown", max_output_tokens=4)
    assert theirs.value.body["param"] == "previous_response_id"
    assert str(theirs.value.body["message"]).replace(stored.id, "X") == str(unknown.value.body["message"]).replace(
        "resp_unknown", "X"
    )


# -- forget, prune and export by tenant ------------------------------------------------------------------------


def test_forget_prune_and_export_by_tenant(gw, keys, postgres_url, capsys, tmp_path):
    from clawgate.cli import main

    for tenant in ("acme", "beta"):
        for n in range(2):
            assert chat(gw, keys[f"{tenant}-user"], MESSAGES, **{"X-Rollout-Id": f"{tenant}-{n}"}).status_code == 200
    assert chat(gw, CLIENT, MESSAGES, **{"X-Rollout-Id": "default-0"}).status_code == 200
    gw.flush()
    url = ["--database-url", postgres_url]
    out = tmp_path / "acme.jsonl"
    assert main(["export", "--tenant", "acme", "--out", str(out), *url]) == 0
    exported = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in exported) == ["acme-0", "acme-1"] and {r["tenant"] for r in exported} == {"acme"}

    engine = connect(postgres_url)
    age(engine, ["acme-0", "beta-0", "default-0"], 40)
    assert main(["db", "prune", "--older-than", "30d", "--tenant", "beta", "--json", *url]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"]["rollouts"] == 1
    assert count(engine, "rollouts", "id = 'beta-0'") == 0
    assert count(engine, "rollouts", "id IN ('acme-0', 'default-0', 'beta-1')") == 3

    assert main(["forget", "--tenant", "acme", "--json", *url]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["deleted"]["rollouts"] == 2 and report["deleted"]["calls"] == 2
    assert count(engine, "rollouts", "tenant = 'acme'") == 0 and count(engine, "calls") == 2
    assert main(["forget", "--tenant", "acme", "--json", *url]) == 0  # idempotent
    assert json.loads(capsys.readouterr().out)["not_found"] == ["acme"]
    # The admin route forgets a tenant too.
    r = httpx.post(f"{gw.url}/v1/admin/forget", json={"tenants": ["beta"]}, headers=bearer(ADMIN))
    assert r.status_code == 200 and r.json()["deleted"]["rollouts"] == 1, r.text
    assert count(engine, "rollouts", "tenant = 'beta'") == 0 and count(engine, "rollouts") == 1
    assert orphans(engine) == {}
    # The export file no longer holds them (it held nothing else, so it is gone).
    assert not out.exists() or out.read_text().strip() == ""
    engine.dispose()
