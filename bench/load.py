"""Load and soak: many concurrent streaming agent sessions through one gateway, every call accounted for.

The gateway runs in its own process (``build_app`` with a fast scripted engine: ``--tokens`` tokens per answer,
``--token-ms`` apart, so the figure is the gateway's, not a model's) on PostgreSQL (``--database-url``, default the
machine's server; a fresh database) or SQLite. ``--sessions`` clients each hold a multi-turn conversation (each
turn echoes the previous answer, as harnesses do, so calls are spliced) and stream every answer. Printed: calls,
errors, calls/s, latency and time-to-first-token percentiles, the gateway's CPU per call and its RSS over time,
and the check that matters: the database holds exactly the calls the clients received, each once.

    .venv/bin/python bench/load.py [--sessions 200] [--turns 5]            # load
    .venv/bin/python bench/load.py --sessions 50 --duration 600            # soak: RSS growth over 10 minutes
    .venv/bin/python bench/load.py --vllm --sessions 16                     # through a real vLLM CPU server

With ``--vllm`` the gateway serves through a vLLM CPU server on the tiny model (started from ``.venv-vllm`` or
``CLAWGATE_VLLM_PYTHON``); answers run to ``max_tokens`` (64), as the tiny model never ends its turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SERVER = r"""
import asyncio, sys
import uvicorn
from transformers import AutoTokenizer
from gateway.app import build_app
from gateway.engines.base import GenerationEnd, TokenDelta
from gateway.settings import Settings

model, url, port, data, tokens, token_ms = sys.argv[1:7]
tokenizer = AutoTokenizer.from_pretrained(model)
end = tokenizer.convert_tokens_to_ids("<|im_end|>")
answer = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 64, add_special_tokens=False)

class FastEngine:
    name = "scripted"
    max_model_len = 40960
    async def start(self): pass
    async def close(self): pass
    async def health(self): return True
    async def load_adapter(self, name, path): pass
    async def unload_adapter(self, name): pass
    async def generate(self, request):
        n = min(int(tokens), request.params.max_tokens)
        ids = answer[: n - 1] + [end]
        for i, tid in enumerate(ids):
            await asyncio.sleep(float(token_ms) / 1000)
            yield TokenDelta([tid], [-0.5])
        yield GenerationEnd("stop", end, len(request.prompt_ids))

vllm_url = sys.argv[7] if len(sys.argv) > 7 else ""
engine = {"engine": "vllm", "vllm_url": vllm_url, "vllm_model": "tiny"} if vllm_url else {}
settings = Settings(model=model, served_model_name="tiny", database_url=url, port=int(port), data_dir=data,
                    policy_follow=False, max_concurrent_calls=0, **engine)
app = build_app(settings, engine=None if vllm_url else FastEngine(), tokenizer=tokenizer)
uvicorn.run(app, host="127.0.0.1", port=int(port), log_level="warning", access_log=False)
"""


def psycopg_url(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg://", 1) if url.startswith("postgresql://") else url


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_stats(pid: int) -> tuple[float, float]:
    """(CPU seconds, RSS MiB) of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    return cpu, rss


async def session(base: str, turns: int, deadline: float | None, out: dict, sid: int) -> None:
    # One client (one keep-alive connection) per session, as each harness has its own: a shared pool scans all
    # its connections on every event, which made the load generator, not the gateway, the bottleneck.
    async with httpx.AsyncClient(timeout=120) as client:
        await converse(client, base, turns, deadline, out, sid)


async def converse(
    client: httpx.AsyncClient, base: str, turns: int, deadline: float | None, out: dict, sid: int
) -> None:
    messages = [{"role": "user", "content": f"session {sid}: start working"}]
    turn = 0
    while (deadline is None and turn < turns) or (deadline is not None and time.monotonic() < deadline):
        body = {"model": "tiny", "messages": messages, "stream": True, "max_tokens": 64}
        t0 = time.perf_counter()
        first = None
        text = []
        try:
            async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    out["errors"].append(f"status {r.status_code}: {(await r.aread())[:200]!r}")
                    return
                call_id = r.headers["x-clawgate-call-id"]
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if first is None:
                        first = time.perf_counter() - t0
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out["errors"].append(str(chunk["error"])[:200])
                        return
                    for choice in chunk["choices"]:
                        text.append(choice["delta"].get("content") or "")
        except httpx.HTTPError as exc:
            out["errors"].append(repr(exc))
            return
        out["latency"].append(time.perf_counter() - t0)
        out["ttft"].append(first or 0.0)
        out["calls"].append(call_id)
        messages += [{"role": "assistant", "content": "".join(text)}, {"role": "user", "content": f"turn {turn}"}]
        turn += 1


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] * 1000 if ordered else float("nan")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--turns", type=int, default=5, help="turns per session (load)")
    ap.add_argument("--duration", type=float, default=0, help="seconds to keep sessions going (soak); 0: --turns")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per answer")
    ap.add_argument("--token-ms", type=float, default=2.0, help="milliseconds between tokens")
    ap.add_argument(
        "--database-url",
        default=os.environ.get("CLAWGATE_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"),
    )
    ap.add_argument("--vllm", action="store_true", help="serve through a vLLM CPU server instead of a scripted engine")
    args = ap.parse_args()

    from clawgate.tiny_model import build_tiny_model
    from gateway.store import db

    tmp = Path(tempfile.mkdtemp(prefix="clawgate-load-"))
    model = build_tiny_model(tmp / "model", seed=0)
    url = args.database_url
    admin = None
    if url.startswith("postgresql"):
        name = f"clawgate_load_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(psycopg_url(url), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        url = url.rsplit("/", 1)[0] + "/" + name
    db.upgrade(url)
    vllm = None
    if args.vllm:
        from gateway.engines.vllm_server import VLLMServer, find_vllm_python

        python = find_vllm_python(None)
        if python is None:
            sys.exit("no vLLM install: ./dev setup-vllm (or set CLAWGATE_VLLM_PYTHON)")
        vllm = VLLMServer(python, model, served_model_name="tiny", max_model_len=2048, log_path=tmp / "vllm.log")
        vllm.start(timeout=300)
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SERVER,
            str(model),
            url,
            str(port),
            str(tmp / "data"),
            str(args.tokens),
            str(args.token_ms),
            vllm.url if vllm is not None else "",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.sessions + 10)) as client:
            for _ in range(600):
                try:
                    if (await client.get(base + "/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None:
                    sys.exit(f"the gateway exited ({server.returncode}) before it answered")
                await asyncio.sleep(0.1)
            cpu0, rss0 = proc_stats(server.pid)
            out: dict = {"calls": [], "errors": [], "latency": [], "ttft": []}
            deadline = time.monotonic() + args.duration if args.duration else None
            t0 = time.perf_counter()
            tasks = [asyncio.create_task(session(base, args.turns, deadline, out, i)) for i in range(args.sessions)]
            rss_samples = [(0.0, rss0)]
            while not all(t.done() for t in tasks):
                await asyncio.sleep(min(30.0, max(args.duration / 20, 1.0)) if args.duration else 1.0)
                rss_samples.append((time.perf_counter() - t0, proc_stats(server.pid)[1]))
            await asyncio.gather(*tasks)
            elapsed = time.perf_counter() - t0
            cpu1, rss1 = proc_stats(server.pid)
            health = (await client.get(base + "/health")).json()
        # Everything the clients received must be in the store once the writer has drained.
        engine = sa.create_engine(psycopg_url(url))
        stored: list[str] = []
        for _ in range(300):
            with engine.connect() as conn:
                stored = [r[0] for r in conn.execute(sa.text("SELECT id FROM calls"))]
                spliced = conn.execute(sa.text("SELECT count(*) FROM calls WHERE render_mode = 'spliced'")).scalar()
            if len(stored) >= len(out["calls"]):
                break
            time.sleep(0.1)
        engine.dispose()
    finally:
        server.terminate()
        server.wait(60)
        if vllm is not None:
            vllm.stop()
        if admin is not None:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()

    calls = len(out["calls"])
    rate = calls / elapsed
    scripted = f"a scripted engine ({args.tokens} tokens, {args.token_ms} ms apart)"
    upstream = "vLLM CPU (tiny model)" if args.vllm else scripted
    print(f"{args.sessions} concurrent streaming sessions through {upstream}")
    print(f"{calls} calls in {elapsed:.1f} s ({rate:.0f} calls/s)")
    print(f"errors: {len(out['errors'])}" + (f" (first: {out['errors'][0]})" if out["errors"] else ""))
    print(
        f"latency p50 {pct(out['latency'], 0.5):.0f} ms, p95 {pct(out['latency'], 0.95):.0f} ms, "
        f"p99 {pct(out['latency'], 0.99):.0f} ms; "
        f"TTFT p50 {pct(out['ttft'], 0.5):.0f} ms, p95 {pct(out['ttft'], 0.95):.0f} ms"
    )
    streamed = "up to 64" if args.vllm else str(args.tokens)
    print(f"gateway CPU {(cpu1 - cpu0) / max(calls, 1) * 1000:.2f} ms per call ({streamed} tokens streamed each)")
    print(
        "gateway RSS MiB over time: "
        + ", ".join(f"{t:.0f}s {r:.0f}" for t, r in rss_samples[:: max(len(rss_samples) // 12, 1)])
    )
    print(
        f"RSS {rss0:.0f} -> {rss1:.0f} MiB; capture {health['capture']['state']}, queued {health['capture']['queued']}"
    )
    exact = sorted(stored) == sorted(out["calls"]) and len(set(stored)) == len(stored)
    verdict = "exact" if exact else "MISMATCH"
    print(f"database: {len(stored)} calls for {calls} received, {spliced} spliced: {verdict}")
    sys.exit(0 if exact and not out["errors"] else 1)


if __name__ == "__main__":
    asyncio.run(main())
