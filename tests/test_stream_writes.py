"""Streamed responses are written in as few socket writes as the tokens allow: the opening events go out with the
first token's, each engine delta is one write, and the last events go out with the end of the response (the
OpenAI usage chunk and ``data: [DONE]``, or Anthropic's message_delta and message_stop, plus HTTP's last chunk).

A counting wrapper around the app sees every ASGI message uvicorn turns into one ``transport.write``; a raw httpx
client reads the stream and parses its events, which must be exactly the events of one-event-per-write streaming.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.settings import Settings
from gateway.store import db
from tests.conftest import LiveGateway, free_port, start_gateway, stop_gateway
from tests.fakes import ScriptedEngine

WORDS = ["one", " two", " three", " four", " five"]


class CountingApp:
    """The app, counting the response messages (one socket write each in uvicorn) of each request path."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state = app.state
        self.writes: list[int] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        count = [0]
        self.writes.append(0)
        slot = len(self.writes) - 1

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] in ("http.response.start", "http.response.body"):
                count[0] += 1
                self.writes[slot] = count[0]
            await send(message)

        await self.app(scope, receive, counting_send)


@pytest.fixture
def counted(tmp_path: Path, tiny_model_dir: Path, tiny_tokenizer: Any, monkeypatch: Any) -> Iterator[Any]:
    url = f"sqlite:///{tmp_path / 'gw.db'}"
    db.upgrade(url)
    settings = Settings(
        model=str(tiny_model_dir), served_model_name="tiny", database_url=url, port=free_port(), data_dir=tmp_path
    )
    engine = ScriptedEngine(tiny_tokenizer)
    wrapped: list[CountingApp] = []
    import tests.conftest as conftest

    real_build = conftest.build_app

    def build(*args: Any, **kwargs: Any) -> Any:
        wrapped.append(CountingApp(real_build(*args, **kwargs)))
        return wrapped[-1]

    monkeypatch.setattr(conftest, "build_app", build)
    gw: LiveGateway = start_gateway(settings, engine=engine, tokenizer=tiny_tokenizer)
    yield gw, engine, wrapped[0]
    stop_gateway(gw)


def sse_events(raw: bytes) -> list[tuple[str | None, str]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((fields.get("event"), fields["data"]))
    return out


def test_a_chat_stream_is_one_write_per_token_plus_two(counted: Any) -> None:
    gw, engine, app = counted
    engine.push("".join(WORDS))
    tokens = len(engine.scripts[0][0]) - 1  # the end-of-turn token writes no text
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "count"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
        raw = b"".join(r.iter_raw())
    events = sse_events(raw)
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [c["choices"][0]["delta"]["content"] for c in chunks[1 : 1 + tokens]]
    assert all(contents) and "".join(contents) == "".join(WORDS)
    assert chunks[1 + tokens]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert chunks[2 + tokens]["choices"] == [] and chunks[2 + tokens]["usage"]["completion_tokens"] == tokens + 1
    assert len(chunks) == tokens + 3
    # headers, role + first token, one per further token, finish + usage + [DONE] + HTTP's last chunk
    assert app.writes[-1] == 1 + tokens + 1, f"{app.writes[-1]} writes for {tokens} tokens"


def test_an_anthropic_stream_is_one_write_per_token_plus_two(counted: Any) -> None:
    gw, engine, app = counted
    engine.push("".join(WORDS))
    tokens = len(engine.scripts[0][0]) - 1
    body = {"model": "tiny", "max_tokens": 64, "messages": [{"role": "user", "content": "count"}], "stream": True}
    with httpx.stream("POST", gw.url + "/v1/messages", json=body, timeout=30) as r:
        raw = b"".join(r.iter_raw())
    kinds = [kind for kind, _ in sse_events(raw)]
    assert kinds == [
        "message_start",
        "ping",
        "content_block_start",
        *["content_block_delta"] * tokens,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    text = "".join(json.loads(data)["delta"]["text"] for kind, data in sse_events(raw) if kind == "content_block_delta")
    assert text == "".join(WORDS)
    assert app.writes[-1] == 1 + tokens + 1, f"{app.writes[-1]} writes for {tokens} tokens"
