"""vLLM engine: an httpx client of a vLLM (0.32) OpenAI-compatible server, token ids in and token ids out.

Every generation is one streamed ``POST /v1/completions`` whose ``prompt`` is the token id list the gateway
rendered; the request body, the reading of vLLM's answers and the mapping of its errors onto ``gateway.errors``
are pure functions in ``gateway.engines.vllm_wire`` (with the vLLM behaviour they rely on), so this module holds
the HTTP client, the engine's lifecycle, adapters and aborts.

Closing the stream closes the connection, and vLLM aborts a request whose client disconnected, but its API
server can notice that late: measured here, one closed stream went on for 3149 more tokens (25 s). So a
generation that ends before its finish (the consumer closed the stream, the task was cancelled) is also
aborted explicitly: each request carries ``X-Request-Id`` (vLLM names it ``cmpl-<id>-0``) and is named in
``POST /inference/v1/abort_requests``, which vLLM serves when started with ``--enable-scale-out``
(``VLLMServer`` and the compose file pass it). Without that endpoint (403/404) the client stops trying and
relies on the disconnect alone.

Several replicas (``replicas``: their base URLs) sit behind a router at ``base_url`` (``vllm-router``, see
``gateway/engines/vllm_router.py``). Generations go through the router with the rollout id in ``X-Session-ID``,
which its ``consistent_hash`` policy hashes first, so a rollout's calls reach the replica that holds its prefix
cache. What every replica must do goes to each of them directly: adapter loads and unloads (a version is served
only after every reachable replica loaded it), the adapter list (the versions loaded on every reachable replica,
so a replica that came back without the current version makes the policy follower load it again), and aborts
(the router does not say which replica runs a request; an abort naming an id a replica does not know is a no-op
there). A replica that is down is skipped; when none answers the engine is unavailable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from typing import Any

import httpx
from httpx_aiohttp import AiohttpTransport

from gateway.engines.base import FinishReason, GenerationEnd, GenerationEvent, GenerationRequest
from gateway.engines.vllm_wire import (
    FINISH_REASONS,
    completion_body,
    error_from_response,
    stream_error,
    token_delta,
    transport_error,
)
from gateway.engines.vllm_wire import timings as read_timings
from gateway.errors import APIError, BadRequest, EngineError, EngineTimeout, EngineUnavailable, NotFound

logger = logging.getLogger(__name__)
# The header vllm-router's consistent_hash policy reads first (before X-User-ID, X-Request-ID, body fields).
SESSION_HEADER = "X-Session-ID"


class VLLMEngine:
    """``Engine`` backed by a vLLM server at ``base_url`` (without the ``/v1`` suffix) serving ``model``.

    ``replicas`` are the base URLs of the vLLM servers behind a router at ``base_url`` (see the module
    docstring); empty for one server. ``eos_token_ids`` are the ids that end a turn for this model (the
    tokenizer's EOS and, for chat models, the generation config's extra ones). They are sent as
    ``stop_token_ids`` on every request, so generation stops on them whether or not the server read the model's
    generation config. ``client`` lets a caller share one ``httpx.AsyncClient`` (it is then not closed by
    ``close``); otherwise ``start`` creates one sized for ``max_connections`` concurrent streams.
    """

    name = "vllm"

    def __init__(
        self,
        base_url: str,
        *,
        model: str,
        client: httpx.AsyncClient | None = None,
        timeout: float = 600.0,
        max_model_len: int | None = None,
        api_key: str | None = None,
        eos_token_ids: Iterable[int] = (),
        max_connections: int = 512,
        connect_timeout: float = 5.0,
        replicas: Iterable[str] = (),
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # Where adapter loads, the adapter list and aborts go: each replica, or the one server.
        self.replicas = [url.rstrip("/") for url in replicas] or [self.base_url]
        self.model = model
        self.max_model_len = max_model_len or 0
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self._requested_max_model_len = max_model_len
        self._client = client
        self._owns_client = client is None
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._max_connections = max_connections
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # None until an abort was tried: whether the server has the abort endpoint (see the module docstring).
        self.abort_supported: bool | None = None
        self.aborts_sent = 0
        self._aborts: set[asyncio.Task[None]] = set()

    # ---- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._client is None:
            # httpx's API over aiohttp's HTTP/1.1 implementation: measured here against vLLM, a streamed
            # 16-token completion cost the gateway 5.9 ms of CPU with httpx's own transport and 2.9 ms with this
            # one (1.7 vs 1.3 ms unstreamed), and that CPU is taken from the engine on a shared host.
            self._client = httpx.AsyncClient(
                transport=AiohttpTransport(
                    limits=httpx.Limits(
                        max_connections=self._max_connections,
                        max_keepalive_connections=min(self._max_connections, 64),
                    )
                ),
                # `read` bounds the gap between two stream chunks, so a long generation is fine while a
                # stalled server is not; a refused or hanging connect fails fast.
                timeout=httpx.Timeout(self._timeout, connect=self._connect_timeout),
                limits=httpx.Limits(
                    max_connections=self._max_connections,
                    max_keepalive_connections=min(self._max_connections, 64),
                ),
            )
            self._owns_client = True
        if self._requested_max_model_len is None:
            self.max_model_len = await self._served_max_model_len()

    async def close(self) -> None:
        if self._aborts:
            await asyncio.wait(set(self._aborts), timeout=5.0)
        if self._client is not None and self._owns_client:
            await self._client.aclose()
            self._client = None

    async def health(self) -> bool:
        if self._client is None:
            return False
        try:
            response = await self._client.get(f"{self.base_url}/health", headers=self._headers, timeout=5.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    # ---- generation --------------------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationEvent, None]:
        if not request.stream:
            async for event in self._generate_whole(request):
                yield event
            return
        body = self._completion_body(request)
        http = self._http
        finish: FinishReason | None = None
        stop_reason: str | int | None = None
        last_token: int | None = None
        prompt_tokens = len(request.prompt_ids)
        timings: dict[str, float] = {}
        vllm_id, headers = self._request_id(request)
        running = False  # vLLM accepted the request and has not reported its end
        try:
            async with http.stream("POST", f"{self.base_url}/v1/completions", json=body, headers=headers) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise error_from_response(response)
                running = True
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        # Keep reading to the end of the body: a response closed early also closes its
                        # connection, and the next request would pay for a new one.
                        continue
                    try:
                        chunk = json.loads(data)
                    except ValueError as exc:
                        raise EngineError(f"vLLM sent an unreadable stream event: {data[:200]!r}") from exc
                    if "error" in chunk:
                        raise stream_error(chunk)
                    for choice in chunk.get("choices") or ():
                        delta = token_delta(choice, request.params.top_logprobs)
                        if delta is not None:
                            last_token = delta.token_ids[-1]
                            yield delta
                        if choice.get("finish_reason") is not None:
                            finish = FINISH_REASONS.get(choice["finish_reason"], "stop")
                            stop_reason = choice.get("stop_reason")
                            running = False
                    usage = chunk.get("usage")
                    if usage:
                        prompt_tokens = int(usage.get("prompt_tokens", prompt_tokens))
                        timings = read_timings(chunk.get("metrics"))
        except httpx.TransportError as exc:
            raise self._transport_error(exc) from exc
        finally:
            if running:  # closed, cancelled or failed before vLLM finished: it may still be generating
                self._abort_later(vllm_id)
        if finish is None:
            raise EngineError("vLLM ended the stream without a finish reason")
        if finish == "stop" and stop_reason is None:
            # The primary EOS id: vLLM reports no stop_reason for it, but it is the last id it sent.
            stop_reason = last_token
        yield GenerationEnd(finish_reason=finish, stop_reason=stop_reason, prompt_tokens=prompt_tokens, timings=timings)

    def _request_id(self, request: GenerationRequest) -> tuple[str, dict[str, str]]:
        """vLLM's id for this request (``cmpl-<X-Request-Id>-<prompt index>``) and the headers that set it.

        A random suffix keeps it unique when one gateway id is generated twice (a retry, several choices).
        """
        sent = f"{request.request_id}-{secrets.token_hex(4)}"
        headers = {**self._headers, "X-Request-Id": sent}
        if request.session_id is not None:
            # The router's first hash key; without it, it would hash X-Request-Id and scatter a rollout.
            headers[SESSION_HEADER] = request.session_id
        return f"cmpl-{sent}-0", headers

    def _abort_later(self, vllm_id: str) -> None:
        """Ask vLLM to stop ``vllm_id`` without making the caller wait (it may be closing or cancelled)."""
        if self.abort_supported is False or self._client is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # closed outside the event loop (garbage collection at exit): nothing to run on
            return
        task = loop.create_task(self._abort(vllm_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, vllm_id: str) -> None:
        if len(self.replicas) == 1:  # no gather: its extra tasks would let a second close abort before this ends
            answers = [await self._abort_on(self.replicas[0], vllm_id)]
        else:
            answers = await asyncio.gather(*(self._abort_on(url, vllm_id) for url in self.replicas))
        responses = [r for r in answers if r is not None]
        if not responses:
            return
        # Every replica runs the same server, so the first answer tells whether the endpoint exists.
        response = next((r for r in responses if r.status_code < 400), responses[0])
        if response.status_code in (403, 404, 405):
            if self.abort_supported is not False:
                logger.info(
                    "vLLM at %s has no abort endpoint (start it with --enable-scale-out); a closed stream "
                    "then relies on vLLM noticing the disconnect",
                    self.base_url,
                )
            self.abort_supported = False
        elif response.status_code < 400:
            self.abort_supported = True
            self.aborts_sent += 1
        else:
            logger.debug("vLLM refused to abort %s: %s %s", vllm_id, response.status_code, response.text[:200])

    async def _abort_on(self, url: str, vllm_id: str) -> httpx.Response | None:
        try:
            return await self._http.post(
                f"{url}/inference/v1/abort_requests",
                json={"request_ids": [vllm_id]},
                headers=self._headers,
                timeout=5.0,
            )
        except (httpx.HTTPError, EngineUnavailable, RuntimeError) as exc:  # RuntimeError: the client was closed
            logger.debug("could not abort vLLM request %s at %s: %r", vllm_id, url, exc)
            return None

    def _transport_error(self, exc: httpx.TransportError) -> APIError:
        return transport_error(self.base_url, exc)

    async def _generate_whole(self, request: GenerationRequest) -> AsyncGenerator[GenerationEvent, None]:
        """One unstreamed completion: the same events, in one piece."""
        body = self._completion_body(request)
        body["stream"] = False
        del body["stream_options"]
        vllm_id, headers = self._request_id(request)
        try:
            response = await self._http.post(f"{self.base_url}/v1/completions", json=body, headers=headers)
        except httpx.TransportError as exc:
            raise self._transport_error(exc) from exc
        except asyncio.CancelledError:
            self._abort_later(vllm_id)
            raise
        if response.status_code >= 400:
            raise error_from_response(response)
        try:
            payload = response.json()
            choice = payload["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise EngineError(f"vLLM sent an unreadable completion: {response.text[:200]!r}") from exc
        delta = token_delta(choice, request.params.top_logprobs)
        if delta is not None:
            yield delta
        finish = FINISH_REASONS.get(choice.get("finish_reason") or "", "stop")
        stop_reason = choice.get("stop_reason")
        if finish == "stop" and stop_reason is None and delta is not None:
            stop_reason = delta.token_ids[-1]
        usage = payload.get("usage") or {}
        yield GenerationEnd(
            finish_reason=finish,
            stop_reason=stop_reason,
            prompt_tokens=int(usage.get("prompt_tokens", len(request.prompt_ids))),
            timings=read_timings(payload.get("metrics")),
        )

    def _completion_body(self, request: GenerationRequest) -> dict[str, Any]:
        return completion_body(
            request, model=self.model, max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids
        )

    # ---- adapters ----------------------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str) -> None:
        await self._on_every_replica(self._load_on, name, str(path))

    async def _load_on(self, url: str, name: str, path: str) -> None:
        response = await self._request(
            "POST", "/v1/load_lora_adapter", base=url, json={"lora_name": name, "lora_path": path}
        )
        if response.status_code < 400:
            return
        error = error_from_response(response)
        # Loading the same name from the same folder again (say, after a gateway restart) is a no-op; a new
        # folder under an old name is refused, because vLLM's prefix cache would mix the two weights.
        if (
            isinstance(error, BadRequest)
            and "already been loaded" in error.message
            and await self._adapter_path(name, url) == path
        ):
            return
        raise error

    async def unload_adapter(self, name: str) -> None:
        await self._on_every_replica(self._unload_on, name)

    async def _unload_on(self, url: str, name: str) -> None:
        response = await self._request("POST", "/v1/unload_lora_adapter", base=url, json={"lora_name": name})
        if response.status_code >= 400:
            error = error_from_response(response)
            # A replica that restarted since the load no longer has it, which is what unloading asks for.
            if len(self.replicas) > 1 and isinstance(error, NotFound):
                return
            raise error

    async def adapters(self) -> list[str]:
        """The adapters loaded on every reachable replica (on the one server)."""
        answers = await asyncio.gather(*(self._model_cards(url) for url in self.replicas), return_exceptions=True)
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

    async def _on_every_replica(self, step: Callable[..., Awaitable[None]], *args: str) -> None:
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

    # ---- helpers -----------------------------------------------------------------------------------------

    @property
    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            raise EngineUnavailable("the vLLM engine is not started")
        return self._client

    async def _request(self, method: str, path: str, base: str | None = None, **kwargs: Any) -> httpx.Response:
        base = base or self.base_url
        try:
            return await self._http.request(method, f"{base}{path}", headers=self._headers, **kwargs)
        except httpx.TimeoutException as exc:
            if isinstance(exc, httpx.ConnectTimeout):
                raise EngineUnavailable(f"vLLM at {base} did not accept a connection") from exc
            raise EngineTimeout(f"vLLM at {base} timed out on {path}") from exc
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"vLLM at {base} is unreachable: {exc!r}") from exc

    async def _model_cards(self, base: str | None = None) -> list[dict[str, Any]]:
        response = await self._request("GET", "/v1/models", base=base)
        if response.status_code >= 400:
            raise error_from_response(response)
        cards: list[dict[str, Any]] = response.json().get("data", [])
        return cards

    async def _served_max_model_len(self) -> int:
        for card in await self._model_cards():
            if card.get("id") == self.model and card.get("max_model_len"):
                return int(card["max_model_len"])
        raise NotFound(f"vLLM at {self.base_url} serves no base model named {self.model!r}", param="model")

    async def _adapter_path(self, name: str, base: str | None = None) -> str | None:
        for card in await self._model_cards(base):
            if card.get("id") == name and card.get("parent"):
                root: str | None = card.get("root")
                return root
        return None
