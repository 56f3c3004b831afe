"""The runner's client for the gateway's rollout API, and the failures it tells apart.

Transient answers (unreachable, 429, 502–504) are retried with backoff and then raised as ``InfraFailure``, which
the runner retries as a new rollout; a refused admin key or a gateway without models ends the run
(``RunAborted``); any other error answer is a ``GatewayError``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

TRANSIENT_STATUS = (429, 502, 503, 504)
DEFAULT_GATEWAY = "http://127.0.0.1:8080"  # CLAWGATE_GATEWAY_URL when unset


class InfraFailure(Exception):
    """Something outside the model failed (gateway unreachable, sandbox not starting): worth retrying."""


class RunAborted(Exception):
    """The run cannot go on at all (the gateway refuses the admin key, the model cannot be found)."""


class GatewayError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class GatewayClient:
    """The rollout API, with transient failures retried and then raised as ``InfraFailure``."""

    def __init__(self, base: str, admin_key: str | None, *, attempts: int = 3, backoff: float = 0.5) -> None:
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.base = base
        self.attempts = attempts
        self.backoff = backoff
        self.http = httpx.AsyncClient(base_url=base, headers=headers, timeout=httpx.Timeout(120.0, connect=10.0))

    async def close(self) -> None:
        await self.http.aclose()

    async def request(self, method: str, url: str, *, key: str | None = None, **kwargs: Any) -> Any:
        headers = {"Authorization": f"Bearer {key}"} if key else None
        last = ""
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                resp = await self.http.request(method, url, headers=headers, **kwargs)
            except httpx.TransportError as exc:
                last = f"{method} {url}: {type(exc).__name__}: {exc}"
                continue
            if resp.status_code in TRANSIENT_STATUS:
                last = f"{method} {url}: HTTP {resp.status_code}: {resp.text[:300]}"
                continue
            if resp.status_code in (401, 403) and key is None:
                raise RunAborted(f"the gateway refused the admin key ({method} {url}): {resp.text[:300]}")
            if resp.status_code >= 400:
                raise GatewayError(resp.status_code, f"{method} {url}: {resp.text[:500]}")
            return resp.json()
        raise InfraFailure(f"gateway unreachable: {last}")

    async def create_rollout(self, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("POST", "/v1/rollouts", json=body)
        return result

    async def post_reward(self, rollout_id: str, value: float, details: dict[str, Any]) -> None:
        body = {"value": value, "source": "verifier", "details": details}
        await self.request("POST", f"/v1/rollouts/{rollout_id}/reward", json=body)

    async def finish(self, rollout_id: str, status: str, reason: str) -> None:
        body = {"status": status, "reason": reason[:2000]}
        await self.request("POST", f"/v1/rollouts/{rollout_id}/finish", json=body)

    async def rollout(self, rollout_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", f"/v1/rollouts/{rollout_id}", params={"tokens": "false"})
        return result

    async def first_model(self, base_url: str, key: str) -> str:
        data = await self.request("GET", base_url.rstrip("/") + "/models", key=key)
        models = data.get("data") or []
        if not models:
            raise RunAborted("the gateway lists no models: pass --model")
        return str(models[0]["id"])
