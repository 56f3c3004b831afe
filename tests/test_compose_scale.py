"""The scale-out stack (docker-compose.scale.yml over docker-compose.yml, deploy/) agrees with what it runs.

Read without a Docker engine, as tests/test_compose.py reads the base file: the override is merged onto the base
file the way compose merges service mappings, then checked against the base services it copies (a second vLLM
replica with the same command line, a second gateway with the same settings), against vllm-router's own argument
parser where the router is installed, and against the nginx configuration it mounts; where nginx is installed, that
configuration runs in front of two stand-in gateways. Where the `docker-compose` validator is installed, it checks
the merged pair of files.
"""

from __future__ import annotations

import copy
import http.server
import json
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml

from clawgate import cli
from gateway import cli as gateway_cli
from gateway.engines.managed import free_port
from gateway.settings import Settings
from tests.missing import missing
from tests.test_compose import (
    COMPOSE,
    ROOT,
    _write_env,
    filled_env,
    flag_values,
    port_of,
    resolve,
    service_env,
    settings_for,
    volume_mounts,
)

SCALE = ROOT / "docker-compose.scale.yml"
NGINX_CONF = ROOT / "deploy" / "nginx.conf"
ROUTER_DOCKERFILE = ROOT / "deploy" / "router.Dockerfile"
ROUTER_RELEASE = "vllm-router==0.1.17"


def merge(base: Any, override: Any) -> Any:
    """Compose's merge for what the override uses: mappings merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = merge(base[key], value) if key in base else value
        return merged
    return copy.deepcopy(override)


def scale_compose(env: Mapping[str, str]) -> dict[str, Any]:
    raw = merge(yaml.safe_load(COMPOSE.read_text("utf-8")), yaml.safe_load(SCALE.read_text("utf-8")))
    data: dict[str, Any] = resolve(raw, env)
    return data


def router_argv(service: Mapping[str, Any]) -> dict[str, list[str]]:
    """``--flag v1 v2 …`` of the router's command line (--worker-urls takes several values)."""
    flags: dict[str, list[str]] = {}
    current = ""
    for token in service["command"]:
        if token.startswith("--"):
            current = token
            flags[current] = []
        else:
            assert current, f"positional {token!r}"
            flags[current].append(token)
    return flags


def test_scale_stack_has_two_replicas_a_router_two_gateways_and_nginx(monkeypatch: pytest.MonkeyPatch) -> None:
    services = scale_compose(filled_env())["services"]
    assert {"vllm", "vllm-2", "vllm-router", "gateway", "gateway-2", "nginx"} <= set(services)

    # The second replica runs exactly the first one's vLLM, on another GPU.
    first, second = services["vllm"], services["vllm-2"]
    for key in ("image", "entrypoint", "command", "environment", "volumes", "ipc", "healthcheck"):
        assert second[key] == first[key], key
    assert first["environment"]["VLLM_PLUGINS"] == "lora_filesystem_resolver"
    assert first["environment"]["VLLM_LORA_RESOLVER_CACHE_DIR"] == "/adapters"  # where the trainer publishes
    gpus = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in (first, second)]
    assert gpus == [["0"], ["1"]]

    # The router fronts every replica, by the port each listens on, hashing the session header.
    router = router_argv(services["vllm-router"])
    replica_port = flag_values(first["command"])["--port"]
    assert router["--worker-urls"] == [f"http://vllm:{replica_port}", f"http://vllm-2:{replica_port}"]
    assert router["--policy"] == ["consistent_hash"]
    assert {dep: c["condition"] for dep, c in services["vllm-router"]["depends_on"].items()} == {
        "vllm": "service_healthy",
        "vllm-2": "service_healthy",
    }
    router_port = router["--port"][0]
    assert f"127.0.0.1:{router_port}/health" in " ".join(services["vllm-router"]["healthcheck"]["test"])

    # Both gateways: one set of settings, serving through the router, loading versions into every replica.
    parser = cli.build_parser()
    gateways = {}
    for name in ("gateway", "gateway-2"):
        parsed = parser.parse_args(services[name]["command"])
        assert parsed.func is gateway_cli.cmd_serve and parsed.engine == "vllm"
        assert services[name]["image"] == services["migrate"]["image"]
        assert services[name]["depends_on"]["vllm-router"]["condition"] == "service_healthy"
        gateways[name] = settings_for(services[name], monkeypatch)
        env = service_env(services[name])
        assert env["CLAWGATE_VLLM_REPLICAS"].split(",") == router["--worker-urls"]
    assert gateways["gateway"] == gateways["gateway-2"]
    assert gateways["gateway"].vllm_url == f"http://vllm-router:{router_port}"
    assert service_env(services["gateway"]) == service_env(services["gateway-2"])

    # Each gateway spools to its own volume; both read the one adapter volume the replicas load from.
    mounts = {name: {src: dst for src, dst, _ in volume_mounts(services[name])} for name in services}
    assert mounts["gateway"]["gateway-data"] != mounts["gateway-2"].get("gateway-data")
    assert mounts["gateway-2"]["gateway-2-data"] == str(gateways["gateway-2"].data_dir)
    assert mounts["vllm-2"]["adapters"] == mounts["vllm"]["adapters"] == str(gateways["gateway"].vllm_adapter_dir)

    # The router's image installs the release whose flags and session header this file relies on.
    assert f'ARG VLLM_ROUTER_REQUIREMENT="{ROUTER_RELEASE}"' in ROUTER_DOCKERFILE.read_text("utf-8")
    build = services["vllm-router"]["build"]
    assert (ROOT / build["context"] / build["dockerfile"]).resolve() == ROUTER_DOCKERFILE


def test_every_clawgate_variable_of_the_scale_stack_is_a_setting() -> None:
    names = {n for s in yaml.safe_load(SCALE.read_text("utf-8"))["services"].values() for n in service_env(s)}
    ours = {n for n in names if n.startswith("CLAWGATE_")}
    assert {"CLAWGATE_VLLM_URL", "CLAWGATE_VLLM_REPLICAS", "CLAWGATE_DATABASE_URL"} <= ours
    unknown = sorted(n for n in ours if n.removeprefix("CLAWGATE_").lower() not in Settings.model_fields)
    assert not unknown, f"not Settings fields (gateway/settings.py): {unknown}"


# -- nginx -----------------------------------------------------------------------------------------------------------


def nginx_blocks(text: str) -> dict[str, Any]:
    """nginx.conf as nested dicts: ``{"http": {"upstream gateways": {...}, "server": [...]}}``; directives map to
    lists of their argument lists. Enough for a structural check (no includes, no quotes spanning lines)."""
    tokens = re.findall(r'"[^"]*"|[{};]|[^\s{};"]+', re.sub(r"#[^\n]*", "", text))
    root: dict[str, Any] = {}
    stack = [root]
    words: list[str] = []
    for token in tokens:
        if token == "{":
            block: dict[str, Any] = {}
            stack[-1].setdefault(" ".join(words), []).append(block)
            stack.append(block)
            words = []
        elif token == "}":
            assert not words, f"unterminated directive {words}"
            stack.pop()
        elif token == ";":
            stack[-1].setdefault(words[0], []).append(words[1:])
            words = []
        else:
            words.append(token)
    assert len(stack) == 1 and not words, "unbalanced braces"
    return root


def seconds(value: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600}
    return int(value[:-1]) * units[value[-1]] if value[-1] in units else int(value)


def test_nginx_spreads_calls_over_both_gateways_and_streams_unbuffered(monkeypatch: pytest.MonkeyPatch) -> None:
    services = scale_compose(filled_env())["services"]
    nginx = services["nginx"]
    assert f"./{NGINX_CONF.relative_to(ROOT)}:/etc/nginx/nginx.conf:ro" in nginx["volumes"]
    assert re.fullmatch(r"nginx:\d+\.\d+(-alpine)?", nginx["image"]), "the official image, pinned"
    assert {dep: c["condition"] for dep, c in nginx["depends_on"].items()} == {
        "gateway": "service_healthy",
        "gateway-2": "service_healthy",
    }

    http = nginx_blocks(NGINX_CONF.read_text("utf-8"))["http"][0]
    upstream = http["upstream gateways"][0]
    ports = {name: settings_for(services[name], monkeypatch).port for name in ("gateway", "gateway-2")}
    assert sorted(args[0] for args in upstream["server"]) == sorted(f"{name}:{port}" for name, port in ports.items())
    assert int(upstream["keepalive"][0][0]) > 0
    # nginx must drop an idle connection before the gateway does, or a call races the gateway's close.
    assert seconds(upstream["keepalive_timeout"][0][0]) < uvicorn.Config("gateway.app:build_app").timeout_keep_alive

    (server,) = http["server"]
    published, container_port = nginx["ports"][0].split(":")
    assert server["listen"] == [[container_port]]
    assert published == "8000"
    location = server["location /"][0]
    assert location["proxy_pass"] == [["http://gateways"]]
    # Upstream keepalive needs HTTP/1.1 and no `Connection: close` passed on.
    assert location["proxy_http_version"] == [["1.1"]]
    assert ["Connection", '""'] in location["proxy_set_header"]
    # Server-sent events go out as the gateway writes them.
    assert location["proxy_buffering"] == [["off"]]
    assert location["proxy_request_buffering"] == [["off"]]
    assert seconds(location["proxy_read_timeout"][0][0]) >= 600
    assert seconds(location["proxy_send_timeout"][0][0]) >= 600
    size = http["client_max_body_size"][0][0]
    assert size.endswith("m") and int(size[:-1]) >= 16, "agent prompts run to megabytes"
    # A POST that reached a gateway is never re-sent to the other one (a second generation of one call).
    assert all("non_idempotent" not in args for args in location.get("proxy_next_upstream", []))


# -- the real parsers, where installed -------------------------------------------------------------------------------


def router_python() -> str:
    for candidate in (ROOT / ".venv-vllm" / "bin" / "vllm-router", shutil.which("vllm-router")):
        if candidate and Path(candidate).exists():
            shebang = Path(candidate).read_text("utf-8", errors="replace").splitlines()[0]
            return shebang.removeprefix("#!").strip()
    missing(f"vllm-router is not installed (.venv-vllm/bin/pip install {ROUTER_RELEASE})")


_ROUTER_PARSE = """
import json, sys
from importlib.metadata import version
from vllm_router.launch_router import parse_router_args

args = parse_router_args(json.loads(sys.argv[1]))
print(json.dumps({"version": version("vllm-router"), "policy": args.policy, "worker_urls": args.worker_urls,
                  "port": args.port, "host": args.host, "timeout": args.request_timeout_secs}))
"""


def test_vllm_router_itself_accepts_the_compose_command_line() -> None:
    service = scale_compose(filled_env())["services"]["vllm-router"]
    result = subprocess.run(
        [router_python(), "-c", _ROUTER_PARSE, json.dumps(service["command"])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    assert f"vllm-router=={parsed['version']}" == ROUTER_RELEASE
    assert parsed["policy"] == "consistent_hash"
    assert parsed["worker_urls"] == router_argv(service)["--worker-urls"]
    assert parsed["host"] == "0.0.0.0" and port_of(f"http://x:{parsed['port']}") == 8000
    assert parsed["timeout"] >= 3600


def test_docker_compose_validates_the_scale_stack(tmp_path: Path) -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        missing("docker-compose is not installed (Debian: apt-get install docker-compose)")
    env = filled_env()
    result = subprocess.run(
        [
            binary,
            "--env-file",
            str(_write_env(tmp_path / "filled.env", env)),
            "-f",
            str(COMPOSE),
            "-f",
            str(SCALE),
            "config",
        ],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(tmp_path)},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    validated = yaml.safe_load(result.stdout)["services"]
    ours = scale_compose(env)["services"]
    # Compose's merge agrees with the one the other tests read.
    for name in ("gateway", "gateway-2", "vllm-2", "vllm-router"):
        assert service_env(validated[name]) == service_env(ours[name]), name
        assert validated[name]["command"] == ours[name]["command"], name
    assert set(validated["gateway"]["depends_on"]) == {"migrate", "vllm", "trainer", "vllm-router"}


# -- nginx itself, where installed -----------------------------------------------------------------------------------


class _Upstream(http.server.BaseHTTPRequestHandler):
    """A gateway stand-in: streams three server-sent events, saying which upstream it is and how many body bytes it
    received; 0.4 s apart for a large body (the streaming check), at once for a small one (the affinity checks)."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        received = len(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(3):
            data = f"data: {json.dumps({'upstream': self.server.server_port, 'received': received, 'i': i})}\n\n"
            self.wfile.write(f"{len(data):x}\r\n{data}\r\n".encode())
            self.wfile.flush()
            if received > 1024:
                time.sleep(0.4)
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: Any) -> None:
        pass


def test_nginx_streams_events_as_they_come_and_uses_both_gateways(tmp_path: Path) -> None:
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if binary is None:
        missing("nginx is not installed (Debian: apt-get install nginx)")
    upstreams = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Upstream) for _ in range(2)]
    for server in upstreams:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    port = free_port()
    conf = NGINX_CONF.read_text("utf-8")
    for name, server in zip(("gateway", "gateway-2"), upstreams, strict=True):
        conf = conf.replace(f"server {name}:8080", f"server 127.0.0.1:{server.server_port}")
    conf = conf.replace("listen 8080;", f"listen 127.0.0.1:{port};")
    (tmp_path / "nginx.conf").write_text(conf, encoding="utf-8")
    (tmp_path / "logs").mkdir()
    directives = f"pid {tmp_path}/nginx.pid; error_log {tmp_path}/error.log; daemon off;"
    proc = subprocess.Popen([binary, "-p", str(tmp_path), "-c", "nginx.conf", "-g", directives])
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        body = b"x" * (20 * 1024 * 1024)  # a 20 MiB prompt passes
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=30) as client:

            def upstream(path: str = "/v1/chat/completions", headers: dict[str, str] | None = None) -> int:
                r = client.post(base + path, content=b"{}", headers=headers or {})
                assert r.status_code == 200
                return int(json.loads(r.text.split("\n")[0][6:])["upstream"])

            for _ in range(2):
                arrivals: list[float] = []
                events = []
                t0 = time.monotonic()
                with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", content=body) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            arrivals.append(time.monotonic() - t0)
                            events.append(json.loads(line[6:]))
                assert [e["i"] for e in events] == [0, 1, 2]
                assert events[0]["received"] == len(body)
                # Streamed: each event reached the client when the upstream wrote it, not all at the end.
                assert arrivals[2] - arrivals[0] > 0.6, arrivals
            # Calls that name no session spread over both gateways (by their own request id: 40 calls all on one
            # gateway would be a 1 in 2**39 chance); a named session stays on one gateway, whichever it is.
            ports = {s.server_port for s in upstreams}
            assert {upstream() for _ in range(40)} == ports, "calls go to both gateways"
            named = [
                ("/v1/messages", "x-claude-code-session-id"),  # Claude Code
                ("/v1/responses", "session-id"),  # Codex
            ]
            for path, header in named:
                homes = {f"s{i}": {upstream(path, {header: f"s{i}"}) for _ in range(4)} for i in range(12)}
                assert all(len(home) == 1 for home in homes.values()), (header, homes)
                assert set().union(*homes.values()) == ports, "sessions are spread over both gateways"
            for i in range(12):
                path = f"/rollouts/ro-{i}/v1/chat/completions"
                assert len({upstream(path) for _ in range(4)}) == 1, path
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for server in upstreams:
            server.shutdown()
