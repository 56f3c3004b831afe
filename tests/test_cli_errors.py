"""Configuration errors reach the operator as one clear line and exit code 2, never as a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.store import db

ROOT = Path(__file__).resolve().parent.parent


def clawgate(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CLAWGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "clawgate.cli", *args],
        env={**clean, "PYTHONPATH": str(ROOT), **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("env", "line"),
    [
        ({"CLAWGATE_ENVIRONMENT": "production"}, "error: CLAWGATE_API_KEYS must be set in production"),
        (
            {"CLAWGATE_ENVIRONMENT": "production", "CLAWGATE_API_KEYS": "k1", "CLAWGATE_ADMIN_KEY": "changeme"},
            "error: CLAWGATE_ADMIN_KEY must be set to a real secret in production",
        ),
        ({"CLAWGATE_PORT": "eighty"}, "error: CLAWGATE_PORT: Input should be a valid integer"),
        ({"CLAWGATE_TRAIN_LR": "-1"}, "error: CLAWGATE_TRAIN_LR: Input should be greater than or equal to 0"),
    ],
)
def test_a_bad_setting_is_one_line_and_exit_code_2(env, line, tmp_path):
    result = clawgate("serve", env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    [printed] = result.stderr.strip().splitlines()
    assert printed.startswith(line), result.stderr


def test_a_secret_in_a_bad_setting_is_not_printed(tmp_path):
    result = clawgate("serve", env={"CLAWGATE_ENVIRONMENT": "production", "CLAWGATE_ADMIN_KEY": "s3cr3t-value"})
    assert result.returncode == 2 and "s3cr3t-value" not in result.stderr + result.stdout


def test_serve_refuses_an_unmigrated_database_in_one_line(tmp_path):
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    result = clawgate("serve", "--database-url", url, cwd=tmp_path)
    assert result.returncode == 2
    head = db.head_revision()
    assert result.stderr.strip().splitlines() == [
        f"error: the database schema is at nothing, expected {head}: run `clawgate db upgrade` (database {url})"
    ]
