"""The clawgate image is built and the CI compose stack (deploy/ci/docker-compose.ci.yml) runs, for real.

tests/test_compose.py reads the compose files without an engine; here a Docker daemon of the test's own
(tests/docker_daemon.py) builds the image from the repository's Dockerfile — on a local Python base image and a CPU
torch wheel, through the BASE_IMAGE, TORCH_REQUIREMENT and TORCH_PIP_OPTIONS build arguments — and starts PostgreSQL,
the migration step and `clawgate up`. Over HTTP: the gateway is healthy and serves the policy version the trainer
published (v0), a chat completion is answered and captured in PostgreSQL, and after `down` and `up` (volumes kept)
the captured call is still there and v0 is served again.

The first run on a machine builds everything (minutes); the daemon's data root is kept, so later runs rebuild only
the layers whose inputs changed.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests import docker_daemon as dd
from tests.conftest import free_port

pytestmark = pytest.mark.slow

IMAGE = "clawgate-ci/clawgate:test"
COMPOSE_FILE = dd.CI_DIR / "docker-compose.ci.yml"
PROJECT = "clawgate-ci"


def say(what: str, started: float) -> None:
    # Shown with -s: how long each stage took, cold or warm.
    print(f"[test_image] {what}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)


def build_project_image() -> None:
    """The repository's Dockerfile on the local Python image, with the CPU torch wheel this machine has."""
    version = importlib.metadata.version("torch")
    args = {"BASE_IMAGE": dd.PYTHON_IMAGE, "TORCH_REQUIREMENT": f"torch=={version}"}
    wheel = dd.local_torch_wheel(version)
    if wheel is None:
        # No wheel on disk: PyTorch's own CPU index (where this machine can reach it).
        args["TORCH_PIP_OPTIONS"] = "--index-url https://download.pytorch.org/whl/cpu"
        dd.build(IMAGE, dd.ROOT, dd.ROOT / "Dockerfile", args)
        return
    host = dd.bridge_gateway()
    with dd.serve_folder(wheel.parent, host) as url:
        # Plain HTTP on the bridge, which only this machine's containers reach: pip wants it named as trusted.
        args["TORCH_PIP_OPTIONS"] = f"--find-links {url} --trusted-host {host}"
        dd.build(IMAGE, dd.ROOT, dd.ROOT / "Dockerfile", args)


class Stack:
    """docker-compose on the CI file, under its own project name."""

    def __init__(self, compose: str) -> None:
        self.compose = compose
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def run(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {**dd.client_env(), "CI_CLAWGATE_IMAGE": IMAGE, "CI_POSTGRES_IMAGE": dd.POSTGRES_IMAGE}
        env["CI_GATEWAY_PORT"] = str(self.port)
        command = [self.compose, "-p", PROJECT, "-f", str(COMPOSE_FILE), *args]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-4000:]}")
        return result

    def logs(self) -> str:
        return self.run("logs", "--no-color", "--tail", "80", check=False).stdout[-6000:]

    def sql(self, query: str) -> str:
        """One query through psql in the postgres container (local socket, as the database's owner)."""
        result = self.run("exec", "-T", "postgres", "psql", "-U", "clawgate", "-d", "clawgate", "-tAc", query)
        return result.stdout.strip()

    def wait_serving(self, version: int, timeout: float = 300) -> dict[str, Any]:
        """Wait until /health answers and the gateway serves ``version`` (the trainer has published it)."""
        deadline = time.monotonic() + timeout
        health: Any = None
        while time.monotonic() < deadline:
            try:
                health = httpx.get(self.url + "/health", timeout=5).json()
                if health["policy"]["version"] == version:
                    return dict(health)
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
            time.sleep(1)
        raise AssertionError(f"not serving v{version} within {timeout}s (last health: {health}):\n{self.logs()}")

    def wait_row(self, query: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            row = self.sql(query)
            if row:
                return row
            time.sleep(0.5)
        raise AssertionError(f"no row for {query!r} within {timeout}s:\n{self.logs()}")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    tools = dd.require_tools()
    started = time.monotonic()
    with dd.daemon(tools["dockerd"]):
        say("daemon up", started)
        dd.base_images(tools["debootstrap"])
        say("base images ready", started)
        build_project_image()
        say("clawgate image built", started)
        stack = Stack(tools["docker-compose"])
        # What a killed earlier run may have left: its containers and volumes.
        stack.run("down", "-v", "--remove-orphans", check=False)
        try:
            yield stack
        finally:
            stack.run("down", "-v", "--remove-orphans", check=False)
            # Images left untagged by rebuilds: without this the kept data root grows with every source change.
            dd.docker("image", "prune", "-f", check=False)
            say("stack down", started)


def test_the_compose_stack_serves_captures_trains_and_keeps_its_data(stack: Stack) -> None:
    started = time.monotonic()
    stack.run("up", "-d", timeout=600)
    health = stack.wait_serving(version=0)
    say("stack serving v0", started)
    assert health["engine"] == {"name": "local", "ok": True, "state": "ok"}, health
    assert health["policy"]["adapter"] == "policy@v0"

    response = httpx.post(
        stack.url + "/v1/chat/completions",
        json={"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    call_id = response.headers["x-clawgate-call-id"]
    assert response.json()["choices"][0]["message"]["content"] is not None
    row = stack.wait_row(f"SELECT status, policy_version FROM calls WHERE id = '{call_id}'")
    assert row == "ok|0", row
    # The trainer's v0 is recorded in the same database.
    assert stack.sql("SELECT count(*) FROM policy_versions WHERE version = 0") == "1"

    # Down without -v, then up: the database and the policy versions live in named volumes.
    stack.run("down")
    stack.run("up", "-d", timeout=600)
    stack.wait_serving(version=0)
    say("stack serving again after down/up", started)
    assert stack.sql(f"SELECT status FROM calls WHERE id = '{call_id}'") == "ok"
    again = httpx.post(
        stack.url + "/v1/chat/completions",
        json={"model": "tiny-model", "messages": [{"role": "user", "content": "again"}], "max_tokens": 4},
        timeout=120,
    )
    assert again.status_code == 200, again.text
    stack.wait_row(f"SELECT id FROM calls WHERE id = '{again.headers['x-clawgate-call-id']}'")


def test_image_runs_as_the_non_root_user_with_the_cpu_torch(stack: Stack) -> None:
    result = dd.docker(
        "run",
        "--rm",
        "--entrypoint",
        "python",
        IMAGE,
        "-c",
        "import os, torch; print(os.getuid(), torch.__version__, torch.cuda.is_available())",
        timeout=120,
    )
    uid, version, cuda = result.stdout.split()
    assert uid == "1000"
    assert version.split("+")[0] == importlib.metadata.version("torch").split("+")[0]
    assert cuda == "False"
    size = int(dd.docker("image", "inspect", "-f", "{{.Size}}", IMAGE).stdout.strip())
    print(f"[test_image] image size: {size / 2**30:.2f} GiB", file=sys.stderr)
    # The CUDA build would be several GiB; the CPU image stays well under.
    assert size < 3 * 2**30, size
