"""Running one real harness through the task runner against a gateway whose model is scripted, and reading back
what the gateway recorded: the runner's rollout with every call's exact prompt tokens, decoded to text."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx

from runner.harnesses import make_harness
from runner.report import RunReport
from runner.run import RunConfig, Runner
from runner.sandbox import SandboxFactory
from tests.runner_support import make_tasks

ADMIN = "harness-runs-admin"


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A model answer that calls one tool, in the tiny model's (Qwen's) tool-call format."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def run_one(gw: Any, task: dict[str, Any], harness: str, exe: Path, sandboxes: SandboxFactory, tmp: Path) -> RunReport:
    config = RunConfig(gw.url, ADMIN, n=1, concurrency=1, max_turns=4)
    tasks = make_tasks(tmp, task)
    return asyncio.run(Runner(config, tasks, [make_harness(harness, str(exe))], sandboxes).run())


def rollout(gw: Any, rollout_id: str) -> dict[str, Any]:
    """The rollout as the admin API gives it: its calls with exact token ids, and its reward."""
    gw.flush()
    resp = httpx.get(f"{gw.url}/v1/rollouts/{rollout_id}", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    resp.raise_for_status()
    return resp.json()


def prompts(detail: dict[str, Any], tokenizer: Any) -> list[str]:
    """Each call's prompt as the model saw it (its exact token ids, decoded)."""
    return [tokenizer.decode(c["prompt_token_ids"]) for c in detail["calls"]]


def offered_tools(prompt: str) -> list[str]:
    """The tool names the chat template rendered into a prompt (one JSON object per line inside ``<tools>``)."""
    match = re.search(r"<tools>\n(.*?)\n</tools>", prompt, re.DOTALL)  # not the template's own "<tools></tools>"
    if match is None:
        return []
    return [json.loads(line)["function"]["name"] for line in match[1].splitlines() if line.strip()]


def rollouts_with_calls(gw: Any) -> dict[str, int]:
    """Every rollout the gateway holds that has calls, with their number: a harness's calls that escaped the
    runner's rollout (a session or implicit rollout of their own) would show up here."""
    gw.flush()
    resp = httpx.get(f"{gw.url}/v1/rollouts", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    resp.raise_for_status()
    return {r["id"]: r["calls"] for r in resp.json()["data"] if r["calls"]}
