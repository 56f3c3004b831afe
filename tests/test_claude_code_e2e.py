"""Claude Code itself (the npm package) pointed at a live gateway with `ANTHROPIC_BASE_URL`.

The package is the version pinned in `tests/harnesses/package-lock.json`, installed with the other harnesses
(`tests/npm_harnesses.py`) into `.clawgate/test-cache/npm` (gitignored), so reruns reuse it; without npm, or when the
registry refuses, the tests skip and say why. Two runs of `claude -p "say hi" --max-turns 2`:

- against a scripted answer, Claude Code must print it and exit 0 (the whole protocol round trip works);
- against the real tiny model, every call is captured with its token ids under the session's rollout id. The
  random model never ends its turn within the server's 64-token cap, so each answer stops with
  ``stop_reason: "max_tokens"``; Claude Code then asks for a continuation three times (each spliced onto the
  previous answer's raw tokens) and gives up with exit code 1 and an "output token maximum" message.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from gateway.store.db import connect
from tests.fakes import ScriptedEngine
from tests.npm_harnesses import harness_exe

# Each call with the real model re-reads a ~32k-token prompt (10-20 s on two CPU cores, depending on load): the
# whole run took 60 s here and 103 s with both cores taken by other work; the limit leaves room for a shared machine.
TIMEOUT_S = 400


@pytest.fixture(scope="session")
def claude_exe() -> Path:
    return harness_exe("claude")


def run_claude(exe: Path, base_url: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "test",
        "ANTHROPIC_MODEL": "tiny",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "IS_SANDBOX": "1",  # lets it run as root (CI containers)
    }
    t0 = time.monotonic()
    proc = subprocess.run(
        [str(exe), "-p", "say hi", "--max-turns", "2"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    return proc, time.monotonic() - t0


def captured(gw: Any) -> list[dict[str, Any]]:
    gw.flush()
    engine = connect(gw.settings.database_url)
    with engine.connect() as conn:
        found = conn.execute(sa.text("SELECT * FROM calls ORDER BY started_at")).mappings().all()
    engine.dispose()
    return [dict(r) for r in found]


def test_claude_code_prints_the_answer_and_exits_0(claude_exe, gateway_factory, tiny_tokenizer, tmp_path):
    engine = ScriptedEngine(tiny_tokenizer)
    for _ in range(8):  # enough for any side call Claude Code makes besides the main one
        engine.push("Hi from clawgate!")
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, model_aliases="*")
    proc, took = run_claude(claude_exe, gw.url, tmp_path)
    print(f"claude -p (scripted engine) took {took:.1f} s")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Hi from clawgate!" in proc.stdout
    calls = captured(gw)
    assert calls and all(c["status"] == "ok" and c["api"] == "messages" for c in calls)
    assert {c["rollout_id"] for c in calls} == {calls[0]["rollout_id"]}
    assert calls[0]["rollout_id"].startswith("claude-code-")


@pytest.mark.slow  # four calls of ~32k prompt tokens each: 50-80 s on two CPU cores
def test_claude_code_against_the_tiny_model(claude_exe, gateway_factory, tmp_path):
    gw = gateway_factory(model_aliases="*", max_tokens=64)
    proc, took = run_claude(claude_exe, gw.url, tmp_path)
    print(f"claude -p (tiny model) took {took:.1f} s, exit {proc.returncode}")
    calls = captured(gw)
    assert calls, proc.stdout[-2000:] + proc.stderr[-2000:]
    # See the module docstring: a random model cut off by the server cap makes Claude Code give up with exit 1.
    if proc.returncode != 0:
        assert proc.returncode == 1 and "output token maximum" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        assert all(c["finish_reason"] == "length" for c in calls)
    [rollout] = {c["rollout_id"] for c in calls}
    assert rollout.startswith("claude-code-")
    for c in calls:
        assert c["status"] == "ok" and c["api"] == "messages" and not c["is_subagent"]
        assert c["prompt_len"] > 1000 and 1 <= c["completion_len"] <= 64
    # Claude Code's continuations echo the previous answer: each is spliced onto its raw tokens.
    assert all(c["render_mode"] == "spliced" for c in calls[1:])
    assert gw.state.metrics.drift._value.get() == 0
