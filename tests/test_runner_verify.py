"""Verifiers: pass, fail, partial credit, crash and timeout, for shell commands and Python entry points, each
run for real inside a sandbox on a real workspace."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest

from runner.sandbox import SandboxFactory
from runner.tasks import Task
from runner.verify import judge_shell, reward_line, verify
from tests.runner_support import make_tasks, require_bwrap

CHECKS = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path

    def has_answer(ws: Path):
        return (ws / "answer.txt").read_text().strip() == "42"

    def fraction(ws: Path):
        return {"reward": 0.25, "note": "one of four"}

    def number(ws: Path):
        return 0.75

    def boom(ws: Path):
        raise RuntimeError("verifier bug")

    def exits(ws: Path):
        sys.exit(0)

    def hangs(ws: Path):
        time.sleep(30)

    def wrong_type(ws: Path):
        return "yes"

    def which_module(ws: Path):
        return 1.0
    """
)


@pytest.fixture(scope="module")
def sandboxes(tmp_path_factory: pytest.TempPathFactory):
    require_bwrap()
    factory = SandboxFactory("bwrap", base_dir=tmp_path_factory.mktemp("sandboxes"))
    yield factory
    factory.close()


def run_verifier(factory: SandboxFactory, task: Task):
    async def go():
        with factory.create(task) as sandbox:
            return await verify(task, sandbox)

    return asyncio.run(go())


def one(tmp_path: Path, verifier: object, files: dict[str, str] | None = None, **extra: object) -> Task:
    (tmp_path / "checks.py").write_text(CHECKS)
    [task] = make_tasks(tmp_path, {"id": "t", "instruction": "x", "verifier": verifier, "files": files or {}, **extra})
    return task


@pytest.mark.parametrize(
    ("verifier", "reward"),
    [
        ('test "$(cat answer.txt)" = 42', 1.0),
        ('test "$(cat answer.txt)" = 41', 0.0),
        ('echo \'{"reward": 0.1}\'; echo \'{"reward": 0.6, "cases": 5}\'; exit 1', 0.6),  # the last line wins
        ("echo 'not json {'; exit 0", 1.0),
        ("kill -9 $$", 0.0),  # dying of a signal (code under test crashing it) is a failure, not a crash
    ],
)
def test_shell_verifier_scores(sandboxes, tmp_path, verifier, reward):
    verdict = run_verifier(sandboxes, one(tmp_path, verifier, {"answer.txt": "42\n"}))
    assert (verdict.status, verdict.reward) == ("scored", reward), verdict
    if reward == 0.6:
        assert verdict.details["cases"] == 5


@pytest.mark.parametrize(
    ("verifier", "status", "message"),
    [
        ("no-such-command-xyz", "crashed", "could not run (exit 127)"),
        ('echo \'{"reward": "high"}\'', "crashed", "invalid reward line"),
        ("sleep 20", "timed_out", "timed out after"),
    ],
)
def test_shell_verifier_failures_are_reported(sandboxes, tmp_path, verifier, status, message):
    # A short limit only where the verifier must run out of time: a loaded machine can be slow to start one.
    task = one(tmp_path, verifier, verifier_timeout=0.5 if status == "timed_out" else 60)
    verdict = run_verifier(sandboxes, task)
    assert verdict.status == status and verdict.reward is None, verdict
    assert message in verdict.detail


@pytest.mark.parametrize(
    ("entry", "answer", "reward"),
    [
        ("checks:has_answer", "42", 1.0),
        ("checks:has_answer", "7", 0.0),
        ("checks:fraction", "", 0.25),
        ("checks:number", "", 0.75),
    ],
)
def test_python_entry_point_scores(sandboxes, tmp_path, entry, answer, reward):
    verdict = run_verifier(sandboxes, one(tmp_path, entry, {"answer.txt": answer}))
    assert (verdict.status, verdict.reward) == ("scored", reward), verdict
    if entry == "checks:fraction":
        assert verdict.details == {"note": "one of four"}


@pytest.mark.parametrize(
    ("entry", "status", "message"),
    [
        ("checks:boom", "crashed", "RuntimeError: verifier bug"),
        ("checks:exits", "crashed", "SystemExit"),
        ("checks:wrong_type", "crashed", "expected a bool, a finite number"),
        ("checks:missing_function", "crashed", "has no attribute 'missing_function'"),
        ("nomodule:fn", "crashed", "No module named 'nomodule'"),
        ("checks:hangs", "timed_out", "timed out after"),
    ],
)
def test_python_entry_point_failures_are_reported(sandboxes, tmp_path, entry, status, message):
    verdict = run_verifier(sandboxes, one(tmp_path, entry, verifier_timeout=1 if status == "timed_out" else 60))
    assert (verdict.status, verdict.reward) == (status, None), verdict
    assert message in verdict.detail


def test_an_agent_cannot_shadow_its_python_verifier(sandboxes, tmp_path):
    forged = "def which_module(ws):\n    return 1.0\ndef has_answer(ws):\n    return True\n"
    verdict = run_verifier(sandboxes, one(tmp_path, "checks:has_answer", {"checks.py": forged, "answer.txt": "0"}))
    assert (verdict.status, verdict.reward) == ("scored", 0.0)


def test_reward_line_parsing():
    assert reward_line('x\n{"reward": 1}\n{"other": 2}\n') == (1.0, {"reward": 1}, None)
    assert reward_line("no reward here") == (None, None, None)
    assert reward_line('{"reward": NaN}')[2] is not None
    assert reward_line('{"reward": true}')[2] is not None
    killed = judge_shell(-9, "", "", False, 0.1)
    assert (killed.status, killed.reward, killed.details["exit_code"]) == ("scored", 0.0, 137)
    assert judge_shell(None, "", "", True, 3.0).detail == "verifier timed out after 3.0 s"
