"""Throw-away sandboxes: a fresh workspace per rollout, process isolation, time and resource limits, cleanup.

With bubblewrap (``bwrap``, the Debian/Ubuntu package ``bubblewrap``) a command runs in new user, PID, IPC,
UTS, cgroup and network namespaces with:

- the host's file system mounted read-only (interpreters and installed harnesses must be usable), with private,
  empty ``/tmp`` and ``/run`` (which hides host Unix sockets such as a database's or a container engine's),
  a fresh ``/dev`` and ``/proc``;
- the rollout's own directory as the only writable host path: its workspace and a private home for harness
  configuration, both deleted when the rollout ends; other rollouts' directories are hidden;
- no network except the gateway (``network="gateway"``): the namespace has only a loopback interface, and a
  relay (``runner.netbridge``) joins one loopback port inside to the gateway through a bind-mounted Unix
  socket. This is real isolation, not a firewall rule: there is no route to anywhere else. ``"host"`` shares
  the host's network instead (for a harness that must reach something else; say so when you use it), and
  ``"none"`` (verifiers) gets loopback only;
- reading is not confined: whatever this user can read outside ``/tmp`` and ``/run`` stays readable (harnesses
  and interpreters live there). Keep secrets and a local gateway database out of that user's reach;
- all capabilities dropped, a new session (no terminal injection), and ``--die-with-parent``;
- limits: wall-clock time (the whole process tree is killed: the outer process group, and with it the PID
  namespace, whose every process the kernel kills when its first process dies), file size, open files and
  optionally address space and CPU time (``ulimit`` in a ``sh`` wrapper; address-space limits break Node.js
  harnesses, which reserve large virtual ranges, so it is off by default).

Without a usable ``bwrap`` the fallback is a plain temporary directory and a new process group: the command
can write anywhere this user can and reach any network, so the runner prints a loud warning (and the CLI
refuses the fallback when ``--sandbox bwrap`` is asked for). A process that starts its own session escapes
the process-group kill there; under bwrap the PID namespace catches it.

A sandbox that cannot start its command (bwrap failing to set up namespaces or mounts, an executable that
does not exist) raises ``SandboxError``: an infrastructure failure, which the runner may retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from runner import netbridge
from runner.tasks import Task

SandboxMode = Literal["auto", "bwrap", "none"]
Network = Literal["gateway", "host", "none"]
OUTPUT_TAIL = 256 * 1024  # bytes of each stream kept
KILL_GRACE_S = 1.0
FALLBACK_WARNING = (
    "WARNING: {why}. Rollouts run in plain temporary directories WITHOUT "
    "isolation: harnesses and verifiers can write anywhere this user can and reach any network. Install it "
    "(Debian/Ubuntu: apt-get install bubblewrap) or pass --sandbox bwrap to refuse running without it."
)


class SandboxError(RuntimeError):
    """The sandbox could not be created or could not start its command (an infrastructure failure)."""


@dataclass(frozen=True, slots=True)
class Limits:
    file_size_mb: int | None = 1024
    open_files: int | None = 4096
    memory_mb: int | None = None  # address space; breaks Node.js harnesses, so off by default
    cpu_seconds: int | None = None


@dataclass(frozen=True, slots=True)
class ProcessResult:
    exit_code: int | None  # None when the command was killed for its time limit
    stdout: str  # the last OUTPUT_TAIL bytes of each stream
    stderr: str
    timed_out: bool
    duration: float


@functools.lru_cache(maxsize=8)
def bwrap_problem(executable: str | None = None) -> str | None:
    """Why bubblewrap cannot be used here (None: it works). It can be installed yet unusable, e.g. where the
    kernel or a container forbids unprivileged user namespaces, so a trial sandbox is started."""
    exe = executable or shutil.which("bwrap")
    if exe is None:
        return "bwrap is not installed"
    try:
        proc = subprocess.run(
            [exe, *_base_args(), "--", "true"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{exe} does not run: {exc}"
    if proc.returncode != 0:
        return f"{exe} cannot create a sandbox: {proc.stderr.strip()[-300:] or f'exit {proc.returncode}'}"
    return None


def _base_args() -> list[str]:
    return [
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/tmp",
        "--tmpfs",
        "/run",
    ]


def _own_paths() -> list[Path]:
    """This package's checkout and the Python installation, where the sandbox's private /tmp or /run hide them."""
    candidates = [Path(__file__).resolve().parent.parent, Path(sys.prefix), Path(sys.base_prefix)]
    hidden = (Path("/tmp"), Path("/run"))
    return [p for p in candidates if any(p.is_relative_to(h) for h in hidden)]


def _ulimit_prefix(limits: Limits) -> list[str]:
    """``sh -c 'ulimit …; exec "$@"' sh`` — limits lowered (never raised above the current hard limit)."""
    wanted = [
        ("-f", resource.RLIMIT_FSIZE, limits.file_size_mb and limits.file_size_mb * 2048),  # 512-byte blocks
        ("-n", resource.RLIMIT_NOFILE, limits.open_files),
        ("-v", resource.RLIMIT_AS, limits.memory_mb and limits.memory_mb * 1024),  # KiB
        ("-t", resource.RLIMIT_CPU, limits.cpu_seconds),
    ]
    statements = []
    for flag, which, value in wanted:
        if not value:
            continue
        _, hard = resource.getrlimit(which)
        unit = {"-f": 512, "-v": 1024}.get(flag, 1)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard // unit)
        statements.append(f"ulimit {flag} {int(value)}")
    if not statements:
        return []
    return ["/bin/sh", "-c", "; ".join(statements) + '; exec "$@"', "sh"]


class Sandbox:
    """One rollout's directory (``workspace``, ``home``) and the way commands run in it."""

    def __init__(self, root: Path, kind: Literal["bwrap", "none"], bwrap: str | None, hide: Path, limits: Limits):
        self.root = root
        self.kind = kind
        self.bwrap = bwrap
        self.limits = limits
        self._hide = hide  # the directory holding every rollout's root: hidden inside bwrap
        self.workspace = root / "work"
        self.home = root / "home"
        self.tmp = root / "tmp"  # TMPDIR in the fallback (bwrap has its own /tmp)
        for d in (self.workspace, self.home, self.tmp):
            d.mkdir(parents=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def populate(self, task: Task) -> None:
        """The task's initial workspace: its ``workspace`` directory copied, then its ``files`` written."""
        if task.workspace is not None:
            shutil.copytree(task.workspace, self.workspace, dirs_exist_ok=True, symlinks=True)
        for rel, content in task.files.items():
            path = self.workspace / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content, encoding="utf-8")

    def close(self) -> None:
        """Remove everything the rollout wrote. Safe to call twice."""
        if self.root.exists():
            # A harness can leave read-only directories behind; make them writable before removing.
            for dirpath, dirnames, _ in os.walk(self.root):
                for name in dirnames:
                    with contextlib.suppress(OSError):
                        os.chmod(os.path.join(dirpath, name), 0o700)
            shutil.rmtree(self.root, ignore_errors=True)

    @property
    def removed(self) -> bool:
        return not self.root.exists()

    def url_for(self, gateway_url: str) -> str:
        """The URL a command inside this sandbox uses to reach ``gateway_url`` with ``network="gateway"``."""
        if self.kind != "bwrap":
            return gateway_url
        return netbridge.plan_endpoint(gateway_url).inner_url

    def base_env(self) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": str(self.home),
            "TMPDIR": "/tmp" if self.kind == "bwrap" else str(self.tmp),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
        }

    def _bwrap_argv(
        self,
        argv: Sequence[str],
        network: Network,
        endpoint: netbridge.Endpoint | None,
        ro_paths: Sequence[Path],
        net: Path | None = None,
    ) -> list[str]:
        assert self.bwrap is not None
        args = [self.bwrap, *_base_args()]
        if network == "host":
            args.append("--share-net")
        args += ["--hostname", "clawgate-sandbox"]
        # What must stay readable although the private /tmp and /run hide it: this package and its interpreter
        # (run from a checkout under /tmp, say) and the caller's paths (a task file's directory).
        for path in dict.fromkeys([*_own_paths(), *ro_paths]):
            args += ["--ro-bind", str(path), str(path)]
        args += ["--tmpfs", str(self._hide)]  # other rollouts' directories, wherever the run directory is
        for d in (self.workspace, self.home):
            args += ["--bind", str(d), str(d)]
        inner = list(argv)
        if endpoint is not None:
            assert net is not None
            args += ["--ro-bind", str(net), netbridge.INNER_SOCKET_DIR]
            if endpoint.hosts_name is not None:
                args += ["--ro-bind", str(self.root / "hosts"), "/etc/hosts"]
            bridge = [sys.executable, "-I", str(Path(netbridge.__file__).resolve()), "--socket", netbridge.INNER_SOCKET]
            for host, port in endpoint.listen:
                bridge += ["--listen", f"{host}:{port}"]
            inner = [*bridge, "--", *inner]
        args += ["--chdir", str(self.workspace)]
        return [*args, "--", *_ulimit_prefix(self.limits), *inner]

    async def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        timeout: float,
        network: Network = "none",
        gateway_url: str | None = None,
        stdin: bytes | None = None,
        ro_paths: Sequence[Path] = (),
    ) -> ProcessResult:
        """Run ``argv`` in the workspace; kill its whole process tree after ``timeout`` seconds. ``ro_paths``
        are host directories the command must be able to read even where the sandbox hides them (``/tmp``)."""
        endpoint = None
        if self.kind == "bwrap" and network == "gateway":
            if gateway_url is None:
                raise ValueError("network='gateway' needs gateway_url")
            endpoint = netbridge.plan_endpoint(gateway_url)
            if endpoint.hosts_name is not None:
                (self.root / "hosts").write_text(netbridge.hosts_file(endpoint.hosts_name))
            # The socket lives in a short path of its own: sun_path holds 108 bytes, rollout paths can be long.
            net = Path(tempfile.mkdtemp(prefix="clawgate-net-"))
            try:
                if len(str(net / "gw.sock")) > 100:
                    raise SandboxError(f"temporary directory path too long for a Unix socket: {net}")
                async with netbridge.GatewayRelay(net / "gw.sock", *endpoint.target):
                    bwrap_argv = self._bwrap_argv(argv, network, endpoint, ro_paths, net)
                    return await self._run(bwrap_argv, env, timeout, stdin, status=True)
            finally:
                shutil.rmtree(net, ignore_errors=True)
        if self.kind == "bwrap":
            return await self._run(self._bwrap_argv(argv, network, None, ro_paths), env, timeout, stdin, status=True)
        return await self._run([*_ulimit_prefix(self.limits), *argv], env, timeout, stdin, status=False)

    async def _run(
        self, argv: list[str], env: Mapping[str, str], timeout: float, stdin: bytes | None, *, status: bool
    ) -> ProcessResult:
        status_r = status_w = -1
        if status:
            # bwrap reports {"exit-code": N} only for a command it set up and executed; a failure to build the
            # sandbox (a mount, a namespace) or to exec the command leaves it out ({"child-pid"} comes too early).
            status_r, status_w = os.pipe()
            argv = [argv[0], "--json-status-fd", str(status_w), *argv[1:]]
        t0 = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=self.workspace,
                env=dict(env),
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                pass_fds=(status_w,) if status else (),
            )
        except OSError as exc:
            if status:
                os.close(status_r)
            raise SandboxError(f"cannot start {argv[0]}: {exc}") from exc
        finally:
            if status:
                os.close(status_w)
        assert proc.stdout is not None and proc.stderr is not None
        readers = [asyncio.create_task(_tail(proc.stdout)), asyncio.create_task(_tail(proc.stderr))]
        if stdin is not None and proc.stdin is not None:
            with contextlib.suppress(ConnectionError):
                proc.stdin.write(stdin)
                await proc.stdin.drain()
            proc.stdin.close()
        timed_out = False
        try:
            if not await _exited(proc, timeout):
                timed_out = True
                _killpg(proc.pid, signal.SIGTERM)
                if not await _exited(proc, KILL_GRACE_S):
                    _killpg(proc.pid, signal.SIGKILL)
                    await _exited(proc, None)
        except BaseException:
            _killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            # Whatever the command left running in its group (`cmd &`) goes too.
            _killpg(proc.pid, signal.SIGKILL)
            started = _bwrap_started(status_r) if status else True
        # A straggler in another session can still hold the pipes open: do not wait for it forever.
        done, pending = await asyncio.wait(readers, timeout=2.0)
        for task in pending:
            task.cancel()
        out, err = (t.result() if t in done else b"" for t in readers)
        duration = time.monotonic() - t0
        if not started and not timed_out:
            raise SandboxError(f"bwrap could not start the sandbox: {err.decode(errors='replace').strip()[-500:]}")
        code = proc.returncode
        return ProcessResult(
            exit_code=None if timed_out else code,
            stdout=out.decode("utf-8", errors="replace"),
            stderr=err.decode("utf-8", errors="replace"),
            timed_out=timed_out,
            duration=duration,
        )


async def _exited(proc: asyncio.subprocess.Process, timeout: float | None) -> bool:
    """Whether the process exits within ``timeout``. Not ``proc.wait()``: that also waits for its pipes to
    close, which a background child holding stdout delays until it is killed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.005
    while proc.returncode is None:
        if deadline is not None and time.monotonic() >= deadline:
            return False
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)
    return True


async def _tail(stream: asyncio.StreamReader) -> bytes:
    buf = bytearray()
    while chunk := await stream.read(65536):
        buf += chunk
        if len(buf) > 2 * OUTPUT_TAIL:
            del buf[:-OUTPUT_TAIL]
    return bytes(buf[-OUTPUT_TAIL:])


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _bwrap_started(fd: int) -> bool:
    """Whether bwrap's status pipe reports the command's exit, i.e. the sandbox was built and the command ran."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    for line in data.decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            if "exit-code" in json.loads(line):
                return True
    return False


class SandboxFactory:
    """Creates one sandbox per rollout under a private run directory, all of the same kind."""

    def __init__(
        self,
        mode: SandboxMode = "auto",
        *,
        base_dir: str | Path | None = None,
        limits: Limits | None = None,
        bwrap: str | None = None,
    ) -> None:
        exe = bwrap or shutil.which("bwrap")
        problem = bwrap_problem(exe) if mode != "none" else None
        if mode == "bwrap" and problem is not None:
            raise SandboxError(f"--sandbox bwrap: {problem}")
        self.kind: Literal["bwrap", "none"] = "bwrap" if mode != "none" and problem is None else "none"
        self.bwrap = exe if self.kind == "bwrap" else None
        self.limits = limits or Limits()
        why = "the sandbox is turned off (--sandbox none)" if mode == "none" else f"bubblewrap is not usable: {problem}"
        self.warning = None if self.kind == "bwrap" else FALLBACK_WARNING.format(why=why)
        parent = Path(base_dir) if base_dir is not None else Path(tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        self.run_dir = Path(tempfile.mkdtemp(prefix="clawgate-run-", dir=parent))

    def create(self, task: Task | None = None) -> Sandbox:
        """A fresh sandbox, populated with ``task``'s workspace; raises ``SandboxError`` if that fails."""
        try:
            root = Path(tempfile.mkdtemp(prefix="r", dir=self.run_dir))
            sandbox = Sandbox(root, self.kind, self.bwrap, self.run_dir, self.limits)
        except OSError as exc:
            raise SandboxError(f"cannot create a sandbox directory in {self.run_dir}: {exc}") from exc
        if task is not None:
            try:
                sandbox.populate(task)
            except OSError as exc:
                sandbox.close()
                raise SandboxError(f"cannot populate the workspace of task {task.id!r}: {exc}") from exc
        return sandbox

    def close(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def leftovers(self) -> list[Path]:
        """Sandbox directories still present (each should be removed as its rollout ends)."""
        return sorted(self.run_dir.iterdir()) if self.run_dir.exists() else []
