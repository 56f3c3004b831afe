"""What a vLLM engine does on every replica rather than through the router: adapter loads, unloads, the adapter
list, the check that an adapter answers, and the ``--max-loras`` check (see ``gateway/engines/vllm.py``).

A replica that is down is skipped as long as one answered (it is given the current version when it is back); any
other failure is raised.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from gateway.engines.vllm_wire import LORA_INFO, error_from_response, max_loras_of
from gateway.errors import APIError, BadRequest, EngineError, EngineUnavailable, NotFound

logger = logging.getLogger("gateway.engines.vllm")

# How long a fresh server may take to publish its first step's stats after answering (seconds).
STATS_WAIT_S = 2.0

# The engine's control-plane request: (method, path, base=..., body=..., brief=...) -> (status, body).
Request = Callable[..., Awaitable[tuple[int, bytes]]]


class TooFewLoras(RuntimeError):
    """A vLLM server's ``--max-loras`` is below the number of adapters the gateway serves side by side."""


class Replicas:
    """The replicas at ``urls`` (the one server when there is no router), reached through ``request``; ``model`` is
    the base model's served name (the one-token generation a fresh server is given)."""

    def __init__(self, urls: list[str], request: Request, model: str) -> None:
        self.replicas = urls
        self.request = request
        self.model = model

    async def load_adapter(self, name: str, path: str) -> None:
        await self.on_every_replica(self._load_on, name, str(path))

    async def _load_on(self, url: str, name: str, path: str) -> None:
        status, body = await self.request(
            "POST", "/v1/load_lora_adapter", base=url, body={"lora_name": name, "lora_path": path}
        )
        if status < 400:
            return
        error = error_from_response(status, body, "/v1/load_lora_adapter")
        # Loading the same name from the same folder again (say, after a gateway restart) is a no-op; a new
        # folder under an old name is refused, because vLLM's prefix cache would mix the two weights.
        if (
            isinstance(error, BadRequest)
            and "already been loaded" in error.message
            and await self.adapter_path(name, url) == path
        ):
            return
        raise error

    async def unload_adapter(self, name: str) -> None:
        await self.on_every_replica(self._unload_on, name)

    async def _unload_on(self, url: str, name: str) -> None:
        status, body = await self.request("POST", "/v1/unload_lora_adapter", base=url, body={"lora_name": name})
        if status >= 400:
            error = error_from_response(status, body, "/v1/unload_lora_adapter")
            # A replica that restarted since the load no longer has it, which is what unloading asks for.
            if len(self.replicas) > 1 and isinstance(error, NotFound):
                return
            raise error

    async def adapters(self) -> list[str]:
        """The adapters loaded on every reachable replica (on the one server)."""
        answers = await asyncio.gather(*(self.model_cards(url) for url in self.replicas), return_exceptions=True)
        loaded: list[list[str]] = []
        for answer in answers:
            if isinstance(answer, EngineUnavailable) and len(self.replicas) > 1:
                continue  # down: it is given the current version when it is back
            if isinstance(answer, BaseException):
                raise answer
            loaded.append([card["id"] for card in answer if card.get("parent")])
        if not loaded:
            raise EngineUnavailable(f"no vLLM replica answers ({', '.join(self.replicas)})")
        everywhere = set.intersection(*(set(names) for names in loaded))
        return [name for name in loaded[0] if name in everywhere]

    async def verify_adapter(self, name: str, prompt_ids: list[int]) -> None:
        # Each replica asked directly, not through the router: the router would verify one replica, and a replica's
        # LoRA resolver would load an adapter it was not given (say, one kept from it on purpose during a partition).
        await self.on_every_replica(self._verify_on, name, list(prompt_ids) or [0])

    async def _verify_on(self, url: str, name: str, prompt: list[int]) -> None:
        body = {"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
        status, answer = await self.request("POST", "/v1/completions", base=url, body=body)
        if status >= 400:
            raise error_from_response(status, answer, "/v1/completions")
        try:
            if not orjson.loads(answer)["choices"]:
                raise ValueError("no choice")
        except (ValueError, KeyError, TypeError) as exc:
            raise EngineError(f"vLLM at {url} sent an unreadable answer through {name}: {answer[:200]!r}") from exc

    async def on_every_replica(self, step: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run ``step(url, *args)`` on every replica at once; a replica that is down is skipped as long as one
        answered, any other failure is raised."""
        results = await asyncio.gather(*(step(url, *args) for url in self.replicas), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        down = [e for e in errors if isinstance(e, EngineUnavailable)]
        for error in errors:
            if not isinstance(error, EngineUnavailable) or len(down) == len(results) or len(self.replicas) == 1:
                raise error
        for error in down:
            logger.warning("%s (skipped: it gets the current version when it is back)", error.message)

    async def check_max_loras(self, min_loras: int) -> dict[str, int | None]:
        """Each replica's ``--max-loras`` (None: not reported); ``TooFewLoras`` when one is below ``min_loras``."""
        found = await asyncio.gather(*(self._max_loras_on(url) for url in self.replicas))
        max_loras = dict(zip(self.replicas, found, strict=True))
        too_few = {url: n for url, n in max_loras.items() if n is not None and n < min_loras}
        if too_few:
            servers = ", ".join(f"{url} has --max-loras {n}" for url, n in too_few.items())
            raise TooFewLoras(
                f"vLLM cannot batch the {min_loras} LoRA adapters this gateway serves side by side (guarded "
                f"promotion: the incumbent and a candidate): {servers}; start vLLM with --max-loras "
                f"{min_loras} or more"
            )
        for url, n in max_loras.items():
            if n is None:
                logger.warning(
                    "vLLM at %s does not report its --max-loras (no %s on /metrics): could not check that it "
                    "batches the %d LoRA adapters served side by side",
                    url,
                    LORA_INFO,
                    min_loras,
                )
            else:
                logger.info("vLLM at %s batches up to %d LoRA adapters (--max-loras %d)", url, n, n)
        return max_loras

    async def _max_loras_on(self, url: str) -> int | None:
        """``url``'s ``--max-loras`` from its ``/metrics``; None when it does not say (or does not answer)."""
        try:
            text = await self._metrics(url)
            if max_loras_of(text) is None and LORA_INFO in text:
                # Declared without a sample: the server has not run an engine step yet (see vllm_wire). One now.
                probe = {"model": self.model, "prompt": [0], "max_tokens": 1, "temperature": 0.0}
                await self.request("POST", "/v1/completions", base=url, body=probe)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + STATS_WAIT_S
                while max_loras_of(text := await self._metrics(url)) is None and loop.time() < deadline:
                    await asyncio.sleep(0.1)
        except APIError:
            return None
        return max_loras_of(text)

    async def _metrics(self, url: str) -> str:
        status, body = await self.request("GET", "/metrics", base=url, brief=True)
        return body.decode(errors="replace") if status < 400 else ""

    async def model_cards(self, base: str) -> list[dict[str, Any]]:
        status, body = await self.request("GET", "/v1/models", base=base)
        if status >= 400:
            raise error_from_response(status, body, "/v1/models")
        try:
            cards: list[dict[str, Any]] = orjson.loads(body).get("data", [])
        except (ValueError, AttributeError) as exc:
            raise EngineError(f"vLLM at {base} sent an unreadable model list") from exc
        return cards

    async def adapter_path(self, name: str, base: str) -> str | None:
        for card in await self.model_cards(base):
            if card.get("id") == name and card.get("parent"):
                root: str | None = card.get("root")
                return root
        return None
