"""OpenClaw (``openclaw agent --local``: one embedded agent turn, no OpenClaw gateway daemon).

Its configuration is JSON5 (plain JSON is valid JSON5) at ``$OPENCLAW_CONFIG_PATH``, written into the sandbox's
private state directory: a ``clawgate`` entry under ``models.providers`` speaking OpenAI chat completions with
the rollout's base URL, the key taken from the environment (``${VAR}`` substitution), and the agent's default
model and workspace. OpenClaw needs Node.js >= 24.16; detection reports an older Node as the problem.
"""

from __future__ import annotations

import json

from runner.harnesses.base import Harness, HarnessContext, Invocation, node_problem

KEY_ENV = "CLAWGATE_ROLLOUT_KEY"
NODE_MINIMUM = (24, 16, 0)


def config_json5(ctx: HarnessContext) -> str:
    config = {
        "models": {
            "providers": {
                "clawgate": {
                    "baseUrl": ctx.base_url,
                    "apiKey": "${" + KEY_ENV + "}",
                    "api": "openai-completions",
                    "models": [{"id": ctx.model, "name": ctx.model}],
                }
            }
        },
        "agents": {"defaults": {"model": {"primary": f"clawgate/{ctx.model}"}, "workspace": str(ctx.workspace)}},
    }
    return json.dumps(config, indent=2) + "\n"


class OpenClawHarness(Harness):
    name = "openclaw"
    binary = "openclaw"
    install_hint = "npm install -g openclaw (needs Node.js >= 24.16)"

    def requirement_problem(self) -> str | None:
        return node_problem(NODE_MINIMUM)

    def prepare(self, ctx: HarnessContext) -> Invocation:
        exe = self.executable()
        assert exe is not None
        state = ctx.home / ".openclaw"
        state.mkdir(parents=True, exist_ok=True)
        config = state / "openclaw.json"
        config.write_text(config_json5(ctx), encoding="utf-8")
        argv = [
            exe,
            "agent",
            "--local",
            "--session-id",
            ctx.rollout_id,
            "--message",
            ctx.instruction,
            "--timeout",
            str(max(1, int(ctx.timeout))),
            "--json",
        ]
        env = {"OPENCLAW_STATE_DIR": str(state), "OPENCLAW_CONFIG_PATH": str(config), KEY_ENV: ctx.api_key}
        return Invocation(argv, env)
