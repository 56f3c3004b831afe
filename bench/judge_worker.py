"""The reward worker's own cost: CPU per judged turn, and throughput at several concurrency limits.

Turns are made the way everyday traffic makes them: two-turn conversations served through an in-process gateway
(a scripted engine on the tiny model's tokenizer, so no model time is spent) into SQLite, each with the system
prompt OpenClaw sends (about 10k tokens: the worker rebuilds and decodes real-size prompts). Every rollout is then
closed, so both turns of every conversation are judgeable. A judge server in a child process answers every request
after ``--latency`` seconds (a remote model's latency) — through LiteLLM, as in production.

The worker runs alone in this process: its CPU time (``time.process_time``) per judged turn is the figure, beside
the wall time, the turns judged per second and the most requests the judge server saw at once.

    .venv/bin/python bench/judge_worker.py [--conversations 100] [--latency 0.05] [--concurrency 1 4 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.settings import Settings  # noqa: E402
from gateway.store import db  # noqa: E402
from rewards.judge import Judge  # noqa: E402
from rewards.turns import tokenizer_decode  # noqa: E402
from rewards.worker import RewardWorker, WorkerConfig  # noqa: E402
from tests.conftest import start_gateway, stop_gateway  # noqa: E402
from tests.fakes import ScriptedEngine  # noqa: E402
from tests.judge_server import free_port  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "harness-requests" / "openclaw" / "01-chat-completions-after-tool-result.json"
ADMIN = "bench-admin"


def make_turns(model: Path, tokenizer: object, url: str, data: Path, conversations: int) -> int:
    system = json.loads(FIXTURE.read_text())["body"]["messages"][0]["content"]
    engine = ScriptedEngine(tokenizer)
    settings = Settings(
        model=str(model),
        served_model_name="tiny",
        database_url=url,
        port=free_port(),
        data_dir=data,
        admin_key=ADMIN,
        policy_follow=False,
        max_tokens=64,
    )
    gw = start_gateway(settings, engine=engine, tokenizer=tokenizer)
    rollouts = set()
    try:
        with httpx.Client(base_url=gw.url, timeout=60) as client:
            for i in range(conversations):
                messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Task {i}."}]
                for turn in range(2):
                    engine.push(f"Working on task {i}, step {turn}: reading the files and running the tests.")
                    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages})
                    r.raise_for_status()
                    rollouts.add(r.headers["x-clawgate-rollout-id"])
                    messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "Next."}]
            for rollout in rollouts:
                client.post(
                    f"/v1/rollouts/{rollout}/finish",
                    json={"status": "completed"},
                    headers={"Authorization": f"Bearer {ADMIN}"},
                ).raise_for_status()
    finally:
        stop_gateway(gw)
    return 2 * conversations


def measure(
    model: Path, tokenizer: object, work: Path, *, conversations: int, latency: float, concurrency: int
) -> dict:
    url = f"sqlite:///{work / f'judge-{concurrency}.db'}"
    db.upgrade(url)
    turns = make_turns(model, tokenizer, url, work / f"data-{concurrency}", conversations)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.judge_server", str(port), str(latency)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and "judge server on" in server.stdout.readline()
        engine = db.connect(url)
        judge = Judge("openai/bench-judge", api_base=f"http://127.0.0.1:{port}/v1", api_key="bench", timeout=30)
        worker = RewardWorker(
            engine,
            tokenizer_decode(tokenizer),
            judge=judge,
            config=WorkerConfig(concurrency=concurrency, interval=0.05),
        )

        async def judge_all() -> int:
            try:
                return await worker.run_once()
            finally:
                await worker.aclose()

        cpu0, wall0 = time.process_time(), time.perf_counter()
        judged = asyncio.run(judge_all())
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        stats = httpx.get(f"http://127.0.0.1:{port}/v1/stats").json()
        engine.dispose()
    finally:
        server.terminate()
        server.wait(10)
    assert judged == turns, f"judged {judged} of {turns} turns"
    return {
        "concurrency": concurrency,
        "turns": judged,
        "wall_s": wall,
        "turns_per_s": judged / wall,
        "cpu_ms_per_turn": 1000 * cpu / judged,
        "peak_in_flight": stats["max_in_flight"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=100)
    ap.add_argument("--latency", type=float, default=0.05, help="seconds the judge server takes per answer")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from clawgate.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "tiny")
        tokenizer = AutoTokenizer.from_pretrained(model)
        system_tokens = len(tokenizer.encode(json.loads(FIXTURE.read_text())["body"]["messages"][0]["content"]))
        print(f"turns with a {system_tokens:,}-token system prompt; judge latency {args.latency * 1000:.0f} ms")
        print("concurrency  turns  wall s  turns/s  worker CPU ms/turn  peak in flight")
        for c in args.concurrency:
            r = measure(model, tokenizer, work, conversations=args.conversations, latency=args.latency, concurrency=c)
            print(
                f"{r['concurrency']:>11}  {r['turns']:>5}  {r['wall_s']:>6.1f}  {r['turns_per_s']:>7.1f}  "
                f"{r['cpu_ms_per_turn']:>18.1f}  {r['peak_in_flight']:>14}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
