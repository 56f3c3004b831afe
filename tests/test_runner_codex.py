"""Codex CLI itself (the pinned ``@openai/codex``, a native binary) through the runner: ``codex exec`` in a
bubblewrap sandbox whose only network is the gateway, speaking the Responses API to a scripted model.

The model calls Codex's shell tool (``exec_command``, ``{"cmd": …}``) to create the file the verifier looks for;
Codex runs the command and sends its output back as a ``function_call_output``; the model then ends its turn.
Everything the gateway recorded is checked: both calls under the runner's rollout, the tool call and the command's
result in the exact prompt of the second call, and the verifier's reward.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes import ScriptedEngine
from tests.harness_runs import (
    ADMIN,
    offered_tools,
    prompts,
    rollout,
    rollouts_with_calls,
    run_one,
    tool_call,
)
from tests.npm_harnesses import harness_exe

TASK = {
    "id": "codex-hello",
    "instruction": "Create a file hello.txt containing the word hello.",
    "verifier": "grep -qx hello hello.txt",
    "timeout": 120,
}
COMMAND = "echo hello > hello.txt && echo wrote-hello"


@pytest.fixture(scope="session")
def codex_exe() -> Path:
    return harness_exe("codex")


def test_codex_runs_a_shell_tool_through_the_runner(
    codex_exe,
    gateway_factory,
    tiny_tokenizer,
    sandboxes,
    tmp_path,
):
    engine = ScriptedEngine(tiny_tokenizer)
    engine.push(tool_call("exec_command", {"cmd": COMMAND}))
    engine.push("Created hello.txt.")
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, model_aliases="*", admin_key=ADMIN, max_tokens=256)
    [r] = run_one(gw, TASK, "codex", codex_exe, sandboxes, tmp_path).results
    print(f"codex through the runner: {r.outcome}: {r.reason[:200]} ({r.calls} calls, {r.duration:.1f} s)")
    assert (r.kind, r.status, r.outcome, r.reward, r.group) == (
        "rewarded",
        "completed",
        "done",
        1.0,
        "codex-hello::codex",
    ), r.harness_log[-3000:]
    # Through the rollout's own URL, so the runner's rollout holds every call (not a `codex-<session>` rollout).
    assert rollouts_with_calls(gw) == {r.rollout_id: 2} and r.calls == 2
    detail = rollout(gw, r.rollout_id)
    calls = detail["calls"]
    assert detail["reward"] == 1.0
    assert {c["api"] for c in calls} == {"responses"} and {c["status"] for c in calls} == {"ok"}
    first, second = prompts(detail, tiny_tokenizer)
    assert "exec_command" in offered_tools(first)
    # The second prompt continues the first with the model's own tool call and the command's output.
    assert second.startswith(first)
    turn = second[len(first) :]
    assert turn.startswith(tool_call("exec_command", {"cmd": COMMAND}) + "<|im_end|>")
    assert turn.index("<tool_response>") < turn.index("Output:\nwrote-hello") < turn.index("</tool_response>")
    assert "Process exited with code 0" in turn and turn.endswith("<|im_start|>assistant\n")
    # The tool call Codex echoes back is the model's own raw tokens, not a re-tokenization of its text.
    assert [c["render_mode"] for c in calls] == ["fresh", "spliced"]
    assert sandboxes.leftovers() == [] and r.sandbox_removed
