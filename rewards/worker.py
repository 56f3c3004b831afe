"""The reward worker (`clawgate judge`): every turn of everyday traffic, once its next state is known (or its
rollout closed), goes through the reward functions and the LLM judge, and gets one recorded verdict.

The loop looks for judgeable turns (``judgements.candidates``, in the store), claims up to ``concurrency`` of them
and processes each on its own task:

1. read the turn from the store and decode it (``turns.load_turn``, on a thread);
2. call each reward function (on a thread);
3. ask the judge (``judge.Judge.score``), at most ``concurrency`` calls at once, each with a timeout;
4. record the verdict and all rewards in one transaction (``judgements.finish``), or give the turn back.

Failures:

- the judge is unreachable (outage): the turn goes back without counting an attempt, the worker stops claiming
  for a backoff that doubles up to ``max_backoff``, and it logs one line when the outage starts, a reminder per
  minute, and one line when it ends. Turns wait; nothing is lost or judged twice;
- an answer without a usable score, or a request the judge refuses: counted (``stats``) and logged; the turn is
  retried until ``max_attempts``, then recorded ``unparseable`` / ``failed`` without a judge reward (the
  functions' rewards are kept);
- a reward function that raises: logged with the turn, no reward from it, the rest goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from gateway.faults import Fault, describe
from gateway.store import counterfactuals, judgements
from rewards.functions import RewardFunction, RewardFunctionError
from rewards.judge import Judge, JudgeError, JudgeResult, UnparseableAnswer, Usage
from rewards.turns import Decode, Limits, TurnView, load_group, load_turn

log = logging.getLogger("clawgate.judge")
JUDGE_SOURCE = "judge"


@dataclass(slots=True)
class WorkerConfig:
    concurrency: int = 4
    max_attempts: int = 3
    interval: float = 1.0  # seconds between looks when nothing was judgeable
    lease: float = 300.0  # seconds a claim is held before another worker may take the turn
    min_backoff: float = 1.0
    max_backoff: float = 60.0
    retry_delay: float = 1.0  # before another attempt at a turn whose answer was unusable
    limits: Limits = field(default_factory=Limits)
    max_staleness: int | None = None


@dataclass(slots=True)
class WorkerStats:
    verdicts: int = 0  # turns with a final verdict recorded by this worker
    judged: int = 0  # of which the judge scored
    score_sum: float = 0.0
    unparseable_answers: int = 0  # answers without a usable score (each one, retried or not)
    given_up: int = 0  # turns recorded unparseable or failed
    outages: int = 0  # judge calls that failed for the judge's own reasons
    function_errors: int = 0
    lost_claims: int = 0  # verdicts another worker recorded first (a lease ran out)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    judge_seconds: float = 0.0
    groups_judged: int = 0  # counterfactual groups scored (served answer and siblings, without next state)

    @property
    def mean_score(self) -> float | None:
        return self.score_sum / self.judged if self.judged else None

    def add_usage(self, usage: Usage | None) -> None:
        if usage is None:
            return
        self.prompt_tokens += usage.prompt_tokens or 0
        self.completion_tokens += usage.completion_tokens or 0
        self.cost_usd += usage.cost_usd or 0.0
        self.judge_seconds += usage.seconds


class JudgeUnavailable(RuntimeError):
    """``run_once`` met a judge outage: the turns it could not judge are left for a later run."""


class RewardWorker:
    def __init__(
        self,
        db: sa.Engine,
        decode: Decode,
        *,
        judge: Judge | None = None,
        functions: list[RewardFunction] | None = None,
        config: WorkerConfig | None = None,
    ) -> None:
        if judge is None and not functions:
            raise ValueError("the reward worker needs a judge model or a reward function")
        self.db = db
        self.decode = decode
        self.judge = judge
        self.functions = list(functions or [])
        self.config = config or WorkerConfig()
        self.stats = WorkerStats()
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        self._resume_at = 0.0
        self._backoff = self.config.min_backoff
        self._outage = Fault(log, "judge unreachable")
        self._store_fault = Fault(log, "judge: cannot read or claim turns in the database")

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def run(self, stop: asyncio.Event) -> None:
        """Judge until ``stop`` is set, then let the turns in flight finish."""
        try:
            while not stop.is_set():
                try:
                    started = await self.poll()
                except Exception as error:  # the database is down: the turns are all there when it is back
                    self._store_fault.failed(describe(error), exc_info=error)
                    started = 0
                    self._resume_at = time.monotonic() + self._backoff
                    self._backoff = min(self._backoff * 2, self.config.max_backoff)
                else:
                    if self._store_fault.active:
                        self._store_fault.cleared()
                        self._backoff = self.config.min_backoff
                wait = self._resume_at - time.monotonic() if self._paused else 0.0
                if not started:
                    wait = max(wait, self.config.interval)
                if wait > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), wait)
                elif self.in_flight >= self.config.concurrency:
                    await asyncio.wait(list(self._in_flight.values()), return_when=asyncio.FIRST_COMPLETED)
        finally:
            await self.drain()

    async def run_once(self) -> int:
        """Judge every turn judgeable now (retries included) and return the verdicts recorded.

        Raises ``JudgeUnavailable`` when the judge cannot be reached (the turns stay for a later run).
        """
        before = self.stats.verdicts
        while True:
            if self._outage.active:
                await self.drain()
                raise JudgeUnavailable(self._outage.last_error or "the judge cannot be reached")
            started = await self.poll()
            if not started and not self._in_flight:
                pending = await asyncio.to_thread(judgements.backlog, self.db, max_staleness=self.config.max_staleness)
                if not pending:
                    return self.stats.verdicts - before
                await asyncio.sleep(min(self.config.retry_delay, 0.2))
                continue
            if self._in_flight:
                await asyncio.wait(list(self._in_flight.values()), return_when=asyncio.FIRST_COMPLETED)

    async def drain(self) -> None:
        if self._in_flight:
            await asyncio.gather(*self._in_flight.values(), return_exceptions=True)

    async def aclose(self) -> None:
        """Let the turns in flight finish and release the judge's resources."""
        await self.drain()
        if self.judge is not None:
            await self.judge.aclose()

    @property
    def _paused(self) -> bool:
        return time.monotonic() < self._resume_at

    async def poll(self) -> int:
        """Claim judgeable turns up to the concurrency limit and start them; returns how many started."""
        room = self.config.concurrency - len(self._in_flight)
        if room <= 0 or self._paused:
            return 0
        found = await asyncio.to_thread(
            judgements.candidates,
            self.db,
            room * 2,
            exclude=set(self._in_flight),
            max_staleness=self.config.max_staleness,
        )
        rollout_of = dict(found[:room])
        token = secrets.token_hex(16)  # one claim token for the batch; a verdict is recorded per (turn, token)
        taken = await asyncio.to_thread(
            judgements.claim_many, self.db, list(rollout_of.items()), token, self.config.lease
        )
        for call_id, attempts in taken.items():  # the others another worker holds
            rollout_id = rollout_of[call_id]
            task = asyncio.create_task(self._process(call_id, rollout_id, token, attempts), name=f"judge-{call_id}")
            self._in_flight[call_id] = task
            task.add_done_callback(self._forget)
        return len(taken)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._in_flight.pop(task.get_name().removeprefix("judge-"), None)

    async def _process(self, call_id: str, rollout_id: str, token: str, attempts: int) -> None:
        try:
            await self._judge_turn(call_id, rollout_id, token, attempts)
        except Exception as error:
            # The database going away mid-turn (or a bug): the claim's lease runs out and the turn is tried again.
            self._store_fault.failed(f"turn {call_id}: {describe(error)}; retried when its claim expires", error)

    async def _judge_turn(self, call_id: str, rollout_id: str, token: str, attempts: int) -> None:
        try:
            turn = await asyncio.to_thread(load_turn, self.db, call_id, self.decode, self.config.limits)
        except LookupError as error:
            await self._finish(call_id, rollout_id, token, "failed", [], error=str(error))
            return
        if not await self._judge_group(call_id, token, turn):
            return
        rewards, errors = await self._call_functions(call_id, turn)
        if self.judge is None:
            await self._finish(call_id, rollout_id, token, "done", rewards, error="; ".join(errors) or None)
            return
        result = await self._score(self.judge, turn, call_id, rollout_id, token, attempts, rewards)
        if result is not None:
            await self._record_judged(call_id, rollout_id, token, turn, result, rewards, errors)

    async def _judge_group(self, call_id: str, token: str, turn: TurnView) -> bool:
        """Score the turn's counterfactual group, if it has one not scored yet (``turns.load_group``: all answers on the
        context alone), before the turn's own verdict, so no turn is ready to train before its group's scores exist.
        A member's score is the judge's plus the reward functions'. False: the judge was unreachable, the turn was
        given back and waits like any other."""
        views = await asyncio.to_thread(load_group, self.db, turn, self.decode, self.config.limits)
        if not views:
            return True
        scores: list[float | None] = []
        for view in views:
            rewards, _ = await self._call_functions(view.call_id, view)
            total: float | None = sum(r.value for r in rewards) if rewards else None
            if self.judge is not None:
                try:
                    result = await self.judge.score(view)
                except UnparseableAnswer as error:
                    self.stats.add_usage(error.usage)
                    total = None
                except JudgeError as error:
                    if error.kind == "outage":
                        self._judge_down(str(error))
                        await asyncio.to_thread(
                            judgements.release, self.db, call_id, token, retry_in=0.0, attempt=False, error=str(error)
                        )
                        return False
                    total = None
                else:
                    self.stats.add_usage(result.usage)
                    total = (total or 0.0) + result.verdict.score
            scores.append(total)
        siblings = {
            v.call_id: counterfactuals.SiblingScore(score)
            for v, score in zip(views[1:], scores[1:], strict=True)
            if score is not None
        }
        await asyncio.to_thread(counterfactuals.record_scores, self.db, call_id, scores[0], siblings)
        self.stats.groups_judged += 1
        return True

    async def _call_functions(self, call_id: str, turn: TurnView) -> tuple[list[judgements.NewReward], list[str]]:
        """Each reward function's reward of the turn, and the errors of those that raised."""
        rewards: list[judgements.NewReward] = []
        errors: list[str] = []
        for fn in self.functions:
            try:
                got = await asyncio.to_thread(fn, turn)
            except Exception as error:  # the user's code: report it with the turn, never stop the worker
                self.stats.function_errors += 1
                text = error.args[0] if isinstance(error, RewardFunctionError) else f"{type(error).__name__}: {error}"
                log.warning("turn %s: reward function %s failed: %s", call_id, fn.spec, text)
                errors.append(f"{fn.spec}: {text}")
                continue
            if got is not None:
                rewards.append(judgements.NewReward(got.value, fn.source, got.details))
        return rewards, errors

    async def _score(
        self,
        judge: Judge,
        turn: TurnView,
        call_id: str,
        rollout_id: str,
        token: str,
        attempts: int,
        rewards: list[judgements.NewReward],
    ) -> JudgeResult | None:
        """The judge's result, or None when there is none: the turn was given back (outage) or its attempt failed."""
        try:
            return await judge.score(turn)
        except UnparseableAnswer as error:
            self.stats.unparseable_answers += 1
            self.stats.add_usage(error.usage)
            log.warning("turn %s: unparseable judge answer (%s): %r", call_id, error, error.answer[:200])
            await self._turn_failed(call_id, rollout_id, token, attempts, "unparseable", rewards, str(error))
            return None
        except JudgeError as error:
            if error.kind == "outage":
                self._judge_down(str(error))
                await asyncio.to_thread(
                    judgements.release, self.db, call_id, token, retry_in=0.0, attempt=False, error=str(error)
                )
                return None
            log.warning("turn %s: the judge refused the request: %s", call_id, error)
            await self._turn_failed(call_id, rollout_id, token, attempts, "failed", rewards, str(error))
            return None

    async def _record_judged(
        self,
        call_id: str,
        rollout_id: str,
        token: str,
        turn: TurnView,
        result: JudgeResult,
        rewards: list[judgements.NewReward],
        errors: list[str],
    ) -> None:
        """Record the judge's verdict with the functions' rewards, and count it when this claim recorded it."""
        self._judge_up()
        usage = result.usage
        self.stats.add_usage(usage)
        details: dict[str, Any] = {
            "reason": result.verdict.reason,
            "model": usage.model,
            "had_next_state": turn.has_next_state,
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cost_usd": usage.cost_usd,
            "seconds": round(usage.seconds, 3),
        }
        rewards.append(judgements.NewReward(result.verdict.score, JUDGE_SOURCE, details))
        recorded = await self._finish(
            call_id,
            rollout_id,
            token,
            "done",
            rewards,
            score=result.verdict.score,
            reason=result.verdict.reason,
            model=usage.model,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cost_usd=usage.cost_usd,
            had_next_state=turn.has_next_state,
            error="; ".join(errors) or None,
        )
        if recorded:
            self.stats.judged += 1
            self.stats.score_sum += result.verdict.score

    async def _turn_failed(
        self,
        call_id: str,
        rollout_id: str,
        token: str,
        attempts: int,
        status: str,
        rewards: list[judgements.NewReward],
        error: str,
    ) -> None:
        """An attempt that was the turn's fault: retry it, or record it without a judge reward after the last."""
        self._judge_up()
        if attempts + 1 >= self.config.max_attempts:
            self.stats.given_up += 1
            log.warning("turn %s: no usable judge answer after %d attempts; recorded %s", call_id, attempts + 1, status)
            await self._finish(call_id, rollout_id, token, status, rewards, attempt=True, error=error)
            return
        await asyncio.to_thread(
            judgements.release, self.db, call_id, token, retry_in=self.config.retry_delay, attempt=True, error=error
        )

    async def _finish(
        self, call_id: str, rollout_id: str, token: str, status: str, rewards: list[judgements.NewReward], **fields: Any
    ) -> bool:
        recorded = await asyncio.to_thread(
            judgements.finish, self.db, call_id, rollout_id, token, status=status, rewards=rewards, **fields
        )
        if recorded:
            self.stats.verdicts += 1
        else:
            self.stats.lost_claims += 1
            log.warning("turn %s: another worker recorded its verdict first (this claim had expired)", call_id)
        return recorded

    def _judge_down(self, error: str) -> None:
        self.stats.outages += 1
        self._outage.failed(error)
        self._resume_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.config.max_backoff)

    def _judge_up(self) -> None:
        self._outage.cleared()
        self._backoff = self.config.min_backoff

    def describe(self) -> str:
        s = self.stats
        mean = "n/a" if s.mean_score is None else f"{s.mean_score:.3f}"
        cost = "unknown" if not s.cost_usd else f"${s.cost_usd:.4f}"
        return (
            f"{s.verdicts} verdicts ({s.judged} judged, mean score {mean}); {s.unparseable_answers} unparseable "
            f"answers, {s.given_up} given up, {s.function_errors} function errors, {s.outages} failed calls; "
            f"tokens {s.prompt_tokens:,} in + {s.completion_tokens:,} out, cost {cost}; {self.in_flight} in flight"
        )


__all__ = ["JUDGE_SOURCE", "JudgeUnavailable", "RewardWorker", "WorkerConfig", "WorkerStats"]
