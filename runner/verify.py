"""Verifiers: score a rollout's final workspace, inside its sandbox, without network.

Shell verifiers run with ``/bin/sh -c`` in the workspace: exit 0 → reward 1.0, any other exit → 0.0, unless
stdout has a line ``{"reward": x}`` (the last such line wins, whatever the exit code), which gives x —
partial credit. Python verifiers (``module:function``) are called as ``function(workspace: Path)`` in a child
process (``python -m runner.verify``), so a crash, a hang or a stray ``sys.exit`` cannot take the runner down;
they return a bool, a number, or a dict with ``reward`` and any other keys as details. Their modules are
imported from the task file's directory before anything in the workspace, so an agent cannot shadow its own
verifier by writing a module of the same name.

A verifier that cannot produce a score is reported, not fatal: ``crashed`` (a shell verifier exiting 126/127:
not runnable; an invalid reward line; an exception in a Python verifier) or ``timed_out``. A shell verifier
that dies of a signal scores 0 like any other failure: the code under test crashing it must not let an agent
escape a zero reward. The runner then
marks the rollout failed with the reason and posts no reward: a broken verifier says nothing about the model.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from runner.sandbox import Sandbox, SandboxError
from runner.tasks import Task

PROJECT_ROOT = Path(__file__).resolve().parent.parent
EXIT_CRASH = 2


@dataclass(frozen=True, slots=True)
class Verdict:
    status: Literal["scored", "crashed", "timed_out"]
    reward: float | None
    detail: str  # one line for people: why this score, or what went wrong
    duration: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)  # posted with the reward


def _tail(text: str, limit: int = 1000) -> str:
    return text.strip()[-limit:]


def _reward_value(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def reward_line(stdout: str) -> tuple[float | None, dict[str, Any] | None, str | None]:
    """The last ``{"reward": x, ...}`` line of stdout: (reward, the object, problem). (None, None, None): none."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not (line.startswith("{") and line.endswith("}")):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or "reward" not in obj:
            continue
        value = _reward_value(obj["reward"])
        if value is None:
            return None, obj, f"invalid reward line (reward must be a finite number): {line[:200]}"
        return value, obj, None
    return None, None, None


def judge_shell(exit_code: int | None, stdout: str, stderr: str, timed_out: bool, duration: float) -> Verdict:
    """The verdict of a shell verifier from how its process ended (pure, for tests)."""
    if timed_out or exit_code is None:
        return Verdict("timed_out", None, f"verifier timed out after {duration:.1f} s", duration)
    if exit_code < 0:
        exit_code = 128 - exit_code  # killed by signal n: report it the way a shell (and bwrap) would, 128 + n
    out = {"exit_code": exit_code, "stdout": _tail(stdout), "stderr": _tail(stderr)}
    if exit_code in (126, 127):
        return Verdict(
            "crashed", None, f"verifier could not run (exit {exit_code}): {_tail(stderr, 300)}", duration, out
        )
    value, obj, problem = reward_line(stdout)
    if problem is not None:
        return Verdict("crashed", None, problem, duration, out)
    if value is not None:
        extra = {k: v for k, v in (obj or {}).items() if k != "reward"}
        return Verdict("scored", value, f"reward line: {value:g} (exit {exit_code})", duration, {**out, **extra})
    reward = 1.0 if exit_code == 0 else 0.0
    return Verdict("scored", reward, f"exit {exit_code}", duration, out)


def judge_python(exit_code: int | None, stdout: str, stderr: str, timed_out: bool, duration: float) -> Verdict:
    if timed_out or exit_code is None:
        return Verdict("timed_out", None, f"verifier timed out after {duration:.1f} s", duration)
    value, obj, problem = reward_line(stdout)
    if exit_code != 0 or value is None:
        why = problem or f"exit {exit_code}: {_tail(stderr, 500) or 'no reward printed'}"
        return Verdict("crashed", None, f"python verifier failed: {why}", duration, {"stderr": _tail(stderr)})
    details = (obj or {}).get("details") or {}
    return Verdict("scored", value, f"returned {value:g}", duration, details if isinstance(details, dict) else {})


async def verify(task: Task, sandbox: Sandbox) -> Verdict:
    """Run the task's verifier on the sandbox's workspace. Never raises for a verifier's own failure."""
    env = sandbox.base_env()
    try:
        if task.verifier.kind == "shell":
            argv = ["/bin/sh", "-c", task.verifier.spec]
            result = await sandbox.run(argv, env=env, timeout=task.verifier_timeout, ro_paths=[task.base_dir])
            judge = judge_shell
        else:
            env["PYTHONPATH"] = f"{task.base_dir}:{PROJECT_ROOT}"
            # -P: the workspace (the current directory) is not put first on sys.path (see the module docstring).
            argv = [sys.executable, "-P", "-m", "runner.verify", task.verifier.spec]
            ro = [task.base_dir, PROJECT_ROOT]
            result = await sandbox.run(argv, env=env, timeout=task.verifier_timeout, ro_paths=ro)
            judge = judge_python
    except SandboxError as exc:
        return Verdict("crashed", None, f"verifier could not start: {exc}")
    return judge(result.exit_code, result.stdout, result.stderr, result.timed_out, result.duration)


def _call(spec: str, workspace: Path) -> dict[str, Any]:
    module_name, _, func_name = spec.partition(":")
    func = getattr(importlib.import_module(module_name), func_name)
    value = func(workspace)
    details: dict[str, Any] = {}
    if isinstance(value, dict):
        details = {k: v for k, v in value.items() if k != "reward"}
        value = value.get("reward")
    reward = 1.0 if value is True else 0.0 if value is False else _reward_value(value)
    if reward is None:
        raise TypeError(f"{spec} returned {value!r}: expected a bool, a finite number, or a dict with 'reward'")
    return {"reward": reward, "details": details}


def main(argv: list[str]) -> int:
    """The child side of a Python verifier: call it on the current directory, print the reward line."""
    if len(argv) != 1:
        print("usage: python -P -m runner.verify module:function", file=sys.stderr)
        return EXIT_CRASH
    workspace = Path.cwd()
    sys.path.append(str(workspace))  # the workspace's own modules are importable, after everything else
    try:
        line = _call(argv[0], workspace)
        text = json.dumps(line, default=str)
    except BaseException:  # any failure of the verifier, SystemExit included, is a crash
        traceback.print_exc()
        return EXIT_CRASH
    sys.stdout.flush()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
