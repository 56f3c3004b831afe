"""Does the whole loop learn? GRPO on the tiny model, every sample served and captured by the gateway.

A synthetic task whose reward is computable from the completion: reward = the fraction of completion tokens that
fall in a fixed target set of token ids (a random policy scores ~ |set| / |vocabulary|). Each step, for each of
``prompts`` prompts, ``group`` rollouts are created through the rollout API, sampled through the gateway's chat
completions endpoint (in-process transformers engine), scored from the token ids the gateway stored, rewarded and
finished over HTTP; then one ``Trainer`` step runs on what the store holds and the new policy version is loaded
into the engine for the next step's samples. A learning-rate-0 control runs the same loop: its reward must not rise.

    .venv/bin/python bench/learning_check.py [--steps 20] [--seeds 0 1 2] [--lr 5e-3]

Prints the mean reward per step for each run, and the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.app import build_app  # noqa: E402
from gateway.settings import Settings  # noqa: E402
from gateway.store import db  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from trainer.step import Trainer  # noqa: E402

ADMIN = "learning-check-admin"


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.app = build_app(settings)
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=settings.port, log_level="warning")
        )
        self.url = f"http://127.0.0.1:{settings.port}"
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("gateway failed to start")
            time.sleep(0.05)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.server.serve())

    def call(self, coro: object) -> object:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)  # type: ignore[arg-type]

    def serve_version(self, version: int) -> None:
        """Have the gateway's policy follower swap to the newest published version now (it would on its next
        poll anyway): the product's own hot swap (load, probe, route, mark current), without the poll's delay."""
        follower = self.app.state.clawgate.policy
        served = self.call(follower.sync())
        if served != version:
            raise RuntimeError(f"the gateway serves policy version {served}, not the {version} just published")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_rollout(client: httpx.Client, prompt: str, task: str, targets: set[int], max_tokens: int, seed: int) -> float:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    ro = client.post("/v1/rollouts", json={"task_id": task, "harness": "bench"}, headers=admin).json()
    key = {"Authorization": f"Bearer {ro['api_key']}"}
    r = client.post(
        f"/rollouts/{ro['id']}/v1/chat/completions",
        headers=key,
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": seed,
        },
    )
    r.raise_for_status()
    calls = client.get(f"/v1/rollouts/{ro['id']}", headers=key).json()["calls"]
    ids = calls[0]["completion_token_ids"]
    reward = sum(t in targets for t in ids) / max(len(ids), 1)
    client.post(f"/v1/rollouts/{ro['id']}/reward", json={"value": reward, "source": "target-set"}, headers=key)
    client.post(f"/v1/rollouts/{ro['id']}/finish", json={"status": "completed"}, headers=key)
    return reward


def run(
    model: Path,
    *,
    steps: int,
    lr: float,
    seed: int,
    prompts: int,
    group: int,
    max_tokens: int,
    target_size: int,
    workdir: Path,
    log: bool = True,
    algorithm: str = "grpo",
) -> list[float]:
    rng = random.Random(seed)
    url = f"sqlite:///{workdir / f'run-{seed}-{lr}.db'}"
    db.upgrade(url)
    adapters = workdir / f"adapters-{seed}-{lr}"
    # The follower's own polling is slowed down: each step swaps explicitly (serve_version), so that every
    # sample of a step comes from the version that step is about.
    settings = Settings(
        model=str(model),
        served_model_name="tiny",
        database_url=url,
        port=free_port(),
        data_dir=workdir / f"data-{seed}-{lr}",
        admin_key=ADMIN,
        max_tokens=max_tokens,
        policy_follow=True,
        policy_poll_interval=3600,
    )
    gw = Gateway(settings)
    engine = db.connect(url)
    try:
        tokenizer = gw.app.state.clawgate.tokenizer
        special = set(tokenizer.all_special_ids)
        vocab = [i for i in range(len(tokenizer)) if i not in special]
        targets = set(rng.sample(vocab, target_size))
        texts = [f"Write item {rng.randrange(10_000)} of the list." for _ in range(prompts)]
        trainer = Trainer(
            TrainConfig(
                model=str(model),
                database_url=url,
                adapter_dir=adapters,
                lr=lr,
                seed=seed,
                max_rollouts=prompts * group,
                algorithm=algorithm,
            ),
            engine,
        )
        gw.serve_version(0)
        curve = []
        # Idle connections are dropped before the server's keep-alive (5 s) ends them: a trainer step between two
        # rounds of calls is longer, and a request sent on a connection the server is closing fails.
        limits = httpx.Limits(keepalive_expiry=1.0)
        with (
            httpx.Client(base_url=gw.url, timeout=120, limits=limits) as client,
            concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool,
        ):
            for step in range(steps):
                # Seeded samples: the same policy gives the same rollouts, so a run is repeatable.
                jobs = [
                    pool.submit(
                        one_rollout,
                        client,
                        texts[p],
                        f"p{p}",
                        targets,
                        max_tokens,
                        seed * 1_000_003 + step * 10_007 + p * group + g,
                    )
                    for p in range(prompts)
                    for g in range(group)
                ]
                rewards = [j.result() for j in jobs]
                curve.append(sum(rewards) / len(rewards))
                result = trainer.step()
                assert result is not None
                gw.serve_version(result.version)
                if log:
                    print(
                        f"  seed {seed} lr {lr:g} step {step:2d}: mean reward {curve[-1]:.3f}  "
                        f"(trained {result.trained_rollouts}/{result.rollouts} rollouts, "
                        f"{result.metrics.get('tokens_processed', 0):.0f} tokens, {result.seconds:.1f}s)",
                        flush=True,
                    )
        return curve
    finally:
        engine.dispose()
        gw.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--target-size", type=int, default=50)
    ap.add_argument("--no-control", action="store_true", help="skip the learning-rate-0 control")
    ap.add_argument(
        "--algorithm",
        choices=["grpo", "ppo"],
        default="grpo",
        help="ppo: a value head and GAE per branch (the same as --advantage critic)",
    )
    args = ap.parse_args()
    from clawgate.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "tiny")
        t0 = time.perf_counter()
        for seed in args.seeds:
            for lr in [args.lr] if args.no_control else [args.lr, 0.0]:
                curve = run(
                    model,
                    steps=args.steps,
                    lr=lr,
                    seed=seed,
                    prompts=args.prompts,
                    group=args.group,
                    max_tokens=args.max_tokens,
                    target_size=args.target_size,
                    workdir=work,
                    algorithm=args.algorithm,
                )
                k = max(1, len(curve) // 5)
                print(
                    f"seed {seed} lr {lr:g}: first {k} steps {sum(curve[:k]) / k:.3f} -> last {k} steps "
                    f"{sum(curve[-k:]) / k:.3f}  curve " + " ".join(f"{c:.2f}" for c in curve),
                    flush=True,
                )
        print(f"wall time {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
