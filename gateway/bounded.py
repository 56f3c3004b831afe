"""Per-id memory that a long-running gateway can hold without growing with every id it ever saw.

New rollout, conversation and response ids keep appearing for as long as a gateway serves, so anything it keeps
per id must forget: ``LRUDict`` keeps the most recently used ``max_size`` entries (a cache in front of the
database: a forgotten entry is read again), ``ExpiringSet`` remembers each member for ``ttl`` seconds after it was
last added (a fact that matters only for a bounded time, such as "this rollout was closed").
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")


class LRUDict(MutableMapping[K, V]):
    """A dict that keeps only its ``max_size`` most recently read or written entries."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._data: OrderedDict[K, V] = OrderedDict()

    def __getitem__(self, key: K) -> V:
        value = self._data[key]
        self._data.move_to_end(key)
        return value

    def __setitem__(self, key: K, value: V) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.max_size:
            self._data.popitem(last=False)

    def __delitem__(self, key: K) -> None:
        del self._data[key]

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class ExpiringSet(Generic[T]):
    """A set whose members are forgotten ``ttl`` seconds after they were last added."""

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self._clock = clock
        self._added: OrderedDict[T, float] = OrderedDict()  # oldest first

    def add(self, member: T) -> None:
        now = self._clock()
        self._added[member] = now
        self._added.move_to_end(member)
        self._expire(now)

    def update(self, members: Iterable[T]) -> None:
        for member in members:
            self.add(member)

    def __contains__(self, member: object) -> bool:
        added = self._added.get(member)  # type: ignore[arg-type]
        return added is not None and added > self._clock() - self.ttl

    def __len__(self) -> int:
        self._expire(self._clock())
        return len(self._added)

    def _expire(self, now: float) -> None:
        stale = now - self.ttl
        while self._added:
            member, added = next(iter(self._added.items()))
            if added > stale:
                break
            del self._added[member]
