"""Harness adapters: the configuration each writes into the sandbox's private home, how the rollout's URL and
key reach it, how its exit is read, and detection with install hints (OpenClaw's Node.js requirement)."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest

from runner.harnesses import HARNESSES, HarnessContext, Outcome, detect_all, make_harness
from runner.harnesses.base import node_problem, node_version
from runner.harnesses.openclaw import NODE_MINIMUM


@pytest.fixture
def ctx(tmp_path: Path) -> HarnessContext:
    for d in ("work", "home"):
        (tmp_path / d).mkdir()
    return HarnessContext(
        rollout_id="ro-123",
        instruction="Fix the bug.",
        workspace=tmp_path / "work",
        home=tmp_path / "home",
        base_url="http://127.0.0.1:8080/rollouts/ro-123/v1",
        api_key="cgr-secret",
        model="tiny",
        max_turns=5,
        timeout=90,
    )


@pytest.fixture
def fake_exe(tmp_path: Path) -> str:
    exe = tmp_path / "bin" / "tool"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\necho 1.2.3\n")
    exe.chmod(0o755)
    return str(exe)


def test_builtin_runs_the_agent_with_the_key_in_the_environment(ctx):
    inv = make_harness("builtin").prepare(ctx)
    assert inv.argv[:3] == [sys.executable, "-m", "runner.agent"]
    assert "cgr-secret" not in " ".join(inv.argv)  # never on a command line
    assert inv.env["CLAWGATE_ROLLOUT_KEY"] == "cgr-secret" and inv.network == "gateway"
    assert (ctx.home / "instruction.txt").read_text() == "Fix the bug."
    assert inv.argv[inv.argv.index("--base-url") + 1] == ctx.base_url
    assert inv.argv[inv.argv.index("--max-turns") + 1] == "5"


def test_claude_code_gets_the_rollout_url_without_v1(ctx, fake_exe):
    inv = make_harness("claude-code", fake_exe).prepare(ctx)
    assert inv.argv[:3] == [fake_exe, "-p", "Fix the bug."]
    assert inv.env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8080/rollouts/ro-123"
    assert inv.env["ANTHROPIC_API_KEY"] == "cgr-secret" and inv.env["ANTHROPIC_MODEL"] == "tiny"
    assert inv.env["ANTHROPIC_SMALL_FAST_MODEL"] == "tiny" and inv.env["IS_SANDBOX"] == "1"


def test_codex_gets_a_responses_provider_in_its_private_home(ctx, fake_exe):
    inv = make_harness("codex", fake_exe).prepare(ctx)
    config = tomllib.loads((ctx.home / ".codex" / "config.toml").read_text())
    assert config["model"] == "tiny" and config["model_provider"] == "clawgate"
    provider = config["model_providers"]["clawgate"]
    assert provider["base_url"] == ctx.base_url and provider["wire_api"] == "responses"
    assert inv.env[provider["env_key"]] == "cgr-secret" and inv.env["CODEX_HOME"] == str(ctx.home / ".codex")
    assert inv.argv[1] == "exec" and inv.argv[-1] == "Fix the bug." and str(ctx.workspace) in inv.argv


def test_openclaw_gets_a_provider_in_its_private_state_dir(ctx, fake_exe):
    inv = make_harness("openclaw", fake_exe).prepare(ctx)
    config = json.loads(Path(inv.env["OPENCLAW_CONFIG_PATH"]).read_text())  # JSON is valid JSON5
    provider = config["models"]["providers"]["clawgate"]
    assert provider["baseUrl"] == ctx.base_url and provider["api"] == "openai-completions"
    assert provider["apiKey"] == "${CLAWGATE_ROLLOUT_KEY}" and inv.env["CLAWGATE_ROLLOUT_KEY"] == "cgr-secret"
    assert config["agents"]["defaults"]["model"]["primary"] == "clawgate/tiny"
    assert inv.argv[1:3] == ["agent", "--local"] and "ro-123" in inv.argv and "Fix the bug." in inv.argv


def test_detection_reports_what_is_missing_with_an_install_hint(tmp_path, fake_exe):
    missing = make_harness("codex", str(tmp_path / "no-codex")).detect()
    assert not missing.available and "not found" in (missing.problem or "")
    assert "npm install -g @openai/codex" in missing.describe()
    found = make_harness("codex", fake_exe).detect()
    assert found.available and found.version == "1.2.3"
    assert make_harness("builtin").detect().available
    assert [d.name for d in detect_all()] == list(HARNESSES)
    with pytest.raises(ValueError, match="unknown harness 'vim'"):
        make_harness("vim")


def test_openclaw_needs_a_recent_node(fake_exe):
    node = node_version()
    openclaw = make_harness("openclaw", fake_exe).detect()
    if node is None or node < NODE_MINIMUM:
        assert not openclaw.available and "Node.js >= 24.16.0 is needed" in (openclaw.problem or "")
    else:
        assert openclaw.available
    assert "is needed" in (node_problem((999, 0, 0)) or "")


@pytest.mark.parametrize(
    ("name", "code", "stdout", "stderr", "outcome"),
    [
        ("builtin", 0, "", "agent: the model ended its turn after 1 turn(s)", Outcome.DONE),
        ("builtin", 3, "", "agent: turn limit reached (8 turns) after 8 turn(s)", Outcome.GAVE_UP),
        ("builtin", 75, "", "agent: gateway unreachable: ConnectError after 0 turn(s)", Outcome.INFRA),
        (
            "claude-code",
            0,
            '{"type": "result", "subtype": "success", "is_error": false, "result": "ok"}',
            "",
            Outcome.DONE,
        ),
        ("claude-code", 1, '{"type": "result", "subtype": "error_max_turns", "is_error": true}', "", Outcome.GAVE_UP),
        (
            "claude-code",
            1,
            '{"type": "result", "is_error": true, "result": "API Error: Connection error."}',
            "",
            Outcome.INFRA,
        ),
        ("claude-code", 1, "", "Error: connect ECONNREFUSED 127.0.0.1:8080", Outcome.INFRA),
        ("codex", 1, "", "stream error: model refused", Outcome.GAVE_UP),
        ("codex", 1, "", "error sending request for url (http://127.0.0.1:8080/v1/responses)", Outcome.INFRA),
    ],
)
def test_exits_are_read_as_done_gave_up_or_infrastructure(name, code, stdout, stderr, outcome):
    assert make_harness(name).outcome(code, stdout, stderr)[0] is outcome
