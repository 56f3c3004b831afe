"""The agent harnesses the tests run (Claude Code, Codex, OpenClaw), at the versions pinned in
``tests/harnesses/package-lock.json``, installed with ``npm ci`` into ``.clawgate/test-cache/npm`` (gitignored).

Every machine tests the same versions, and the install is redone only when the lockfile changes. OpenClaw needs a
newer Node.js than many machines have: ``./dev test`` installs one into ``.clawgate/node`` where the machine's own
is missing or too old, and :func:`tool_path` puts it first on PATH for the install and for the harnesses (the
runner's sandbox passes the test process's PATH on). Without npm, or when the registry refuses, the tests that
need a harness skip and say why (and fail under ``CLAWGATE_TEST_STRICT=1``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from runner.harnesses.base import node_version
from runner.harnesses.openclaw import NODE_MINIMUM
from tests.missing import missing

ROOT = Path(__file__).resolve().parent.parent
PINNED = ROOT / "tests" / "harnesses"  # package.json and package-lock.json
NPM_DIR = ROOT / ".clawgate" / "test-cache" / "npm"
LOCAL_NODE = ROOT / ".clawgate" / "node" / "bin"  # where ./dev installs Node.js
STAMP = ".clawgate-lock-sha256"
# A first install downloads about 300 MB (two native binaries and OpenClaw's dependencies): 2 minutes here.
INSTALL_TIMEOUT_S = 900


def tool_path() -> str:
    """PATH with ./dev's Node.js first where it installed one (the machine's own was missing or too old)."""
    path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    if (LOCAL_NODE / "node").exists() and str(LOCAL_NODE) not in path.split(os.pathsep):
        return f"{LOCAL_NODE}{os.pathsep}{path}"
    return path


def _lock_digest() -> str:
    digest = hashlib.sha256()
    for name in ("package.json", "package-lock.json"):
        digest.update((PINNED / name).read_bytes())
    return digest.hexdigest()


def _run(cmd: list[str], timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": tool_path()}
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        missing(f"`{' '.join(cmd[:3])}` did not finish within {timeout:.0f} s")


def install() -> Path:
    """The pinned harnesses' ``node_modules/.bin``, installed first if the lockfile changed since the last install."""
    NPM_DIR.mkdir(parents=True, exist_ok=True)
    want = _lock_digest()
    # Test files run on several processes at once: one installs, the others wait for it.
    with open(NPM_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = NPM_DIR / STAMP
        if not (stamp.exists() and stamp.read_text() == want):
            npm = shutil.which("npm", path=tool_path())
            if npm is None:
                missing("npm is not installed (./dev test installs Node.js and npm into .clawgate/node)")
            # OpenClaw's install refuses an older Node.js, and the three are installed together.
            node = node_version(shutil.which("node", path=tool_path()))
            if node is None or node < NODE_MINIMUM:
                found = ".".join(map(str, node)) if node else "none"
                missing(
                    f"installing the pinned harnesses needs Node.js >= {'.'.join(map(str, NODE_MINIMUM))} (found "
                    f"{found}); ./dev test installs one into .clawgate/node"
                )
            stamp.unlink(missing_ok=True)
            for name in ("package.json", "package-lock.json"):
                shutil.copyfile(PINNED / name, NPM_DIR / name)
            done = _run([npm, "ci", "--no-audit", "--no-fund"], INSTALL_TIMEOUT_S, cwd=NPM_DIR)
            if done.returncode != 0:
                missing(f"`npm ci` of tests/harnesses failed: {(done.stderr or done.stdout).strip()[-500:]}")
            stamp.write_text(want)
    return NPM_DIR / "node_modules" / ".bin"


def harness_exe(binary: str) -> Path:
    """One pinned harness's executable, checked to start on this machine (``--version``)."""
    exe = install() / binary
    if not exe.exists():
        missing(f"the pinned harnesses were installed but {exe} is missing")
    version = _run([str(exe), "--version"], timeout=120)
    if version.returncode != 0:
        missing(f"{binary} does not run on this machine: {(version.stderr or version.stdout).strip()[-300:]}")
    return exe
