"""Conversations of earlier Responses-API answers, kept so a request can continue one by `previous_response_id`.

Each stored response holds its whole conversation as internal ``Message``s: the input items it was given (after
those of the response it continued) and its own answer turn. Instructions are not part of it: the API does not
carry them over to a continuation. A continuation's prompt is then the stored conversation plus the new items,
and since the stored answer is exactly the message the service registered, TITO splices its raw tokens.

The database is the shared truth, so a continuation works on any gateway process and after a restart: each
answer is committed with its call (``stored_responses``, see ``job.ResponseCapture``), holding only the items it
added and the id of the response it continued, so a long chain costs its unique text once, not once per turn.
In front of it sits this process's cache, bounded (least recently used responses are forgotten); lists share
their ``Message`` objects with the responses they extend. A response created with ``store: false`` is
remembered only as an id (a row without items), so a continuation of it can be refused with a clear message.

With durable capture (the default) the row is committed before the client sees the response end, so a
follow-up sent to another process right away finds it. Without it, a miss waits up to ``miss_wait_s`` for the
other process's writer to commit (its flush interval is much shorter) before answering "not found".
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import sqlalchemy as sa

from gateway.core.conversation import Message, message_from_dict
from gateway.store import stored_responses

MISS_POLL_S = 0.05


class Found(enum.Enum):
    MISSING = "missing"
    UNSTORED = "unstored"


class ResponseStore:
    def __init__(
        self,
        max_responses: int = 2048,
        max_unstored_ids: int = 16384,
        *,
        db: sa.Engine | None = None,
        miss_wait_s: float = 0.0,
    ) -> None:
        self.max_responses = max_responses
        self.max_unstored_ids = max_unstored_ids
        self.db = db
        self.miss_wait_s = miss_wait_s
        # response id -> (its tenant, its conversation); an id of another tenant is "not found".
        self._conversations: OrderedDict[str, tuple[str, tuple[Message, ...]]] = OrderedDict()
        self._unstored: OrderedDict[str, str] = OrderedDict()  # response id -> its tenant

    def __len__(self) -> int:
        return len(self._conversations)

    def put(self, response_id: str, conversation: Sequence[Message], tenant: str = "default") -> None:
        self._conversations[response_id] = (tenant, tuple(conversation))
        self._conversations.move_to_end(response_id)
        while len(self._conversations) > self.max_responses:
            self._conversations.popitem(last=False)

    def mark_unstored(self, response_id: str, tenant: str = "default") -> None:
        self._unstored[response_id] = tenant
        while len(self._unstored) > self.max_unstored_ids:
            self._unstored.popitem(last=False)

    def get(self, response_id: str, tenant: str = "default") -> tuple[Message, ...] | None:
        """The cached conversation ending with that response's answer, or None if this process does not hold it
        for ``tenant``."""
        held = self._conversations.get(response_id)
        if held is None or held[0] != tenant:
            return None
        self._conversations.move_to_end(response_id)
        return held[1]

    def discard(self, response_ids: Iterable[str]) -> None:
        """Forget these responses (deleted from the database): a continuation of one is refused as unknown."""
        for response_id in response_ids:
            self._conversations.pop(response_id, None)

    def was_unstored(self, response_id: str, tenant: str = "default") -> bool:
        """Whether this process knows the response was created with ``store: false`` (by ``tenant``)."""
        return self._unstored.get(response_id) == tenant

    async def find(self, response_id: str, tenant: str = "default") -> tuple[Message, ...] | Found:
        """The stored conversation ending with that response's answer: from the cache, else from the database.
        Another tenant's response is MISSING, as an unknown one is."""
        conversation = self.get(response_id, tenant)
        if conversation is not None:
            return conversation
        if self.was_unstored(response_id, tenant):
            return Found.UNSTORED
        if self.db is None:
            return Found.MISSING
        deadline = time.monotonic() + self.miss_wait_s
        while True:
            found = await asyncio.to_thread(self._load, response_id, tenant)
            if found is not Found.MISSING or time.monotonic() >= deadline:
                break
            await asyncio.sleep(MISS_POLL_S)
        if found is Found.UNSTORED:
            self.mark_unstored(response_id, tenant)
        elif found is not Found.MISSING:
            self.put(response_id, found, tenant)
        return found

    def _load(self, response_id: str, tenant: str) -> tuple[Message, ...] | Found:
        """The conversation from the database, read back to a response this process holds (or to the first)."""
        assert self.db is not None
        found = stored_responses.chain(self.db, response_id, lambda rid: rid in self._conversations, tenant)
        if found.status != "ok":
            return Found.UNSTORED if found.status == "unstored" else Found.MISSING
        base: tuple[Message, ...] = ()
        if found.base is not None:
            held = self._conversations.get(found.base)
            if held is None:  # evicted meanwhile: read the whole chain
                found = stored_responses.chain(self.db, response_id, lambda rid: False, tenant)
            else:
                base = held[1]
        return (*base, *(message_from_dict(item) for item in found.items))
