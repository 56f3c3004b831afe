"""The protocol-independent serving core: plan a prompt, run the engine, parse, capture.

Every public API (chat completions, completions, Anthropic messages, responses; see ``gateway/protocols``)
translates its request into a ``ChatJob``, calls ``ChatService.plan`` and then iterates
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
from typing import TYPE_CHECKING

import sqlalchemy as sa

from gateway.bounded import ExpiringSet
from gateway.core.continuity import Continuity
from gateway.core.conversation import Message, ToolCall, exact_hash, extend_hash, output_hash
from gateway.core.counterfactuals import Counterfactuals
from gateway.core.job import ChatJob, ChoiceDelta, ChoiceResult, PlannedCall
from gateway.core.parsers import get_parser
from gateway.core.parsers.base import OutputParser, ParsedOutput
from gateway.core.parsers.plain import PlainText
from gateway.core.pipeline import TextPipeline
from gateway.core.record import Generated, Outcome, call_record, rule_reward
from gateway.core.render import Renderer
from gateway.core.sessions import CallEntry, PromptPlan, SessionIndex, entry_ids, plan_prompt
from gateway.core.structured import Structured
from gateway.core.tokens import Alternatives, prompt_ids, token_texts
from gateway.core.tool_choice import ToolChoice
from gateway.engines.base import Engine, GenerationEnd, GenerationRequest
from gateway.errors import APIError, ContextTooLong, EngineError, EngineUnavailable
from gateway.ids import new_id
from gateway.metrics import Metrics
from gateway.promotion.routing import Arm, Routing
from gateway.store.errors import CaptureFull
from gateway.store.writer import CallWriter

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


def _shared_prefix(plan: PromptPlan, exact: list[bytes]) -> int:
    """How many of the request's messages equal the continued call's (the stored request holds only the rest).

    The session index keeps this call's hashes: the shared ones become the parent's objects instead of equal copies.
    """
    if plan.parent is None:
        return 0
    parent_hashes = plan.parent.exact_hashes
    prefix = 0
    while prefix < min(len(parent_hashes), len(exact)) and parent_hashes[prefix] == exact[prefix]:
        prefix += 1
    exact[:prefix] = parent_hashes[:prefix]
    return prefix


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
        self.structured = Structured(self.parser_cls, tokenizer, metrics)
        # Which version serves a call (gateway/promotion/routing.py): the incumbent, and a canary's candidate.
        self.routing = Routing(Arm(adapter, policy_version))
        # Tenants with a policy of their own whose lineage serves a version here: their calls route by this instead.
        self.lineage_routing: dict[str, Routing] = {}
        # Calls running per adapter: a version is unloaded only once none of this gateway's calls use it.
        self.adapter_in_flight: Counter[str] = Counter()
        self.db = db
        self.durable_capture = durable_capture
        # The reward a turn gets when the tool results in its next state report a failure (0: the rule is off).
        self.tool_error_reward = tool_error_reward
        # Implicit rollouts the gateway closed: a conversation that resumes after that starts a new rollout
        # (still spliced from the raw tokens), so nothing is added to a rollout that may already be trained.
        # Remembered for one idle timeout, not forever (see Continuity.can_join for why that is enough).
        self.closed_rollouts: ExpiringSet[str] = ExpiringSet(session_idle_timeout)
        # What the index does not know is looked up in the database: another gateway process may have served it.
        self.continuity = Continuity(db, renderer, index, self.closed_rollouts, session_idle_timeout)
        # Calls generating now, and the most allowed at once (0: no limit); more are refused with a 503.
        self.in_flight = 0
        self.max_in_flight = max_in_flight
        # Draws counterfactual siblings of served turns in the background (None: off); see counterfactuals.py.
        self.counterfactuals: Counterfactuals | None = None

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

    def use_lineage_routing(self, tenant: str, routing: Routing | None) -> None:
        """Serve ``tenant``'s new calls as ``routing`` says (None: the shared policy's routing), in one assignment."""
        routes = dict(self.lineage_routing)
        if routing is None:
            routes.pop(tenant, None)
        else:
            routes[tenant] = routing
        self.lineage_routing = routes

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

    # -- plan ---------------------------------------------------------------------------------------------
    async def plan(self, job: ChatJob) -> PlannedCall:
        """Plan ``job``'s calls: the prompt (rendered, or spliced onto the earlier call it continues), the tool choice,
        the token budget, the rollout the calls join and the policy version that serves them. Nothing is generated
        yet: the protocol then runs each choice with ``run_choice``."""
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
        constraint = self.structured.constraint(job, forced_text)
        if constraint is not None:
            await self.structured.check(constraint, "tool_choice" if forced_text else "response_format")
            params = replace(params, constraint=constraint)
        # A template whose generation prompt opens a <think> block (Qwen3 thinking) starts the answer in reasoning.
        opened = job.parse_output and self.parser_cls.starts_in_reasoning(
            str(self.tokenizer.decode(plan.prompt_ids[-4:]))
        )
        if opened and constraint is not None:
            # Under a grammar the block is closed empty, and the grammar's answer follows.
            forced_text = self.parser_cls.closed_reasoning() + forced_text
        if forced_text:
            # The opening of a tool call goes at the end of the prompt: the model continues inside the call. These
            # tokens were not sampled, so they belong to the prompt (never trained on); a later turn that echoes
            # the call splices onto prompt + completion, which hold the whole call.
            plan = replace(plan, prompt_ids=[*plan.prompt_ids, *self.renderer.encode(forced_text)])
        params = replace(params, max_tokens=self._max_tokens(job, len(plan.prompt_ids)))
        rollout_id = self._rollout_of(job, plan, join)
        arm = self._arm(job, rollout_id, plan.parent)
        prefix = _shared_prefix(plan, exact)
        return PlannedCall(
            job=job,
            request_id=job.request_id,
            rollout_id=rollout_id,
            prompt=plan,
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
            opened_reasoning=opened,
        )

    def _max_tokens(self, job: ChatJob, prompt_len: int) -> int:
        """The completion budget: what the job asks for, within the server's cap and the room the prompt leaves."""
        room = self.engine.max_model_len - prompt_len
        if room < 1:
            raise ContextTooLong(
                f"This model's maximum context length is {self.engine.max_model_len} tokens, but the prompt "
                f"has {prompt_len} tokens."
            )
        return min(job.params.max_tokens, self.max_tokens_cap or room, room)

    @staticmethod
    def _rollout_of(job: ChatJob, plan: PromptPlan, join: bool) -> str:
        """The rollout the calls belong to: the one the client named, the continued call's, or a new one."""
        if job.rollout.id is not None:
            return job.rollout.id
        if plan.parent is not None and join:
            return plan.parent.rollout_id
        return new_id("ro")

    def _arm(self, job: ChatJob, rollout_id: str, parent: CallEntry | None) -> Arm:
        """The version that serves this call: the one its rollout is pinned to, else as routing assigns it."""
        pinned = job.rollout.policy_version
        routing = self.lineage_routing.get(job.rollout.tenant, self.routing)
        if pinned is None:
            return routing.arm_for(rollout_id, parent.policy_version if parent else None, parent is not None)
        # A rollout may be pinned to a version of its tenant's lineage or of the shared one, never another tenant's.
        arm = routing.arm_of(pinned) or self.routing.arm_of(pinned)
        if arm is None:
            raise EngineUnavailable(
                f"policy@v{pinned}, which rollout {rollout_id!r} is pinned to, is not served by this gateway now "
                "(it is loaded at the next policy poll while it is being evaluated, a candidate or promoted)"
            )
        return arm

    def _plan(self, job: ChatJob, scope: str | None) -> tuple[PromptPlan, list[bytes], bool]:
        """The prompt plan, the request's exact message hashes, and whether it may join its parent's rollout."""
        if job.prompt_ids is not None:
            return PromptPlan(list(job.prompt_ids), "raw", None, []), [], False
        shared = self.continuity
        lookups = (shared.stored_parent, shared.known_outputs)
        plan = plan_prompt(
            self.renderer, self.index, scope, job.messages, job.tools, *lookups, tenant=job.rollout.tenant
        )
        raw = job.raw_messages
        exact = [exact_hash(m) for m in raw] if isinstance(raw, list) else []
        join = scope is None and plan.parent is not None and shared.can_join(plan.parent)
        return plan, exact, join

    # -- generate -------------------------------------------------------------------------------------------
    async def run_choice(self, prep: PlannedCall, index: int) -> AsyncIterator[ChoiceDelta | ChoiceResult]:
        """Generate choice ``index``: yields deltas as tokens arrive, then one ``ChoiceResult``; records the call
        exactly once, whatever happens (see the module docstring)."""
        job, call_id = prep.job, prep.call_ids[index]
        request = self._request(prep, index)
        params = request.params
        text = TextPipeline(self.tokenizer, self._parser(prep), params.stop, prep.forced_text)
        got = Generated(tops=[] if params.top_logprobs else None)
        outcome = Outcome()
        # Admission control, before the engine generates anything: room in the capture queue for what this call
        # will record (the call, and for the first choice its parent's rule reward), and a free call slot.
        slots = 2 if index == 0 and self._rule_possible(prep) else 1
        self._admit(slots)
        self._running(prep.adapter, +1)
        stream = self.engine.generate(request)
        try:
            async for event in stream:
                if isinstance(event, GenerationEnd):
                    got.end = event
                    continue
                got.add(event)
                delta = text.feed(event.token_ids)
                tokens = (event.token_ids, event.logprobs, event.top_logprobs)
                yield ChoiceDelta(index, delta.content, delta.reasoning, delta.tool_calls, *tokens)
            if got.end is None:
                raise EngineError("the engine ended the stream without a finish reason")
            last = text.finish()
            if last:
                yield ChoiceDelta(index, last.content, last.reasoning, last.tool_calls)
            output = text.output()
            finish = "tool_calls" if output.tool_calls and got.finish_reason == "stop" else got.finish_reason
            outcome.hashes = self._register(prep, call_id, got.ids, output)
            if job.response is not None and index == 0:
                outcome.response = job.response.row(prep.request_id, output)
            outcome.status = "ok"
            if self.durable_capture:
                # Commit the call before the client sees its end (the last chunk, or the whole response): a served
                # call then survives even a SIGKILL right after. Concurrent calls share the commit.
                self._record(prep, index, slots, got, outcome)
                await self._wait_durable()
            yield ChoiceResult(index, call_id, finish, output, got.ids, got.logprobs, got.tops, text.stopped)
        except APIError as exc:
            outcome.error = exc
            exc.of_calls(prep.call_ids, [prep.rollout_id])
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome.status = "cancelled"
            raise
        except Exception as exc:
            log.exception("engine failure on %s", call_id)
            outcome.error = EngineError(f"engine failure: {exc}")
            outcome.error.of_calls(prep.call_ids, [prep.rollout_id])
            raise outcome.error from exc
        finally:
            self._running(prep.adapter, -1)
            await stream.aclose()
            if not outcome.recorded:
                self._record(prep, index, slots, got, outcome)

    @staticmethod
    def _request(prep: PlannedCall, index: int) -> GenerationRequest:
        """The engine request of choice ``index`` (choices after the first draw with the next seeds)."""
        params = prep.params
        if params.seed is not None and index:
            params = replace(params, seed=params.seed + index)
        call_id = prep.call_ids[index]
        return GenerationRequest(
            call_id, prep.prompt_ids, params, prep.adapter, stream=prep.job.stream, session_id=prep.rollout_id
        )

    def parse_answer(self, prep: PlannedCall, ids: list[int]) -> ParsedOutput:
        """What a choice of ``prep`` with completion ``ids`` reads as (a counterfactual sibling's answer)."""
        text = TextPipeline(self.tokenizer, self._parser(prep), prep.params.stop, prep.forced_text)
        text.feed(ids)
        text.finish()
        return text.output()

    def _parser(self, prep: PlannedCall) -> OutputParser | PlainText:
        """A new output parser for one choice: the model family's, or plain text for the token-level API."""
        job = prep.job
        if not job.parse_output:
            return PlainText()
        parser = self.parser_cls(
            tools_requested=job.tool_use.parse and bool(job.tools), reasoning_started=prep.opened_reasoning
        )
        parser.partial_calls = prep.params.constraint is not None
        return parser

    def _running(self, adapter: str | None, step: int) -> None:
        """Count a call in (``+1``) or out (``-1``): in flight, and per adapter (see ``adapter_in_flight``)."""
        self.in_flight += step
        self.metrics.in_flight.inc(step)
        if adapter is not None:
            self.adapter_in_flight[adapter] += step

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

    def _rule_possible(self, prep: PlannedCall) -> bool:
        return bool(self.tool_error_reward) and prep.prompt.parent is not None

    async def _wait_durable(self) -> None:
        """Wait (at most DURABLE_WAIT_S) for the capture to commit, unless the capture is degraded.

        The circuit breaker: once a commit failed, or took longer than a call waits, nothing is gained by making
        every call wait — the call stays queued (spooled to disk at shutdown) and is answered at once, until a
        commit succeeds again.
        """
        if not await self.writer.wait_committed(DURABLE_WAIT_S):
            self.metrics.served_degraded.inc()

    def _register(
        self, prep: PlannedCall, call_id: str, ids: list[int], output: ParsedOutput
    ) -> tuple[str, str] | None:
        """Make this answer findable by the request that echoes it; returns the conversation's tail hash and the
        answer's hash (both stored with the call, for the other gateway processes)."""
        answer = Message(
            role="assistant",
            content=output.content,
            tool_calls=[ToolCall(tc.name, tc.arguments) for tc in output.tool_calls],
        )
        hashes = prep.prompt.hashes
        if not hashes:  # token-level API: nothing to echo back
            return None
        tail = extend_hash(hashes[-1], answer)
        entry = CallEntry(
            call_id=call_id,
            rollout_id=prep.rollout_id,
            token_ids=entry_ids(prep.prompt.parent, prep.prompt_ids, ids),
            ends_with_end_of_turn=self.renderer.ends_with_end_of_turn(ids),
            exact_hashes=prep.exact_hashes,
            explicit=prep.job.rollout.id is not None,
            policy_version=prep.policy_version,
        )
        out = output_hash(answer, prep.job.rollout.tenant)
        self.index.add(prep.job.rollout.id, tail, out, entry)
        return tail.hex(), out.hex()

    def _record(self, prep: PlannedCall, index: int, slots: int, got: Generated, outcome: Outcome) -> None:
        """Hand the call (and for the first choice its parent's rule reward) to the capture writer, once."""
        record = call_record(prep, index, self.engine.name, got, outcome)
        outcome.recorded = True
        # The parent turn's rule reward goes first: whoever sees this call (the parent's next state) sees it too.
        rule = rule_reward(prep, self.tool_error_reward) if index == 0 and slots > 1 else None
        if rule is not None:
            self.writer.submit(rule, reserved=True)
        self.writer.submit(record, reserved=True)  # room reserved by _admit: never refused
        self.writer.release(slots - 1 - (rule is not None))
        if outcome.status == "ok" and self.counterfactuals is not None:
            self.counterfactuals.offer(prep, index)
        if (meter := prep.job.rollout.usage) is not None:  # a quota's tokens: the prompt once, every completion
            meter.charge(len(got.ids) + (len(prep.prompt_ids) if index == 0 else 0))
        m, api = self.metrics, prep.job.api
        total_s = time.perf_counter() - prep.t0
        m.calls.labels(api, outcome.status).inc()
        m.prompt_tokens.inc(len(prep.prompt_ids))
        m.completion_tokens.inc(len(got.ids))
        m.latency.labels(api).observe(total_s)
        if got.t_first is not None:
            m.ttft.labels(api).observe(got.t_first - prep.t0)
        m.overhead.observe((record.gateway_ms or 0.0) / 1000)
