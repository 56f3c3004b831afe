"""What a test does when a tool it needs is missing from the machine: skip and say why on a developer's machine;
fail in CI (CLAWGATE_TEST_STRICT=1, set by .ci/run), where every tool is installed and a skip would hide a
defect behind a green run."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

STRICT = "CLAWGATE_TEST_STRICT"


def missing(reason: str) -> NoReturn:
    if os.environ.get(STRICT):
        pytest.fail(f"{reason} ({STRICT} is set: this machine must have it)")
    pytest.skip(reason)
