"""Scripted HTTP servers for protocol edge cases a real vLLM cannot produce on demand (a 429, a stream cut short, a
stall): real aiohttp servers on loopback ports, so the engine's own HTTP client is what is tested.

A test's handler is a plain function of an ``httpx.Request`` (the request as received: method, path, headers,
body) returning an ``httpx.Response`` (status, headers and body to send). Raising ``httpx.TimeoutException`` makes
the server stall without answering (until the client gives up); any other ``httpx.TransportError`` makes it drop
the connection without answering. ``name`` is the base URL the handler sees in ``request.url`` (several scripted
servers can then tell which of them was asked).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
from aiohttp import web

Handler = Callable[[httpx.Request], httpx.Response]


@asynccontextmanager
async def scripted_server(handler: Handler, name: str | None = None) -> AsyncIterator[str]:
    """Serve ``handler`` on a free loopback port while the block runs; yields the server's base URL."""
    released = asyncio.Event()  # lets stalled handlers finish when the block ends

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        url = (name or f"http://{request.host}") + str(request.rel_url)
        seen = httpx.Request(request.method, url, headers=list(request.headers.items()), content=body)
        try:
            response = handler(seen)
        except httpx.TimeoutException:
            await released.wait()
            raise web.HTTPServiceUnavailable() from None
        except httpx.TransportError:
            assert request.transport is not None
            request.transport.abort()
            raise web.HTTPServiceUnavailable() from None
        framing = ("content-length", "transfer-encoding")  # aiohttp frames the body itself
        headers = {k: v for k, v in response.headers.items() if k.lower() not in framing}
        return web.Response(status=response.status_code, body=response.content, headers=headers)

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        released.set()
        await runner.cleanup()
