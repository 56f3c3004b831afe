"""A harness-like client for online-learning tests: it talks to a running `clawgate up` over HTTP only.

The task is synthetic and verifiable: reward = the fraction of completion tokens that fall in a fixed target set
of token ids (a random policy scores about |set| / |vocabulary|). The client keeps creating rollouts, sampling,
verifying from the token ids the gateway recorded, rewarding and finishing — while the trainer daemon trains and
the gateway swaps versions underneath it.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Sample:
    rollout_id: str
    version: int | None
    reward: float
    round: int


@dataclass
class UpProcess:
    """`clawgate up` (or another subcommand) in a child process, its output collected."""

    env: dict[str, str]
    cwd: Path
    args: list[str] = field(default_factory=list)
    command: str = "up"
    lines: list[str] = field(default_factory=list)
    proc: Any = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clawgate.cli", self.command, *self.args],
            cwd=self.cwd,
            env={**os.environ, "PYTHONPATH": str(ROOT), **self.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    @property
    def output(self) -> str:
        return "\n".join(x for x in self.lines[-80:] if "Loading weights" not in x)

    def stop(self, timeout: float = 90.0) -> int:
        return terminate(self.proc, timeout)


def terminate(proc: subprocess.Popen[Any], timeout: float = 90.0) -> int:
    """SIGTERM a child started in its own session, SIGKILL its group after ``timeout`` s; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return int(proc.returncode)


def wait_healthy(url: str, up: UpProcess, timeout: float, version: int | None = 0) -> dict[str, Any]:
    """Wait until the gateway answers /health (and serves ``version``, when given)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if up.proc.poll() is not None:
            raise AssertionError(f"`clawgate up` exited with {up.proc.returncode}:\n{up.output}")
        try:
            health = httpx.get(url + "/health", timeout=5).json()
            if version is None or health["policy"]["version"] == version:
                return dict(health)
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"the gateway was not ready within {timeout}s:\n{up.output}")


class TargetTokenTask:
    def __init__(
        self,
        url: str,
        admin_key: str,
        vocab_size: int,
        special: set[int],
        *,
        seed: int = 0,
        prompts: int = 8,
        group: int = 8,
        max_tokens: int = 24,
        target_size: int = 50,
    ) -> None:
        rng = random.Random(seed)
        vocab = [i for i in range(vocab_size) if i not in special]
        self.targets = set(rng.sample(vocab, target_size))
        self.texts = [f"Write item {rng.randrange(10_000)} of the list." for _ in range(prompts)]
        self.url, self.admin = url, {"Authorization": f"Bearer {admin_key}"}
        self.seed, self.prompts, self.group, self.max_tokens = seed, prompts, group, max_tokens
        self.samples: list[Sample] = []
        self.failures: list[str] = []

    def one(self, client: httpx.Client, round_: int, p: int, g: int) -> Sample | None:
        ro = client.post("/v1/rollouts", json={"task_id": f"p{p}", "harness": "client"}, headers=self.admin)
        ro.raise_for_status()
        info = ro.json()
        key = {"Authorization": f"Bearer {info['api_key']}"}
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": self.texts[p]}],
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
            "seed": self.seed * 1_000_003 + round_ * 10_007 + p * self.group + g,
        }
        r = client.post(f"/rollouts/{info['id']}/v1/chat/completions", json=body, headers=key)
        if r.status_code != 200:
            self.failures.append(f"{r.status_code}: {r.text[:300]}")
            return None
        calls = client.get(f"/v1/rollouts/{info['id']}", headers=key).json()["calls"]
        ids = calls[0]["completion_token_ids"]
        reward = sum(t in self.targets for t in ids) / max(len(ids), 1)
        client.post(f"/v1/rollouts/{info['id']}/reward", json={"value": reward, "source": "verifier"}, headers=key)
        client.post(f"/v1/rollouts/{info['id']}/finish", json={"status": "completed"}, headers=key)
        return Sample(info["id"], calls[0]["policy_version"], reward, round_)

    def run(self, *, until: Any, timeout: float, workers: int = 8) -> None:
        """Rounds of prompts × group rollouts until ``until(samples)`` is true or ``timeout`` seconds passed."""
        deadline = time.monotonic() + timeout
        round_ = 0
        with (
            httpx.Client(base_url=self.url, timeout=120) as client,
            concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool,
        ):
            while time.monotonic() < deadline and not until(self.samples):
                jobs = [
                    pool.submit(self.one, client, round_, p, g) for p in range(self.prompts) for g in range(self.group)
                ]
                for job in jobs:
                    try:
                        sample = job.result()
                    except httpx.HTTPError as exc:
                        self.failures.append(repr(exc))
                        continue
                    if sample is not None:
                        self.samples.append(sample)
                round_ += 1

    def by_version(self) -> dict[int | None, list[float]]:
        out: dict[int | None, list[float]] = {}
        for s in self.samples:
            out.setdefault(s.version, []).append(s.reward)
        return out

    def curve(self) -> str:
        return "  ".join(
            f"v{v}: {sum(r) / len(r):.2f} (n={len(r)})"
            for v, r in sorted(self.by_version().items(), key=lambda kv: -1 if kv[0] is None else kv[0])
        )
