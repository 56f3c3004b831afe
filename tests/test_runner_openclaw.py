"""OpenClaw itself (the pinned ``openclaw`` package: ``openclaw agent --local``) through the runner, in a bubblewrap
sandbox whose only network is the gateway, speaking OpenAI chat completions to a scripted model.

The model calls OpenClaw's ``write`` tool (``{"path", "content"}``) to create the file the verifier looks for;
OpenClaw writes it into the agent's workspace (the task's) and sends the tool's result back; the model then ends
its turn. Everything the gateway recorded is checked: the calls under the runner's rollout, the tool call and its
result in the exact prompt of the next call, and the verifier's reward. OpenClaw needs Node.js >= 24.16, which
``./dev test`` installs into ``.clawgate/node`` where the machine's is older (``tool_path`` puts it on PATH).
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
from tests.npm_harnesses import harness_exe, tool_path

TASK = {
    "id": "openclaw-hello",
    "instruction": "Create a file hello.txt containing the word hello.",
    "verifier": "grep -qx hello hello.txt",
    "timeout": 240,
}
# OpenClaw adds its runtime state to every request as a last user message and drops it from the history it sends
# next, so the second prompt continues the first only up to that message.
INTERNAL_CONTEXT = "<|im_start|>user\n<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"


@pytest.fixture(scope="session")
def openclaw_exe() -> Path:
    return harness_exe("openclaw")


@pytest.mark.slow  # OpenClaw takes 25-40 s to start on two CPU cores (plugins, its SQLite stores); the calls, 1 s
def test_openclaw_runs_its_write_tool_through_the_runner(
    openclaw_exe,
    gateway_factory,
    tiny_tokenizer,
    sandboxes,
    tmp_path,
    monkeypatch,
):
    monkeypatch.setenv("PATH", tool_path())  # the runner's detection and the sandbox both read PATH
    engine = ScriptedEngine(tiny_tokenizer)
    engine.push(tool_call("write", {"path": "hello.txt", "content": "hello\n"}))
    engine.push("Created hello.txt.")
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, model_aliases="*", admin_key=ADMIN, max_tokens=256)
    [r] = run_one(gw, TASK, "openclaw", openclaw_exe, sandboxes, tmp_path).results
    print(f"openclaw through the runner: {r.outcome}: {r.reason[:200]} ({r.calls} calls, {r.duration:.1f} s)")
    assert (r.kind, r.status, r.outcome, r.reward, r.group) == (
        "rewarded",
        "completed",
        "done",
        1.0,
        "openclaw-hello::openclaw",
    ), r.harness_log[-3000:]
    # Through the rollout's own URL, so the runner's rollout holds every call.
    assert rollouts_with_calls(gw) == {r.rollout_id: 2} and r.calls == 2
    detail = rollout(gw, r.rollout_id)
    assert detail["reward"] == 1.0
    assert [(c["api"], c["status"]) for c in detail["calls"]] == [("chat", "ok")] * 2
    first, second = prompts(detail, tiny_tokenizer)
    assert {"write", "exec", "read", "edit"} <= set(offered_tools(first))
    shared = first[: first.index(INTERNAL_CONTEXT)]
    assert second.startswith(shared)
    turn = second[len(shared) :]
    call = tool_call("write", {"path": "hello.txt", "content": "hello\n"})
    assert turn.startswith("<|im_start|>assistant\n" + call + "<|im_end|>")
    assert turn.index(call) < turn.index("<tool_response>") < turn.index("Successfully wrote 6 bytes to hello.txt")
    assert turn.endswith("<|im_start|>assistant\n")
    assert sandboxes.leftovers() == [] and r.sandbox_removed
