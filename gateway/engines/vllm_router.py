"""Start and stop ``vllm-router`` (PyPI: ``vllm-router``, a Rust binary with a Python launcher) in front of
several vLLM replicas, as a subprocess (tests, local scale-out runs).

The router is started with ``python -m vllm_router.launch_router`` of the interpreter it is installed in (the
vLLM environment: ``./dev setup-vllm`` installs it there) and the flags the gateway depends on:

- ``--policy consistent_hash``: the gateway sends each call's rollout id in ``X-Session-ID``, the first key this
  policy hashes, so all calls of a rollout reach one replica (its prefix cache is there).
- ``--health-check-interval-secs``, ``--health-failure-threshold``, ``--health-success-threshold``: how soon a
  dead replica is routed around and a returned one taken back (the defaults, 60 s × 3, leave a dead replica in
  the ring for minutes).
- ``--prometheus-port``: the router always serves metrics, on 29000 by default; a free port keeps two routers
  on one host apart.

Measured with vllm-router 0.1.17 against two vLLM CPU replicas: see README.md ("Several vLLM replicas").
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import httpx

from gateway.engines.vllm_server import VLLMServerError, free_port, stop_group


class VLLMRouter:
    """One ``vllm-router`` process on ``host:port`` routing to ``workers`` (base URLs of vLLM servers)."""

    def __init__(
        self,
        python: str,
        workers: Sequence[str],
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        policy: str = "consistent_hash",
        health_check_interval: int = 1,
        health_failure_threshold: int = 1,
        health_success_threshold: int = 2,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
    ) -> None:
        self.python = python
        self.workers = [url.rstrip("/") for url in workers]
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.policy = policy
        self.health_check_interval = health_check_interval
        self.health_failure_threshold = health_failure_threshold
        self.health_success_threshold = health_success_threshold
        self.extra_args = list(extra_args)
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL without ``/v1``, as ``VLLMEngine`` takes it."""
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def command(self) -> list[str]:
        return [
            self.python,
            "-m",
            "vllm_router.launch_router",
            "--worker-urls",
            *self.workers,
            "--policy",
            self.policy,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--prometheus-host",
            self.host,
            "--prometheus-port",
            str(free_port(self.host)),
            "--health-check-interval-secs",
            str(self.health_check_interval),
            "--health-failure-threshold",
            str(self.health_failure_threshold),
            "--health-success-threshold",
            str(self.health_success_threshold),
            *self.extra_args,
        ]

    def start(self, timeout: float = 60.0) -> None:
        """Start the router and wait until ``/health`` answers; the workers must already be up (the router
        waits for them before it listens)."""
        if self.running:
            return
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="vllm-router-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        self._log_file = self.log_path.open("ab")
        self._process = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                code = self._process.poll()
                if code is not None:
                    self.stop()
                    raise VLLMServerError(f"vllm-router exited with status {code} while starting:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                time.sleep(0.2)
        self.stop()
        raise VLLMServerError(f"vllm-router did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, grace: float = 10.0) -> None:
        process, self._process = self._process, None
        if process is not None:
            stop_group(process, grace)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
