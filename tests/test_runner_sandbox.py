"""Sandboxes: under bubblewrap the workspace (and the private home) is the only writable host path, other
rollouts are invisible, the network reaches the gateway and nothing else; in both modes a time limit kills the
whole process tree and the directory is always removed. The fallback announces itself loudly."""

from __future__ import annotations

import asyncio
import http.server
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner import netbridge
from runner.sandbox import Limits, Sandbox, SandboxError, SandboxFactory
from runner.tasks import Task, Verifier
from tests.runner_support import require_bwrap

PROJECT = Path(__file__).resolve().parent.parent
TASK = Task("t", "x", Verifier("shell", "true"), files={"src/main.txt": "original\n"})


@pytest.fixture
def bwrap_sandboxes(tmp_path: Path) -> Iterator[SandboxFactory]:
    require_bwrap()
    factory = SandboxFactory("bwrap", base_dir=tmp_path / "sandboxes")
    assert factory.kind == "bwrap" and factory.warning is None
    yield factory
    factory.close()


@pytest.fixture(params=["bwrap", "none"])
def any_sandboxes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SandboxFactory]:
    if request.param == "bwrap":
        require_bwrap()
    factory = SandboxFactory(request.param, base_dir=tmp_path / "sandboxes")
    assert factory.kind == request.param
    yield factory
    factory.close()


def run(sandbox: Sandbox, script: str, timeout: float = 20, **kw):
    return asyncio.run(sandbox.run(["/bin/sh", "-c", script], env=sandbox.base_env(), timeout=timeout, **kw))


def processes_with(marker: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and "pgrep" not in cmdline:
                found.append(f"{entry.name}: {cmdline}")
    return found


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = self.server.name.encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_servers() -> Iterator[dict[str, int]]:
    """Two HTTP servers on the host: one plays the gateway, the other anything else on the network."""
    servers = {}
    for name in ("gateway", "elsewhere"):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
        server.name = name  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers[name] = server
    yield {name: s.server_address[1] for name, s in servers.items()}
    for s in servers.values():
        s.shutdown()


def fetch_script(url: str) -> str:
    code = (
        "import sys, urllib.request\n"
        "try:\n"
        f"    print(urllib.request.urlopen({url!r}, timeout=5).read().decode())\n"
        "except Exception as exc:\n"
        "    print('unreachable', type(exc).__name__, exc); sys.exit(1)\n"
    )
    return f"{sys.executable} -I -c {shlex.quote(code)}"


def test_bwrap_workspace_is_the_only_writable_host_path(bwrap_sandboxes, tmp_path):
    # A host directory the sandbox can see (outside /tmp, which it replaces with its own).
    (PROJECT / ".clawgate").mkdir(exist_ok=True)
    outside = Path(tempfile.mkdtemp(prefix="sandbox-probe-", dir=PROJECT / ".clawgate"))
    try:
        with bwrap_sandboxes.create(TASK) as sandbox, bwrap_sandboxes.create(TASK) as other:
            assert (sandbox.workspace / "src" / "main.txt").read_text() == "original\n"
            script = f"""
                echo changed > src/main.txt && echo ws-ok
                echo x > "$HOME/config" && echo home-ok
                echo x > {outside}/escaped || echo outside-refused
                echo x > /etc/escaped || echo etc-refused
                echo x > {tmp_path}/escaped  # lands in the sandbox's private /tmp, if anywhere
                ls {other.workspace} || echo other-rollout-invisible
                echo x > /tmp/private && echo private-tmp-ok
            """
            result = run(sandbox, script)
            assert result.exit_code == 0, result
            for word in (
                "ws-ok",
                "home-ok",
                "outside-refused",
                "etc-refused",
                "other-rollout-invisible",
                "private-tmp-ok",
            ):
                assert word in result.stdout, (word, result)
            assert "Read-only file system" in result.stderr
            assert (sandbox.workspace / "src" / "main.txt").read_text() == "changed\n"
            assert (sandbox.home / "config").exists()
            assert not (outside / "escaped").exists() and not Path("/etc/escaped").exists()
            assert not (tmp_path / "escaped").exists() and not Path("/tmp/private").exists()
            assert list(other.workspace.rglob("*")) == [other.workspace / "src", other.workspace / "src" / "main.txt"]
    finally:
        shutil.rmtree(outside)


def test_bwrap_network_reaches_the_gateway_and_nothing_else(bwrap_sandboxes, http_servers):
    gateway = f"http://127.0.0.1:{http_servers['gateway']}/v1"
    elsewhere = f"http://127.0.0.1:{http_servers['elsewhere']}/"
    with bwrap_sandboxes.create(TASK) as sandbox:
        inner = sandbox.url_for(gateway)
        assert inner == gateway  # a loopback address keeps its URL
        ok = run(sandbox, fetch_script(inner), network="gateway", gateway_url=gateway)
        assert (ok.exit_code, ok.stdout.strip()) == (0, "gateway"), ok
        blocked = run(sandbox, fetch_script(elsewhere), network="gateway", gateway_url=gateway)
        assert blocked.exit_code == 1 and "unreachable" in blocked.stdout, blocked
        cut_off = run(sandbox, fetch_script(gateway), network="none")
        assert cut_off.exit_code == 1 and "unreachable" in cut_off.stdout, cut_off
        # A host name is mapped to the relay by the sandbox's own /etc/hosts.
        by_name = f"http://localhost:{http_servers['gateway']}/v1"
        named = run(sandbox, fetch_script(sandbox.url_for(by_name)), network="gateway", gateway_url=by_name)
        assert (named.exit_code, named.stdout.strip()) == (0, "gateway"), named
        shared = run(sandbox, fetch_script(elsewhere), network="host")
        assert (shared.exit_code, shared.stdout.strip()) == (0, "elsewhere"), shared


def test_endpoint_plans():
    same = netbridge.plan_endpoint("http://127.0.0.1:8080/rollouts/ro-1/v1")
    assert same.inner_url == "http://127.0.0.1:8080/rollouts/ro-1/v1" and same.target == ("127.0.0.1", 8080)
    named = netbridge.plan_endpoint("https://gw.example.com/rollouts/ro-1/v1")
    assert named.inner_url == "https://gw.example.com:18080/rollouts/ro-1/v1"  # TLS name kept, port unprivileged
    assert named.hosts_name == "gw.example.com" and named.target == ("gw.example.com", 443)
    assert named.listen == (("127.0.0.1", 18080),)
    remote_ip = netbridge.plan_endpoint("http://10.1.2.3:9000/v1")
    assert remote_ip.inner_url == "http://127.0.0.1:9000/v1" and remote_ip.hosts_name is None
    local = netbridge.plan_endpoint("http://localhost:8080/v1")
    assert local.listen == (("127.0.0.1", 8080), ("::1", 8080))
    with pytest.raises(ValueError):
        netbridge.plan_endpoint("ftp://x/")


def test_a_timeout_kills_the_whole_process_tree(any_sandboxes):
    marker = f"31.{os.getpid()}"
    with any_sandboxes.create(TASK) as sandbox:
        t0 = time.monotonic()
        result = run(sandbox, f"sleep {marker} & (sleep {marker}; echo never) & echo started; sleep 30", timeout=1)
        took = time.monotonic() - t0
    assert result.timed_out and result.exit_code is None
    assert "started" in result.stdout and took < 10  # not the 30 s the command wanted
    time.sleep(0.2)
    assert processes_with(marker) == []


def test_background_processes_die_with_a_command_that_exits(any_sandboxes):
    marker = f"32.{os.getpid()}"
    with any_sandboxes.create(TASK) as sandbox:
        result = run(sandbox, f"sleep {marker} & echo done")
    assert (result.exit_code, result.stdout.strip(), result.timed_out) == (0, "done", False)
    time.sleep(0.2)
    assert processes_with(marker) == []


def test_the_sandbox_is_always_removed(any_sandboxes):
    with pytest.raises(RuntimeError), any_sandboxes.create(TASK) as sandbox:
        # Read-only directories and files left behind must not stop the cleanup.
        result = run(sandbox, "mkdir -p locked/deep && echo x > locked/deep/f && chmod -R a-w locked && echo ok")
        assert result.stdout.strip() == "ok"
        raise RuntimeError("the rollout failed half-way")
    assert sandbox.removed and not sandbox.root.exists()
    with any_sandboxes.create(TASK) as timed_out:
        assert run(timed_out, "echo x > f; sleep 30", timeout=0.5).timed_out
    assert timed_out.removed
    assert any_sandboxes.leftovers() == []
    any_sandboxes.close()
    assert not any_sandboxes.run_dir.exists()


def test_limits_apply(any_sandboxes):
    factory = any_sandboxes
    factory.limits = Limits(file_size_mb=1, open_files=64)
    with factory.create(TASK) as sandbox:
        result = run(sandbox, "ulimit -n; head -c 3000000 /dev/zero > big; echo exit=$?; wc -c < big")
    lines = result.stdout.split()
    assert lines[0] == "64"
    assert int(lines[-1]) <= 1024 * 1024 and "exit=0" not in result.stdout, result


def test_a_sandbox_that_cannot_start_is_an_infrastructure_error(bwrap_sandboxes):
    sandbox = bwrap_sandboxes.create(TASK)
    shutil.rmtree(sandbox.root)  # bwrap cannot bind a workspace that is gone
    sandbox.root.mkdir()
    (sandbox.root / "work").mkdir()
    with pytest.raises(SandboxError, match="bwrap could not start the sandbox"):
        run(sandbox, "true")
    sandbox.close()


def test_the_fallback_warns_loudly(tmp_path):
    factory = SandboxFactory("none", base_dir=tmp_path)
    assert factory.kind == "none"
    assert factory.warning is not None and factory.warning.startswith("WARNING: the sandbox is turned off")
    assert "WITHOUT isolation" in factory.warning
    factory.close()
    missing = SandboxFactory("auto", base_dir=tmp_path, bwrap=str(tmp_path / "no-bwrap"))
    assert missing.kind == "none" and "WARNING: bubblewrap is not usable:" in (missing.warning or "")
    assert "does not run" in (missing.warning or "")
    missing.close()
    with pytest.raises(SandboxError, match="--sandbox bwrap"):
        SandboxFactory("bwrap", base_dir=tmp_path, bwrap=str(tmp_path / "no-bwrap"))
