"""Hot-swap latency: from a policy version being saved to the first call the gateway serves with it.

A gateway serves the tiny model (the in-process engine, and a vLLM CPU server when one is installed) while a
client sends a call every ~20 ms. Each round publishes a new version the way the trainer does — the directory
``policy@vN`` written atomically, then its ``policy_versions`` row committed — and measures:

- save: writing the version directory (safetensors + manifest);
- load+verify+route: the gateway's own work once it has seen the row (engine load, one-token probe, routing);
- routed: row committed → the gateway routes new calls to it (includes waiting for the next poll);
- first call: row committed → start of the first call recorded with that version.

The poll interval bounds the wait (on average half of it: versions are published at a random phase of the poll);
it is run at the default (1 s) and at 0.1 s.

    .venv/bin/python bench/hot_swap.py [--rounds 8] [--no-vllm]
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import sqlalchemy as sa
import torch
from sqlalchemy.orm import Session

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.learning_check import Gateway, free_port  # noqa: E402
from gateway.settings import Settings  # noqa: E402
from gateway.store import db  # noqa: E402
from gateway.store.models import Call, PolicyVersion  # noqa: E402
from trainer import lora  # noqa: E402


def publish(
    engine: sa.Engine, policy: lora.PeftModel, adapters: Path, model: Path, version: int
) -> tuple[float, float]:
    """Returns (seconds to save, time.time() at which the row was committed)."""
    with torch.no_grad():
        for name, param in lora.lora_parameters(policy).items():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    t0 = time.perf_counter()
    path = lora.save_version(policy, adapters, lora.Manifest(version=version, base_model=str(model)))
    save_s = time.perf_counter() - t0
    with Session(engine) as session, session.begin():
        session.add(
            PolicyVersion(
                version=version,
                adapter_name=lora.version_name(version),
                path=str(path),
                base_model=str(model),
                status="published",
                is_current=False,
                created_at=dt.datetime.now(dt.UTC),
            )
        )
    return save_s, time.time()


def run(model: Path, work: Path, *, engine_kind: str, vllm_url: str | None, poll: float, rounds: int) -> None:
    tag = f"{engine_kind}-{poll}"
    url = f"sqlite:///{work / f'{tag}.db'}"
    db.upgrade(url)
    adapters = work / f"adapters-{tag}"
    settings = Settings(
        model=str(model),
        served_model_name="tiny",
        database_url=url,
        port=free_port(),
        data_dir=work / f"data-{tag}",
        max_tokens=4,
        policy_poll_interval=poll,
        engine=engine_kind,
        vllm_url=vllm_url or "http://127.0.0.1:1",
        vllm_model="tiny",
    )
    gw = Gateway(settings)
    store = db.connect(url)
    policy = lora.new_policy(lora.load_base(str(model)), lora.LoraSettings())
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=gw.url, timeout=60) as c:
            while not stop.is_set():
                c.post(
                    "/v1/chat/completions",
                    json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
                )
                time.sleep(0.02)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    saves, routed, first, swaps = [], [], [], []
    try:
        rng = random.Random(0)
        for version in range(rounds):
            time.sleep(rng.uniform(0, poll))  # publish at a random phase of the gateway's poll
            save_s, committed = publish(store, policy, adapters, model, version)
            state = gw.app.state.clawgate
            deadline = time.monotonic() + 60
            while state.service.policy_version != version:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"policy@v{version} was not picked up")
                time.sleep(0.001)
            routed.append(time.time() - committed)
            saves.append(save_s)
            swaps.append(state.policy.last_swap_seconds)
            time.sleep(max(poll, 0.3))  # let calls on the new version be recorded
            gw.call(state.writer.flush())
            with Session(store) as session:
                started = session.scalar(sa.select(sa.func.min(Call.started_at)).where(Call.policy_version == version))
            assert started is not None, f"no call served by policy@v{version}"
            first.append(started.timestamp() - committed)
    finally:
        stop.set()
        thread.join(timeout=30)
        gw.stop()
        store.dispose()

    def fmt(xs: list[float]) -> str:
        return f"median {statistics.median(xs) * 1000:7.1f} ms  max {max(xs) * 1000:7.1f} ms"

    print(
        f"{engine_kind:6s} poll {poll:4.1f}s  save: {fmt(saves)}  |  load+verify+route: {fmt(swaps)}  |  "
        f"routed: {fmt(routed)}  |  first call: {fmt(first)}  ({rounds} versions)",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()
    from clawgate.tiny_model import build_tiny_model
    from gateway.engines.vllm_server import VLLMServer, find_vllm_python

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "tiny")
        for poll in (1.0, 0.1):
            run(model, work, engine_kind="local", vllm_url=None, poll=poll, rounds=args.rounds)
        python = None if args.no_vllm else find_vllm_python(None)
        if python is None:
            print("vLLM: not installed (./dev setup-vllm), skipped")
            return 0
        with VLLMServer(python, model, served_model_name="tiny", log_path=work / "vllm.log") as server:
            for poll in (1.0, 0.1):
                run(model, work, engine_kind="vllm", vllm_url=server.url, poll=poll, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
