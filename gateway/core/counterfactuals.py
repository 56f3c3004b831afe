"""Counterfactual siblings: more answers to a served turn's exact prompt, drawn off the critical path.

Everyday traffic gives one answer per prompt, so its turns can only be compared with answers to *other* prompts (a
batch baseline). After a served turn was recorded and answered, ``Counterfactuals.offer`` draws ``k`` more answers to
the same prompt ids, with the same sampling settings and adapter (so the same policy version), and records them as the
turn's siblings (``gateway/store/counterfactuals.py``); the judge scores the group and the trainer normalizes its
rewards within it (GRPO), as for a task's rollouts.

A sibling is never returned to a client, registered in the session index or written as a call: nothing that
serves, splices or links conversations can reach it. It is read as its served call would have been: the served
call's output parser reads its tokens (content, reasoning, tool calls; a call-only answer finishes "tool_calls"),
and the credential scan finds what it holds (token spans the judge redacts and the trainer leaves out; with
``secrets=drop`` the tokens and text are removed before anything is stored).

Live traffic first:

- a cap on the groups pending (drawn or waiting) at once: a turn offered beyond it gets none, counted as dropped,
  so the background work never queues without bound;
- with ``priority`` > 0 the siblings go to the engine with that request priority (vLLM under
  ``--scheduling-policy priority`` schedules them after live calls and preempts them first);
- with ``priority`` 0 (the local engine, or vLLM under its default FCFS policy, which refuses priorities) the gateway
  yields itself: one group at a time, its siblings started together (one batch over the shared prompt: on the local
  engine 7 answers take 3x the time of one, not 7x) only while no live call runs in this gateway, and abandoned as
  soon as one arrives; those cut short are drawn again in the next idle moment, in a batch half as large (doubling
  again after each batch drawn whole, so batches fit the gaps live traffic leaves), and the group keeps the siblings
  drawn whole. The engine then serves siblings beside a live call only until their next token shows the
  gateway the live call: two decoding steps at most on an engine that schedules a step as the previous one ends.

The group is opened in the store when its draw starts and closed when its siblings are recorded, by
``DRAW_DEADLINE_S`` at the latest (siblings not drawn by then are dropped as ``late``): the reward worker judges a turn
whose group is open only once it is closed, so the served answer and its siblings are scored together.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import sqlalchemy as sa

from gateway.core.job import PlannedCall
from gateway.core.parsers.base import ParsedOutput
from gateway.engines.base import Engine, GenerationEnd, GenerationRequest
from gateway.ids import new_id
from gateway.metrics import Metrics
from gateway.store.counterfactuals import DrawnSibling, NewGroup, close_group, open_group, record_group
from gateway.store.writer import CallWriter

log = logging.getLogger("clawgate.counterfactuals")

# APIs whose calls are turns of a conversation (the token-level completions API has no judgeable turn).
CONVERSATION_APIS = ("chat", "messages", "responses")
# How long a group waits for its served call's commit before it is given up (the capture is degraded then).
COMMIT_WAIT_S = 10.0
# How long a group's draw waits for the gateway to have no live call (priority 0) before the rest is dropped.
IDLE_WAIT_S = 2.0
# How long a group may take to be drawn: its turn's judge waits for it until then.
DRAW_DEADLINE_S = 30.0
IDLE_POLL_S = 0.02

# The served call's output parser over an answer's ids (``Service.parse_answer``).
Parse = Callable[[PlannedCall, list[int]], ParsedOutput]
# The credential scan of an answer (``gateway.credentials.tokens.AnswerScanner``): (ids, message) -> (ids, message,
# (kind, start, end) token spans), the ids and message without the credentials under ``secrets=drop``.
Scan = Callable[[list[int], Any], tuple[list[int], Any, list[tuple[str, int, int]]]]


class _Preempted(Exception):
    """A live call arrived while a sibling was drawn."""


class Counterfactuals:
    """Draws and records counterfactual siblings of served turns (see the module docstring)."""

    def __init__(
        self,
        *,
        engine: Engine,
        writer: CallWriter,
        db: sa.Engine,
        metrics: Metrics,
        k: int,
        share: float = 1.0,
        max_pending: int = 4,
        priority: int = 0,
        live: Callable[[], int] = lambda: 0,
        adapters_in_use: Counter[str] | None = None,
        rng: random.Random | None = None,
        parse: Parse | None = None,
        scan: Scan | None = None,
    ) -> None:
        self.engine = engine
        self.writer = writer
        self.db = db
        self.metrics = metrics
        self.k = k
        self.share = share
        self.max_pending = max_pending
        self.priority = priority
        self.live = live  # live calls generating in this gateway now
        # The service's count of calls per adapter: a version is not unloaded while a sibling is drawn through it.
        self.adapters_in_use: Counter[str] = adapters_in_use if adapters_in_use is not None else Counter()
        self.rng = rng or random.Random()
        self.parse = parse
        self.scan = scan  # None: credentials are not looked for (``secrets=off``)
        self.pending = 0
        self._tasks: set[asyncio.Task[None]] = set()
        # Priority 0: one group at a time, whatever the number of groups pending. Several groups started together in a
        # gap would each decode slower, rarely finish before the next live call, and all share its first steps.
        self._yielding = asyncio.Lock()
        # Priority 0: how many of a group's siblings start together. All of them (one batch over the shared prompt
        # costs a batching engine far less than as many answers one by one) until a live call cuts a batch short;
        # then half as many, doubling again after each batch drawn whole, so batches fit the gaps live traffic leaves.
        self._batch = k

    def eligible(self, prep: PlannedCall) -> bool:
        """A turn of everyday traffic whose answer can be compared: a conversation API, no grammar (its logprobs are
        a masked distribution's and never trained on), an implicit conversation or a harness session (a rollout the
        client named may be a task run, trained as a whole, or an evaluation pinned to a version)."""
        job = prep.job
        return (
            self.k > 0
            and job.api in CONVERSATION_APIS
            and job.prompt_ids is None
            and (job.rollout.id is None or job.rollout.kind == "session")
            and job.rollout.policy_version is None
            and prep.params.constraint is None
        )

    def offer(self, prep: PlannedCall, index: int) -> None:
        """A served choice was recorded: draw its siblings in the background, if it is drawn for and there is room."""
        if index != 0 or not self.eligible(prep) or self.rng.random() >= self.share:
            return
        if self.pending >= self.max_pending:
            self.metrics.counterfactuals_dropped.labels("cap").inc(self.k)
            return
        self.pending += 1
        task = asyncio.get_running_loop().create_task(self._draw(prep))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def idle(self) -> None:
        """Wait until every group offered so far was drawn and recorded (or dropped)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _draw(self, prep: PlannedCall) -> None:
        siblings: list[DrawnSibling] = []
        call_id = prep.call_ids[0]
        opened = False
        try:
            # The group names the served call: wait for its commit (the writer commits in order).
            if not await self.writer.wait_committed(COMMIT_WAIT_S):
                self.metrics.counterfactuals_dropped.labels("capture").inc(self.k)
                return
            until = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=DRAW_DEADLINE_S)
            opened = await asyncio.to_thread(open_group, self.db, call_id, prep.rollout_id, self.k, until)
            if not opened:
                self.metrics.counterfactuals_dropped.labels("capture").inc(self.k)
                return
            deadline = asyncio.get_running_loop().time() + DRAW_DEADLINE_S - 1.0  # a second left to record them
            siblings = await self._siblings(prep, deadline)
            if not siblings:
                return
            siblings = await asyncio.to_thread(self._read, prep, siblings)
            group = NewGroup(
                call_id, prep.rollout_id, self.k, prep.adapter, prep.policy_version, self.engine.name, siblings
            )
            if await asyncio.to_thread(record_group, self.db, group):
                self.metrics.counterfactuals_drawn.inc(len(siblings))
            else:  # the turn was judged without them (the draw outlasted its deadline)
                self.metrics.counterfactuals_dropped.labels("late").inc(len(siblings))
            opened = False
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a database fault: the served turn trains with the batch baseline instead
            log.warning("counterfactual group of %s not recorded: %s", call_id, exc)
            self.metrics.counterfactuals_dropped.labels("error").inc(len(siblings) or self.k)
        finally:
            self.pending -= 1
            if opened:  # nothing to record: let the judge go on without waiting for the deadline
                await self._close(call_id)

    async def _close(self, call_id: str) -> None:
        try:
            await asyncio.to_thread(close_group, self.db, call_id)
        except Exception as exc:  # the deadline closes it
            log.warning("counterfactual group of %s not closed: %s", call_id, exc)

    async def _siblings(self, prep: PlannedCall, deadline: float) -> list[DrawnSibling]:
        """Draw the group's siblings, all at once under a priority; under priority 0 in batches that start in idle
        moments, those a live call cuts short drawn again in the next. A fault, no idle moment within IDLE_WAIT_S, or
        the deadline drops the rest."""
        out: list[DrawnSibling] = []
        todo = list(range(self.k))
        loop = asyncio.get_running_loop()
        while todo:
            if loop.time() >= deadline:
                self.metrics.counterfactuals_dropped.labels("late").inc(len(todo))
                break
            if self.priority == 0:
                async with self._yielding:
                    busy = await self._wait_idle(deadline)
                    if busy is not None:
                        self.metrics.counterfactuals_dropped.labels(busy).inc(len(todo))
                        break
                    batch, todo = todo[: self._batch], todo[self._batch :]
                    results = await asyncio.gather(*(self._one(prep, i) for i in batch), return_exceptions=True)
            else:
                batch, todo = todo, []
                results = await asyncio.gather(*(self._one(prep, i) for i in batch), return_exceptions=True)
            again: list[int] = []
            failed: BaseException | None = None
            for i, result in zip(batch, results, strict=True):
                if isinstance(result, DrawnSibling):
                    out.append(result)
                elif isinstance(result, _Preempted):
                    self.metrics.counterfactuals_dropped.labels("preempted").inc()
                    again.append(i)
                elif isinstance(result, asyncio.CancelledError):
                    raise result
                else:
                    failed = result
                    again.append(i)
            if self.priority == 0:  # fit the batches to the gaps live traffic leaves
                self._batch = max(1, len(batch) // 2) if again else min(self.k, 2 * self._batch)
            todo = again + todo
            if failed is not None:
                log.warning("counterfactual draw for %s failed: %s", prep.call_ids[0], failed)
                self.metrics.counterfactuals_dropped.labels("error").inc(len(todo))
                break
        return out

    def _read(self, prep: PlannedCall, siblings: list[DrawnSibling]) -> list[DrawnSibling]:
        """Each sibling as its served call would have been read: parsed, and scanned for credentials."""
        out = []
        for s in siblings:
            ids, finish, message = s.completion_ids, s.finish_reason, None
            if self.parse is not None:
                output = self.parse(prep, ids)
                message = {
                    "content": output.content,
                    "reasoning": output.reasoning,
                    "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in output.tool_calls],
                }
                if output.tool_calls and finish == "stop":
                    finish = "tool_calls"
            spans = None
            if self.scan is not None:
                ids, message, spans = self.scan(ids, message)
            out.append(replace(s, completion_ids=ids, finish_reason=finish, message=message, secret_spans=spans))
        return out

    async def _wait_idle(self, deadline: float) -> str | None:
        """None once the gateway has no live call; else why it gave up: "busy" (none within IDLE_WAIT_S) or "late"
        (the group's deadline came first)."""
        loop = asyncio.get_running_loop()
        until = min(loop.time() + IDLE_WAIT_S, deadline)
        while self.live() > 0:
            if loop.time() >= until:
                return "late" if until == deadline else "busy"
            await asyncio.sleep(IDLE_POLL_S)
        return None

    async def _one(self, prep: PlannedCall, i: int) -> DrawnSibling:
        params = prep.params
        # A seeded call would draw its own answer again: the siblings take the seeds after the choices' (``n``).
        if params.seed is not None:
            params = replace(params, seed=params.seed + prep.job.n + i)
        sibling_id = new_id("cf")
        request = GenerationRequest(
            sibling_id,
            list(prep.prompt_ids),
            replace(params, top_logprobs=0),
            prep.adapter,
            # Streamed under priority 0, so a live call that arrives is seen between tokens.
            stream=self.priority == 0,
            session_id=prep.rollout_id,
            priority=self.priority,
        )
        ids: list[int] = []
        logprobs: list[float] = []
        end: GenerationEnd | None = None
        adapter = prep.adapter
        if adapter is not None:
            self.adapters_in_use[adapter] += 1
        stream = self.engine.generate(request)
        try:
            async for event in stream:
                if isinstance(event, GenerationEnd):
                    end = event
                    continue
                ids.extend(event.token_ids)
                logprobs.extend(event.logprobs)
                if self.priority == 0 and self.live() > 0:
                    raise _Preempted
        finally:
            await stream.aclose()  # aborts the generation when it was cut short
            if adapter is not None:
                self.adapters_in_use[adapter] -= 1
        if end is None:
            raise RuntimeError("the engine ended the sibling without a finish reason")
        return DrawnSibling(sibling_id, ids, logprobs, end.finish_reason)


__all__ = ["Counterfactuals"]
