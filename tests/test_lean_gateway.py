"""A gateway that serves through vLLM loads no torch and no CUDA libraries: `clawgate serve --engine vllm` is run
as a child process in front of a stand-in vLLM server, answers a call from the official openai client, and its
memory map is then checked for torch's shared libraries (the proof that `import torch` never ran) and its
resident memory against the 200 MiB goal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai

from gateway.store import db
from tests.stand_in_vllm import stand_in_vllm, start_vllm_gateway

RSS_GOAL_MIB = 200


def test_a_vllm_gateway_runs_without_torch(tmp_path: Path, tiny_model_dir: Path, tiny_tokenizer: Any) -> None:
    url = f"sqlite:///{tmp_path / 'clawgate.db'}"
    db.upgrade(url)
    answer = [*tiny_tokenizer.encode("Hello there", add_special_tokens=False), tiny_tokenizer.eos_token_id]
    with stand_in_vllm(tiny_model_dir, answer) as vllm_url:
        gw = start_vllm_gateway(tmp_path, tiny_model_dir, vllm_url, url)
        try:
            client = openai.OpenAI(base_url=gw.env["URL"] + "/v1", api_key="none")
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
