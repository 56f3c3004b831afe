"""The built-in harness: ``runner.agent``, a minimal tool-using agent loop (a white-box baseline).

It needs nothing installed beyond this package, speaks OpenAI chat completions, and runs inside the sandbox
like any other harness. Its exit codes are its completion protocol (see ``runner.agent``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from runner import agent
from runner.harnesses.base import Detection, Harness, HarnessContext, Invocation, Outcome, last_line

PROJECT_ROOT = Path(agent.__file__).resolve().parent.parent
KEY_ENV = "CLAWGATE_ROLLOUT_KEY"


class BuiltinHarness(Harness):
    name = "builtin"
    install_hint = "nothing to install (part of clawgate)"

    def detect(self) -> Detection:
        return Detection(self.name, True, sys.executable, "clawgate runner.agent", install_hint=self.install_hint)

    def prepare(self, ctx: HarnessContext) -> Invocation:
        instruction = ctx.home / "instruction.txt"
        instruction.write_text(ctx.instruction, encoding="utf-8")
        argv = [
            sys.executable,
            "-m",
            "runner.agent",
            "--base-url",
            ctx.base_url,
            "--model",
            ctx.model,
            "--instruction-file",
            str(instruction),
            "--max-turns",
            str(ctx.max_turns),
            "--api-key-env",
            KEY_ENV,
        ]
        # The key goes in the environment, not argv: command lines are visible to every process.
        return Invocation(argv, {KEY_ENV: ctx.api_key, "PYTHONPATH": str(PROJECT_ROOT)})

    def outcome(self, exit_code: int, stdout: str, stderr: str) -> tuple[Outcome, str]:
        said = last_line(stderr).removeprefix("agent: ")  # the agent's last line says why it stopped
        if exit_code == agent.EXIT_DONE:
            return Outcome.DONE, "the model ended its turn"
        if exit_code in (agent.EXIT_INFRA, agent.EXIT_GAVE_UP):
            return (Outcome.INFRA if exit_code == agent.EXIT_INFRA else Outcome.GAVE_UP), said
        return Outcome.GAVE_UP, f"agent exited with {exit_code}: {said}"
