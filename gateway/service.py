"""The protocol-independent serving core: prepare a prompt, run the engine, parse, capture.

Every public API (chat completions, completions, Anthropic messages, responses; see ``gateway/serving``)
translates its request into a ``ChatJob``, calls ``ChatService.prepare`` and then iterates
``ChatService.run_choice`` for each of its ``n`` choices, translating the ``ChoiceDelta``s and the final
``ChoiceResult`` back into its own wire format. So rendering, TITO splicing, parsing, capture and rollout grouping
behave identically whichever API is used. The service knows no protocol's field names: a job carries what it
needs. Token-level work a protocol asks for (raw prompts, token texts for logprobs) runs here too, off the event
loop when it is large.

Capture invariant: every choice that reached the engine is recorded exactly once — ``ok`` with its tokens,
``failed`` with the error, or ``cancelled`` (client went away) with the tokens produced so far — from the
``finally`` of ``run_choice``. Only ``ok`` calls are registered for splicing, and only ``ok`` calls are trainable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from gateway.continuity import Continuity
from gateway.conversation import Message, ToolCall, exact_hash, extend_hash, output_hash
from gateway.detokenize import IncrementalDetokenizer
from gateway.engines.base import Engine, GenerationEnd, GenerationRequest, TokenDelta
from gateway.errors import APIError, ContextTooLong, EngineError, EngineUnavailable
from gateway.ids import new_id
from gateway.job import ChatJob, ChoiceDelta, ChoiceResult, Prepared
from gateway.metrics import Metrics
from gateway.next_state import RULE_SOURCE, next_state, tool_errors
from gateway.parsers import get_parser
from gateway.parsers.base import OutputParser, ParseDelta, ParsedOutput, collect
from gateway.parsers.plain import PlainText
from gateway.promotion.routing import Arm, Routing
from gateway.render import Renderer
from gateway.sessions import CallEntry, PromptPlan, SessionIndex, plan_prompt
from gateway.stops import StopTrimmer
from gateway.store.errors import CaptureFull
from gateway.store.records import CallRecord, RewardRecord, RolloutRecord
from gateway.store.writer import CallWriter
from gateway.tokens import Alternatives, prompt_ids, token_texts
from gateway.tool_choice import ToolChoice

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("clawgate.service")


# How long a durable-capture call waits for its commit before it is served anyway.
DURABLE_WAIT_S = 5.0
# Up to this many tokens are decoded for logprobs on the event loop: a thread hop costs more than a stream
# chunk's few tokens, and a whole answer's many are decoded in a worker thread.
INLINE_DECODE_TOKENS = 32
# A conversation without an assistant turn (nothing to splice, nothing to look up in the database) and without tools,
# whose messages hold at most this many characters, is rendered on the event loop: measured here, the render and
# tokenization of a 100-character conversation take ~0.15 ms and a hop to a worker thread ~0.08 ms of CPU on its own.
INLINE_RENDER_CHARS = 2048


def _cheap_to_plan(job: ChatJob) -> bool:
    """Whether planning ``job`` costs less than a hop to a worker thread and can touch no database: a token-level
    prompt, or a short conversation without tools and without an assistant turn."""
    if job.prompt_ids is not None:
        return True
    if job.tools:
        return False
    size = 0
    for m in job.messages:
        if m.role == "assistant":
            return False
        size += len(m.content or "")
    return size <= INLINE_RENDER_CHARS


class ChatService:
    def __init__(
        self,
        *,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        renderer: Renderer,
        index: SessionIndex,
        writer: CallWriter,
        metrics: Metrics,
        max_tokens_cap: int | None,
        parser: str = "hermes",
        adapter: str | None = None,
        policy_version: int | None = None,
        db: sa.Engine | None = None,
        durable_capture: bool = False,
        tool_error_reward: float = 0.0,
        max_in_flight: int = 0,
        session_idle_timeout: float = 1800.0,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.renderer = renderer
        self.index = index
        self.writer = writer
        self.metrics = metrics
        self.max_tokens_cap = max_tokens_cap
        self.parser_cls = get_parser(parser)
        self.tool_choice = ToolChoice(self.parser_cls, tokenizer)
        # Which version serves a call (gateway/promotion/routing.py): the incumbent, and a canary's candidate.
        self.routing = Routing(Arm(adapter, policy_version))
        # Calls running per adapter: a version is unloaded only once none of this gateway's calls use it.
        self.adapter_in_flight: Counter[str] = Counter()
        self.db = db
        self.durable_capture = durable_capture
        # The reward a turn gets when the tool results in its next state report a failure (0: the rule is off).
        self.tool_error_reward = tool_error_reward
        # Implicit rollouts the gateway closed: a conversation that resumes after that starts a new rollout
        # (still spliced from the raw tokens), so nothing is added to a rollout that may already be trained.
        self.closed_rollouts: set[str] = set()
        # What the index does not know is looked up in the database: another gateway process may have served it.
        self.continuity = Continuity(db, renderer, index, self.closed_rollouts, session_idle_timeout)
        # Calls generating now, and the most allowed at once (0: no limit); more are refused with a 503.
        self.in_flight = 0
        self.max_in_flight = max_in_flight

    # -- state others change through these ------------------------------------------------------------------
    @property
    def adapter(self) -> str | None:
        """The incumbent's adapter (None: the base model)."""
        return self.routing.incumbent.adapter

    @property
    def policy_version(self) -> int | None:
        return self.routing.incumbent.version

    def use_policy(self, adapter: str | None, version: int | None) -> None:
        """Serve every new call with ``adapter`` (None: the base model), recorded as policy ``version``."""
        self.routing = Routing(Arm(adapter, version))

    def use_routing(self, routing: Routing) -> None:
        """Serve new calls as ``routing`` says (one assignment: a call sees the old routing or the new one)."""
        self.routing = routing

    def close_rollouts(self, rollout_ids: Iterable[str]) -> None:
        """Rollouts the gateway closed: a conversation that resumes one starts a new rollout instead."""
        self.closed_rollouts.update(rollout_ids)

    # -- token-level work ------------------------------------------------------------------------------------
    async def raw_prompt(self, prompt: str | list[int], *, echo: bool, param: str) -> tuple[list[int], str]:
        """A token-level prompt's ids (checked against the vocabulary) and, with ``echo``, its text."""
        return await asyncio.to_thread(prompt_ids, self.tokenizer, self.renderer, prompt, echo=echo, param=param)

    async def token_texts(
        self, ids: list[int], tops: list[dict[int, float]] | None
    ) -> tuple[list[str], list[Alternatives] | None]:
        """The text of each token and of its top alternatives; a long run is decoded in a worker thread."""
        if len(ids) <= INLINE_DECODE_TOKENS:
            return token_texts(self.tokenizer, ids, tops)
        return await asyncio.to_thread(token_texts, self.tokenizer, ids, tops)

    # -- prepare --------------------------------------------------------------------------------------------
    async def prepare(self, job: ChatJob) -> Prepared:
        t0 = time.perf_counter()
        started_at = datetime.now(UTC)
        scope = job.rollout.id
        # Rendering and tokenizing are CPU work: off the event loop, but for the smallest (see INLINE_RENDER_CHARS).
        if _cheap_to_plan(job):
            plan, exact, join = self._plan(job, scope)
        else:
            plan, exact, join = await asyncio.to_thread(self._plan, job, scope)
        render_s = time.perf_counter() - t0
        self.metrics.render_mode.labels(plan.mode).inc()
        if plan.mode == "drifted":
            self.metrics.drift.inc()
            log.warning("prompt drift: could not splice an earlier answer (rollout=%s)", scope)
        forced_text, params = self.tool_choice.apply(job)
        if forced_text:
            # The opening of a tool call goes at the end of the prompt: the model continues inside the call. These
            # tokens were not sampled, so they belong to the prompt (never trained on); a later turn that echoes
            # the call splices onto prompt + completion, which hold the whole call.
            forced_ids = self.renderer.encode(forced_text)
            plan = replace(plan, prompt_ids=[*plan.prompt_ids, *forced_ids])
        prompt_len = len(plan.prompt_ids)
        room = self.engine.max_model_len - prompt_len
        if room < 1:
            raise ContextTooLong(
                f"This model's maximum context length is {self.engine.max_model_len} tokens, but the prompt "
                f"has {prompt_len} tokens."
            )
        max_tokens = min(job.params.max_tokens, self.max_tokens_cap or room, room)
        params = replace(params, max_tokens=max_tokens)
        if job.rollout.id is not None:
            rollout_id = job.rollout.id
        elif plan.parent is not None and join:
            rollout_id = plan.parent.rollout_id
        else:
            rollout_id = new_id("ro")
        parent = plan.parent
        arm = self.routing.arm_for(rollout_id, parent.policy_version if parent else None, parent is not None)
        prefix = 0
        if plan.parent is not None:
            parent_hashes = plan.parent.exact_hashes
            while prefix < min(len(parent_hashes), len(exact)) and parent_hashes[prefix] == exact[prefix]:
                prefix += 1
        return Prepared(
            job=job,
            request_id=job.request_id,
            rollout_id=rollout_id,
            plan=plan,
            params=params,
            call_ids=[new_id("call") for _ in range(job.n)],
            started_at=started_at,
            t0=t0,
            render_s=render_s,
            exact_hashes=exact,
            stored_request=job.raw_request,
            request_prefix_messages=prefix,
            adapter=arm.adapter,
            policy_version=arm.version,
            forced_text=forced_text,
        )

    def _plan(self, job: ChatJob, scope: str | None) -> tuple[PromptPlan, list[bytes], bool]:
        """The prompt plan, the request's exact message hashes, and whether it may join its parent's rollout."""
        if job.prompt_ids is not None:
            return PromptPlan(list(job.prompt_ids), "raw", None, []), [], False
        shared = self.continuity
        plan = plan_prompt(
            self.renderer, self.index, scope, job.messages, job.tools, shared.stored_parent, shared.known_outputs
        )
        raw = job.raw_messages
        exact = [exact_hash(m) for m in raw] if isinstance(raw, list) else []
        join = scope is None and plan.parent is not None and shared.can_join(plan.parent)
        return plan, exact, join

    # -- generate -------------------------------------------------------------------------------------------
    async def run_choice(self, prep: Prepared, index: int) -> AsyncIterator[ChoiceDelta | ChoiceResult]:
        """Generate choice ``index``; yields deltas as tokens arrive, then one ``ChoiceResult``."""
        job = prep.job
        params = prep.params
        if params.seed is not None and index:
            params = replace(params, seed=params.seed + index)
        call_id = prep.call_ids[index]
        request = GenerationRequest(
            call_id, prep.prompt_ids, params, prep.adapter, stream=job.stream, session_id=prep.rollout_id
        )
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True)
        trimmer = StopTrimmer(params.stop)
        parser: OutputParser | PlainText
        if job.parse_output:
            # A template whose generation prompt opens a <think> block (Qwen3 thinking) starts us in reasoning.
            prompt_tail = str(self.tokenizer.decode(prep.prompt_ids[-4:]))
            parser = self.parser_cls(
                tools_requested=job.tool_use.parse and bool(job.tools),
                reasoning_started=self.parser_cls.starts_in_reasoning(prompt_tail),
            )
        else:
            parser = PlainText()
        opening = parser.feed(prep.forced_text) if prep.forced_text else ParseDelta()
        ids: list[int] = []
        logprobs: list[float] = []
        tops: list[dict[int, float]] | None = [] if params.top_logprobs else None
        deltas: list[ParseDelta] = [opening]
        status, error = "failed", None
        recorded = False
        hashes: tuple[str, str] | None = None  # the conversation's tail hash and the answer's hash
        response: dict[str, Any] | None = None
        end: GenerationEnd | None = None
        t_engine = time.perf_counter()
        t_first: float | None = None
        # Admission control, before the engine generates anything: room in the capture queue for what this call
        # will record (the call, and for the first choice its parent's rule reward), and a free call slot.
        slots = 2 if index == 0 and self._rule_possible(prep) else 1
        self._admit(slots)
        self.in_flight += 1
        self.metrics.in_flight.inc()
        if prep.adapter is not None:
            self.adapter_in_flight[prep.adapter] += 1
        stream = self.engine.generate(request)
        try:
            async for event in stream:
                if isinstance(event, TokenDelta):
                    if t_first is None:
                        t_first = time.perf_counter()
                    ids.extend(event.token_ids)
                    logprobs.extend(event.logprobs)
                    if tops is not None and event.top_logprobs is not None:
                        tops.extend(event.top_logprobs)
                    text = trimmer.feed(detok.add(event.token_ids))
                    delta = parser.feed(text) if text else ParseDelta()
                    deltas.append(delta)
                    yield ChoiceDelta(
                        index,
                        delta.content,
                        delta.reasoning,
                        delta.tool_calls,
                        event.token_ids,
                        event.logprobs,
                        event.top_logprobs,
                    )
                else:
                    end = event
            if end is None:
                raise EngineError("the engine ended the stream without a finish reason")
            tail = trimmer.feed(detok.finish()) + trimmer.finish()
            last = parser.feed(tail) if tail else ParseDelta()
            closing = parser.finish()
            deltas += (last, closing)
            if last or closing:
                yield ChoiceDelta(
                    index,
                    last.content + closing.content,
                    last.reasoning + closing.reasoning,
                    last.tool_calls + closing.tool_calls,
                )
            output = collect(deltas)
            finish: str = end.finish_reason if end.finish_reason != "abort" else "stop"
            if output.tool_calls and finish == "stop":
                finish = "tool_calls"
            hashes = self._register(prep, call_id, ids, output)
            if job.response is not None and index == 0:
                response = job.response.row(prep.request_id, output)
            status = "ok"
            if self.durable_capture:
                # Commit the call before the client sees its end (the last chunk, or the whole response): a served
                # call then survives even a SIGKILL right after. Concurrent calls share the commit.
                engine_s = time.perf_counter() - t_engine
                self._record(prep, index, slots, status, None, end, ids, logprobs, engine_s, t_first, hashes, response)
                recorded = True
                await self._wait_durable()
            yield ChoiceResult(index, call_id, finish, output, ids, logprobs, tops, trimmer.stopped)
        except APIError as exc:
            error = exc
            exc.of_calls(prep.call_ids, [prep.rollout_id])
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        except Exception as exc:
            log.exception("engine failure on %s", call_id)
            error = EngineError(f"engine failure: {exc}")
            error.of_calls(prep.call_ids, [prep.rollout_id])
            raise error from exc
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            if prep.adapter is not None:
                self.adapter_in_flight[prep.adapter] -= 1
            await stream.aclose()
            if not recorded:
                engine_s = time.perf_counter() - t_engine
                self._record(prep, index, slots, status, error, end, ids, logprobs, engine_s, t_first, hashes, response)

    def _admit(self, slots: int) -> None:
        """Refuse a call (503 with Retry-After) that the gateway could not serve or record; else hold its room."""
        if self.max_in_flight and self.in_flight >= self.max_in_flight:
            self.metrics.refused.labels("concurrency").inc()
            raise EngineUnavailable(
                f"the gateway is serving its limit of {self.max_in_flight} concurrent calls "
                "(CLAWGATE_MAX_CONCURRENT_CALLS): try again shortly",
                code="overloaded",
                retry_after=1,
            )
        try:
            self.writer.reserve(slots)
        except CaptureFull as full:
            self.metrics.refused.labels("capture_queue").inc()
            raise EngineUnavailable(full.message, code=full.code, retry_after=full.retry_after) from full

    def _rule_possible(self, prep: Prepared) -> bool:
        return bool(self.tool_error_reward) and prep.plan.parent is not None

    async def _wait_durable(self) -> None:
        """Wait (at most DURABLE_WAIT_S) for the capture to commit, unless the capture is degraded.

        The circuit breaker: once a commit failed, or took longer than a call waits, nothing is gained by making
        every call wait — the call stays queued (spooled to disk at shutdown) and is answered at once, until a
        commit succeeds again.
        """
        if not await self.writer.wait_committed(DURABLE_WAIT_S):
            self.metrics.served_degraded.inc()

    def _register(self, prep: Prepared, call_id: str, ids: list[int], output: ParsedOutput) -> tuple[str, str] | None:
        """Make this answer findable by the request that echoes it; returns the conversation's tail hash and the
        answer's hash (both stored with the call, for the other gateway processes)."""
        answer = Message(
            role="assistant",
            content=output.content,
            tool_calls=[ToolCall(tc.name, tc.arguments) for tc in output.tool_calls],
        )
        hashes = prep.plan.hashes
        if not hashes:  # token-level API: nothing to echo back
            return None
        tail = extend_hash(hashes[-1], answer)
        entry = CallEntry(
            call_id=call_id,
            rollout_id=prep.rollout_id,
            token_ids=prep.prompt_ids + ids,
            ends_with_end_of_turn=self.renderer.ends_with_end_of_turn(ids),
            exact_hashes=prep.exact_hashes,
            explicit=prep.job.rollout.id is not None,
            policy_version=prep.policy_version,
        )
        out = output_hash(answer)
        self.index.add(prep.job.rollout.id, tail, out, entry)
        return tail.hex(), out.hex()

    def _rule_reward(self, prep: Prepared) -> RewardRecord | None:
        """The parent turn's reward from the next-state rules, when its tool results report a failure."""
        parent = prep.plan.parent
        if parent is None or not self.tool_error_reward:
            return None
        errors = tool_errors(next_state(prep.job.messages, prep.plan.splice_at))
        if not errors:
            return None
        return RewardRecord(
            rollout_id=parent.rollout_id,
            call_id=parent.call_id,
            value=self.tool_error_reward,
            source=RULE_SOURCE,
            details={"next_call_id": prep.call_ids[0], "errors": [e.as_dict() for e in errors]},
        )

    def _record(
        self,
        prep: Prepared,
        index: int,
        slots: int,
        status: str,
        error: APIError | None,
        end: GenerationEnd | None,
        ids: list[int],
        logprobs: list[float],
        engine_s: float,
        t_first: float | None,
        hashes: tuple[str, str] | None,
        response: dict[str, Any] | None,
    ) -> None:
        job = prep.job
        now = time.perf_counter()
        total_s = now - prep.t0
        parent = prep.plan.parent
        prefix_len = len(parent.token_ids) if parent is not None else 0
        call_id = prep.call_ids[index]
        record = CallRecord(
            id=call_id,
            request_id=prep.request_id,
            choice_index=index,
            rollout_id=prep.rollout_id,
            api=job.api,
            model=job.model,
            adapter=prep.adapter,
            policy_version=prep.policy_version,
            engine=self.engine.name,
            status=status,
            error=None if error is None else f"{type(error).__name__}: {error.message}",
            finish_reason=None if end is None else end.finish_reason,
            render_mode=prep.plan.mode,
            is_subagent=job.rollout.is_subagent,
            agent_id=job.rollout.agent_id,
            request=prep.stored_request,
            request_prefix_messages=prep.request_prefix_messages,
            parent_call_id=parent.call_id if parent is not None else None,
            prompt_prefix_len=prefix_len,
            prompt_delta=prep.prompt_ids[prefix_len:],
            completion_ids=ids,
            completion_logprobs=logprobs,
            tail_hash=hashes[0] if hashes else None,
            output_hash=hashes[1] if hashes else None,
            response=response if status == "ok" else None,
            started_at=prep.started_at,
            ended_at=datetime.now(UTC),
            ttft_ms=None if t_first is None else (t_first - prep.t0) * 1000,
            engine_ms=engine_s * 1000,
            gateway_ms=max(total_s - engine_s, 0.0) * 1000,
            rollout=RolloutRecord(
                id=prep.rollout_id, kind=job.rollout.kind if job.rollout.id is not None else "implicit"
            ),
        )
        # The parent turn's rule reward goes first: whoever sees this call (the parent's next state) sees it too.
        rule = self._rule_reward(prep) if index == 0 and slots > 1 else None
        if rule is not None:
            self.writer.submit(rule, reserved=True)
        self.writer.submit(record, reserved=True)  # room reserved by _admit: never refused
        self.writer.release(slots - 1 - (rule is not None))
        m = self.metrics
        m.calls.labels(job.api, status).inc()
        m.prompt_tokens.inc(len(prep.prompt_ids))
        m.completion_tokens.inc(len(ids))
        m.latency.labels(job.api).observe(total_s)
        if t_first is not None:
            m.ttft.labels(job.api).observe(t_first - prep.t0)
        m.overhead.observe(max(total_s - engine_s, 0.0))
