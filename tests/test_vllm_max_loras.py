"""Under guarded promotion the gateway serves two adapters side by side, so it refuses to start on a vLLM whose
``--max-loras`` is below 2, and logs what each server reported otherwise.

Against scripted vLLM servers (``tests/scripted_http.py``) that answer ``/metrics`` as vLLM 0.32 does: the LoRA
gauge is declared from the start and sampled only once the engine has run a step (the sample line below is copied
from a real server started with ``--max-loras 1``). A second real vLLM started with ``--max-loras 1`` would add
about a minute to the suite; what the real server reports is checked in ``tests/test_promotion_vllm.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import httpx
import pytest

from gateway.engines.vllm import VLLMEngine
from gateway.engines.vllm_replicas import TooFewLoras
from gateway.engines.vllm_wire import max_loras_of
from gateway.store import db
from tests.scripted_http import scripted_server
from tests.test_cli_errors import clawgate

DECLARED = "# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge\n"
SAMPLE = 'vllm:lora_requests_info{max_lora="%d",running_lora_adapters="",waiting_lora_adapters=""} 1.7963005189e+09\n'
OTHER = '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n'


class ScriptedVLLM:
    """``/v1/models``, ``/v1/completions`` and ``/metrics`` of a vLLM started with ``--max-loras max_loras``
    (None: one that has no LoRA gauge)."""

    def __init__(self, max_loras: int | None) -> None:
        self.max_loras = max_loras
        self.stepped = False  # the engine ran a step: the gauge has its sample
        self.paths: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.paths.append(path)
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 64}]})
        if path == "/v1/completions":
            self.stepped = True
            choice = {"index": 0, "text": "", "token_ids": [3], "finish_reason": "length"}
            return httpx.Response(200, json={"choices": [choice], "usage": {"prompt_tokens": 1}})
        if path == "/metrics":
            lora = "" if self.max_loras is None else DECLARED + (SAMPLE % self.max_loras if self.stepped else "")
            return httpx.Response(200, text=OTHER + lora)
        return httpx.Response(404, json={"error": {"message": path}})


@asynccontextmanager
async def serving(*servers: ScriptedVLLM) -> AsyncIterator[list[str]]:
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(scripted_server(server)) for server in servers]


async def started(*servers: ScriptedVLLM, min_loras: int = 2) -> VLLMEngine:
    """An engine on ``servers`` (the first one alone, or each as a replica behind the first), started and closed."""
    async with serving(*servers) as urls:
        engine = VLLMEngine(urls[0], model="tiny", replicas=urls if len(urls) > 1 else (), min_loras=min_loras)
        try:
            await engine.start()
        finally:
            await engine.close()
        return engine


def test_the_max_lora_label_is_read_from_the_gauges_sample() -> None:
    assert max_loras_of(OTHER + DECLARED + SAMPLE % 4) == 4
    assert max_loras_of(OTHER + DECLARED) is None  # declared, no engine step yet
    assert max_loras_of(OTHER) is None
    # The adapter names in the other labels are anything; only the max_lora label counts.
    named = 'vllm:lora_requests_info{running_lora_adapters="max_lora=9",max_lora="3",waiting_lora_adapters=""} 1\n'
    assert max_loras_of(named) == 3


async def test_a_fresh_server_is_given_one_step_and_then_reports_its_max_loras(caplog) -> None:
    server = ScriptedVLLM(4)
    with caplog.at_level(logging.INFO, logger="gateway.engines.vllm"):
        engine = await started(server)
    assert list(engine.max_loras.values()) == [4]
    # The gauge had no sample until the one-token generation: then it was read again.
    assert server.paths == ["/v1/models", "/metrics", "/v1/completions", "/metrics"]
    assert "batches up to 4 LoRA adapters (--max-loras 4)" in caplog.text


async def test_max_loras_below_two_refuses_to_start_naming_the_flag() -> None:
    with pytest.raises(TooFewLoras) as refused:
        await started(ScriptedVLLM(1))
    assert "has --max-loras 1; start vLLM with --max-loras 2 or more" in str(refused.value)
    # Behind a router each replica is checked, and the message names the one that is short.
    good, short = ScriptedVLLM(4), ScriptedVLLM(1)
    with pytest.raises(TooFewLoras) as refused:
        await started(ScriptedVLLM(4), good, short)
    assert str(refused.value).count("--max-loras 1") == 1 and "--max-loras 4" not in str(refused.value)
    assert good.stepped and short.stepped


async def test_a_server_that_does_not_report_it_is_logged_once_and_served(caplog) -> None:
    server = ScriptedVLLM(None)
    with caplog.at_level(logging.INFO, logger="gateway.engines.vllm"):
        engine = await started(server)
    assert list(engine.max_loras.values()) == [None] and not server.stepped
    [line] = [r.getMessage() for r in caplog.records if "max-loras" in r.getMessage()]
    assert "does not report its --max-loras" in line and "could not check" in line


async def test_without_guarded_promotion_nothing_is_checked() -> None:
    server = ScriptedVLLM(1)
    engine = await started(server, min_loras=1)
    assert engine.max_loras == {} and server.paths == ["/v1/models"]


async def test_the_slots_are_read_once_when_a_tenant_policy_asks() -> None:
    """Before a tenant's own policy is served beside the shared one, the policy follower asks for the slots."""
    server = ScriptedVLLM(3)
    async with serving(server) as [url]:
        engine = VLLMEngine(url, model="tiny", min_loras=1)
        await engine.start()
        try:
            assert await engine.lora_slots() == {url: 3}
            assert await engine.lora_slots() == {url: 3}  # read once
        finally:
            await engine.close()
    assert server.paths == ["/v1/models", "/metrics", "/v1/completions", "/metrics"]


async def test_clawgate_serve_under_guarded_promotion_refuses_a_vllm_with_max_loras_1(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'clawgate.db'}"
    db.upgrade(url)
    async with serving(ScriptedVLLM(1)) as [vllm_url]:
        flags = ["--engine", "vllm", "--vllm-url", vllm_url, "--model", str(tiny_model_dir), "--database-url", url]
        result = await asyncio.to_thread(
            clawgate, "serve", *flags, "--promotion", "guarded", "--port", "0", env={"CLAWGATE_VLLM_MODEL": "tiny"}
        )
    assert result.returncode != 0
    assert "has --max-loras 1; start vLLM with --max-loras 2 or more" in result.stderr, result.stderr
