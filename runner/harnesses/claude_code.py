"""Claude Code (``claude -p``), pointed at the rollout through ``ANTHROPIC_BASE_URL``.

Claude Code speaks Anthropic Messages and appends ``/v1/messages`` to its base URL, so it gets the rollout's
``base_url`` without the trailing ``/v1``; the rollout key goes in ``ANTHROPIC_API_KEY``. Every model name it
uses (main, small/fast) is set to the served model, so the gateway needs no aliases. It runs with permission
prompts off (``--dangerously-skip-permissions``: the sandbox is the boundary, and nobody is there to answer)
and ``IS_SANDBOX=1``, which it requires for that when running as root.
"""

from __future__ import annotations

import json

from runner.harnesses.base import (
    CONNECTION_ERRORS,
    Harness,
    HarnessContext,
    Invocation,
    Outcome,
    last_line,
    node_problem,
)


class ClaudeCodeHarness(Harness):
    name = "claude-code"
    binary = "claude"
    install_hint = "npm install -g @anthropic-ai/claude-code (Node.js >= 18)"

    def requirement_problem(self) -> str | None:
        return node_problem((18, 0, 0))

    def prepare(self, ctx: HarnessContext) -> Invocation:
        exe = self.executable()
        assert exe is not None
        base = ctx.base_url.removesuffix("/").removesuffix("/v1")
        argv = [
            exe,
            "-p",
            ctx.instruction,
            "--max-turns",
            str(ctx.max_turns),
            "--output-format",
            "json",
            "--dangerously-skip-permissions",
        ]
        env = {
            "ANTHROPIC_BASE_URL": base,
            "ANTHROPIC_API_KEY": ctx.api_key,
            "ANTHROPIC_MODEL": ctx.model,
            "ANTHROPIC_SMALL_FAST_MODEL": ctx.model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": ctx.model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": ctx.model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": ctx.model,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "IS_SANDBOX": "1",
        }
        return Invocation(argv, env)

    def outcome(self, exit_code: int, stdout: str, stderr: str) -> tuple[Outcome, str]:
        # `--output-format json` ends with one result object: {"type": "result", "subtype": ..., "is_error": ...}.
        result = None
        for line in reversed(stdout.strip().splitlines()):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and obj.get("type") == "result":
                result = obj
                break
        text = stdout[-4000:] + stderr[-4000:]
        if result is None:
            if exit_code != 0 and CONNECTION_ERRORS.search(text):
                return Outcome.INFRA, f"exit {exit_code}: could not reach the gateway: {last_line(text)}"
            return (Outcome.DONE if exit_code == 0 else Outcome.GAVE_UP), f"exit {exit_code}: {last_line(text)}"
        summary = f"{result.get('subtype', '?')}: {str(result.get('result', ''))[:200]}"
        if exit_code == 0 and not result.get("is_error"):
            return Outcome.DONE, summary
        if CONNECTION_ERRORS.search(str(result.get("result", ""))):
            return Outcome.INFRA, f"could not reach the gateway: {summary}"
        return Outcome.GAVE_UP, summary
