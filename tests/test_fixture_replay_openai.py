"""Real harness requests on the chat-completions API, replayed as captured against the real tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

FIXTURES = Path(__file__).parent / "fixtures" / "harness-requests"
REPLAYED_HEADERS = ("accept", "content-type", "traceparent", "user-agent")


def data_lines(body: str) -> list[str]:
    blocks = [b for b in body.split("\n\n") if b.strip()]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), blocks
    return [b[len("data: ") :] for b in blocks]


def test_openclaw_chat_completions_stream(gateway_factory):
    """OpenClaw after a tool result (rewritten call ids, an extra user turn, include_usage): well-formed chunks."""
    gw = gateway_factory(model_aliases="*", max_tokens=8)
    captured = json.loads((FIXTURES / "openclaw" / "01-chat-completions-after-tool-result.json").read_text())
    body = captured["body"]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    headers = {k: v for k, v in captured["headers"].items() if k in REPLAYED_HEADERS}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream") and r.headers["x-clawgate-call-id"]
    lines = data_lines(r.text)
    assert lines[-1] == "[DONE]"
    chunks: list[dict[str, Any]] = [json.loads(line) for line in lines[:-1]]
    assert not any("error" in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == body["model"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length", "tool_calls")
    *_, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] >= 1
    assert all(c["usage"] is None for c in chunks[:-1])
    offered = {t["function"]["name"] for t in body["tools"]}
    # Between the role chunk and the usage chunk, the answer itself: text or tool-call deltas, not nothing.
    assert len(chunks) >= 3, chunks
    middle = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    calls = [call for delta in middle for call in delta.get("tool_calls") or []]
    assert "".join(delta.get("content") or "" for delta in middle) or calls, chunks
    for call in calls:
        assert call["function"].get("name", "exec") in offered  # only a call's first delta names it
