"""Background workers as supervised child processes of `clawgate up`: the trainer, and the reward worker.

Training is torch work that holds the GIL for seconds at a time; in the serving process it would stall every
stream. The reward worker (`clawgate judge`) imports LiteLLM and decodes long prompts; it too stays out of the
serving process. So `clawgate up` runs `clawgate train` and `clawgate judge` as children with the same settings
(passed as ``CLAWGATE_*`` variables), restarts one that dies with a capped backoff (a crash mid-step or mid-turn
is safe: see ``trainer/publish.py`` and ``gateway/store/judgements.py``), and stops them with SIGTERM (then
SIGKILL) when the gateway exits.
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
from trainer.cli import TRAINER_BUSY

log = logging.getLogger("clawgate")

# Exit code of a worker whose configuration is wrong (`clawgate judge` without a judge model or reward function, a
# function that does not load): restarting it would fail the same way.
CONFIG_ERROR = 2
# Exit codes of a worker that must not be restarted.
NO_RESTART = (CONFIG_ERROR, TRAINER_BUSY)


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


class ChildProcess:
    """`clawgate <subcommand>` kept running beside the gateway."""

    def __init__(
        self, settings: Settings, subcommand: str, *, min_backoff: float = 5.0, max_backoff: float = 300.0
    ) -> None:
        self.settings = settings
        self.subcommand = subcommand
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        self.restarts = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "clawgate.cli", self.subcommand]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._supervise, name=f"clawgate-{self.subcommand}", daemon=True)
        self._thread.start()

    def _spawn(self) -> subprocess.Popen[bytes]:
        env = {**os.environ, **settings_env(self.settings)}
        return subprocess.Popen(self.command(), env=env)

    def _supervise(self) -> None:
        backoff = self.min_backoff
        while not self._stop.is_set():
            self._process = self._spawn()
            log.info("%s started (pid %d)", self.subcommand, self._process.pid)
            code = self._process.wait()
            if self._stop.is_set():
                return
            if code == 0:
                log.info("%s exited", self.subcommand)
                return
            if code in NO_RESTART:
                log.error("%s exited with code %d (see above); not restarting it", self.subcommand, code)
                return
            self.restarts += 1
            log.error("%s exited with code %d; restarting in %.0fs", self.subcommand, code, backoff)
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
