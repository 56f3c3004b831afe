"""A gateway that serves through vLLM loads no torch and no CUDA libraries: `clawgate serve --engine vllm` is run
as a child process in front of a stand-in vLLM server, answers a call from the official openai client, and its
memory map is then checked for torch's shared libraries (the proof that `import torch` never ran) and its
resident memory against the 200 MiB goal."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import openai
import pytest

from gateway.store import db
from tests.conftest import free_port
from tests.online import UpProcess, wait_healthy

RSS_GOAL_MIB = 200


class StandInVLLM(BaseHTTPRequestHandler):
    """vLLM's /health, /v1/models and unstreamed /v1/completions, answering a fixed few token ids."""

    model = ""
    answer: ClassVar[list[int]] = []

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
        if self.path == "/v1/models":
            self._json({"data": [{"id": self.model, "max_model_len": 2048}]})
        else:
            self._json({})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["content-length"])))
        assert self.path == "/v1/completions" and not request["stream"]
        ids = self.answer
        choice = {"token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)}, "finish_reason": "stop"}
        self._json({"choices": [{**choice, "stop_reason": None}], "usage": {"prompt_tokens": len(request["prompt"])}})


@pytest.fixture
def stand_in_vllm(tiny_model_dir: Path, tiny_tokenizer: Any) -> Iterator[str]:
    StandInVLLM.model = str(tiny_model_dir)
    StandInVLLM.answer = [*tiny_tokenizer.encode("Hello there", add_special_tokens=False), tiny_tokenizer.eos_token_id]
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInVLLM)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_vllm_gateway_runs_without_torch(tmp_path: Path, tiny_model_dir: Path, stand_in_vllm: str) -> None:
    url = f"sqlite:///{tmp_path / 'clawgate.db'}"
    db.upgrade(url)
    port = free_port()
    env = {
        "CLAWGATE_ENGINE": "vllm",
        "CLAWGATE_VLLM_URL": stand_in_vllm,
        "CLAWGATE_MODEL": str(tiny_model_dir),
        "CLAWGATE_SERVED_MODEL_NAME": "tiny",
        "CLAWGATE_DATABASE_URL": url,
        "CLAWGATE_DATA_DIR": str(tmp_path / "data"),
        "CLAWGATE_PORT": str(port),
        "CLAWGATE_POLICY_FOLLOW": "false",
    }
    gw = UpProcess(env=env, cwd=tmp_path, command="serve")
    gw.start()
    try:
        wait_healthy(f"http://127.0.0.1:{port}", gw, 120, version=None)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "Hello there"
        proc = Path(f"/proc/{gw.proc.pid}")
        libraries = {line.split()[-1] for line in (proc / "maps").read_text().splitlines() if ".so" in line}
        status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines())
    finally:
        gw.stop()
    loaded = sorted(lib for lib in libraries if "torch" in lib or "nvidia" in lib or "libcuda" in lib)
    assert not loaded, f"the gateway loaded torch or CUDA libraries: {loaded[:5]}"
    rss_mib = int(status["VmRSS"].split()[0]) / 1024
    print(f"gateway RSS after serving one call: {rss_mib:.0f} MiB (peak {int(status['VmHWM'].split()[0]) / 1024:.0f})")
    assert rss_mib <= RSS_GOAL_MIB
