"""Task files: what a valid task becomes, and that every kind of mistake is reported with file:line and key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.tasks import BUNDLED_SUITE, TaskFileError, load_tasks, select


def write(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(TaskFileError) as info:
        load_tasks(path)
    return info.value.problems


def test_a_valid_file_becomes_tasks(tmp_path):
    (tmp_path / "seed").mkdir()
    (tmp_path / "seed" / "main.py").write_text("print(1)\n")
    path = write(
        tmp_path,
        {"id": "a", "instruction": "do a", "verifier": "test -f x", "files": {"src/x.txt": "hi"}, "tags": ["t1"]},
        "",  # blank lines are allowed
        {"id": "b", "instruction": "do b", "verifier": "checks:score", "workspace": "seed", "timeout": 5},
        {"id": "c", "instruction": "do c", "verifier": {"shell": "mod:fn"}, "verifier_timeout": 2.5},
    )
    a, b, c = load_tasks(path)
    assert (a.id, a.verifier.kind, a.verifier.spec, a.files, a.tags) == (
        "a",
        "shell",
        "test -f x",
        {"src/x.txt": "hi"},
        ("t1",),
    )
    assert a.source == f"{path}:1" and a.base_dir == tmp_path.resolve()
    assert (b.verifier.kind, b.verifier.spec, b.timeout, b.workspace) == (
        "python",
        "checks:score",
        5.0,
        tmp_path.resolve() / "seed",
    )
    assert c.source.endswith(":4")
    # The explicit object form overrides the module:function look of the string.
    assert (c.verifier.kind, c.verifier.spec, c.verifier_timeout) == ("shell", "mod:fn", 2.5)
    assert [t.id for t in select([a, b, c], ["t1"])] == ["a"]
    assert len(select([a, b, c], None)) == 3


def test_every_problem_is_reported_with_file_line_and_key(tmp_path):
    path = write(
        tmp_path,
        {"id": "ok", "instruction": "x", "verifier": "true"},
        "{not json",
        {"id": "ok", "instruction": "again", "verifier": "true"},
        {"instruction": "no id", "verifer": "true"},
        {"id": "bad id!", "instruction": "", "verifier": "true", "timeout": 0},
        {"id": "f", "instruction": "x", "verifier": "true", "files": {"../escape": "x", "/abs": "y", "n": 3}},
        {"id": "g", "instruction": "x", "verifier": "true", "workspace": "missing-dir", "tags": "one"},
        {"id": "h", "instruction": "x", "verifier": {"python": "not an entry point"}, "timeout": True},
        ["a", "list"],
    )
    found = problems(path)
    text = "\n".join(found)
    p = str(path)
    expected = [
        f"{p}:2: not valid JSON",
        f"{p}:3: id: 'ok' already used on line 1",
        f"{p}:4: verifer: unknown key",
        f"{p}:4: id: missing (required)",
        f"{p}:4: verifier: missing (required)",
        f"{p}:5: id: must be 1-200 letters",
        f"{p}:5: instruction: must be a non-empty string",
        f"{p}:5: timeout: must be a positive number of seconds, not 0",
        f"{p}:6: files: '../escape' must be a relative path",
        f"{p}:6: files: '/abs' must be a relative path",
        f"{p}:6: files: 'n': content must be a string",
        f"{p}:7: workspace: 'missing-dir' is not a directory",
        f"{p}:7: tags: must be a list of non-empty strings",
        f"{p}:8: verifier: python entry point must look like module:function",
        f"{p}:8: timeout: must be a positive number of seconds, not true",
        f"{p}:9: a task must be a JSON object, not list",
    ]
    for message in expected:
        assert message in text, f"missing {message!r} in:\n{text}"
    assert len(found) == len(expected), text


def test_unreadable_and_empty_files(tmp_path):
    assert problems(tmp_path / "nope.jsonl")[0].startswith(f"{tmp_path / 'nope.jsonl'}: cannot read")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert problems(empty) == [f"{empty}: no tasks (the file is empty)"]
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe{}")
    assert "not UTF-8" in problems(binary)[0]


def test_the_bundled_suite_is_valid_and_covers_edits_shell_and_code_fixes():
    tasks = load_tasks("suite")
    assert load_tasks(BUNDLED_SUITE) == tasks
    tags = {tag for t in tasks for tag in t.tags}
    assert {"file-edit", "shell", "code-fix", "partial-credit"} <= tags
    assert {t.verifier.kind for t in tasks} == {"shell", "python"}
