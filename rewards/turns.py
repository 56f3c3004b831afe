"""A turn as a judge reads it: the conversation before the reply, the reply, and the next state, as text.

Everything comes from the exact tokens the gateway recorded, decoded with the served model's tokenizer (special
tokens kept, so role markers, ``<tool_call>`` and ``<think>`` blocks show what the model really produced and what
the harness really answered):

- ``reply``: the call's completion;
- ``next_state``: the tokens the continuing call (``Call.next_call_id``) has after this call's prompt +
  completion — tool results, the user's next message — or None when the rollout closed without one;
- ``context``: the call's prompt.

Long texts keep their start and their end (``clip``), so a 30k-token harness prompt shows its instructions and
the latest exchange within the configured budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from gateway.store import codec, repo
from gateway.store.models import Call, Rollout

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


def clip(ids: Sequence[int] | np.ndarray, budget: int, decode: Decode) -> str:
    """Decode ``ids``; beyond ``budget`` tokens keep the first quarter and the last three quarters of it."""
    n = len(ids)
    if n <= budget:
        return decode(list(ids))
    if budget <= 0:
        return f"[{n} tokens left out]"
    head = budget // 4
    tail = budget - head
    return decode(list(ids[:head])) + f"\n[… {n - head - tail} tokens left out …]\n" + decode(list(ids[n - tail :]))


def load_turn(session: Session, call_id: str, decode: Decode, limits: Limits = Limits()) -> TurnView:
    """The turn of call ``call_id`` as text (raises LookupError when the call is gone)."""
    call = session.get(Call, call_id)
    if call is None:
        raise LookupError(f"call {call_id} not found")
    rollout = session.get(Rollout, call.rollout_id)
    cache = repo.CallCache(session)
    prompt = repo.full_prompt_array(cache, call)
    completion = codec.ids_array(call.completion_ids)
    next_state: str | None = None
    if call.next_call_id is not None:
        child = session.get(Call, call.next_call_id)
        start = call.prompt_len + call.completion_len
        # The child's prompt starts with exactly this call's prompt + completion (that is how it was linked).
        if child is not None and child.parent_call_id == call.id and child.prompt_prefix_len == start:
            next_state = clip(repo.full_prompt_array(cache, child)[start:], limits.next_state, decode)
    return TurnView(
        call_id=call.id,
        rollout_id=call.rollout_id,
        api=call.api,
        harness=None if rollout is None else rollout.harness,
        policy_version=call.policy_version,
        finish_reason=call.finish_reason,
        context=clip(prompt, limits.context, decode),
        reply=clip(completion, limits.reply, decode),
        next_state=next_state,
        reply_token_ids=tuple(completion.tolist()),
        rollout_metadata=None if rollout is None else rollout.metadata_,
    )


def tokenizer_decode(tokenizer: Any) -> Decode:
    """A decode function keeping special tokens (role markers, tool-call tags)."""

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=False))

    return decode


__all__ = ["Decode", "Limits", "TurnView", "clip", "load_turn", "tokenizer_decode"]
