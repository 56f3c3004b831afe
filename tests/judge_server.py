"""A small OpenAI-compatible judge server for tests: answers `/v1/chat/completions` from a fixed rule.

LiteLLM reaches it as ``openai/<name>`` with ``api_base`` = ``server.url``, exactly as it reaches any
OpenAI-compatible server (a self-hosted vLLM, a proxy). The server records every request, counts the requests in
flight at once, and can be stopped and started again on the same port (a judge outage: connections refused).
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Rule = Callable[[list[dict[str, Any]]], str]
_REPLY = re.compile(r"<reply>\n(.*?)\n</reply>", re.DOTALL)
_NEXT = re.compile(r"<next_state>\n(.*?)\n</next_state>", re.DOTALL)


def section(messages: list[dict[str, Any]], name: str) -> str:
    """The text of one section (``reply`` or ``next_state``) of the judge prompt."""
    user = messages[-1]["content"]
    match = (_REPLY if name == "reply" else _NEXT).search(user)
    assert match is not None, f"no <{name}> section in the judge prompt"
    return match.group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class JudgeServer:
    def __init__(self, rule: Rule, *, delay: float = 0.0, port: int | None = None) -> None:
        self.rule = rule
        self.delay = delay
        self.port = port or free_port()
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.status = 200  # answer every request with this status (500, 503: a failing judge)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> JudgeServer:
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/stats"):
                    with judge._lock:
                        stats = {"requests": len(judge.requests), "max_in_flight": judge.max_in_flight}
                    self._send(200, stats)
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                with judge._lock:
                    judge.requests.append(body)
                    judge.in_flight += 1
                    judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
                try:
                    if judge.delay:
                        time.sleep(judge.delay)
                    if judge.status != 200:
                        self._send(judge.status, {"error": {"message": "judge unavailable", "type": "server_error"}})
                        return
                    content = judge.rule(body["messages"])
                    self._send(
                        200,
                        {
                            "id": f"chatcmpl-{len(judge.requests)}",
                            "object": "chat.completion",
                            "created": int(time.time()),
                            "model": body.get("model", "judge"),
                            "choices": [
                                {
                                    "index": 0,
                                    "message": {"role": "assistant", "content": content},
                                    "finish_reason": "stop",
                                }
                            ],
                            "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
                        },
                    )
                finally:
                    with judge._lock:
                        judge.in_flight -= 1

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="judge-server")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> JudgeServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def main() -> None:
    """Serve a constant verdict (for benchmarks that measure the reward worker alone): PORT [DELAY]."""
    import sys

    port, delay = int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    server = JudgeServer(lambda m: '{"score": 0.5, "reason": "constant"}', delay=delay, port=port).start()
    print(f"judge server on {server.url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
