"""A server started as a subprocess in its own process group and waited for until its ``/health`` answers: what the
vLLM server (``vllm_server.py``) and the router in front of replicas (``vllm_router.py``) share."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

import httpx

LOG_TAIL_LINES = 40


class VLLMServerError(RuntimeError):
    """A managed server failed to start (the message ends with the tail of its log)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (another process may still take it before the server binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def stop_group(process: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM a child's process group (it was started in a new session), then SIGKILL it after ``grace`` s."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


class ManagedServer:
    """One server process on ``host:port``, its output appended to ``log_path`` (a temporary file when None)."""

    def __init__(self, host: str, port: int | None, log_path: Path | None) -> None:
        self.host = host
        self.port = port if port is not None else free_port(host)
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

    def _launch(
        self, command: list[str], env: dict[str, str] | None, *, name: str, timeout: float, poll: float
    ) -> float:
        """Start ``command`` and wait until ``/health`` answers 200: the seconds that took. ``VLLMServerError``
        (with the log's tail) when the process exits first or ``timeout`` passes; the process is then stopped."""
        if self.log_path is None:
            handle, path = tempfile.mkstemp(prefix=f"{name.lower()}-", suffix=".log")
            os.close(handle)
            self.log_path = Path(path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log_path.open("ab")
        started = time.monotonic()
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < started + timeout:
                code = self._process.poll()
                if code is not None:
                    self.stop()
                    raise VLLMServerError(f"{name} exited with status {code} while starting:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        return time.monotonic() - started
                time.sleep(poll)
        self.stop()
        raise VLLMServerError(f"{name} did not become healthy within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the server's process group, then SIGKILL it after ``grace`` seconds."""
        process, self._process = self._process, None
        if process is not None:
            stop_group(process, grace)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])
