"""What one choice leaves behind: the engine's output as it arrives, how the choice ended, the call record built
from both (``gateway/store/records.py``) for the capture writer, and the reward a rule reads for the turn before."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gateway.core.job import PlannedCall
from gateway.core.next_state import RULE_SOURCE, next_state, tool_errors
from gateway.engines.base import GenerationEnd, TokenDelta
from gateway.errors import APIError
from gateway.store.records import CallRecord, RewardRecord, RolloutRecord


@dataclass(slots=True)
class Generated:
    """What the engine produced for one choice: its tokens with their logprobs, its end, and when."""

    t_engine: float = field(default_factory=time.perf_counter)  # when the engine was asked
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[dict[int, float]] | None = None  # a list when top logprobs were asked for
    end: GenerationEnd | None = None
    t_first: float | None = None  # when the first token arrived

    def add(self, delta: TokenDelta) -> None:
        if self.t_first is None:
            self.t_first = time.perf_counter()
        self.ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if self.tops is not None and delta.top_logprobs is not None:
            self.tops.extend(delta.top_logprobs)

    @property
    def finish_reason(self) -> str:
        """The client's finish reason: an engine's abort (a stop string cut by the gateway) reads as a stop."""
        assert self.end is not None
        return self.end.finish_reason if self.end.finish_reason != "abort" else "stop"


@dataclass(slots=True)
class Outcome:
    """How a choice ended: ``ok``, ``failed`` (with its error) or ``cancelled`` (the client went away)."""

    status: str = "failed"
    error: APIError | None = None
    hashes: tuple[str, str] | None = None  # the conversation's tail hash and the answer's hash (ok calls)
    response: dict[str, Any] | None = None  # the stored Responses-API response (ok calls of that API)
    recorded: bool = False


def call_record(call: PlannedCall, index: int, engine: str, got: Generated, outcome: Outcome) -> CallRecord:
    """The capture record of choice ``index`` of ``call``, as it ended."""
    job = call.job
    now = time.perf_counter()
    total_s, engine_s = now - call.t0, now - got.t_engine
    parent = call.prompt.parent
    prefix_len = len(parent.token_ids) if parent is not None else 0
    error, hashes = outcome.error, outcome.hashes
    return CallRecord(
        id=call.call_ids[index],
        request_id=call.request_id,
        choice_index=index,
        rollout_id=call.rollout_id,
        api=job.api,
        model=job.model,
        adapter=call.adapter,
        policy_version=call.policy_version,
        engine=engine,
        status=outcome.status,
        error=None if error is None else f"{type(error).__name__}: {error.message}",
        finish_reason=None if got.end is None else got.end.finish_reason,
        render_mode=call.prompt.mode,
        is_subagent=job.rollout.is_subagent,
        agent_id=job.rollout.agent_id,
        request=call.stored_request,
        request_prefix_messages=call.request_prefix_messages,
        parent_call_id=parent.call_id if parent is not None else None,
        parent_ids=weakref.ref(parent.token_ids) if parent is not None else None,
        prompt_prefix_len=prefix_len,
        prompt_delta=call.prompt_ids[prefix_len:],
        completion_ids=got.ids,
        completion_logprobs=got.logprobs,
        constrained=call.params.constraint is not None,
        tail_hash=hashes[0] if hashes else None,
        output_hash=hashes[1] if hashes else None,
        response=outcome.response if outcome.status == "ok" else None,
        started_at=call.started_at,
        ended_at=datetime.now(UTC),
        ttft_ms=None if got.t_first is None else (got.t_first - call.t0) * 1000,
        engine_ms=engine_s * 1000,
        gateway_ms=max(total_s - engine_s, 0.0) * 1000,
        rollout=RolloutRecord(
            id=call.rollout_id,
            kind=job.rollout.kind if job.rollout.id is not None else "implicit",
            tenant=job.rollout.tenant,
        ),
    )


def rule_reward(call: PlannedCall, value: float) -> RewardRecord | None:
    """The continued turn's reward ``value`` from the next-state rules, when its tool results report a failure
    (``value`` 0: the rule is off)."""
    parent = call.prompt.parent
    if parent is None or not value:
        return None
    errors = tool_errors(next_state(call.job.messages, call.prompt.splice_at))
    if not errors:
        return None
    return RewardRecord(
        rollout_id=parent.rollout_id,
        call_id=parent.call_id,
        value=value,
        source=RULE_SOURCE,
        details={"next_call_id": call.call_ids[0], "errors": [e.as_dict() for e in errors]},
    )
