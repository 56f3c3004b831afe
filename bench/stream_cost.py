"""Gateway CPU per streamed answer against vLLM's stream interval, with the cost of merely reading the stream.

A streamed answer reaches the gateway as one chunk per token (vLLM's default) and leaves it as one event per chunk:
each chunk costs a wake-up of the event loop, a read and a socket write, however few tokens it holds. This measures
that cost with a scripted vLLM in its own process (``bench/scripted_vllm.py``: ``--tokens`` token ids, ``--gap-ms``
apart, grouped as vLLM groups them under ``stream_interval``: the first token alone, then that many per chunk) and
``clawgate serve --engine vllm`` in front of it (SQLite capture), once per ``CLAWGATE_VLLM_STREAM_INTERVAL`` value.
Printed per interval: the gateway process's CPU per answer (from its threads' schedstat), and beside it the CPU an
aiohttp client alone spends reading the same stream from the scripted vLLM (the floor: wake-ups and syscalls).

    .venv/bin/python bench/stream_cost.py [--tokens 256] [--gap-ms 2] [--calls 30] [--intervals 1,4,16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.prompt_length import proc_cpu  # noqa: E402
from bench.scripted_vllm import scripted_vllm  # noqa: E402
from clawgate.tiny_model import build_tiny_model  # noqa: E402
from gateway.engines.managed import free_port  # noqa: E402
from gateway.store import db  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a long story."}]


def wait_up(url: str, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with status {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{what} did not answer at {url}")


async def read_floor(vllm: str, tokens: int, interval: int, calls: int) -> float:
    """CPU seconds per answer of an aiohttp client that only reads the scripted stream."""
    body = {"prompt": [1, 2, 3], "max_tokens": tokens, "stream": True, "stream_interval": interval}
    async with aiohttp.ClientSession() as session:

        async def one() -> None:
            async with session.post(vllm + "/v1/completions", json=body) as response:
                async for _ in response.content.iter_any():
                    pass

        await one()
        start = time.process_time()
        for _ in range(calls):
            await one()
        return (time.process_time() - start) / calls


def gateway_cost(model: Path, vllm: str, tokens: int, interval: int, calls: int, tmp: Path) -> float:
    """CPU seconds per streamed answer of a gateway process with this stream interval."""
    port = free_port()
    database = f"sqlite:///{tmp}/capture-{interval}.db"
    db.upgrade(database)
    env = {
        **os.environ,
        "CLAWGATE_ENGINE": "vllm",
        "CLAWGATE_VLLM_URL": vllm,
        "CLAWGATE_MODEL": str(model),
        "CLAWGATE_SERVED_MODEL_NAME": "tiny",
        "CLAWGATE_DATABASE_URL": database,
        "CLAWGATE_DATA_DIR": str(tmp / f"data-{interval}"),
        "CLAWGATE_PORT": str(port),
        "CLAWGATE_POLICY_FOLLOW": "false",
        "CLAWGATE_LOG_LEVEL": "warning",
        "CLAWGATE_VLLM_STREAM_INTERVAL": str(interval),
    }
    gateway = subprocess.Popen([sys.executable, "-m", "clawgate.cli", "serve"], env=env, cwd=tmp)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url + "/health", gateway, "the gateway")
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": tokens, "stream": True}
        with httpx.Client(timeout=120) as client:

            def answer() -> None:
                with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200, response.read()
                    for _ in response.iter_bytes():
                        pass

            for _ in range(3):
                answer()
            before = proc_cpu(gateway.pid)
            for _ in range(calls):
                answer()
            time.sleep(0.3)  # the capture of the last answer
            return (proc_cpu(gateway.pid) - before) / calls
    finally:
        gateway.terminate()
        gateway.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--intervals", default="1,4,16")
    args = ap.parse_args()
    intervals = [int(x) for x in args.intervals.split(",")]
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        model = build_tiny_model(tmp / "tiny-model")
        port = free_port()
        vllm = f"http://127.0.0.1:{port}"
        with scripted_vllm(port, str(model), tokens=args.tokens, gap_ms=args.gap_ms):
            print(f"{args.tokens}-token streamed answers, a token every {args.gap_ms:g} ms, {args.calls} calls each")
            print(f"{'stream interval':>16} {'chunks':>7} {'gateway CPU ms/answer':>22} {'read-only CPU ms':>17}")
            for interval in intervals:
                chunks = 1 + -(-(args.tokens - 1) // interval)
                gateway = gateway_cost(model, vllm, args.tokens, interval, args.calls, tmp)
                floor = asyncio.run(read_floor(vllm, args.tokens, interval, args.calls))
                print(f"{interval:>16} {chunks:>7} {gateway * 1000:>22.1f} {floor * 1000:>17.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
