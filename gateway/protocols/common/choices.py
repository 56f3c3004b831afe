"""Running a request's n choices: interleaved as their tokens arrive (streams) or gathered (whole responses),
with every choice's iterator closed whatever happens, so the service's ``finally`` records each call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from gateway.core.job import ChoiceDelta, ChoiceResult

Event = ChoiceDelta | ChoiceResult


async def merge(iterators: list[AsyncIterator[Event]]) -> AsyncIterator[Event]:
    """Interleave the n choices' streams as their tokens arrive."""
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield item
        finally:
            await iterators[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[Event]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
            await queue.put((i, None))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            _, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for it in iterators:
            await it.aclose()  # type: ignore[attr-defined]


async def prefetch(it: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """Pull the first event before answering, so an engine error that happens at once gets a real status code."""
    try:
        first = await anext(it)
    except StopAsyncIteration:
        return it
    except BaseException:
        await it.aclose()  # type: ignore[attr-defined]
        raise

    async def chained() -> AsyncIterator[Event]:
        try:
            yield first
            async for item in it:
                yield item
        finally:
            await it.aclose()  # type: ignore[attr-defined]

    return chained()


async def collect_all(
    iterators: list[AsyncIterator[Event]], observe: Callable[[ChoiceDelta], None] | None = None
) -> list[ChoiceResult]:
    """Each choice's result, in order; ``observe`` sees every delta on the way (token counts, ids)."""

    async def one(it: AsyncIterator[Event]) -> ChoiceResult:
        result: ChoiceResult | None = None
        try:
            async for item in it:
                if isinstance(item, ChoiceResult):
                    result = item
                elif observe is not None:
                    observe(item)
        finally:
            await it.aclose()  # type: ignore[attr-defined]
        assert result is not None
        return result

    if len(iterators) == 1:
        return [await one(iterators[0])]
    return list(await asyncio.gather(*(one(it) for it in iterators)))
