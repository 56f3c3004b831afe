"""Gateway overhead vs calling vLLM directly, measured side by side in one run.

Starts a vLLM CPU server on the tiny model and a clawgate gateway (a separate process, engine `vllm`) in front of
it, then interleaves identical requests (same prompt ids, same seed, so the same tokens are generated):

- direct:  POST vLLM /v1/completions with the rendered prompt ids (what the gateway itself sends);
- gateway: POST clawgate /v1/chat/completions with the chat messages (render, generate, parse, capture).

Prints p50/p99 latency (non-streaming), time to first token and total time (streaming), throughput at concurrency
8, and the gateway process's CPU seconds per request (from /proc), with the direct baseline beside each figure.

    .venv/bin/python bench/gateway_latency.py [--requests 200] [--database-url URL] [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clawgate.tiny_model import build_tiny_model  # noqa: E402
from gateway.engines.vllm_server import VLLMServer, find_vllm_python, free_port  # noqa: E402
from gateway.store import db  # noqa: E402

MESSAGES = [
    {"role": "system", "content": "You are a coding agent. Answer briefly."},
    {"role": "user", "content": "List the files in the current directory and summarize them."},
]
MAX_TOKENS = 16


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_direct(
    client: httpx.AsyncClient, url: str, prompt: list[int], seed: int, stream: bool
) -> tuple[float, float]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "seed": seed,
        "temperature": 1.0,
        "logprobs": 1,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "stream": stream,
    }
    return await _timed(client, url + "/v1/completions", body, stream)


async def one_gateway(client: httpx.AsyncClient, url: str, seed: int, stream: bool) -> tuple[float, float]:
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "seed": seed,
        "temperature": 1.0,
        "stream": stream,
    }
    return await _timed(client, url + "/v1/chat/completions", body, stream)


async def _timed(client: httpx.AsyncClient, url: str, body: dict, stream: bool) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = 0.0
    if not stream:
        r = await client.post(url, json=body)
        r.raise_for_status()
        total = time.perf_counter() - t0
        return total, total
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            # Both servers send their first event once the first token exists (the gateway holds its role
            # chunk until then, so engine errors can still get a real status code).
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


async def measure(args: argparse.Namespace, vllm_url: str, gw_url: str, gw_pid: int, prompt: list[int]) -> None:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        for i in range(10):  # warm-up both paths
            await one_direct(client, vllm_url, prompt, i, False)
            await one_gateway(client, gw_url, i, False)
        results: dict[str, list[float]] = {k: [] for k in ("d", "g", "d_ttft", "g_ttft", "d_stream", "g_stream")}
        cpu0 = cpu_seconds(gw_pid)
        for i in range(args.requests):
            seed = 1000 + i
            results["d"].append((await one_direct(client, vllm_url, prompt, seed, False))[0])
            results["g"].append((await one_gateway(client, gw_url, seed, False))[0])
        cpu_nonstream = (cpu_seconds(gw_pid) - cpu0) / args.requests
        cpu0 = cpu_seconds(gw_pid)
        for i in range(args.requests):
            seed = 5000 + i
            ttft, total = await one_direct(client, vllm_url, prompt, seed, True)
            results["d_ttft"].append(ttft)
            results["d_stream"].append(total)
            ttft, total = await one_gateway(client, gw_url, seed, True)
            results["g_ttft"].append(ttft)
            results["g_stream"].append(total)
        cpu_stream = (cpu_seconds(gw_pid) - cpu0) / args.requests
        n_tp = max(args.requests // 2, 32)
        tp_direct = await throughput(lambda i: one_direct(client, vllm_url, prompt, 9000 + i, False), n_tp, 8)
        tp_gateway = await throughput(lambda i: one_gateway(client, gw_url, 9000 + i, False), n_tp, 8)

    def row(name: str, d: list[float], g: list[float]) -> None:
        d50, g50, d99, g99 = (pct(d, 0.5) * 1e3, pct(g, 0.5) * 1e3, pct(d, 0.99) * 1e3, pct(g, 0.99) * 1e3)
        print(
            f"{name:<28} direct p50 {d50:7.2f} ms  gateway p50 {g50:7.2f} ms  (+{g50 - d50:5.2f} ms, "
            f"{g50 / d50:4.2f}x)   p99 {d99:7.2f} -> {g99:7.2f} ms"
        )

    print(
        f"\n{args.requests} requests each, {MAX_TOKENS} completion tokens, prompt {len(prompt)} tokens, "
        f"capture to {db_label(args.database_url)}"
    )
    row("non-streaming latency", results["d"], results["g"])
    row("streaming time to 1st token", results["d_ttft"], results["g_ttft"])
    row("streaming total", results["d_stream"], results["g_stream"])
    diffs = [g - d for d, g in zip(results["d"], results["g"], strict=True)]
    print(
        f"{'added latency per call':<28} p50 {statistics.median(diffs) * 1e3:.2f} ms  "
        f"mean {statistics.mean(diffs) * 1e3:.2f} ms"
    )
    print(
        f"{'throughput @ concurrency 8':<28} direct {tp_direct:6.1f} req/s  gateway {tp_gateway:6.1f} req/s  "
        f"({tp_gateway / tp_direct:4.2f}x)"
    )
    print(
        f"{'gateway CPU per request':<28} non-streaming {cpu_nonstream * 1e3:.2f} ms  "
        f"streaming {cpu_stream * 1e3:.2f} ms"
    )


def db_label(url: str) -> str:
    return url.split("://", 1)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--database-url", default=None, help="capture database (default: a temporary SQLite file)")
    ap.add_argument("--vllm-python", default=None, help="python of a vLLM install (default .venv-vllm)")
    args = ap.parse_args()
    python = find_vllm_python(args.vllm_python)
    if python is None:
        print("no vLLM install found: run ./dev setup-vllm or pass --vllm-python", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny")
        args.database_url = args.database_url or f"sqlite:///{tmp}/bench.db"
        db.upgrade(args.database_url)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        print("starting vLLM ...", file=sys.stderr)
        with VLLMServer(python, model, served_model_name="tiny", max_model_len=4096) as server:
            port = free_port()
            env = {
                **os.environ,
                "CLAWGATE_ENGINE": "vllm",
                "CLAWGATE_VLLM_URL": server.url,
                "CLAWGATE_VLLM_MODEL": "tiny",
                "CLAWGATE_MODEL": str(model),
                "CLAWGATE_SERVED_MODEL_NAME": "tiny",
                "CLAWGATE_DATABASE_URL": args.database_url,
                "CLAWGATE_PORT": str(port),
                "CLAWGATE_DATA_DIR": f"{tmp}/data",
                "CLAWGATE_LOG_LEVEL": "warning",
            }
            gw = subprocess.Popen([sys.executable, "-m", "clawgate.cli", "serve"], env=env, cwd=ROOT)
            try:
                gw_url = f"http://127.0.0.1:{port}"
                deadline = time.monotonic() + 120
                while True:
                    try:
                        if httpx.get(gw_url + "/health", timeout=2).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if gw.poll() is not None or time.monotonic() > deadline:
                        print("gateway failed to start", file=sys.stderr)
                        return 1
                    time.sleep(0.2)
                asyncio.run(measure(args, server.url, gw_url, gw.pid, prompt_ids))
            finally:
                gw.terminate()
                gw.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
