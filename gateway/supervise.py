"""The trainer as a supervised child process of `clawgate up`.

Training is torch work that holds the GIL for seconds at a time; in the serving process it would stall every
stream. So `clawgate up` runs `clawgate train` as a child with the same settings (passed as ``CLAWGATE_*``
variables), restarts it with a capped backoff if it dies (a crash mid-step is safe: see ``trainer/publish.py``),
and stops it with SIGTERM (then SIGKILL) when the gateway exits.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

from pydantic import SecretStr

from gateway.settings import Settings

log = logging.getLogger("clawgate")

# Exit code of `clawgate train` when another trainer holds the adapter directory: restarting would not help.
TRAINER_BUSY = 3


def settings_env(settings: Settings) -> dict[str, str]:
    """``settings`` as the environment variables that rebuild it in a child process."""
    env: dict[str, str] = {}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        elif isinstance(value, bool):
            value = "true" if value else "false"
        env[f"CLAWGATE_{name.upper()}"] = str(value)
    return env


class TrainerProcess:
    def __init__(self, settings: Settings, *, min_backoff: float = 5.0, max_backoff: float = 300.0) -> None:
        self.settings = settings
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        self.restarts = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "gateway.cli", "train"]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._supervise, name="clawgate-trainer", daemon=True)
        self._thread.start()

    def _spawn(self) -> subprocess.Popen[bytes]:
        env = {**os.environ, **settings_env(self.settings)}
        return subprocess.Popen(self.command(), env=env)

    def _supervise(self) -> None:
        backoff = self.min_backoff
        while not self._stop.is_set():
            self._process = self._spawn()
            log.info("trainer started (pid %d)", self._process.pid)
            code = self._process.wait()
            if self._stop.is_set():
                return
            if code == 0:
                log.info("trainer exited")
                return
            if code == TRAINER_BUSY:
                log.error("trainer not started: another trainer uses %s", self.settings.adapter_dir)
                return
            self.restarts += 1
            log.error("trainer exited with code %d; restarting in %.0fs", code, backoff)
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, self.max_backoff)

    def stop(self, grace: float = 30.0) -> None:
        self._stop.set()
        process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._thread is not None:
            self._thread.join(timeout=5)
