"""Gateway overhead vs calling vLLM directly, measured side by side in one run, with LiteLLM's proxy beside it.

Starts a vLLM CPU server on the tiny model, a clawgate gateway (a separate process, engine `vllm`) in front of it
and, where LiteLLM's proxy is installed in its own environment (``--litellm-python``, default ``.venv-litellm``:
``python3 -m venv .venv-litellm && .venv-litellm/bin/pip install 'litellm[proxy]'``, the `bench` extra), a
``litellm --config`` proxy with a ``hosted_vllm`` model on the same vLLM server. Identical requests (same seed, so
the same tokens are generated) are interleaved to all of them:

- direct:  POST vLLM /v1/completions with the rendered prompt ids (what the gateway itself sends);
- gateway: POST clawgate /v1/chat/completions with the chat messages (render, generate, parse, capture);
- litellm: POST LiteLLM /v1/chat/completions with the chat messages (vLLM renders them).

Prints p50/p99 latency (non-streaming), time to first token and total time (streaming), the added latency and TTFT
per call against direct, throughput at concurrency 8 relative to direct, each proxy's CPU seconds per request and
its RSS (from /proc, the process and its children), with the direct baseline beside each figure.

On 2 cores a vLLM CPU server and the proxy in front of it share the cores, so the throughput ratio says mostly how
much CPU the proxy took from the engine. ``--upstream scripted`` puts a scripted server in vLLM's place whose answers
take fixed times, as a GPU server's would (``--prefill-ms`` to the first token, ``--gap-ms`` per further token;
``bench/scripted_vllm.py``): every figure is then the proxy's own.

    .venv/bin/python bench/gateway_latency.py [--requests 200] [--database-url URL] [--vllm-python PATH]
                                             [--litellm-python PATH | --no-litellm]
                                             [--upstream vllm|scripted] [--prefill-ms 20] [--gap-ms 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scripted_vllm import scripted_vllm  # noqa: E402
from clawgate.tiny_model import build_tiny_model  # noqa: E402
from gateway.engines.managed import free_port  # noqa: E402
from gateway.engines.vllm_server import VLLMServer, find_vllm_python  # noqa: E402
from gateway.store import db  # noqa: E402

MESSAGES = [
    {"role": "system", "content": "You are a coding agent. Answer briefly."},
    {"role": "user", "content": "List the files in the current directory and summarize them."},
]
MAX_TOKENS = 16
LITELLM_CONFIG = """\
model_list:
  - model_name: tiny
    litellm_params:
      model: hosted_vllm/tiny
      api_base: {api_base}/v1
      api_key: none
litellm_settings:
  drop_params: true
general_settings:
  # The proxy refuses to start without one.
  master_key: {master_key}
"""


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a proxy may run its server in a child process)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def cpu_seconds(pid: int) -> float:
    total = 0.0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return total


def rss_mib(pid: int) -> float:
    total = 0.0
    for p in process_tree(pid):
        try:
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in lines if line.startswith("VmRSS:")), 0) / 1024
    return total


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Target:
    """One way to get the same completion: vLLM itself, or a proxy in front of it."""

    def __init__(
        self, name: str, url: str, pid: int | None, prompt: list[int] | None = None, key: str | None = None
    ) -> None:
        self.name, self.url, self.pid, self.prompt = name, url, pid, prompt
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def call(self, client: httpx.AsyncClient, seed: int, stream: bool) -> tuple[float, float]:
        common = {"model": "tiny", "max_tokens": MAX_TOKENS, "seed": seed, "temperature": 1.0, "stream": stream}
        if self.prompt is not None:
            body = {
                **common,
                "prompt": self.prompt,
                "logprobs": 1,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
            }
            return await _timed(client, self.url + "/v1/completions", body, stream)
        body = {**common, "messages": MESSAGES}
        return await _timed(client, self.url + "/v1/chat/completions", body, stream, self.headers)


async def _timed(
    client: httpx.AsyncClient, url: str, body: dict, stream: bool, headers: dict[str, str] | None = None
) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = 0.0
    if not stream:
        r = await client.post(url, json=body, headers=headers)
        r.raise_for_status()
        total = time.perf_counter() - t0
        return total, total
    async with client.stream("POST", url, json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            # Every server sends its first event once the first token exists (the gateway holds its role chunk
            # until then, so engine errors can still get a real status code).
            if not first and line.startswith("data: "):
                first = time.perf_counter() - t0
    return first or time.perf_counter() - t0, time.perf_counter() - t0


async def throughput(call, n: int, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def run(i: int) -> None:
        async with sem:
            await call(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(run(i) for i in range(n)))
    return n / (time.perf_counter() - t0)


async def measure(args: argparse.Namespace, targets: list[Target], prompt_len: int) -> None:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    names = [t.name for t in targets]
    latency: dict[str, list[float]] = {n: [] for n in names}
    ttft: dict[str, list[float]] = {n: [] for n in names}
    stream_total: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [0.0, 0.0] for n in names}
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        for i in range(10):  # warm-up every path
            for t in targets:
                await t.call(client, i, False)
                await t.call(client, i, True)
        for column, stream, seeds in ((0, False, 1000), (1, True, 5000)):
            before = {t.name: cpu_seconds(t.pid) for t in targets if t.pid}
            for i in range(args.requests):
                # Interleaved: a slow spell of the machine hits every column alike.
                for t in targets:
                    first, total = await t.call(client, seeds + i, stream)
                    if stream:
                        ttft[t.name].append(first)
                        stream_total[t.name].append(total)
                    else:
                        latency[t.name].append(total)
            for t in targets:
                if t.pid:
                    cpu[t.name][column] = (cpu_seconds(t.pid) - before[t.name]) / args.requests
        n_tp = max(args.requests // 2, 32)
        rate = {}
        for t in targets:
            rate[t.name] = await throughput(lambda i, t=t: t.call(client, 9000 + i, False), n_tp, 8)
    rss = {t.name: rss_mib(t.pid) for t in targets if t.pid}

    direct, proxies = names[0], names[1:]
    print(
        f"\n{args.requests} requests each, {MAX_TOKENS} completion tokens, prompt {prompt_len} tokens, "
        f"gateway capture to {db_label(args.database_url)}"
    )
    header = f"{'':<34}" + "".join(f"{n:>16}" for n in names)
    print(header)

    def row(label: str, values: list[str]) -> None:
        print(f"{label:<34}" + "".join(f"{v:>16}" for v in values))

    def ms(x: float) -> str:
        return f"{x * 1e3:.2f} ms"

    row("non-streamed latency p50", [ms(pct(latency[n], 0.5)) for n in names])
    row("non-streamed latency p99", [ms(pct(latency[n], 0.99)) for n in names])
    row("streamed TTFT p50", [ms(pct(ttft[n], 0.5)) for n in names])
    row("streamed total p50", [ms(pct(stream_total[n], 0.5)) for n in names])

    def added(series: dict[str, list[float]], n: str) -> str:
        diffs = [p - d for d, p in zip(series[direct], series[n], strict=True)]
        return f"+{statistics.median(diffs) * 1e3:.2f} ms"

    row("added latency p50 (non-streamed)", ["—"] + [added(latency, n) for n in proxies])
    row("added TTFT p50 (streamed)", ["—"] + [added(ttft, n) for n in proxies])
    row("CPU per call, non-streamed", ["—"] + [ms(cpu[n][0]) for n in proxies])
    row("CPU per call, streamed", ["—"] + [ms(cpu[n][1]) for n in proxies])
    row("throughput @ concurrency 8", [f"{rate[n]:.1f}/s {rate[n] / rate[direct]:.2f}x" for n in names])
    row("RSS", ["—"] + [f"{rss[n]:.0f} MiB" for n in proxies])


def db_label(url: str) -> str:
    return url.split("://", 1)[0]


def wait_healthy(url: str, proc: subprocess.Popen, name: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{name} failed to start")
        time.sleep(0.2)


def find_litellm(setting: str | None) -> Path | None:
    """The ``litellm`` command beside ``setting`` (a python), else beside ``.venv-litellm/bin/python``."""
    python = Path(setting) if setting else ROOT / ".venv-litellm" / "bin" / "python"
    command = python.parent / "litellm"
    return command if command.exists() else None


@contextmanager
def upstream(args: argparse.Namespace, python: str | None, model: Path) -> Iterator[str]:
    """The base URL of what answers: a vLLM CPU server, or the scripted one (``--upstream scripted``)."""
    if args.upstream == "scripted":
        port = free_port()
        with scripted_vllm(port, "tiny", tokens=MAX_TOKENS, prefill_ms=args.prefill_ms, gap_ms=args.gap_ms):
            yield f"http://127.0.0.1:{port}"
        return
    if python is None:
        raise SystemExit("no vLLM interpreter: run ./dev setup-vllm, pass --vllm-python, or use --upstream scripted")
    print("starting vLLM ...", file=sys.stderr)
    server = VLLMServer(python, model, served_model_name="tiny", max_model_len=4096)
    server.start(timeout=600)  # minutes on a busy machine
    with server:
        yield server.url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--database-url", default=None, help="capture database (default: a temporary SQLite file)")
    ap.add_argument("--vllm-python", default=None, help="python of a vLLM install (default .venv-vllm)")
    ap.add_argument("--litellm-python", default=None, help="python of a litellm[proxy] install (.venv-litellm)")
    ap.add_argument("--no-litellm", action="store_true", help="leave LiteLLM's column out")
    ap.add_argument(
        "--upstream",
        choices=("vllm", "scripted"),
        default="vllm",
        help="what answers: a vLLM CPU server, or a scripted one whose answers take fixed times (scripted_vllm.py)",
    )
    ap.add_argument("--prefill-ms", type=float, default=20.0, help="scripted upstream: time to the first token")
    ap.add_argument("--gap-ms", type=float, default=5.0, help="scripted upstream: time per further token")
    args = ap.parse_args()
    python = find_vllm_python(args.vllm_python)
    litellm = None if args.no_litellm else find_litellm(args.litellm_python)
    if litellm is None and not args.no_litellm:
        print("no LiteLLM proxy found (.venv-litellm or --litellm-python): its column is left out", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny")
        args.database_url = args.database_url or f"sqlite:///{tmp}/bench.db"
        db.upgrade(args.database_url)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        with upstream(args, python, model) as upstream_url:
            port = free_port()
            env = {
                **os.environ,
                "CLAWGATE_ENGINE": "vllm",
                "CLAWGATE_VLLM_URL": upstream_url,
                "CLAWGATE_VLLM_MODEL": "tiny",
                "CLAWGATE_MODEL": str(model),
                "CLAWGATE_SERVED_MODEL_NAME": "tiny",
                "CLAWGATE_DATABASE_URL": args.database_url,
                "CLAWGATE_PORT": str(port),
                "CLAWGATE_DATA_DIR": f"{tmp}/data",
                "CLAWGATE_LOG_LEVEL": "warning",
            }
            procs: list[subprocess.Popen] = []
            try:
                gw = subprocess.Popen([sys.executable, "-m", "clawgate.cli", "serve"], env=env, cwd=ROOT)
                procs.append(gw)
                targets = [Target("vLLM direct", upstream_url, None, prompt_ids)]
                gw_url = f"http://127.0.0.1:{port}"
                wait_healthy(gw_url + "/health", gw, "gateway")
                targets.append(Target("clawgate", gw_url, gw.pid))
                if litellm is not None:
                    config = Path(tmp) / "litellm.yaml"
                    key = f"sk-{secrets.token_hex(24)}"
                    config.write_text(LITELLM_CONFIG.format(api_base=upstream_url, master_key=key))
                    lport = free_port()
                    lenv = {**os.environ, "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False"}
                    lp = subprocess.Popen(
                        [str(litellm), "--config", str(config), "--host", "127.0.0.1", "--port", str(lport)],
                        env=lenv,
                        cwd=tmp,
                        stdout=subprocess.DEVNULL,
                    )
                    procs.append(lp)
                    lurl = f"http://127.0.0.1:{lport}"
                    wait_healthy(lurl + "/health/liveliness", lp, "LiteLLM proxy")
                    targets.append(Target("LiteLLM", lurl, lp.pid, key=key))
                asyncio.run(measure(args, targets, len(prompt_ids)))
            finally:
                for proc in procs:
                    proc.terminate()
                    proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
