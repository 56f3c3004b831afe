"""Gateway time and CPU per call against prompt length, over a 20-turn OpenClaw conversation.

Does the gateway's cost per call grow with the conversation? A harness resends the whole conversation on every
turn, so a gateway that re-renders (and re-tokenizes) it all pays for every earlier turn again; a spliced render
should cost what the new suffix costs. This replays an OpenClaw agent session: the first request is the captured
OpenClaw request (its 26 kB system prompt and 11 tools, tests/fixtures/harness-requests/openclaw, or
``--fixture``), and each turn the model calls the `read` tool, the client sends back the assistant message as
OpenClaw does (tool-call ids rewritten, ``call_ab12`` -> ``callab12``), the tool's result (a slice of a standard
library source file, ``--result-chars``) and OpenClaw's extra user message, so the prompt grows to ~30k tokens.

The upstream is a fast scripted engine inside the gateway process (tiny vLLM's context is too short for these
prompts, and a model's time would hide the gateway's): it answers each call at once with one tool call. Printed
per turn: prompt tokens, render mode (fresh, spliced, drifted), the gateway's own time for the call as it records
it (``gateway_ms``: the call's time minus the engine's), the client's wall time, and the gateway process's CPU for
the call (from /proc, including whatever its capture writer did meanwhile).

    .venv/bin/python bench/prompt_length.py [--turns 20] [--result-chars 2500] [--database-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIXTURE = ROOT / "tests" / "fixtures" / "harness-requests" / "openclaw" / "01-chat-completions-after-tool-result.json"

SERVER = r"""
import sys
import uvicorn
from transformers import AutoTokenizer
from gateway.app import build_app
from gateway.engines.base import GenerationEnd, TokenDelta
from gateway.settings import Settings

model, url, port, data = sys.argv[1:5]
tokenizer = AutoTokenizer.from_pretrained(model)
end = tokenizer.convert_tokens_to_ids("<|im_end|>")

class ToolCallEngine:
    '''Answers every call at once with one `read` tool call (a new path each time).'''
    name = "scripted"
    max_model_len = 131072
    calls = 0
    async def start(self): pass
    async def close(self): pass
    async def health(self): return True
    async def load_adapter(self, name, path): pass
    async def unload_adapter(self, name): pass
    async def generate(self, request):
        ToolCallEngine.calls += 1
        text = ('<tool_call>\n{"name": "read", "arguments": {"path": "src/module_%d.py"}}\n</tool_call>'
                % ToolCallEngine.calls)
        ids = tokenizer.encode(text, add_special_tokens=False) + [end]
        for tid in ids:
            yield TokenDelta([tid], [-0.5])
        yield GenerationEnd("stop", end, len(request.prompt_ids))

settings = Settings(model=model, served_model_name="tiny", database_url=url, port=int(port), data_dir=data,
                    policy_follow=False, max_concurrent_calls=0, model_aliases=["*"])
app = build_app(settings, engine=ToolCallEngine(), tokenizer=tokenizer)
uvicorn.run(app, host="127.0.0.1", port=int(port), log_level="warning", access_log=False)
"""


def proc_cpu(pid: int) -> float:
    """CPU seconds of every thread of ``pid`` so far, to the nanosecond (/proc/PID/stat counts 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def tool_results(chars: int) -> list[str]:
    """Deterministic file contents to return from `read`: slices of the standard library's sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) >= chars:
            texts.append(text[:chars])
    return texts


def openclaw_id(call_id: str) -> str:
    # OpenClaw strips what is not a letter or digit from the ids it sends back.
    return re.sub(r"[^A-Za-z0-9]", "", call_id)


async def turn(client: httpx.AsyncClient, base: str, body: dict[str, Any]) -> tuple[str, dict[str, Any], float]:
    """One streamed call: (call id, the assistant message as OpenClaw sends it back, wall seconds)."""
    t0 = time.perf_counter()
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"status {r.status_code}: {(await r.aread())[:300]!r}")
        call_id = r.headers["x-clawgate-call-id"]
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices", []):
                delta = choice["delta"]
                content.append(delta.get("content") or "")
                for tc in delta.get("tool_calls") or []:
                    slot = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
                    function = tc.get("function") or {}
                    # The id and the name come once, the arguments in pieces.
                    slot["id"] = slot["id"] or tc.get("id") or ""
                    slot["name"] = slot["name"] or function.get("name") or ""
                    slot["arguments"] += function.get("arguments") or ""
    elapsed = time.perf_counter() - t0
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [
            {
                "id": openclaw_id(c["id"]),
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for _, c in sorted(calls.items())
        ]
    return call_id, message, elapsed


def fresh_database(url: str) -> tuple[str, sa.Engine | None, str | None]:
    if not url.startswith("postgresql"):
        return url, None, None
    name = f"clawgate_plen_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    return url.rsplit("/", 1)[0] + "/" + name, admin, name


async def converse(args: argparse.Namespace, base: str, pid: int) -> list[tuple[str, float, float]]:
    fixture = json.loads(args.fixture.read_text(encoding="utf-8"))["body"]
    first = fixture["messages"]
    # The session's opening: OpenClaw's system prompt and the user's request; its extra user message (internal
    # context) follows every tool result.
    messages = [first[0], first[1]]
    extra_user = first[4]
    results = tool_results(args.result_chars)
    out = []
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(args.turns):
            body = {
                "model": fixture["model"],
                "messages": messages,
                "stream": True,
                "stream_options": {"include_usage": True},
                "tools": fixture["tools"],
                "tool_choice": "auto",
                "max_completion_tokens": 256,
            }
            cpu0 = proc_cpu(pid)
            call_id, assistant, elapsed = await turn(client, base, body)
            cpu = proc_cpu(pid) - cpu0
            out.append((call_id, elapsed, cpu))
            messages = [*messages, assistant]
            for tc in assistant.get("tool_calls", []):
                messages.append({"role": "tool", "tool_call_id": tc["id"], "content": results[i % len(results)]})
            messages.append(extra_user)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--result-chars", type=int, default=2500, help="size of each tool result")
    ap.add_argument("--fixture", type=Path, default=FIXTURE, help="an OpenClaw chat-completions request capture")
    ap.add_argument("--database-url", default=None, help="capture database (default: a temporary SQLite file)")
    args = ap.parse_args()

    from clawgate.tiny_model import build_tiny_model
    from gateway.engines.managed import free_port
    from gateway.store import db

    tmp = Path(tempfile.mkdtemp(prefix="clawgate-plen-"))
    model = build_tiny_model(tmp / "model", seed=0)
    url, admin, name = fresh_database(args.database_url or f"sqlite:///{tmp}/bench.db")
    db.upgrade(url)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(model), url, str(port), str(tmp / "data")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"the gateway exited ({server.returncode}) before it answered")
            time.sleep(0.1)
        turns = asyncio.run(converse(args, base, server.pid))
        engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
        ids = [call_id for call_id, _, _ in turns]
        rows: dict[str, Any] = {}
        for _ in range(300):
            with engine.connect() as conn:
                query = sa.text("SELECT id, prompt_len, render_mode, gateway_ms, engine_ms FROM calls")
                rows = {r.id: r for r in conn.execute(query)}
            if all(i in rows for i in ids):
                break
            time.sleep(0.1)
        engine.dispose()
    finally:
        server.terminate()
        server.wait(60)
        if admin is not None:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()

    print(f"{len(turns)}-turn OpenClaw conversation, a scripted engine, capture to {url.split('://', 1)[0]}")
    print(f"{'turn':>4} {'prompt tokens':>13} {'render':>8} {'gateway ms':>10} {'wall ms':>8} {'CPU ms':>7}")
    for n, (call_id, elapsed, cpu) in enumerate(turns, 1):
        row = rows.get(call_id)
        if row is None:
            print(f"{n:>4} (not captured)")
            continue
        print(
            f"{n:>4} {row.prompt_len:>13} {row.render_mode:>8} {row.gateway_ms or 0:>10.2f} "
            f"{elapsed * 1e3:>8.2f} {cpu * 1e3:>7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
