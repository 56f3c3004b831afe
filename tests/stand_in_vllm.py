"""A stand-in for a vLLM server (``/health``, ``/v1/models``, unstreamed ``/v1/completions`` answering fixed token
ids) and `clawgate serve --engine vllm` in front of it: for tests about the gateway process itself (its memory, its
capture) that need neither torch in the gateway nor a real engine's start-up time. Real-vLLM tests cover the wire."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.conftest import free_port
from tests.online import UpProcess, wait_healthy


def handler(model: str, answer: list[int]) -> type[BaseHTTPRequestHandler]:
    class StandInVLLM(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._json({"data": [{"id": model, "max_model_len": 2048}]} if self.path == "/v1/models" else {})

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["content-length"])))
            assert self.path == "/v1/completions" and not request["stream"]
            choice = {"token_ids": answer, "logprobs": {"token_logprobs": [-0.5] * len(answer)}}
            choice |= {"finish_reason": "stop", "stop_reason": None}
            self._json({"choices": [choice], "usage": {"prompt_tokens": len(request["prompt"])}})

    return StandInVLLM


@contextmanager
def stand_in_vllm(model_dir: Path, answer: list[int]) -> Iterator[str]:
    """The stand-in's base URL while the block runs."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(str(model_dir), answer))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def start_vllm_gateway(tmp: Path, model_dir: Path, vllm_url: str, database_url: str, **settings: str) -> UpProcess:
    """`clawgate serve --engine vllm` as a child process, once it answers /health; its URL is ``.env['URL']``."""
    port = free_port()
    env = {
        "CLAWGATE_ENGINE": "vllm",
        "CLAWGATE_VLLM_URL": vllm_url,
        "CLAWGATE_MODEL": str(model_dir),
        "CLAWGATE_SERVED_MODEL_NAME": "tiny",
        "CLAWGATE_DATABASE_URL": database_url,
        "CLAWGATE_DATA_DIR": str(tmp / "data"),
        "CLAWGATE_PORT": str(port),
        "CLAWGATE_POLICY_FOLLOW": "false",
        **{f"CLAWGATE_{k.upper()}": v for k, v in settings.items()},
    }
    gw = UpProcess(env=env, cwd=tmp, command="serve")
    gw.start()
    gw.env["URL"] = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(gw.env["URL"], gw, 120, version=None)
    except BaseException:
        gw.stop()
        raise
    return gw
