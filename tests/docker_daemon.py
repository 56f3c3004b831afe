"""A Docker daemon of the test suite's own, and the local base images tests/test_image.py builds on.

The daemon listens on its own socket and keeps its pid file and runtime state in ``STATE`` (removed when it
stops, with the bridges and iptables chains it added to the host), and its images, layers and build cache in
``DATA_ROOT``, outside the repository and kept between runs: a rerun on the same machine then rebuilds only what
changed (seconds) instead of everything (minutes). A machine that has never run the test starts from an empty data
root and builds it all.

No image registry is needed: Debian's root file system comes from ``debootstrap`` (through Debian's package
mirror) and is imported as an image; Python and PostgreSQL are installed on it from Debian's packages.

CLAWGATE_TEST_DOCKER_ROOT puts the data root elsewhere (an empty folder: a cold run); CLAWGATE_TEST_DEBIAN_MIRROR
names another Debian mirror for debootstrap.
"""

from __future__ import annotations

import http.server
import ipaddress
import json
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from tests.missing import missing

ROOT = Path(__file__).resolve().parent.parent
CI_DIR = ROOT / "deploy" / "ci"
STATE = Path("/run/clawgate-test-docker")
DATA_ROOT = Path(os.environ.get("CLAWGATE_TEST_DOCKER_ROOT", "/var/lib/clawgate-test-docker"))
SOCKET = STATE / "docker.sock"
PID_FILE = STATE / "dockerd.pid"
DEBIAN_IMAGE = "clawgate-ci/debian:bookworm"
PYTHON_IMAGE = "clawgate-ci/python:3.11"
POSTGRES_IMAGE = "clawgate-ci/postgres:15"
DEBIAN_MIRROR = os.environ.get("CLAWGATE_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# The torch wheel server listens here when it can: the address is part of the build step's cache key.
WHEEL_PORT = 47831
TOOLS = ("dockerd", "docker", "docker-compose", "debootstrap")


def require_tools() -> dict[str, str]:
    """The machine tools the image test needs, by path (``missing`` when one is absent or we are not root)."""
    found = {tool: shutil.which(tool) for tool in TOOLS}
    absent = [tool for tool, path in found.items() if path is None]
    if absent:
        missing(f"{', '.join(absent)} not installed (Debian: apt-get install docker.io docker-compose debootstrap)")
    if os.geteuid() != 0:
        missing("a Docker daemon and debootstrap need root")
    return {tool: str(path) for tool, path in found.items()}


def client_env() -> dict[str, str]:
    # The classic builder: it needs no buildx plugin, works with any client version beside the daemon, and keeps
    # its cache as plain images in the data root.
    return {**os.environ, "DOCKER_HOST": f"unix://{SOCKET}", "DOCKER_BUILDKIT": "0", "COMPOSE_DOCKER_CLI_BUILD": "0"}


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["docker", *args], env=client_env(), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        output = result.stdout[-3000:] + result.stderr[-3000:]
        raise AssertionError(f"docker {' '.join(args)} exited {result.returncode}:\n{output}")
    return result


def _stop_pid(pid: int, timeout: float = 60) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)


def _stop_leftover() -> None:
    """A daemon a killed earlier run left behind, found by its pid file (ours alone: it is in ``STATE``). Not our
    child, so it is watched with kill(pid, 0) until it is gone."""
    try:
        pid = int(PID_FILE.read_text().strip())
    except (OSError, ValueError):
        return
    _stop_pid(pid)


def _forward_policy(policy: str | None = None) -> str | None:
    """The host firewall's FORWARD policy, set to ``policy`` first when given (None: no iptables here)."""
    iptables = shutil.which("iptables")
    if iptables is None:
        return None
    if policy is not None:
        subprocess.run([iptables, "-P", "FORWARD", policy], capture_output=True, timeout=30, check=False)
    listed = subprocess.run([iptables, "-S", "FORWARD"], capture_output=True, text=True, timeout=30, check=False)
    first = listed.stdout.splitlines()[:1]
    return first[0].split()[-1] if first and first[0].startswith("-P FORWARD") else None


HostNetwork = tuple[frozenset[str], dict[str, frozenset[str]]]
# What dockerd adds to the host's network: its bridges (docker0, a compose network's br-…) and their veth ends.
DOCKER_LINKS = ("docker0", "br-", "veth")


def _iptables(table: str, *args: str) -> subprocess.CompletedProcess[str]:
    iptables = shutil.which("iptables") or "iptables"
    return subprocess.run([iptables, "-t", table, *args], capture_output=True, text=True, timeout=30, check=False)


def _host_network() -> HostNetwork:
    """The host's network interfaces, and per iptables table its chains and rules (``iptables -S`` lines)."""
    links = frozenset(p.name for p in Path("/sys/class/net").iterdir())
    tables = ("filter", "nat") if shutil.which("iptables") else ()
    return links, {table: frozenset(_iptables(table, "-S").stdout.splitlines()) for table in tables}


def _remove_new_network(before: HostNetwork) -> None:
    """Remove the bridges, iptables chains and rules the daemon added (what was not there before it started)."""
    links, tables = _host_network()
    for link in sorted(links - before[0]):
        if link.startswith(DOCKER_LINKS):
            subprocess.run(["ip", "link", "delete", link], capture_output=True, timeout=30, check=False)
    for table, lines in tables.items():
        added = lines - before[1].get(table, frozenset())
        chains = sorted(line.split()[1] for line in added if line.startswith("-N "))
        for rule in sorted(line for line in added if line.startswith("-A ")):
            if rule.split()[1] not in chains:  # the rules of a new chain go with it
                _iptables(table, "-D", *rule.split()[1:])
        for flag in ("-F", "-X"):  # every new chain emptied first: they jump to each other
            for chain in chains:
                _iptables(table, flag, chain)


def _leftovers(before: HostNetwork) -> list[str]:
    links, tables = _host_network()
    out = [link for link in sorted(links - before[0]) if link.startswith(DOCKER_LINKS)]
    for table, lines in tables.items():
        out += [f"{table}: {line}" for line in sorted(lines - before[1].get(table, frozenset()))]
    return out


@contextmanager
def daemon(dockerd: str) -> Iterator[None]:
    """Start the daemon, wait until it answers, and stop it by its pid at the end, removing what it added to the
    host's network (bridges, iptables chains; the FORWARD policy it sets to DROP is put back)."""
    _stop_leftover()
    forward = _forward_policy()
    network = _host_network()
    shutil.rmtree(STATE, ignore_errors=True)
    STATE.mkdir(parents=True)
    DATA_ROOT.mkdir(parents=True, exist_ok=True)
    log = (STATE / "dockerd.log").open("wb")
    command = [dockerd, "--host", f"unix://{SOCKET}", "--pidfile", str(PID_FILE)]
    command += ["--exec-root", str(STATE / "exec"), "--data-root", str(DATA_ROOT)]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while docker("version", check=False, timeout=30).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (STATE / "dockerd.log").read_text(errors="replace")[-3000:]
                missing(f"dockerd could not start:\n{tail}")
            time.sleep(0.2)
        yield
    finally:
        # Our own child: waited for directly (an exited child stays visible to kill(pid, 0) until it is reaped).
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
        # The socket, pid file and runtime state go; DATA_ROOT stays as the layer cache of the next run.
        shutil.rmtree(STATE, ignore_errors=True)
        if forward is not None and _forward_policy() != forward:
            _forward_policy(forward)
        _remove_new_network(network)
        left = _leftovers(network)
        assert not left, f"the test's dockerd left these on the host: {left}"


def image_exists(name: str) -> bool:
    return docker("image", "inspect", name, check=False).returncode == 0


def build(tag: str, context: Path, dockerfile: Path, args: dict[str, str], timeout: float = 1800) -> None:
    command = ["build", "-t", tag, "-f", str(dockerfile)]
    for name, value in args.items():
        command += ["--build-arg", f"{name}={value}"]
    docker(*command, str(context), timeout=timeout)


def base_images(debootstrap: str) -> None:
    """Debian from debootstrap (once: it is the slow part), then Python and PostgreSQL on it (cached layers)."""
    if not image_exists(DEBIAN_IMAGE):
        with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="clawgate-rootfs-") as rootfs:
            subprocess.run(
                [debootstrap, "--variant=minbase", "bookworm", rootfs, DEBIAN_MIRROR],
                check=True,
                capture_output=True,
                timeout=1800,
            )
            tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
            subprocess.run(
                ["docker", "import", "-", DEBIAN_IMAGE], stdin=tar.stdout, env=client_env(), check=True, timeout=600
            )
            assert tar.wait(timeout=60) == 0
    with tempfile.TemporaryDirectory(prefix="clawgate-python-ctx-") as context:
        # The host's authorities: where TLS is inspected on the way out, pip inside trusts what the host trusts.
        shutil.copy(HOST_CA_BUNDLE, Path(context) / "ca-certificates.crt")
        build(PYTHON_IMAGE, Path(context), CI_DIR / "python.Dockerfile", {"DEBIAN_IMAGE": DEBIAN_IMAGE})
    build(POSTGRES_IMAGE, CI_DIR, CI_DIR / "postgres.Dockerfile", {"DEBIAN_IMAGE": DEBIAN_IMAGE})


def bridge_gateway() -> str:
    """The host's address on the default bridge, where build containers reach the host."""
    network = json.loads(docker("network", "inspect", "bridge").stdout)[0]
    config = network["IPAM"]["Config"][0]
    return str(config.get("Gateway") or next(ipaddress.ip_network(config["Subnet"]).hosts()))


def local_torch_wheel(version: str) -> Path | None:
    """The CPU torch wheel for the image's Python (3.11), from the folders pip is told to look in."""
    folders: list[str] = os.environ.get("PIP_FIND_LINKS", "").split()
    config = subprocess.run(["pip", "config", "list"], capture_output=True, text=True, timeout=60)
    for line in config.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            folders += value.strip("'\"").split()
    for folder in folders:
        wheels = sorted(
            Path(folder.removeprefix("file://")).glob(f"torch-{version}-cp311-cp311-*{platform.machine()}.whl")
        )
        if wheels:
            return wheels[0]
    return None


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def serve_folder(folder: Path, host: str, ports: Sequence[int] = (WHEEL_PORT, 0)) -> Iterator[str]:
    """A throw-away HTTP server listing ``folder`` (pip reads the listing as --find-links); yields its URL."""
    handler = partial(_QuietHandler, directory=str(folder))
    for port in ports:
        try:
            server = http.server.ThreadingHTTPServer((host, port), handler)
            break
        except OSError:
            if port == ports[-1]:
                raise
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="wheel-server")
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
