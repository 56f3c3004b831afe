"""Codex CLI (``codex exec``) with a ``clawgate`` model provider speaking the Responses API.

Codex reads providers only from ``$CODEX_HOME/config.toml``; the adapter writes one into the sandbox's private
home (``wire_api = "responses"``, the key read from an environment variable). Codex's own sandbox is turned
off (``--dangerously-bypass-approvals-and-sandbox``): it would need namespaces inside ours, and ours is the
boundary.
"""

from __future__ import annotations

import json

from runner.harnesses.base import Harness, HarnessContext, Invocation

KEY_ENV = "CLAWGATE_ROLLOUT_KEY"


def config_toml(base_url: str, model: str) -> str:
    # json.dumps gives a valid TOML basic string for any URL or model name.
    return "\n".join(
        [
            f"model = {json.dumps(model)}",
            'model_provider = "clawgate"',
            "",
            "[model_providers.clawgate]",
            'name = "clawgate"',
            f"base_url = {json.dumps(base_url)}",
            f"env_key = {json.dumps(KEY_ENV)}",
            'wire_api = "responses"',
            "",
        ]
    )


class CodexHarness(Harness):
    name = "codex"
    binary = "codex"
    install_hint = "npm install -g @openai/codex"

    def prepare(self, ctx: HarnessContext) -> Invocation:
        exe = self.executable()
        assert exe is not None
        codex_home = ctx.home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(config_toml(ctx.base_url, ctx.model), encoding="utf-8")
        argv = [
            exe,
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            "--cd",
            str(ctx.workspace),
            ctx.instruction,
        ]
        return Invocation(argv, {"CODEX_HOME": str(codex_home), KEY_ENV: ctx.api_key})
