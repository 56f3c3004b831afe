"""The request body limit: a body over ``max_bytes`` is refused with 413 before it is read whole.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which adds a task and a copy per request): a declared
``Content-Length`` over the limit is answered at once, without reading the body; a chunked body is counted as it
arrives and reading stops at the limit, so no client can make the gateway buffer gigabytes.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError


class PayloadTooLarge(APIError):
    status_code = 413
    type = "request_too_large"


class BodyLimit:
    def __init__(self, app: ASGIApp, *, max_bytes: int, anthropic_path: Any) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.anthropic_path = anthropic_path  # path -> bool: answer in the Anthropic error shape

    def _error(self) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"request body exceeds {self.max_bytes} bytes (CLAWGATE_MAX_REQUEST_BYTES)", code="request_too_large"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.max_bytes:
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._refuse(scope, send)
                    return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._error()
            return message

        await self.app(scope, limited, send)

    async def _refuse(self, scope: Scope, send: Send) -> None:
        error = self._error()
        body = error.to_anthropic() if self.anthropic_path(scope.get("path", "")) else error.to_dict()
        payload = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        # The body was not read: close the connection rather than leave it in an unknown state.
        headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
