"""Read side of the store: calls by id or rollout, and their full prompts and requests rebuilt from deltas.

A call stores only what its parent did not already have (see ``models.Call``):

    full_prompt(c)   = (full_prompt(p) + completion(p))[:c.prompt_prefix_len] + c.prompt_delta
    full_messages(c) = full_messages(p)[:c.request_prefix_messages] + stored_messages(c)

Rebuilding walks parent links iteratively (a 1,000-turn rollout is a 1,000-deep chain) and from the child up,
so it reads only the pieces that survive the cuts and stops at the first ancestor whose result is memoized.
Walking a rollout's calls in order therefore costs about one prompt's length per call. All functions are
synchronous; the gateway calls them on a worker thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.store import codec
from gateway.store.models import Call, Rollout

DEFAULT_MEMO_SIZE = 32


def get_call(session: Session, call_id: str) -> Call | None:
    return session.get(Call, call_id)


def calls_for_rollout(session: Session, rollout_id: str) -> list[Call]:
    statement = (
        sa.select(Call)
        .where(Call.rollout_id == rollout_id)
        .order_by(Call.started_at, Call.request_id, Call.choice_index, Call.id)
    )
    return list(session.scalars(statement))


def latest_call_by_tail_hash(session: Session, tail_hash: str, rollout_id: str | None = None) -> Call | None:
    """The most recent call whose conversation-after hash is ``tail_hash`` (optionally within one rollout)."""
    statement = sa.select(Call).where(Call.tail_hash == tail_hash)
    if rollout_id is not None:
        statement = statement.where(Call.rollout_id == rollout_id)
    statement = statement.order_by(Call.started_at.desc(), Call.id.desc()).limit(1)
    return session.scalars(statement).first()


@dataclass(frozen=True, slots=True)
class ContinuedCall:
    """A stored call that a new request continues, with what the prompt splice needs from it."""

    call_id: str
    rollout_id: str
    rollout_open: bool
    token_ids: list[int]  # its full prompt + completion
    completion_ids: list[int]
    messages: list[Any]  # its full request's messages
    policy_version: int | None = None


def continued_call(db: sa.Engine, tail_hash: str, rollout_id: str | None) -> ContinuedCall | None:
    """The latest successful call whose conversation-after hash is ``tail_hash``: within rollout ``rollout_id``,
    or, when that is None, among implicit rollouts."""
    with Session(db) as session:
        query = (
            sa.select(Call, Rollout.status)
            .join(Rollout, Rollout.id == Call.rollout_id)
            .where(Call.tail_hash == tail_hash, Call.status == "ok")
        )
        query = (
            query.where(Call.rollout_id == rollout_id)
            if rollout_id is not None
            else query.where(Rollout.kind == "implicit")
        )
        found = session.execute(query.order_by(Call.started_at.desc()).limit(1)).first()
        if found is None:
            return None
        call, status = found.tuple()
        cache = CallCache(session)
        completion = codec.unpack_ids(call.completion_ids)
        return ContinuedCall(
            call_id=call.id,
            rollout_id=call.rollout_id,
            rollout_open=status == "open",
            token_ids=full_prompt_ids(cache, call) + completion,
            completion_ids=completion,
            messages=cache.messages(call),
            policy_version=call.policy_version,
        )


def answered_here(db: sa.Engine, output_hashes: list[str], rollout_id: str | None) -> bool:
    """Whether a successful call generated one of these answers (``Call.output_hash``): within rollout
    ``rollout_id``, or, when that is None, among implicit rollouts."""
    with Session(db) as session:
        query = sa.select(Call.id).where(Call.output_hash.in_(output_hashes), Call.status == "ok")
        if rollout_id is not None:
            query = query.where(Call.rollout_id == rollout_id)
        else:
            query = query.join(Rollout, Rollout.id == Call.rollout_id).where(Rollout.kind == "implicit")
        return session.execute(query.limit(1)).first() is not None


class CallCache:
    """Calls by id (preloaded, or fetched through a session) and a small LRU memo of rebuilt results."""

    def __init__(
        self, session: Session | None = None, calls: Iterable[Call] = (), memo_size: int = DEFAULT_MEMO_SIZE
    ) -> None:
        self._session = session
        self._calls: dict[str, Call] = {call.id: call for call in calls}
        self._memo_size = memo_size
        self._prompts: OrderedDict[str, npt.NDArray[np.uint32]] = OrderedDict()
        self._messages: OrderedDict[str, list[Any]] = OrderedDict()

    @classmethod
    def for_rollout(cls, session: Session, rollout_id: str, memo_size: int = DEFAULT_MEMO_SIZE) -> CallCache:
        """All calls of a rollout loaded in one query (parents from other rollouts are fetched as needed)."""
        return cls(session, calls_for_rollout(session, rollout_id), memo_size)

    def get(self, call_id: str) -> Call:
        call = self._calls.get(call_id)
        if call is None and self._session is not None:
            call = self._session.get(Call, call_id)
            if call is not None:
                self._calls[call_id] = call
        if call is None:
            raise LookupError(f"call {call_id} not found")
        return call

    def prompt_array(self, call: Call) -> npt.NDArray[np.uint32]:
        """The call's full prompt token ids (read-only; copy before changing it)."""
        memo = _memo_get(self._prompts, call.id)
        if memo is not None:
            return memo
        pieces: list[npt.NDArray[np.uint32]] = []  # collected from the end of the prompt backwards
        need = call.prompt_len  # we still need the first `need` tokens of full_prompt(current)
        current = call
        seen: set[str] = set()
        while need > 0:
            if current.id in seen:
                raise ValueError(f"call {call.id}: parent links form a cycle at {current.id}")
            seen.add(current.id)
            if current is not call and (memo := _memo_get(self._prompts, current.id)) is not None:
                pieces.append(memo[:need])
                break
            delta = codec.ids_array(current.prompt_delta)
            prefix = current.prompt_prefix_len
            if prefix + len(delta) != current.prompt_len:
                raise ValueError(f"call {current.id}: prompt_len does not match prefix + delta")
            if need > prefix:
                pieces.append(delta[: need - prefix])
                need = prefix
            if need == 0:
                break
            # The first `need` tokens of (full_prompt(parent) + completion(parent)).
            if current.parent_call_id is None:
                raise ValueError(f"call {current.id}: prompt_prefix_len={prefix} but no parent call")
            parent = self.get(current.parent_call_id)
            if need > parent.prompt_len:
                completion = codec.ids_array(parent.completion_ids)
                take = need - parent.prompt_len
                if take > len(completion):
                    raise ValueError(f"call {current.id}: prefix exceeds its parent's prompt + completion")
                pieces.append(completion[:take])
                need = parent.prompt_len
            current = parent
        pieces.reverse()
        result = np.concatenate(pieces) if pieces else np.empty(0, dtype=codec.IDS_DTYPE)
        if len(result) != call.prompt_len:
            raise ValueError(f"call {call.id}: rebuilt {len(result)} tokens, expected {call.prompt_len}")
        result.flags.writeable = False
        _memo_put(self._prompts, call.id, result, self._memo_size)
        return result

    def messages(self, call: Call) -> list[Any]:
        """The call's full request message list (a new list; the message objects are shared)."""
        memo = _memo_get(self._messages, call.id)
        if memo is not None:
            return list(memo)
        pieces: list[list[Any]] = []
        need: int | None = None  # None: all of the target call's messages
        current = call
        seen: set[str] = set()
        while need is None or need > 0:
            if current.id in seen:
                raise ValueError(f"call {call.id}: parent links form a cycle at {current.id}")
            seen.add(current.id)
            if current is not call and (memo := _memo_get(self._messages, current.id)) is not None:
                assert need is not None  # set on the first step, which is the call itself
                if need > len(memo):
                    raise ValueError(f"call {current.id} has fewer messages than its child's prefix")
                pieces.append(memo[:need])
                break
            stored = _stored_messages(current)
            prefix = current.request_prefix_messages
            if need is None:
                need = prefix + len(stored)
            if need > prefix:
                pieces.append(stored[: need - prefix])
                need = prefix
            if need == 0:
                break
            if current.parent_call_id is None:
                raise ValueError(f"call {current.id}: request_prefix_messages={prefix} but no parent call")
            current = self.get(current.parent_call_id)
        full = [message for piece in reversed(pieces) for message in piece]
        _memo_put(self._messages, call.id, full, self._memo_size)
        return list(full)

    def request(self, call: Call) -> dict[str, Any]:
        """The request body as the gateway received it."""
        stored = codec.unpack_request(call.request)
        key = codec.messages_key(stored)
        if key is None:
            if call.request_prefix_messages:
                raise ValueError(f"call {call.id}: request_prefix_messages set but no message list stored")
            return stored
        return {**stored, key: self.messages(call)}


def _stored_messages(call: Call) -> list[Any]:
    stored = codec.unpack_request(call.request)
    key = codec.messages_key(stored)
    return list(stored[key]) if key is not None else []


def _memo_get(memo: OrderedDict[str, Any], key: str) -> Any:
    value = memo.get(key)
    if value is not None:
        memo.move_to_end(key)
    return value


def _memo_put(memo: OrderedDict[str, Any], key: str, value: Any, size: int) -> None:
    if size <= 0:
        return
    memo[key] = value
    memo.move_to_end(key)
    while len(memo) > size:
        memo.popitem(last=False)


def _cache(source: Session | CallCache) -> CallCache:
    return source if isinstance(source, CallCache) else CallCache(source)


def full_prompt_ids(source: Session | CallCache, call: Call) -> list[int]:
    """The exact token ids of the call's prompt. Pass one CallCache to rebuild many calls of a rollout."""
    return _cache(source).prompt_array(call).tolist()


def full_prompt_array(source: Session | CallCache, call: Call) -> npt.NDArray[np.uint32]:
    return _cache(source).prompt_array(call)


def full_request(source: Session | CallCache, call: Call) -> dict[str, Any]:
    """The request body as received, its full message list rebuilt from the parent chain."""
    return _cache(source).request(call)
