"""Conversations of earlier Responses-API answers, kept so a request can continue one by `previous_response_id`.

Each stored response holds its whole conversation as internal ``Message``s: the input items it was given (after
those of the response it continued) and its own answer turn. Instructions are not part of it: the API does not
carry them over to a continuation. A continuation's prompt is then the stored conversation plus the new items,
and since the stored answer is exactly the message the service registered, TITO splices its raw tokens.

The store is in memory and bounded (least recently used responses are forgotten); a response created with
``store: false`` is remembered only as an id, so a continuation of it can be refused with a clear message.
Lists share their ``Message`` objects with the responses they extend, so a long chain costs one reference per
message per response, not a copy of every message.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from gateway.conversation import Message


class ResponseStore:
    def __init__(self, max_responses: int = 2048, max_unstored_ids: int = 16384) -> None:
        self.max_responses = max_responses
        self.max_unstored_ids = max_unstored_ids
        self._conversations: OrderedDict[str, tuple[Message, ...]] = OrderedDict()
        self._unstored: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._conversations)

    def put(self, response_id: str, conversation: Sequence[Message]) -> None:
        self._conversations[response_id] = tuple(conversation)
        self._conversations.move_to_end(response_id)
        while len(self._conversations) > self.max_responses:
            self._conversations.popitem(last=False)

    def mark_unstored(self, response_id: str) -> None:
        self._unstored[response_id] = None
        while len(self._unstored) > self.max_unstored_ids:
            self._unstored.popitem(last=False)

    def get(self, response_id: str) -> tuple[Message, ...] | None:
        """The stored conversation ending with that response's answer, or None if it is not stored."""
        conversation = self._conversations.get(response_id)
        if conversation is not None:
            self._conversations.move_to_end(response_id)
        return conversation

    def was_unstored(self, response_id: str) -> bool:
        """Whether the response exists but was created with ``store: false``."""
        return response_id in self._unstored
