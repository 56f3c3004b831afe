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
  yields itself: one sibling at a time, started only while no live call runs in this gateway, and abandoned as soon
  as one arrives (the next sibling waits for the next idle moment; the group keeps the siblings drawn whole). The
  engine then serves a sibling beside a live call only until the sibling's next token shows the gateway the live
  call: two decoding steps at most on an engine that schedules a step as the previous one ends.
"""

from __future__ import annotations

import asyncio
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
from gateway.store.counterfactuals import DrawnSibling, NewGroup, record_group
from gateway.store.writer import CallWriter

log = logging.getLogger("clawgate.counterfactuals")

# APIs whose calls are turns of a conversation (the token-level completions API has no judgeable turn).
CONVERSATION_APIS = ("chat", "messages", "responses")
# How long a group waits for its served call's commit before it is given up (the capture is degraded then).
COMMIT_WAIT_S = 10.0
# How long a sibling waits for the gateway to have no live call (priority 0) before the rest of its group is dropped.
IDLE_WAIT_S = 2.0
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
        # Priority 0: one sibling at a time, whatever the number of groups pending. Siblings started together in a gap
        # would each decode slower, rarely finish before the next live call, and all share its first steps.
        self._yielding = asyncio.Lock()

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
        try:
            # The group names the served call: wait for its commit (the writer commits in order).
            if not await self.writer.wait_committed(COMMIT_WAIT_S):
                self.metrics.counterfactuals_dropped.labels("capture").inc(self.k)
                return
            siblings = await self._siblings(prep)
            if not siblings:
                return
            siblings = await asyncio.to_thread(self._read, prep, siblings)
            group = NewGroup(
                prep.call_ids[0],
                prep.rollout_id,
                self.k,
                prep.adapter,
                prep.policy_version,
                self.engine.name,
                siblings,
            )
            if await asyncio.to_thread(record_group, self.db, group):
                self.metrics.counterfactuals_drawn.inc(len(siblings))
            else:
                self.metrics.counterfactuals_dropped.labels("capture").inc(len(siblings))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a database fault: the served turn trains with the batch baseline instead
            log.warning("counterfactual group of %s not recorded: %s", prep.call_ids[0], exc)
            self.metrics.counterfactuals_dropped.labels("error").inc(len(siblings) or self.k)
        finally:
            self.pending -= 1

    async def _siblings(self, prep: PlannedCall) -> list[DrawnSibling]:
        """Draw the siblings one after the other. One that a live call cuts short is dropped and the next waits for
        the gateway to be idle again; a fault, or no idle moment within IDLE_WAIT_S, drops the rest."""
        out: list[DrawnSibling] = []
        for i in range(self.k):
            reason = None
            try:
                if self.priority == 0:
                    async with self._yielding:
                        if await self._wait_idle():
                            out.append(await self._one(prep, i))
                        else:
                            reason = "busy"
                else:
                    out.append(await self._one(prep, i))
            except _Preempted:
                reason = "preempted"
            except Exception as exc:
                log.warning("counterfactual draw for %s failed: %s", prep.call_ids[0], exc)
                reason = "error"
            if reason == "preempted":  # this one is lost; the next waits for the next idle moment
                self.metrics.counterfactuals_dropped.labels(reason).inc()
            elif reason is not None:
                self.metrics.counterfactuals_dropped.labels(reason).inc(self.k - i)
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

    async def _wait_idle(self) -> bool:
        """Whether the gateway had no live call within IDLE_WAIT_S."""
        loop = asyncio.get_running_loop()
        until = loop.time() + IDLE_WAIT_S
        while self.live() > 0:
            if loop.time() >= until:
                return False
            await asyncio.sleep(IDLE_POLL_S)
        return True

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
