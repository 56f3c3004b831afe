"""Helpers every protocol's routes share: SSE framing, response headers, body parsing, and running the n
choices of a request (interleaved for streams, gathered otherwise) with their iterators always closed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from gateway.errors import BadRequest
from gateway.service import ChoiceDelta, ChoiceResult, Prepared

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def call_headers(prep: Prepared) -> dict[str, str]:
    return {"x-clawgate-call-id": ",".join(prep.call_ids), "x-clawgate-rollout-id": prep.rollout_id}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def merge(
    iterators: list[AsyncIterator[ChoiceDelta | ChoiceResult]],
) -> AsyncIterator[ChoiceDelta | ChoiceResult]:
    """Interleave the n choices' streams as their tokens arrive."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[ChoiceDelta | ChoiceResult]) -> None:
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


async def prefetch(
    it: AsyncIterator[ChoiceDelta | ChoiceResult],
) -> tuple[ChoiceDelta | ChoiceResult | None, AsyncIterator[ChoiceDelta | ChoiceResult]]:
    """Pull the first event before answering, so an engine error that happens at once gets a real status code."""
    try:
        first = await anext(it)
    except StopAsyncIteration:
        return None, it
    except BaseException:
        await it.aclose()  # type: ignore[attr-defined]
        raise

    async def chained() -> AsyncIterator[ChoiceDelta | ChoiceResult]:
        try:
            yield first
            async for item in it:
                yield item
        finally:
            await it.aclose()  # type: ignore[attr-defined]

    return first, chained()


async def collect_all(iterators: list[AsyncIterator[ChoiceDelta | ChoiceResult]]) -> list[ChoiceResult]:
    async def one(it: AsyncIterator[ChoiceDelta | ChoiceResult]) -> ChoiceResult:
        result: ChoiceResult | None = None
        try:
            async for item in it:
                if isinstance(item, ChoiceResult):
                    result = item
        finally:
            await it.aclose()  # type: ignore[attr-defined]
        assert result is not None
        return result

    if len(iterators) == 1:
        return [await one(iterators[0])]
    return list(await asyncio.gather(*(one(it) for it in iterators)))


async def json_body(request: Request) -> dict[str, Any]:
    body = await request.body()
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise BadRequest("request body must be a JSON object")
    return value
