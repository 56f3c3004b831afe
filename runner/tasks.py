"""Task files: one JSON object per line, validated up front with errors that name the file, line and key.

A task is what a rollout is about: an instruction for the agent, the initial workspace, and a verifier that
scores the final workspace. Adding a task family means writing lines like these and their verifiers, never
touching the runner or the trainer::

    {"id": "fix-add", "instruction": "Fix add() in calc.py.", "files": {"calc.py": "def add(a, b):\\n..."},
     "verifier": "python3 -c 'import calc; assert calc.add(2, 3) == 5'", "timeout": 120, "tags": ["code"]}

Keys:

- ``id`` (required): letters, digits, ``.``, ``_``, ``-``; unique in the file. With the harness it makes the
  rollout's GRPO group (``<id>::<harness>``).
- ``instruction`` (required): the prompt given to the harness.
- ``files``: relative path → text content, written into a fresh workspace; ``workspace``: a directory
  (relative to the task file) copied into it first. Either, both (files win) or neither (empty workspace).
- ``verifier`` (required): a shell command run in the final workspace (exit 0 → reward 1, else 0; a stdout
  line ``{"reward": x}`` gives partial credit), or ``module:function``, a Python entry point called with the
  workspace path (modules are imported from the task file's directory). The object forms
  ``{"shell": "..."}`` and ``{"python": "module:function"}`` say which explicitly.
- ``timeout``: seconds the harness may run (default 300); ``verifier_timeout``: seconds for the verifier
  (default 60).
- ``tags``: a list of strings, for selecting tasks (``--tag``).

Unknown keys are errors: a misspelt ``verifer`` must not silently become a task without a verifier.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

DEFAULT_TIMEOUT = 300.0
DEFAULT_VERIFIER_TIMEOUT = 60.0
KNOWN_KEYS = ("id", "instruction", "files", "workspace", "verifier", "timeout", "verifier_timeout", "tags")
TASK_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
# `package.module:function`: no spaces, so any real shell command with arguments never matches.
ENTRY_POINT = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")
BUNDLED_SUITE = Path(__file__).resolve().parent / "suite" / "tasks.jsonl"


class TaskFileError(ValueError):
    """A task file that cannot be used; ``problems`` holds one ``file:line: key: message`` string each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        head = f"{len(problems)} problem(s) in the task file:" if len(problems) > 1 else "invalid task file:"
        super().__init__("\n".join([head, *(f"  {p}" for p in problems)]))


@dataclass(frozen=True, slots=True)
class Verifier:
    kind: Literal["shell", "python"]
    spec: str  # the shell command, or `module:function`


@dataclass(frozen=True, slots=True)
class Task:
    id: str
    instruction: str
    verifier: Verifier
    files: dict[str, str] = field(default_factory=dict)
    workspace: Path | None = None
    timeout: float = DEFAULT_TIMEOUT
    verifier_timeout: float = DEFAULT_VERIFIER_TIMEOUT
    tags: tuple[str, ...] = ()
    base_dir: Path = Path(".")  # the task file's directory: Python verifiers are imported from here
    source: str = ""  # "file:line", for messages


def _number(value: Any, where: str, key: str, problems: list[str]) -> float | None:
    # bool is an int subclass: `"timeout": true` is a mistake, not one second.
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        problems.append(f"{where}: {key}: must be a positive number of seconds, not {json.dumps(value)}")
        return None
    return float(value)


def _relative_path(name: str) -> str | None:
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or name.endswith("/"):
        return None
    return str(path)


def _verifier(value: Any, where: str, problems: list[str]) -> Verifier | None:
    if isinstance(value, dict):
        if len(value) != 1 or next(iter(value)) not in ("shell", "python"):
            problems.append(f'{where}: verifier: an object verifier is {{"shell": "..."}} or {{"python": "m:f"}}')
            return None
        [(kind, spec)] = value.items()
        if not isinstance(spec, str) or not spec.strip():
            problems.append(f"{where}: verifier: {kind} must be a non-empty string")
            return None
        if kind == "python" and not ENTRY_POINT.match(spec.strip()):
            problems.append(f"{where}: verifier: python entry point must look like module:function, not {spec!r}")
            return None
        return Verifier(kind, spec.strip())
    if not isinstance(value, str) or not value.strip():
        problems.append(f"{where}: verifier: must be a shell command or module:function string")
        return None
    spec = value.strip()
    return Verifier("python" if ENTRY_POINT.match(spec) else "shell", spec)


def parse_task(obj: Any, where: str, base_dir: Path, problems: list[str]) -> Task | None:
    """One task from a decoded JSON line; appends to ``problems`` and returns None when it is invalid."""
    if not isinstance(obj, dict):
        problems.append(f"{where}: a task must be a JSON object, not {type(obj).__name__}")
        return None
    before = len(problems)
    for key in obj:
        if key not in KNOWN_KEYS:
            problems.append(f"{where}: {key}: unknown key (known: {', '.join(KNOWN_KEYS)})")
    for key in ("id", "instruction", "verifier"):
        if key not in obj:
            problems.append(f"{where}: {key}: missing (required)")

    task_id = obj.get("id")
    if "id" in obj and (not isinstance(task_id, str) or not TASK_ID.match(task_id)):
        problems.append(
            f"{where}: id: must be 1-200 letters, digits, '.', '_' or '-' (starting with a letter or digit), "
            f"not {json.dumps(task_id)}"
        )
    instruction = obj.get("instruction")
    if "instruction" in obj and (not isinstance(instruction, str) or not instruction.strip()):
        problems.append(f"{where}: instruction: must be a non-empty string")
    verifier = _verifier(obj["verifier"], where, problems) if "verifier" in obj else None

    files: dict[str, str] = {}
    raw_files = obj.get("files", {})
    if not isinstance(raw_files, dict):
        problems.append(f"{where}: files: must be an object mapping relative paths to file contents")
    else:
        for name, content in raw_files.items():
            rel = _relative_path(name)
            if rel is None:
                problems.append(f"{where}: files: {name!r} must be a relative path inside the workspace (no '..')")
            elif not isinstance(content, str):
                problems.append(f"{where}: files: {name!r}: content must be a string")
            else:
                files[rel] = content

    workspace: Path | None = None
    if "workspace" in obj:
        raw = obj["workspace"]
        if not isinstance(raw, str) or not raw:
            problems.append(f"{where}: workspace: must be a directory path (relative to the task file)")
        else:
            workspace = (base_dir / raw).resolve()
            if not workspace.is_dir():
                problems.append(f"{where}: workspace: {raw!r} is not a directory ({workspace})")

    timeout = _number(obj["timeout"], where, "timeout", problems) if "timeout" in obj else DEFAULT_TIMEOUT
    vtimeout: float | None = DEFAULT_VERIFIER_TIMEOUT
    if "verifier_timeout" in obj:
        vtimeout = _number(obj["verifier_timeout"], where, "verifier_timeout", problems)

    tags = obj.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) and t for t in tags):
        problems.append(f"{where}: tags: must be a list of non-empty strings")
        tags = []

    if len(problems) > before:
        return None
    assert isinstance(task_id, str) and isinstance(instruction, str) and verifier is not None
    assert timeout is not None and vtimeout is not None
    return Task(
        id=task_id,
        instruction=instruction,
        verifier=verifier,
        files=files,
        workspace=workspace,
        timeout=timeout,
        verifier_timeout=vtimeout,
        tags=tuple(tags),
        base_dir=base_dir,
        source=where,
    )


def parse_tasks(text: str, name: str, base_dir: Path) -> list[Task]:
    """Every task of a JSONL text; raises ``TaskFileError`` listing all problems (not just the first)."""
    problems: list[str] = []
    tasks: list[Task] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})")
            continue
        task = parse_task(obj, where, base_dir, problems)
        if task is None:
            continue
        if task.id in first_line:
            problems.append(f"{where}: id: {task.id!r} already used on line {first_line[task.id]}")
            continue
        first_line[task.id] = number
        tasks.append(task)
    if not tasks and not problems:
        problems.append(f"{name}: no tasks (the file is empty)")
    if problems:
        raise TaskFileError(problems)
    return tasks


def load_tasks(path: str | Path) -> list[Task]:
    """Tasks from a JSONL file (``suite`` or an empty path: the bundled suite)."""
    file = BUNDLED_SUITE if str(path) in ("", "suite") else Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise TaskFileError([f"{file}: cannot read: {exc.strerror or exc}"]) from exc
    except UnicodeDecodeError as exc:
        raise TaskFileError([f"{file}: not UTF-8 text ({exc.reason} at byte {exc.start})"]) from exc
    return parse_tasks(text, str(file), file.resolve().parent)


def select(tasks: list[Task], tags: list[str] | None) -> list[Task]:
    """Tasks carrying at least one of ``tags`` (all tasks when no tags are given)."""
    if not tags:
        return list(tasks)
    wanted = set(tags)
    return [t for t in tasks if wanted & set(t.tags)]
