"""Gateway-only networking for bubblewrap sandboxes: a relay from a loopback port inside to the gateway outside.

A sandbox started with ``--unshare-net`` has its own network namespace holding only a loopback interface: no
route anywhere, no DNS, and the host's abstract Unix sockets are out of reach too. The one way out is a Unix
socket bind-mounted into it (filesystem sockets cross namespace borders):

    harness ──TCP──▶ 127.0.0.1:PORT (inside)  ── bridge (this module's ``main``, first process in the sandbox)
            ──Unix socket /run/clawgate/gw.sock──▶ GatewayRelay (in the runner) ──TCP──▶ gateway host:port

Both relays copy bytes and nothing else, so TLS to an ``https`` gateway passes through untouched. The URL the
harness is given keeps the gateway's scheme and host name where possible (``plan_endpoint``): a loopback
address is kept as is, a host name is mapped to 127.0.0.1 by the sandbox's own ``/etc/hosts`` (so TLS
certificates still match), any other IP address becomes 127.0.0.1. Ports below 1024 move to 18080 inside, as
an unprivileged sandbox cannot bind them.

``python -I netbridge.py --socket S --listen HOST:PORT [--listen ...] -- COMMAND...`` runs inside the sandbox:
it listens, starts COMMAND, relays until COMMAND exits, and exits with its status. It uses the standard
library only, so ``-I`` (isolated mode: no PYTHONPATH, no user site) is enough to run it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

INNER_SOCKET_DIR = "/run/clawgate"
INNER_SOCKET = f"{INNER_SOCKET_DIR}/gw.sock"
HIGH_PORT = 18080
CHUNK = 65536


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the gateway is, seen from outside (``target``) and from inside the sandbox (``inner_url``)."""

    inner_url: str
    listen: tuple[tuple[str, int], ...]  # addresses the bridge binds inside
    hosts_name: str | None  # a host name the sandbox's /etc/hosts must map to 127.0.0.1
    target: tuple[str, int]


def plan_endpoint(url: str) -> Endpoint:
    parts = urlsplit(url)
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    inner_port = port if port >= 1024 else HIGH_PORT
    hosts_name: str | None = None
    listen: tuple[tuple[str, int], ...]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None and ip.version == 4 and ip.is_loopback:
        inner_host, listen = host, ((host, inner_port),)
    elif host == "localhost":
        # Resolvers differ on whether localhost is 127.0.0.1 or ::1 first; listen on both.
        inner_host, listen = host, (("127.0.0.1", inner_port), ("::1", inner_port))
    elif ip is None:
        inner_host, listen, hosts_name = host, (("127.0.0.1", inner_port),), host
    else:
        inner_host, listen = "127.0.0.1", (("127.0.0.1", inner_port),)
    inner_url = urlunsplit((parts.scheme, f"{inner_host}:{inner_port}", parts.path, parts.query, parts.fragment))
    return Endpoint(inner_url, listen, hosts_name, (host, port))


def hosts_file(name: str | None) -> str:
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    if name:
        lines.append(f"127.0.0.1\t{name}")
    return "\n".join(lines) + "\n"


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass


async def _splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter], b: tuple[asyncio.StreamReader, asyncio.StreamWriter]
) -> None:
    try:
        await asyncio.gather(_pump(a[0], b[1]), _pump(b[0], a[1]))
    finally:
        for _, w in (a, b):
            w.close()
            with contextlib.suppress(ConnectionError, OSError):
                await w.wait_closed()


class GatewayRelay:
    """Outside the sandbox: accepts connections on a Unix socket and forwards each one to the gateway."""

    def __init__(self, socket_path: Path, host: str, port: int) -> None:
        self.socket_path = socket_path
        self.host, self.port = host, port
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            try:
                upstream = await asyncio.open_connection(self.host, self.port)
            except OSError:
                writer.close()  # the harness sees a reset connection, as it would with the gateway down
                return
            await _splice((reader, writer), upstream)
        finally:
            self._conns.discard(task)

    async def __aenter__(self) -> GatewayRelay:
        self._server = await asyncio.start_unix_server(self._handle, path=str(self.socket_path))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


async def _bridge(socket_path: str, listen: list[tuple[str, int]], command: list[str]) -> int:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream = await asyncio.open_unix_connection(socket_path)
        except OSError:
            writer.close()
            return
        await _splice((reader, writer), upstream)

    servers = []
    for host, port in listen:
        try:
            servers.append(await asyncio.start_server(handle, host, port))
        except OSError as exc:
            if host != "::1":  # no IPv6 in the sandbox: 127.0.0.1 still serves
                print(f"netbridge: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
                return 70
    proc = await asyncio.create_subprocess_exec(*command)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, proc.send_signal, sig)
    code = await proc.wait()
    for server in servers:
        server.close()
    return 128 - code if code < 0 else code


def main(argv: list[str]) -> int:
    socket_path = INNER_SOCKET
    listen: list[tuple[str, int]] = []
    args = list(argv)
    while args and args[0] != "--":
        flag = args.pop(0)
        if not args:
            break
        value = args.pop(0)
        if flag == "--socket":
            socket_path = value
        elif flag == "--listen":
            host, _, port = value.rpartition(":")
            listen.append((host.strip("[]"), int(port)))
    if not args or args[0] != "--" or len(args) < 2 or not listen:
        print("usage: netbridge.py --socket PATH --listen HOST:PORT [...] -- COMMAND...", file=sys.stderr)
        return 64
    return asyncio.run(_bridge(socket_path, listen, args[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
