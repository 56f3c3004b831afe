"""Counterfactual siblings do not slow live calls: on an engine shared by every request, whose decoding step takes
longer the more requests it batches, live p50 latency with K=3 siblings drawn per turn stays within 10% of the
latency without them, while siblings are drawn in the gaps between live calls.

Three gateways serve the same live traffic side by side (one client loop each, at the same time, so a slow spell of
the machine hits them alike): counterfactuals off, on (the gateway yields: priority 0), and on with the yielding
disabled — the control, which shows that siblings drawn beside live calls would hurt on this engine.
(``bench/counterfactual_latency.py`` measures the same on a vLLM CPU server.)"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.engines.base import GenerationEnd, GenerationEvent, GenerationRequest, TokenDelta
from gateway.store.db import connect
from gateway.store.models import Counterfactual
from tests.fakes import ScriptedEngine

K = 3
LIVE_CALLS = 40
WARMUP_CALLS = 3
TOKENS = 32  # per answer, the end-of-turn token included
STEP_S = 0.0015  # a decoding step's fixed cost ...
PER_REQUEST_S = 0.0015  # ... plus this per request in the batch: 3 ms alone, 4.5 ms beside one more request
GAP_S = (0.10, 0.20)  # a client's pause between calls (a harness running its tools), uniform in this range


@dataclass
class _Slot:
    tokens: asyncio.Queue[None]
    left: int


class BatchedEngine(ScriptedEngine):
    """One model shared by every request, decoded in steps as a continuous-batching server does: a step gives one
    token to each request running when it began and lasts STEP_S + PER_REQUEST_S per request, so every request in a
    batch is slower than it would be alone. A request that arrives during a step waits for the next one.

    Counts, for each counterfactual sibling (request id ``cf-…``), the steps it shared with a live call."""

    name = "batched"

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.word = tokenizer.encode(" sea", add_special_tokens=False)[0]
        self.running: dict[str, _Slot] = {}
        self.shared_steps: Counter[str] = Counter()
        self.siblings: set[str] = set()
        self._wake: asyncio.Event | None = None
        self._stepper: asyncio.Task[None] | None = None

    async def close(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        n = min(TOKENS, request.params.max_tokens)
        slot = _Slot(asyncio.Queue(), n)
        rid = request.request_id
        if rid.startswith("cf-"):
            self.siblings.add(rid)
        if self._stepper is None:
            self._wake = asyncio.Event()
            self._stepper = asyncio.get_running_loop().create_task(self._steps())
        assert self._wake is not None
        self.running[rid] = slot
        self._wake.set()
        try:
            for i in range(n):
                await slot.tokens.get()
                yield TokenDelta([self.end_id if i == n - 1 else self.word], [-0.5])
            yield GenerationEnd("stop", self.end_id, len(request.prompt_ids))
        finally:
            self.running.pop(rid, None)  # closed early: it leaves the batch at the next step

    async def _steps(self) -> None:
        assert self._wake is not None
        while True:
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
            batch = list(self.running.items())
            if any(not rid.startswith("cf-") for rid, _ in batch):
                self.shared_steps.update(rid for rid, _ in batch if rid.startswith("cf-"))
            await asyncio.sleep(STEP_S + PER_REQUEST_S * len(batch))
            for rid, slot in batch:
                if self.running.get(rid) is not slot:
                    continue  # aborted during the step
                slot.tokens.put_nowait(None)
                slot.left -= 1
                if slot.left == 0:
                    del self.running[rid]


def metric(gw: Any, line_start: str) -> float:
    for line in httpx.get(gw.url + "/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    return 0.0


async def live_traffic(gw: Any, name: str, gaps: list[float]) -> list[float]:
    """One client's calls, one after the other with a pause between them: each call's latency (warm-up excluded)."""
    latencies = []
    async with httpx.AsyncClient(timeout=60) as client:
        for i, gap in enumerate(gaps):
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"{name}: question {i}?"}],
                "max_tokens": 64,
                "temperature": 1.0,
            }
            t0 = asyncio.get_running_loop().time()
            r = await client.post(gw.v1 + "/chat/completions", json=body)
            elapsed = asyncio.get_running_loop().time() - t0
            assert r.status_code == 200, r.text
            if i >= WARMUP_CALLS:
                latencies.append(elapsed)
            await asyncio.sleep(gap)
    return latencies


def settle(gw: Any) -> None:
    drawer = gw.state.service.counterfactuals
    asyncio.run_coroutine_threadsafe(drawer.idle(), gw.loop).result(timeout=60)
    gw.flush()


def test_live_p50_latency_under_counterfactual_load_is_within_10_percent(gateway_factory, tiny_tokenizer):
    engines = {name: BatchedEngine(tiny_tokenizer) for name in ("off", "yielding", "control")}
    gateways = {
        "off": gateway_factory(engine=engines["off"], tokenizer=tiny_tokenizer),
        "yielding": gateway_factory(engine=engines["yielding"], tokenizer=tiny_tokenizer, counterfactuals=K),
        "control": gateway_factory(engine=engines["control"], tokenizer=tiny_tokenizer, counterfactuals=K),
    }
    # The control draws its siblings as if no live call ever ran: without waiting for a gap, and to the end.
    gateways["control"].state.service.counterfactuals.live = lambda: 0
    rng = random.Random(0)
    gaps = [rng.uniform(*GAP_S) for _ in range(WARMUP_CALLS + LIVE_CALLS)]

    async def side_by_side() -> list[list[float]]:
        return list(await asyncio.gather(*(live_traffic(gw, name, gaps) for name, gw in gateways.items())))

    off, yielding, control = (statistics.median(lat) for lat in asyncio.run(side_by_side()))
    for name in ("yielding", "control"):
        settle(gateways[name])
    report = f"live p50: off {off * 1e3:.1f} ms, yielding {yielding * 1e3:.1f} ms, control {control * 1e3:.1f} ms"

    assert control > 1.2 * off, f"siblings beside live calls slow them down on this engine ({report})"
    assert yielding <= 1.10 * off, report

    gw, engine = gateways["yielding"], engines["yielding"]
    drawn = metric(gw, "clawgate_counterfactuals_drawn_total")
    db = connect(gw.settings.database_url)
    with Session(db) as session:
        stored = session.scalar(sa.select(sa.func.count()).select_from(Counterfactual)) or 0
    db.dispose()
    # A sibling starts only while no live call runs: those drawn were drawn in the gaps.
    assert drawn == stored >= LIVE_CALLS / 2, f"siblings are drawn in the gaps between live calls ({drawn} drawn)"
    print(f"{report}; {drawn:.0f} siblings drawn whole for {LIVE_CALLS + WARMUP_CALLS} turns")
    preempted = metric(gw, 'clawgate_counterfactuals_dropped_total{reason="preempted"}')
    assert preempted > 0, "a live call arriving cuts a sibling short"
    # A sibling sees a live call that arrived when its next token comes, and leaves the batch; by then the engine has
    # scheduled the step after it. So it shares two steps with a live call at most (one that had just started when
    # the live call arrived has no token before the end of its first step); the control shares whole answers.
    assert len(engine.siblings) >= LIVE_CALLS, "siblings ran in the gaps"
    assert max(engine.shared_steps.values(), default=0) <= 2, engine.shared_steps.most_common(3)
    assert max(engines["control"].shared_steps.values()) >= TOKENS / 4, "the control shares much of its answers"
