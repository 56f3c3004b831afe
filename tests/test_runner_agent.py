"""The built-in agent: its tools stay inside the workspace, and its loop — driven by a scripted engine, since the
random tiny model never emits tool calls — runs tool calls through a live gateway, inside the sandbox, until
the verifier passes and the reward lands. Also: a model that hits the turn limit is verified, not retried; an
unreachable gateway is an infrastructure failure, retried as a new rollout."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest

from runner.agent import Workspace
from runner.harnesses import make_harness
from runner.run import RunConfig, Runner
from tests.fakes import ScriptedEngine
from tests.runner_support import make_tasks
from tests.test_runner_sandbox import processes_with

ADMIN = "agent-admin-key"


def tool_call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    root = tmp_path / "ws"
    root.mkdir()
    return Workspace(root, run_timeout=5)


def test_file_tools_work_inside_the_workspace(ws):
    assert ws.call("write_file", json.dumps({"path": "src/a.py", "content": "print('hi')\n"})) == (
        "wrote 12 bytes to src/a.py"
    )
    assert ws.call("read_file", '{"path": "src/a.py"}') == "print('hi')\n"
    ws.call("write_file", '{"path": "b.txt", "content": ""}')
    assert ws.call("list_files", "{}") == "b.txt\nsrc/a.py"
    assert ws.call("list_files", '{"path": "src"}') == "src/a.py"
    result = ws.call("run", json.dumps({"command": "python3 src/a.py; echo oops >&2; exit 3"}))
    assert result == "exit code 3\nstdout:\nhi\n\nstderr:\noops\n"


def test_file_tools_refuse_paths_outside_the_workspace(ws, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    (ws.root / "link").symlink_to(tmp_path)
    for name, args in [
        ("read_file", {"path": "../secret.txt"}),
        ("read_file", {"path": str(secret)}),
        ("read_file", {"path": "link/secret.txt"}),
        ("write_file", {"path": "../planted.txt", "content": "x"}),
        ("write_file", {"path": "link/planted.txt", "content": "x"}),
        ("list_files", {"path": ".."}),
    ]:
        result = ws.call(name, json.dumps(args))
        assert result.startswith("error: ") and "outside the workspace" in result, (name, args, result)
    assert not (tmp_path / "planted.txt").exists()


def test_bad_tool_calls_become_error_results(ws):
    assert ws.call("read_file", "{not json").startswith("error: arguments are not valid JSON")
    assert ws.call("read_file", "[1]") == "error: arguments must be a JSON object"
    assert ws.call("read_file", '{"path": "missing.txt"}') == "error: 'missing.txt' is not a file"
    assert ws.call("read_file", '{"file": "x"}').startswith("error: bad arguments for read_file")
    assert ws.call("delete_everything", "{}").startswith("error: unknown tool 'delete_everything'")
    assert ws.call("run", '{"command": ""}') == "error: command must be a non-empty string"


def test_run_kills_the_whole_command_at_its_time_limit(ws):
    marker = f"33.{os.getpid()}"
    t0 = time.monotonic()
    result = ws.call("run", json.dumps({"command": f"sleep {marker} & sleep 30", "timeout": 1}))
    assert result.startswith("killed after 1 s") and time.monotonic() - t0 < 10
    time.sleep(0.2)
    assert processes_with(marker) == []


@pytest.fixture
def scripted(gateway_factory, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer)
    gw = gateway_factory(engine=engine, tokenizer=tiny_tokenizer, admin_key=ADMIN, max_tokens=512)
    return engine, gw


def rollout(gw, rollout_id: str) -> dict:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    return httpx.get(f"{gw.url}/v1/rollouts/{rollout_id}", headers=headers, params={"tokens": "false"}).json()


def test_scripted_tool_calls_write_a_file_and_the_reward_lands(scripted, sandboxes, tmp_path, tiny_tokenizer):
    engine, gw = scripted
    engine.push(tool_call("write_file", path="../../escape.txt", content="x"))
    engine.push(tool_call("write_file", path="out/hello.txt", content="hello world\n"))
    engine.push(tool_call("run", command="wc -c < out/hello.txt; echo KEY=[$CLAWGATE_ROLLOUT_KEY] PP=[$PYTHONPATH]"))
    engine.push("Done: out/hello.txt holds the greeting.")
    tasks = make_tasks(
        tmp_path,
        {
            "id": "greet",
            "instruction": "Write hello world to out/hello.txt.",
            "verifier": 'test "$(cat out/hello.txt)" = "hello world"',
        },
    )
    runner = Runner(RunConfig(gw.url, ADMIN, concurrency=1), tasks, [make_harness("builtin")], sandboxes)
    report = asyncio.run(runner.run())

    [r] = report.results
    assert (r.kind, r.status, r.reward, r.outcome, r.calls) == ("rewarded", "completed", 1.0, "done", 4), r
    detail = rollout(gw, r.rollout_id)
    assert detail["reward"] == 1.0 and detail["group"] == "greet::builtin"
    assert detail["finish_reason"] == "done: the model ended its turn"
    calls = detail["calls"]
    assert [c["status"] for c in calls] == ["ok"] * 4
    # The agent echoes the gateway's answers unchanged, so each later prompt splices their raw tokens.
    assert all(c["render_mode"] == "spliced" for c in calls[1:]), [c["render_mode"] for c in calls]

    prompts = [tiny_tokenizer.decode(req.prompt_ids) for req in engine.requests]
    assert len(prompts) == 4
    assert "'../../escape.txt' is outside the workspace" in prompts[1]
    assert "wrote 12 bytes to out/hello.txt" in prompts[2]
    # `run` output came back, and commands the model runs see neither the rollout key nor the agent's path.
    assert "exit code 0\nstdout:\n12\nKEY=[] PP=[]" in prompts[3]
    assert '"name": "write_file"' in prompts[0] and '"name": "run"' in prompts[0]  # the tools were offered
    assert not (sandboxes.run_dir / "escape.txt").exists() and sandboxes.leftovers() == []


def test_turn_limit_is_a_model_failure_and_is_verified_not_retried(scripted, sandboxes, tmp_path):
    engine, gw = scripted
    engine.push(tool_call("list_files"))
    tasks = make_tasks(tmp_path, {"id": "loop", "instruction": "x", "verifier": "test -f never.txt"})
    config = RunConfig(gw.url, ADMIN, max_turns=1, concurrency=1)
    report = asyncio.run(Runner(config, tasks, [make_harness("builtin")], sandboxes).run())
    [r] = report.results
    assert (r.kind, r.reward, r.outcome, r.attempts) == ("rewarded", 0.0, "gave_up", 1), r
    assert "turn limit reached (1 turns)" in rollout(gw, r.rollout_id)["finish_reason"]


def test_an_unreachable_model_is_retried_as_a_new_rollout(scripted, sandboxes, tmp_path):
    engine, gw = scripted
    for _ in range(4):  # the agent's own retries of a 502, then it reports the gateway unreachable
        engine.push("never sent", fail_after=0)
    engine.push("All done.")
    tasks = make_tasks(tmp_path, {"id": "flaky", "instruction": "x", "verifier": "true"})
    config = RunConfig(gw.url, ADMIN, concurrency=1, retries=1, retry_backoff=0.01)
    report = asyncio.run(Runner(config, tasks, [make_harness("builtin")], sandboxes).run())
    [r] = report.results
    assert (r.kind, r.reward, r.attempts, report.retries) == ("rewarded", 1.0, 2, 1), r
    [abandoned] = r.abandoned
    assert abandoned != r.rollout_id
    first = rollout(gw, abandoned)
    assert first["status"] == "aborted" and first["rewards"] == []
    assert first["finish_reason"].startswith("infrastructure failure: gateway unreachable: HTTP 502")
    assert [c["status"] for c in first["calls"]] == ["failed"] * 4
    assert rollout(gw, r.rollout_id)["status"] == "completed"
