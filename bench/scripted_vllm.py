"""A scripted stand-in for a vLLM server, in its own process, for benchmarks of what sits in front of vLLM.

On this 2-core machine a real vLLM CPU server competes for the cores with whatever is measured beside it, so a
proxy's figures there mostly say how much CPU it took from the engine. This server's answers take a fixed time
instead, as a GPU server's would: ``prefill_ms`` before the first token, then ``gap_ms`` per token, ``tokens``
token ids at most (``max_tokens`` caps them), grouped as vLLM groups them under ``stream_interval`` (the first
token alone, then that many a chunk). It serves the two routes the benchmarks' clients use:

- ``/v1/completions`` with a token-id prompt, as the gateway sends it (``token_ids`` and ``token_logprobs`` in
  each choice, usage last);
- ``/v1/chat/completions``, as an OpenAI-compatible proxy (LiteLLM's ``hosted_vllm``) sends it: each token is the
  text ``"tok "``;

and ``/v1/models`` (one model, ``max_model_len`` 4096) and ``/health``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

SERVER = r"""
import asyncio, json, sys, time
from aiohttp import web

port, model, tokens = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
prefill, gap = float(sys.argv[4]) / 1000, float(sys.argv[5]) / 1000

def groups(body):
    n = min(body.get("max_tokens") or tokens, tokens)
    ids = [100 + (i * 37) % 1800 for i in range(n)]
    step = body.get("stream_interval") or 1
    return [ids[:1]] + [ids[i:i + step] for i in range(1, n, step)]

def completion_choice(ids, last):
    return {"index": 0, "text": "", "token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)},
            "finish_reason": "length" if last else None, "stop_reason": None}

def chat_choice(ids, last, stream):
    text = "tok " * len(ids)
    message = {"role": "assistant", "content": text}
    return {"index": 0, ("delta" if stream else "message"): message, "finish_reason": "length" if last else None}

async def answer(request, chat):
    body = await request.json()
    parts = groups(body)
    usage = {"prompt_tokens": 51, "completion_tokens": sum(map(len, parts)), "total_tokens": 0}
    base = {"id": "cmpl-scripted", "created": int(time.time()), "model": body.get("model", model)}
    if not body.get("stream"):
        await asyncio.sleep(prefill + gap * (usage["completion_tokens"] - 1))
        ids = [t for part in parts for t in part]
        choice = chat_choice(ids, True, False) if chat else completion_choice(ids, True)
        return web.json_response({**base, "choices": [choice], "usage": usage})
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for i, part in enumerate(parts):
        await asyncio.sleep(prefill if i == 0 else gap * len(part))
        last = i == len(parts) - 1
        choice = chat_choice(part, last, True) if chat else completion_choice(part, last)
        await response.write(b"data: " + json.dumps({**base, "choices": [choice]}).encode() + b"\n\n")
    await response.write(b"data: " + json.dumps({**base, "choices": [], "usage": usage}).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    return response

async def completions(request):
    return await answer(request, chat=False)

async def chat(request):
    return await answer(request, chat=True)

async def models(request):
    return web.json_response({"object": "list", "data": [{"id": model, "object": "model", "max_model_len": 4096}]})

async def health(request):
    return web.json_response({})

app = web.Application()
app.router.add_post("/v1/completions", completions)
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/v1/models", models)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)
"""


@contextmanager
def scripted_vllm(
    port: int, model: str, *, tokens: int = 16, prefill_ms: float = 0.0, gap_ms: float = 0.0
) -> Iterator[subprocess.Popen[bytes]]:
    """The scripted server on ``port`` serving ``model`` while the block runs (it answers /health first)."""
    command = [sys.executable, "-c", SERVER, str(port), model, str(tokens), str(prefill_ms), str(gap_ms)]
    proc = subprocess.Popen(command)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the scripted vLLM exited with status {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise SystemExit("the scripted vLLM did not start") from None
            time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)
