"""`clawgate up`, embedded mode: one command for the gateway, the trainer and the reward worker (and vLLM).

It migrates the database, builds the built-in tiny model when that is the model and it is missing, starts the
trainer and the reward worker as supervised child processes (``supervise.py``) and, with ``--engine vllm`` and no
``--vllm-url``, a managed vLLM server; then it serves in the foreground and stops them all when it exits. It
takes the flags of `serve`, `train` and `judge`, so it lives beside the CLI that assembles those.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from clawgate.supervise import ChildProcess
from clawgate.tiny_model import build_tiny
from gateway.cli import SERVE_FLAGS, exit_on_sigterm, serve, serve_flags
from gateway.logs import setup_logging
from gateway.settings import DEFAULT_DATA_DIR, Settings, from_flags
from rewards.cli import JUDGE_FLAGS, judge_flags
from trainer.cli import TRAIN_FLAGS, train_flags

if TYPE_CHECKING:
    from gateway.engines.vllm_server import VLLMServer

# `clawgate up` on the built-in tiny model, unless --max-tokens says otherwise.
TINY_MODEL_MAX_TOKENS = 4096
UP_SETTINGS = (*SERVE_FLAGS, *TRAIN_FLAGS, *JUDGE_FLAGS)


def cmd_up(args: argparse.Namespace) -> int:
    """Embedded mode: migrate, build the tiny model if needed, start the trainer (a supervised child process,
    so training never holds the serving process's GIL) and a managed vLLM server when asked, then serve."""
    from gateway.app import redact_url
    from gateway.store import db

    settings = from_flags(args, UP_SETTINGS)
    setup_logging(settings.log_level)
    model_dir = Path(settings.model)
    tiny = model_dir.resolve() == (DEFAULT_DATA_DIR / "tiny-model").resolve()
    if tiny and not model_dir.exists():
        build_tiny(model_dir)
    if tiny and settings.max_tokens is None:
        # The built-in model writes random text and never ends its turn: without a cap every answer would run to
        # the context window (40,960 tokens). A real model needs no cap.
        settings = settings.model_copy(update={"max_tokens": TINY_MODEL_MAX_TOKENS})
        print(f"the built-in tiny model's answers are capped at {TINY_MODEL_MAX_TOKENS} tokens", file=sys.stderr)
    local_path = settings.model.startswith((".", "/", "~"))
    if not tiny and settings.engine == "local" and not model_dir.exists() and local_path:
        print(f"error: model folder {model_dir} does not exist", file=sys.stderr)
        return 2
    print(f"migrating {redact_url(settings.database_url)} ...", file=sys.stderr)
    db.upgrade(settings.database_url)
    vllm = None
    if settings.engine == "vllm" and "vllm_url" not in settings.model_fields_set:
        vllm = _start_vllm(settings)
        if vllm is None:
            return 2
        settings = settings.model_copy(update={"vllm_url": vllm.url})
        if settings.train_threads is None:
            threads = trainer_threads_beside_vllm()
            settings = settings.model_copy(update={"train_threads": threads})
            print(f"the trainer uses {threads} CPU thread(s) beside the vLLM server (--threads)", file=sys.stderr)
    if settings.eval_gate_tasks is not None and settings.gateway_url is None:
        # The trainer's evaluation gate runs its suite through this gateway.
        host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
        settings = settings.model_copy(update={"gateway_url": f"http://{host}:{settings.port}"})
    children = []
    if not args.no_train:
        children.append(ChildProcess(settings, "train"))
    if settings.reward_worker_enabled:
        children.append(ChildProcess(settings, "judge"))
    # uvicorn re-raises the SIGTERM it handled once it has shut down; ending with SystemExit instead lets the
    # `finally` below stop the workers and vLLM (a bare re-raised SIGTERM would orphan them).
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        for child in children:
            child.start()
        base = f"http://{settings.host}:{settings.port}"
        login = "sign in with CLAWGATE_ADMIN_KEY" if settings.admin_key is not None else "open: no admin key set"
        print(f"serving the OpenAI/Anthropic APIs on {base}/v1", file=sys.stderr, flush=True)
        print(f"operator console: {base}/dashboard ({login}); API docs: {base}/docs", file=sys.stderr, flush=True)
        return serve(settings)
    finally:
        for child in children:
            child.stop()
        if vllm is not None:
            vllm.stop()


def trainer_threads_beside_vllm() -> int:
    """The trainer's CPU threads when it shares this machine's cores with the vLLM server `up` started: with a
    thread per core its parallel regions wait on threads vLLM preempts (2 cores, CPU vLLM: a step took 20 s with 2
    threads, 4 s with 1). Half the cores; on a GPU its CPU threads hardly matter."""
    return max(1, (os.cpu_count() or 2) // 2)


def _start_vllm(settings: Settings) -> VLLMServer | None:
    from gateway.engines.managed import VLLMServerError
    from gateway.engines.vllm_server import VLLMServer, find_vllm_python

    python = find_vllm_python(settings.vllm_python)
    if python is None:
        print(
            "error: --engine vllm without --vllm-url starts a vLLM server, but none is installed: run "
            "`./dev setup-vllm` (CPU) or `pip install 'clawgate[vllm]'` (GPU), set CLAWGATE_VLLM_PYTHON to the "
            "interpreter of a vLLM install, or pass --vllm-url of a running server",
            file=sys.stderr,
        )
        return None
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    server = VLLMServer(
        python,
        settings.model,
        served_model_name=settings.vllm_model or settings.model,
        max_lora_rank=max(settings.train_lora_rank, 8),
        max_loras=settings.policy_keep_loaded + 1,
        log_path=settings.data_dir / "vllm.log",
    )
    print(f"starting vLLM ({' '.join(server.command()[1:4])} ...), log in {server.log_path}", file=sys.stderr)
    try:
        server.start(timeout=900)
    except VLLMServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    print(f"vLLM ready on {server.url} after {server.startup_seconds:.0f}s", file=sys.stderr)
    return server


def register(sub: argparse._SubParsersAction) -> None:
    """Add `up` to the `clawgate` parser."""
    up = sub.add_parser("up", help="embedded mode: gateway + trainer (+ vLLM) with one command")
    serve_flags(up)
    up.add_argument("--no-train", action="store_true", help="serve only; do not start the trainer")
    train_flags(up)
    judge_flags(up)
    up.set_defaults(func=cmd_up)


__all__ = ["TINY_MODEL_MAX_TOKENS", "cmd_up", "register"]
