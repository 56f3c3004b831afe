"""Claude Code through the runner: installed from npm like the Claude Code end-to-end tests (skipped, saying why,
only when that is impossible), run in a bubblewrap sandbox whose only network is the gateway, its calls captured
under the runner's rollout and verified. And a mixed-harness batch: the built-in agent and Claude Code on the
same task, whose GRPO advantages are normalized within each task–harness pair."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.store.db import connect
from gateway.store.training_data import load_rollout
from runner.harnesses import make_harness
from runner.run import RunConfig, Runner
from tests.fakes import ScriptedEngine
from tests.runner_support import make_tasks
from tests.test_claude_code_e2e import captured, claude_exe  # noqa: F401 (a fixture)
from trainer.advantages import ZERO_VARIANCE, group_advantages

ADMIN = "claude-runner-admin"
HELLO = {
    "id": "hello",
    "instruction": "Create a file hello.txt containing the word hello.",
    "verifier": "test -f hello.txt",
    # Each call with the real model re-reads a ~32k-token prompt: 10-20 s on two CPU cores.
    "timeout": 400,
}


def run(gw, tasks, harnesses, sandboxes, n: int):
    config = RunConfig(gw.url, ADMIN, n=n, concurrency=1, max_turns=2)
    return asyncio.run(Runner(config, tasks, harnesses, sandboxes).run())


@pytest.mark.slow  # four calls of ~32k prompt tokens: 50-80 s on two CPU cores
def test_claude_code_rollouts_are_captured_and_verified(claude_exe, gateway_factory, sandboxes, tmp_path):  # noqa: F811
    gw = gateway_factory(model_aliases="*", max_tokens=64, admin_key=ADMIN)
    report = run(gw, make_tasks(tmp_path, HELLO), [make_harness("claude-code", str(claude_exe))], sandboxes, n=1)
    [r] = report.results
    print(f"claude-code through the runner: {r.outcome}: {r.reason[:200]} ({r.calls} calls, {r.duration:.1f} s)")
    # The random model writes no file; Claude Code ends (it gives up at the output cap) and is verified: 0.
    assert (r.kind, r.status, r.reward, r.group) == ("rewarded", "completed", 0.0, "hello::claude-code"), r
    assert r.outcome in ("done", "gave_up") and r.attempts == 1
    calls = captured(gw)
    assert calls and r.calls == len(calls)
    # Every call came through the rollout's own URL, so the runner's rollout holds them (not a session rollout).
    assert {c["rollout_id"] for c in calls} == {r.rollout_id}
    assert all(c["status"] == "ok" and c["api"] == "messages" and c["prompt_len"] > 1000 for c in calls)
    assert all(c["render_mode"] == "spliced" for c in calls[1:])
    assert sandboxes.leftovers() == [] and r.sandbox_removed


@pytest.mark.slow  # two Claude Code starts and two built-in runs against a scripted model: ~20 s
def test_mixed_harness_batch_is_normalized_per_task_and_harness(
    claude_exe,  # noqa: F811
    gateway_factory,
    tiny_tokenizer,
    sandboxes,
    tmp_path,
):
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, model_aliases="*", admin_key=ADMIN, max_tokens=256)
    tasks = make_tasks(tmp_path, {**HELLO, "timeout": 120})
    # The built-in agent: the first rollout writes the file (reward 1), the second does not (reward 0).
    write = {"name": "write_file", "arguments": {"path": "hello.txt", "content": "hello\n"}}
    engine.push("<tool_call>\n" + json.dumps(write) + "\n</tool_call>")
    engine.push("Done.")
    engine.push("Done.")
    builtin = run(gw, tasks, [make_harness("builtin")], sandboxes, n=2)
    assert [r.reward for r in builtin.results] == [1.0, 0.0]
    # Claude Code on the same task: scripted answers that write nothing (reward 0 twice).
    for _ in range(16):  # its main call and any side calls
        engine.push("Nothing to do.")
    claude = run(gw, tasks, [make_harness("claude-code", str(claude_exe))], sandboxes, n=2)
    assert [(r.kind, r.reward) for r in claude.results] == [("rewarded", 0.0)] * 2, claude.results
    assert all(r.calls >= 1 for r in claude.results)

    db = connect(gw.settings.database_url)
    try:
        loaded = {r.rollout_id: load_rollout(db, r.rollout_id) for r in [*builtin.results, *claude.results]}
    finally:
        db.dispose()
    rewards = {rid: d.reward for rid, d in loaded.items() if d is not None and d.reward is not None}
    groups = {rid: d.rollout.group_key for rid, d in loaded.items() if d is not None}
    assert sorted(set(groups.values())) == ["hello::builtin", "hello::claude-code"]
    result = group_advantages(rewards, groups)
    b0, b1 = (r.rollout_id for r in builtin.results)
    # Within hello::builtin: mean 0.5, std 0.5, so ±1. Claude Code's zero-variance group carries no signal.
    assert result.advantages[b0] == pytest.approx(1.0, abs=1e-5)
    assert result.advantages[b1] == pytest.approx(-1.0, abs=1e-5)
    assert {result.skipped[r.rollout_id] for r in claude.results} == {ZERO_VARIANCE}
    # Pooling the harnesses into one task group would have changed the built-in rollouts' advantages.
    pooled = group_advantages(rewards, dict.fromkeys(groups, "hello"))
    assert pooled.advantages[b0] == pytest.approx(3**0.5, abs=1e-5)  # (1 - 0.25) / sqrt(0.1875)
