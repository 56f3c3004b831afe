"""Live latency under counterfactual load: a gateway drawing K siblings per served turn against one that draws none.

Starts a vLLM CPU server on the tiny model and, in front of it, one clawgate gateway (a separate process) per mode:

- ``off``: no counterfactuals;
- ``K=3 yield``: K siblings per turn at priority 0 — the gateway draws one group at a time, its siblings in a batch
  started only while it serves no live call and abandoned when one arrives (``gateway/core/counterfactuals.py``);
- ``K=3 prio 1`` (only on a server under ``--scheduling-policy priority``): the siblings go to vLLM with request
  priority 1 and vLLM schedules them after the live calls.

Simulated users (``--users``) send chat completions one after the other, each pausing ``--think`` seconds on average
between its calls (a harness running its tools), so the gateway has gaps to draw siblings in. The modes take turns in
rounds against the same server, one at a time (siblings one gateway draws would slow another's live calls), each
block followed by a wait until its gateway has drawn or dropped every sibling offered. Each policy in
``--policies`` gets its own server: ``fcfs`` (vLLM's default; siblings can only yield) and ``priority``.

Prints per mode: live latency p50/p90 (non-streamed calls) and the p50 against ``off`` on the same server, where the
calls spent it (in the engine, rendering, the rest: HTTP and the capture's commit, from the recorded calls), the
siblings drawn and dropped (by reason), and per user turn the tokens vLLM generated (served answers, siblings, and
siblings abandoned halfway) and the sibling tokens recorded.

    .venv/bin/python bench/counterfactual_latency.py [--turns 160] [--rounds 8] [--users 2] [--think 0.3] [--k 3]
        [--max-tokens 32] [--policies fcfs priority] [--vllm-python PATH] [--engine-cpus 0 --gateway-cpus 1]

A vLLM CPU server that shares its cores with the gateway takes them from live calls while it decodes siblings, in
every mode; ``--engine-cpus`` and ``--gateway-cpus`` put the server, and the gateways with the users, on separate
CPUs, as an engine on its own accelerator would be. The tiny model's decoding step costs little beside vLLM's own
per-step work: a GPU server with a real model batches differently. Figures: README, "Counterfactual groups".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway_latency import wait_healthy  # noqa: E402
from clawgate.tiny_model import build_tiny_model  # noqa: E402
from gateway.engines.managed import free_port  # noqa: E402
from gateway.engines.vllm_server import VLLMServer, find_vllm_python  # noqa: E402
from gateway.store import db  # noqa: E402

DROP_REASONS = ("cap", "busy", "preempted", "capture", "error")


@dataclass
class Mode:
    name: str
    k: int
    priority: int = 0
    url: str = ""
    db_url: str = ""
    process: subprocess.Popen[bytes] | None = None
    served: int = 0  # turns served, warm-up included: each was offered k siblings
    latencies: list[float] = field(default_factory=list)
    call_ids: list[str] = field(default_factory=list)  # the measured calls'
    turns: int = 0  # measured turns
    engine_tokens: float = 0.0  # tokens vLLM generated during this mode's blocks (served + siblings, whole or not)


def metrics(url: str) -> dict[str, float]:
    """Prometheus text as {series: value}, series with labels summed under their bare name too."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        out[series] = out.get(series, 0.0) + float(value)
        bare = series.split("{", 1)[0]
        if bare != series:
            out[bare] = out.get(bare, 0.0) + float(value)
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def user(
    client: httpx.AsyncClient, mode: Mode, name: str, turns: int, args: argparse.Namespace, rng: random.Random
) -> list[tuple[float, str]]:
    """One simulated user: ``turns`` calls, each after a pause (uniform around ``--think``): their latencies and
    call ids."""
    calls = []
    for i in range(turns):
        await asyncio.sleep(rng.uniform(0.5, 1.5) * args.think)
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"{name}, question {i}: what next?"}],
            "max_tokens": args.max_tokens,
            "temperature": 1.0,
        }
        t0 = time.perf_counter()
        r = await client.post(mode.url + "/v1/chat/completions", json=body)
        elapsed = time.perf_counter() - t0
        r.raise_for_status()
        calls.append((elapsed, r.headers["x-clawgate-call-id"]))
        mode.served += 1
    return calls


async def settle(mode: Mode, timeout: float = 300) -> None:
    """Wait until the gateway drew or dropped every sibling of the turns it served."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(mode.url)
        done = m.get("clawgate_counterfactuals_drawn_total", 0.0) + m.get("clawgate_counterfactuals_dropped_total", 0)
        if done >= mode.k * mode.served:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"{mode.name}: {done:g} of {mode.k * mode.served} siblings settled after {timeout:g} s")
        await asyncio.sleep(0.1)


async def block(client: httpx.AsyncClient, mode: Mode, args: argparse.Namespace, turns: int, seed: int) -> None:
    """``turns`` live turns from ``--users`` users at once, then the siblings' settling; counts vLLM's tokens."""
    before = metrics(args.vllm_url).get("vllm:generation_tokens_total", 0.0)
    per_user = [turns // args.users + (u < turns % args.users) for u in range(args.users)]
    runs = [
        user(client, mode, f"user {seed}-{u}", n, args, random.Random(seed * 100 + u)) for u, n in enumerate(per_user)
    ]
    for calls in await asyncio.gather(*runs):
        mode.latencies.extend(latency for latency, _ in calls)
        mode.call_ids.extend(call_id for _, call_id in calls)
    mode.turns += turns
    await settle(mode)
    mode.engine_tokens += metrics(args.vllm_url).get("vllm:generation_tokens_total", 0.0) - before


async def measure(args: argparse.Namespace, modes: list[Mode]) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        for mode in modes:  # warm-up, not counted
            await asyncio.gather(*(user(client, mode, f"warm-up {u}", 3, args, random.Random(u)) for u in range(2)))
            await settle(mode)
        per_round = args.turns // args.rounds
        for r in range(args.rounds):
            # Each round in another order: a slow spell of the machine hits every mode alike.
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            for mode in order:
                await block(client, mode, args, per_round, seed=r)


@dataclass
class Recorded:
    """Where a mode's measured calls spent their time (medians, seconds): in the engine, in the gateway before it
    (rendering), and the rest of what the user waited (HTTP, the capture's commit); and the sibling tokens kept."""

    engine: float
    render: float
    rest: float
    sibling_tokens: int


def recorded(mode: Mode) -> Recorded:
    engine = sa.create_engine(mode.db_url)
    calls = sa.text("SELECT id, engine_ms, gateway_ms FROM calls WHERE id IN :ids").bindparams(
        sa.bindparam("ids", expanding=True)
    )
    with engine.connect() as conn:
        rows = {r.id: (r.engine_ms / 1e3, r.gateway_ms / 1e3) for r in conn.execute(calls, {"ids": mode.call_ids})}
        tokens = conn.execute(sa.text("SELECT COALESCE(SUM(completion_len), 0) FROM counterfactuals")).scalar_one()
    engine.dispose()
    split = [(*rows[c], latency - sum(rows[c])) for c, latency in zip(mode.call_ids, mode.latencies, strict=True)]
    engine_s, render_s, rest_s = (statistics.median(column) for column in zip(*split, strict=True))
    return Recorded(engine_s, render_s, rest_s, int(tokens))


def report(policy: str, modes: list[Mode], args: argparse.Namespace) -> None:
    off = statistics.median(modes[0].latencies)
    print(
        f"\nvLLM --scheduling-policy {policy}: {modes[0].turns} live turns per mode from {args.users} users "
        f"(pause {args.think:g} s on average), {args.max_tokens} tokens at most per answer"
    )
    names = [m.name for m in modes]
    print(f"{'':<34}" + "".join(f"{n:>16}" for n in names))

    def row(label: str, values: list[str]) -> None:
        print(f"{label:<34}" + "".join(f"{v:>16}" for v in values))

    def ms(x: float) -> str:
        return f"{x * 1e3:.1f} ms"

    gateway = [metrics(m.url) for m in modes]
    kept = [recorded(m) for m in modes]
    row("live latency p50", [ms(statistics.median(m.latencies)) for m in modes])
    row("live latency p90", [ms(pct(m.latencies, 0.9)) for m in modes])
    row("p50 against off", [f"{statistics.median(m.latencies) / off:.3f}x" for m in modes])
    row("  in the engine, p50", [ms(r.engine) for r in kept])
    row("  rendering, p50", [ms(r.render) for r in kept])
    row("  the rest (HTTP, commit), p50", [ms(r.rest) for r in kept])
    row(
        "siblings drawn / offered",
        [
            f"{g.get('clawgate_counterfactuals_drawn_total', 0):.0f} / {m.k * m.served}"
            for g, m in zip(gateway, modes, strict=True)
        ],
    )
    for reason in DROP_REASONS:
        key = f'clawgate_counterfactuals_dropped_total{{reason="{reason}"}}'
        if any(g.get(key) for g in gateway):
            row(f"  dropped: {reason}", [f"{g.get(key, 0):.0f}" for g in gateway])
    row("vLLM tokens generated per turn", [f"{m.engine_tokens / m.turns:.1f}" for m in modes])
    row(
        "sibling tokens recorded per turn",
        [f"{r.sibling_tokens / max(m.served, 1):.1f}" for r, m in zip(kept, modes, strict=True)],
    )


@contextmanager
def gateways(modes: list[Mode], vllm_url: str, model: Path, tmp: Path) -> Iterator[None]:
    """One gateway process per mode in front of ``vllm_url``, each capturing to its own SQLite file."""
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        for i, mode in enumerate(modes):
            port = free_port()
            mode.url, mode.db_url = f"http://127.0.0.1:{port}", f"sqlite:///{tmp}/gw{i}.db"
            db.upgrade(mode.db_url)
            env = {
                **os.environ,
                "CLAWGATE_ENGINE": "vllm",
                "CLAWGATE_VLLM_URL": vllm_url,
                "CLAWGATE_VLLM_MODEL": "tiny",
                "CLAWGATE_MODEL": str(model),
                "CLAWGATE_SERVED_MODEL_NAME": "tiny",
                "CLAWGATE_DATABASE_URL": mode.db_url,
                "CLAWGATE_PORT": str(port),
                "CLAWGATE_DATA_DIR": f"{tmp}/data{i}",
                "CLAWGATE_LOG_LEVEL": "warning",
                "CLAWGATE_COUNTERFACTUALS": str(mode.k),
                "CLAWGATE_COUNTERFACTUAL_PRIORITY": str(mode.priority),
            }
            mode.process = subprocess.Popen([sys.executable, "-m", "clawgate.cli", "serve"], env=env, cwd=ROOT)
        for mode in modes:
            assert mode.process is not None
            wait_healthy(mode.url + "/health", mode.process, f"gateway {mode.name}", timeout=300)
        yield
    finally:
        for mode in modes:
            if mode.process is not None:
                mode.process.terminate()
                mode.process.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=160, help="measured live turns per mode")
    ap.add_argument("--rounds", type=int, default=8, help="blocks per mode, the modes taking turns")
    ap.add_argument("--users", type=int, default=2, help="simulated users sending at once")
    ap.add_argument("--think", type=float, default=0.3, help="mean pause of a user between its calls, seconds")
    ap.add_argument("--k", type=int, default=3, help="siblings per served turn")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--policies", nargs="+", choices=("fcfs", "priority"), default=["fcfs", "priority"])
    ap.add_argument("--vllm-python", default=None, help="python of a vLLM install (default .venv-vllm)")
    ap.add_argument("--engine-cpus", type=cpus, default=None, help="pin vLLM to these CPUs, e.g. 0 or 0-3")
    ap.add_argument("--gateway-cpus", type=cpus, default=None, help="pin the gateways and the users to these CPUs")
    args = ap.parse_args()
    python = find_vllm_python(args.vllm_python)
    if python is None:
        raise SystemExit("no vLLM interpreter: run ./dev setup-vllm or pass --vllm-python")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny")
        for policy in args.policies:
            modes = [Mode("off", 0), Mode(f"K={args.k} yield", args.k)]
            if policy == "priority":
                modes.append(Mode(f"K={args.k} prio 1", args.k, priority=1))
            print(f"starting vLLM (--scheduling-policy {policy}) ...", file=sys.stderr)
            server = VLLMServer(
                python, model, served_model_name="tiny", max_model_len=4096, extra_args=["--scheduling-policy", policy]
            )
            with pinned(args.engine_cpus):  # the server's processes inherit the CPUs they are started on
                server.start(timeout=900)  # minutes on a busy machine
            args.vllm_url = server.url
            with server, pinned(args.gateway_cpus), gateways(modes, server.url, model, Path(tmp) / policy):
                asyncio.run(measure(args, modes))
                report(policy, modes, args)
    return 0


def cpus(text: str) -> set[int]:
    """``0,2-3`` -> {0, 2, 3}."""
    out: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


@contextmanager
def pinned(cpu_set: set[int] | None) -> Iterator[None]:
    """Run this process (and what it starts meanwhile) on ``cpu_set``; all CPUs when None."""
    if cpu_set is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpu_set)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


if __name__ == "__main__":
    sys.exit(main())
