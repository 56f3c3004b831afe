"""Helpers for the task-runner tests: bubblewrap required (or an explicit opt-out), tasks written inline."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from runner.sandbox import bwrap_problem
from runner.tasks import Task, load_tasks
from tests.missing import STRICT

ALLOW_NO_BWRAP = "CLAWGATE_TEST_ALLOW_NO_BWRAP"


def require_bwrap() -> None:
    """Fail (not skip) where bubblewrap is unusable: CI installs it, so its absence there is a defect. A
    machine that cannot have it opts out with CLAWGATE_TEST_ALLOW_NO_BWRAP=1, and the tests say so; under
    CLAWGATE_TEST_STRICT (CI, ./dev test) the opt-out is refused."""
    problem = bwrap_problem()
    if problem is None:
        return
    if os.environ.get(ALLOW_NO_BWRAP) and not os.environ.get(STRICT):
        pytest.skip(f"bubblewrap unusable ({problem}) and {ALLOW_NO_BWRAP} is set: sandbox isolation NOT tested")
    if os.environ.get(STRICT):
        pytest.fail(
            f"bubblewrap is needed for the sandbox tests: {problem} ({STRICT} is set: {ALLOW_NO_BWRAP} is refused)"
        )
    pytest.fail(
        f"bubblewrap is needed for the sandbox tests: {problem}. Install it (apt-get install bubblewrap; .ci/run "
        f"does) or set {ALLOW_NO_BWRAP}=1 to skip these tests on a machine that cannot have it."
    )


def task_file(directory: Path, tasks: list[dict[str, Any]], name: str = "tasks.jsonl") -> Path:
    path = directory / name
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def make_tasks(directory: Path, *tasks: dict[str, Any]) -> list[Task]:
    return load_tasks(task_file(directory, list(tasks)))
