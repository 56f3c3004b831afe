"""No secret reaches a log line or a printed line: client keys, the admin key, per-rollout keys and a database
password, used rightly and wrongly.

Three layers: ``redact_url`` over the URL shapes a deployment uses; the gateway's log records at DEBUG level
(in-process, ``caplog``); and the real processes — `clawgate up` (gateway + trainer child) on PostgreSQL with a
password in its database URL, `clawgate train --once` and `clawgate serve` on the same kind of URL — whose whole
stdout and stderr are read after they exit.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from sqlalchemy.engine import make_url

from gateway.app import redact_url
from tests.conftest import free_port
from tests.fakes import ScriptedEngine
from tests.online import terminate

ROOT = Path(__file__).resolve().parent.parent

CLIENT_KEY = "sk-client-5f0c9a1e77d24b"
ADMIN_KEY = "adm-93be41d0c6a2417f"
# Characters a URL must escape (@ : / %), so the password appears percent-encoded in the URL and decoded in the
# driver; the distinctive core is in both forms, so looking for it finds a leak of either.
DB_PASSWORD_CORE = "S3cret-Pa55-q7Zk"
DB_PASSWORD = DB_PASSWORD_CORE + "@w:r/d%"


# --- redact_url -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "password", "kept"),
    [
        (
            "postgresql+psycopg://user:pw-8c1f2e@host:5432/db",
            "pw-8c1f2e",
            ["postgresql+psycopg://", "user", "host:5432", "/db"],
        ),
        (
            "postgresql+psycopg://clawgate:hunter2-x9@db.internal:6543/clawgate?sslmode=require&application_name=gw",
            "hunter2-x9",
            [
                "postgresql+psycopg://",
                "clawgate",
                "db.internal:6543",
                "/clawgate",
                "sslmode=require",
                "application_name=gw",
            ],
        ),
        (
            # @ : / % in the password, percent-encoded as a URL must carry them
            f"postgresql+psycopg://svc:{quote(DB_PASSWORD, safe='')}@10.0.0.5:5432/prod",
            DB_PASSWORD,
            ["postgresql+psycopg://", "svc", "10.0.0.5:5432", "/prod"],
        ),
        ("postgresql+psycopg://u:p%40ss%3Aw%2Frd@h.example/db", "p@ss:w/rd", ["u", "h.example", "/db"]),
        ("postgresql://u:pw-ipv6-77@[::1]:5432/db", "pw-ipv6-77", ["[::1]:5432", "/db"]),
        ("postgresql+psycopg://:only-pw-31@host/db", "only-pw-31", ["host", "/db"]),
        ("mysql+pymysql://root:R00t%25pw@localhost/app?charset=utf8mb4", "R00t%pw", ["localhost", "charset=utf8mb4"]),
    ],
    ids=["plain", "query", "special-characters", "percent-encoded", "ipv6", "no-user", "mysql"],
)
def test_redact_url_hides_the_password_and_keeps_the_rest(url, password, kept):
    redacted = redact_url(url)
    assert password not in redacted
    assert quote(password, safe="") not in redacted
    assert "***" in redacted, redacted
    for part in kept:
        assert part in redacted, f"{part!r} missing from {redacted!r}"
    # What is left still parses, and names the same place.
    parsed, original = make_url(redacted), make_url(url)
    assert (parsed.drivername, parsed.username, parsed.host, parsed.port, parsed.database) == (
        original.drivername,
        original.username,
        original.host,
        original.port,
        original.database,
    )
    assert dict(parsed.query) == dict(original.query)


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///./clawgate.db",
        "sqlite:////var/lib/clawgate/clawgate.db",
        "sqlite://",
        "postgresql+psycopg://postgres@127.0.0.1:5432/test",
        "postgresql+psycopg://postgres@127.0.0.1:5432/test?sslmode=disable",
    ],
)
def test_redact_url_leaves_a_url_without_a_password_as_it_is(url):
    assert redact_url(url) == url


@pytest.mark.parametrize("key", ["password", "sslpassword", "PASSWORD"])
def test_redact_url_hides_a_password_given_in_the_query(key):
    url = f"postgresql+psycopg://svc@db.internal:5432/prod?sslmode=require&{key}=q-pw-5x1d"
    redacted = redact_url(url)
    assert "q-pw-5x1d" not in redacted
    parsed = make_url(redacted)
    assert parsed.query[key] == "***" and parsed.query["sslmode"] == "require"
    assert (parsed.username, parsed.host, parsed.database) == ("svc", "db.internal", "prod")


def test_redact_url_of_garbage_says_so_and_repeats_nothing():
    assert redact_url("not a url: sk-or-pw-Zq81") == "<unparsable url>"


# --- the gateway's log records ----------------------------------------------------------------------------------


def test_no_key_appears_in_any_log_line(gateway_factory, tiny_tokenizer, caplog):
    caplog.set_level(logging.DEBUG)
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, api_keys=[CLIENT_KEY], admin_key=ADMIN_KEY)
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    created = httpx.post(gw.v1 + "/rollouts", json={"task_id": "t"}, headers=admin, timeout=30).json()
    rollout_key = created["api_key"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    for key in (CLIENT_KEY, rollout_key, "sk-wrong-key-1234567890", ADMIN_KEY):
        httpx.post(created["base_url"] + "/chat/completions", json=body, headers={"x-api-key": key}, timeout=30)
        httpx.post(gw.v1 + "/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)
        httpx.post(gw.v1 + "/feedback", json={"call_id": "nope", "value": 1}, headers={"x-api-key": key}, timeout=30)
    reward = httpx.post(
        f"{gw.v1}/rollouts/{created['id']}/reward",
        json={"value": 1},
        headers={"authorization": f"Bearer {rollout_key}"},
        timeout=30,
    )
    assert reward.status_code == 201
    gw.flush()
    lines = [record.getMessage() + (record.exc_text or "") for record in caplog.records]
    assert lines, "the gateway logged something to check"
    for secret in (CLIENT_KEY, ADMIN_KEY, rollout_key):
        leaked = [line for line in lines if secret in line]
        assert not leaked, f"a key reached the log: {leaked[:3]}"


# --- the real processes' output ---------------------------------------------------------------------------------


def with_password(url: str) -> str:
    """``url`` (a database on the local test server, trust auth: any password is accepted) with DB_PASSWORD."""
    return make_url(url).set(password=DB_PASSWORD).render_as_string(hide_password=False)


def clawgate(*args: str) -> list[str]:
    script = Path(sys.executable).with_name("clawgate")
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "clawgate.cli", *args]


def child_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWGATE_")}
    return {**env, "PYTHONPATH": str(ROOT), **{f"CLAWGATE_{k.upper()}": v for k, v in settings.items()}}


def leaks(text: str, secrets: dict[str, str]) -> list[str]:
    return [f"{name}: {line}" for line in text.splitlines() for name, s in secrets.items() if s in line]


class Captured:
    """A `clawgate` process whose stdout and stderr go to files (its own children write there too)."""

    def __init__(self, tmp: Path, name: str, command: list[str], env: dict[str, str]) -> None:
        self.out_path, self.err_path = tmp / f"{name}.stdout", tmp / f"{name}.stderr"
        with self.out_path.open("w") as out, self.err_path.open("w") as err:
            self.proc = subprocess.Popen(command, cwd=tmp, env=env, stdout=out, stderr=err, start_new_session=True)

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def stop(self, timeout: float = 90.0) -> int:
        return terminate(self.proc, timeout)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.stderr + self.stdout:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} (exit {self.proc.poll()}):\n{self.stderr[-4000:]}")
            time.sleep(0.3)

    def wait_healthy(self, base: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"exited with {self.proc.returncode}:\n{self.stderr[-4000:]}")
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"not healthy within {timeout}s:\n{self.stderr[-4000:]}")


@pytest.mark.postgres
def test_clawgate_up_and_train_print_no_secret(tmp_path, tiny_model_dir, postgres_url):
    """`clawgate up` with a password in CLAWGATE_DATABASE_URL, a client key and an admin key, at DEBUG: after real
    calls (right keys and wrong ones) and a SIGTERM, nothing it or its trainer child wrote holds a secret; then
    `clawgate train --once --database-url <password URL>` the same."""
    url = with_password(postgres_url)
    assert DB_PASSWORD_CORE in url and make_url(url).password == DB_PASSWORD
    where = make_url(postgres_url)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = child_env(
        database_url=url,
        api_keys=CLIENT_KEY,
        admin_key=ADMIN_KEY,
        model=str(tiny_model_dir),
        served_model_name="tiny",
        max_tokens="8",
        port=str(port),
        host="127.0.0.1",
        data_dir=str(tmp_path / "data"),
        adapter_dir=str(tmp_path / "adapters"),
        train_threads="1",
        log_level="debug",
    )
    up = Captured(tmp_path, "up", clawgate("up"), env)
    rollout_key = None
    try:
        up.wait_healthy(base, 180)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        with httpx.Client(base_url=base, timeout=120) as client:
            for _ in range(2):
                r = client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {CLIENT_KEY}"})
                assert r.status_code == 200, r.text
            created = client.post(
                "/v1/rollouts", json={"task_id": "t"}, headers={"authorization": f"Bearer {ADMIN_KEY}"}
            )
            assert created.status_code in (200, 201), created.text
            rollout_key = created.json()["api_key"]
            r = client.post(
                created.json()["base_url"] + "/chat/completions", json=body, headers={"x-api-key": rollout_key}
            )
            assert r.status_code == 200, r.text
            for wrong in ("sk-wrong-key-1234567890", DB_PASSWORD):
                r = client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {wrong}"})
                assert r.status_code == 401, r.text
        up.wait_for("training when", 120)  # the trainer child is up and has printed into the same files
    finally:
        rc = up.stop()
    assert rc == 0, up.stderr[-4000:]
    out, err = up.stdout, up.stderr
    assert err.strip(), "`clawgate up` printed nothing to check"
    secrets = {"database password": DB_PASSWORD_CORE, "client key": CLIENT_KEY, "admin key": ADMIN_KEY}
    if rollout_key is not None:
        secrets["rollout key"] = rollout_key
    found = leaks(out + "\n" + err, secrets)
    assert not found, "a secret reached `clawgate up`'s output:\n" + "\n".join(found[:5])
    # Capture worked and the URL was printed — redacted, but naming where it points.
    migrating = [line for line in err.splitlines() if line.startswith("migrating ")]
    assert migrating, err[-4000:]
    assert (
        "***" in migrating[0] and f"{where.host}:{where.port}" in migrating[0] and str(where.database) in migrating[0]
    )
    # Both processes' output is here: the gateway's, and its trainer child's (which got the URL from `up`).
    assert "serving the OpenAI/Anthropic APIs" in err and "policy@v0 loaded" in err and "training when" in err

    train = Captured(
        tmp_path,
        "train",
        clawgate("train", "--once", "--allow-empty", "--database-url", url, "--model", str(tiny_model_dir)),
        child_env(adapter_dir=str(tmp_path / "adapters"), data_dir=str(tmp_path / "data"), log_level="debug"),
    )
    try:
        rc = train.proc.wait(180)
    finally:
        train.stop()
    assert rc == 0, train.stderr[-4000:]
    out, err = train.stdout, train.stderr
    assert (out + err).strip() and "policy@v0 loaded" in err, err[-4000:]
    found = leaks(out + "\n" + err, {"database password": DB_PASSWORD_CORE})
    assert not found, "the database password reached `clawgate train`'s output:\n" + "\n".join(found[:5])


@pytest.mark.postgres
def test_clawgate_serve_names_an_unmigrated_database_without_its_password(tmp_path, postgres_server_url):
    """`clawgate serve` on an empty database refuses to start and says which database: by its redacted URL."""
    from tests import pg

    with pg.fresh_database(postgres_server_url) as empty:
        url = with_password(empty)
        serve = Captured(tmp_path, "serve", clawgate("serve"), child_env(database_url=url, port=str(free_port())))
        try:
            rc = serve.proc.wait(120)
        finally:
            serve.stop()
    out, err = serve.stdout, serve.stderr
    assert rc == 2, err[-4000:]
    assert DB_PASSWORD_CORE not in out + err, err
    where = make_url(empty)
    assert f"postgresql+psycopg://{where.username}:***@{where.host}:{where.port}/{where.database}" in err, err
