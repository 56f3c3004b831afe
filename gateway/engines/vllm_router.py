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

from collections.abc import Sequence
from pathlib import Path

from gateway.engines.managed import ManagedServer, free_port


class VLLMRouter(ManagedServer):
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
        super().__init__(host, port, log_path)
        self.python = python
        self.workers = [url.rstrip("/") for url in workers]
        self.policy = policy
        self.health_check_interval = health_check_interval
        self.health_failure_threshold = health_failure_threshold
        self.health_success_threshold = health_success_threshold
        self.extra_args = list(extra_args)

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
        if not self.running:
            self._launch(self.command(), None, name="vllm-router", timeout=timeout, poll=0.2)
