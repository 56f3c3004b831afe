"""A turn as a judge reads it: the conversation before the reply, the reply, and the next state, as text.

Everything comes from the exact tokens the gateway recorded, decoded with the served model's tokenizer (special
tokens kept, so role markers, ``<tool_call>`` and ``<think>`` blocks show what the model really produced and what
the harness really answered):

- ``reply``: the call's completion;
- ``next_state``: the tokens the continuing call (``Call.next_call_id``) has after this call's prompt +
  completion — tool results, the user's next message — or None when the rollout closed without one;
- ``context``: the call's prompt.

Credentials are replaced by a placeholder naming their kind in all three (``gateway/credentials/redact.py``): this
text goes to an external judge and to reward functions; ``reply_token_ids`` stay exact.

Long texts keep their start and their end (``clip``), so a 30k-token harness prompt shows its instructions and
the latest exchange within the configured budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import sqlalchemy as sa

from gateway.credentials.redact import decode_redacted
from gateway.credentials.tokens import tokenizer_decode  # special tokens kept (role markers, tool-call tags)
from gateway.store import counterfactuals, judgements
from gateway.store.secret_spans import Span, shifted

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True, slots=True)
class Limits:
    """Token budgets of the three texts (start and end kept, the middle left out)."""

    context: int = 1536
    reply: int = 1024
    next_state: int = 1024


@dataclass(frozen=True, slots=True)
class TurnView:
    """One turn of a rollout, as text. Reward functions receive this object."""

    call_id: str
    rollout_id: str
    api: str  # "chat" | "messages" | "responses"
    harness: str | None
    policy_version: int | None
    finish_reason: str | None
    context: str
    reply: str
    next_state: str | None  # None: the rollout closed without a next state
    reply_token_ids: tuple[int, ...]
    rollout_metadata: dict[str, Any] | None = None

    @property
    def has_next_state(self) -> bool:
        return self.next_state is not None


def clip(ids: Sequence[int] | np.ndarray, budget: int, decode: Decode, secrets: Sequence[Span] = ()) -> str:
    """Decode ``ids`` with credentials redacted (``secrets``, their spans, and what a scan of the text finds);
    beyond ``budget`` tokens keep the first quarter and the last three quarters of it."""
    n = len(ids)
    if n <= budget:
        return decode_redacted(list(ids), secrets, decode)
    if budget <= 0:
        return f"[{n} tokens left out]"
    head = budget // 4
    tail = budget - head
    first = decode_redacted(list(ids[:head]), shifted(secrets, 0, head), decode)
    last = decode_redacted(list(ids[n - tail :]), shifted(secrets, n - tail, tail), decode)
    return first + f"\n[… {n - head - tail} tokens left out …]\n" + last


def load_turn(db: sa.Engine, call_id: str, decode: Decode, limits: Limits = Limits()) -> TurnView:
    """The turn of call ``call_id`` as text (raises LookupError when the call is gone)."""
    turn = judgements.recorded_turn(db, call_id)
    if turn is None:
        raise LookupError(f"call {call_id} not found")
    return TurnView(
        call_id=turn.call_id,
        rollout_id=turn.rollout_id,
        api=turn.api,
        harness=turn.harness,
        policy_version=turn.policy_version,
        finish_reason=turn.finish_reason,
        context=clip(turn.prompt, limits.context, decode, turn.prompt_secrets),
        reply=clip(turn.completion, limits.reply, decode, turn.completion_secrets),
        next_state=None
        if turn.next_state is None
        else clip(turn.next_state, limits.next_state, decode, turn.next_state_secrets),
        reply_token_ids=tuple(turn.completion.tolist()),
        rollout_metadata=turn.rollout_metadata,
    )


def load_group(db: sa.Engine, turn: TurnView, decode: Decode, limits: Limits = Limits()) -> list[TurnView]:
    """The turn's counterfactual group as the judge scores it, when it has one not scored yet (else empty): the served
    answer first, then each sibling, all without the next state.

    Only the served answer has a next state; a score that saw it would not compare with its siblings' (the harness's
    reaction is evidence about that one answer). So the group is scored pointwise on the context alone, the served
    answer too, and the served answer's verdict with its next state stays its own turn reward."""
    group = counterfactuals.group_of(db, turn.call_id)
    if group is None or group.judged_at is not None or not group.siblings:
        return []
    views = [dataclasses.replace(turn, next_state=None)]
    for s in group.siblings:
        # Its credential spans were found when it was drawn; ``clip``'s scan of its text redacts what else it finds.
        views.append(
            dataclasses.replace(
                turn,
                call_id=s.id,
                next_state=None,
                finish_reason=s.finish_reason,
                policy_version=s.policy_version,
                reply=clip(s.completion_ids, limits.reply, decode, s.secret_spans or ()),
                reply_token_ids=tuple(s.completion_ids.tolist()),
            )
        )
    return views


__all__ = ["Decode", "Limits", "TurnView", "clip", "load_group", "load_turn", "tokenizer_decode"]
