"""vLLM engine: an aiohttp client of a vLLM (0.32) OpenAI-compatible server, token ids in and token ids out.

Every generation is one streamed ``POST /v1/completions`` whose ``prompt`` is the token id list the gateway
rendered; the request body, the reading of vLLM's answers and the mapping of its errors onto ``gateway.errors``
are pure functions in ``gateway.engines.vllm_wire`` (with the vLLM behaviour they rely on), so this module holds
the HTTP client, the engine's lifecycle, adapters and aborts.

The client is aiohttp's own, not httpx: this is the gateway's hot path, and against a scripted vLLM
(``bench/scripted_vllm.py``) aiohttp's client spends about half the CPU per completion that httpx's does.

Closing the stream closes the connection, and vLLM aborts a request whose client disconnected, but its API
server can notice that thousands of tokens late. So a generation that ends before its finish (the consumer closed
the stream, the task was cancelled) is also aborted explicitly: each request carries ``X-Request-Id`` (vLLM names
it ``cmpl-<id>-0``) and is named in ``POST /inference/v1/abort_requests``, which vLLM serves when started with
``--enable-scale-out`` (``VLLMServer`` and the compose file pass it). Without that endpoint (403/404) the client
stops trying and relies on the disconnect alone.

Several replicas (``replicas``: their base URLs) sit behind a router at ``base_url`` (``vllm-router``, see
``gateway/engines/vllm_router.py``). Generations go through the router with the rollout id in ``X-Session-ID``,
which its ``consistent_hash`` policy hashes first, so a rollout's calls reach the replica that holds its prefix
cache. What every replica must do goes to each of them directly: adapter loads and unloads (a version is served
only after every reachable replica loaded it), the adapter list (the versions loaded on every reachable replica,
so a replica that came back without the current version makes the policy follower load it again), and aborts
(the router does not say which replica runs a request; an abort naming an id a replica does not know is a no-op
there). A replica that is down is skipped; when none answers the engine is unavailable.

A gateway that serves several adapters side by side (guarded promotion: the incumbent and a candidate's canary)
needs a server that batches them together: ``min_loras`` > 1 makes ``start`` read each replica's ``--max-loras``
(``vllm_wire.max_loras_of``; a server that has not run a step yet is given a one-token generation first, after
which it reports it) and refuse one that is lower with ``TooFewLoras``. One that does not report it is logged and
let through.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncGenerator, Iterable
from typing import Any

import aiohttp
import orjson

from gateway.engines.base import GenerationEvent, GenerationRequest
from gateway.engines.vllm_replicas import Replicas
from gateway.engines.vllm_wire import (
    StreamReader,
    completion_body,
    error_from_response,
    transport_error,
)
from gateway.errors import APIError, EngineError, EngineUnavailable, NotFound

logger = logging.getLogger(__name__)
# The header vllm-router's consistent_hash policy reads first (before X-User-ID, X-Request-ID, body fields).
SESSION_HEADER = "X-Session-ID"
# An idle connection is dropped before vLLM's uvicorn drops it (its keep-alive is 5 s): a request sent on a
# connection the server is closing at that moment fails, and a POST is never re-sent.
KEEPALIVE_S = 4.0
# Health checks and aborts wait this long at most.
CONTROL_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
JSON_HEADERS = {"Content-Type": "application/json"}


class VLLMEngine:
    """``Engine`` backed by a vLLM server at ``base_url`` (without the ``/v1`` suffix) serving ``model``.

    ``replicas`` are the base URLs of the vLLM servers behind a router at ``base_url`` (see the module
    docstring); empty for one server. ``eos_token_ids`` are the ids that end a turn for this model (the
    tokenizer's EOS and, for chat models, the generation config's extra ones). They are sent as
    ``stop_token_ids`` on every request, so generation stops on them whether or not the server read the model's
    generation config. ``timeout`` bounds the wait for each piece of an answer (a long generation is fine, a
    stalled server is not); ``start`` opens a connection pool sized for ``max_connections`` concurrent streams.
    ``stream_interval`` > 1 asks vLLM to stream the first token at once and then that many tokens per chunk.
    ``min_loras``: adapters served side by side; ``start`` refuses a server whose ``--max-loras`` is lower (above 1
    only: the check may cost a one-token generation), and ``max_loras`` then holds what each replica reported.
    """

    name = "vllm"

    def __init__(
        self,
        base_url: str,
        *,
        model: str,
        timeout: float = 600.0,
        max_model_len: int | None = None,
        api_key: str | None = None,
        eos_token_ids: Iterable[int] = (),
        max_connections: int = 512,
        connect_timeout: float = 5.0,
        replicas: Iterable[str] = (),
        stream_interval: int = 1,
        min_loras: int = 1,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # Where adapter loads, the adapter list and aborts go: each replica, or the one server.
        self.replicas = [url.rstrip("/") for url in replicas] or [self.base_url]
        self.model = model
        self.max_model_len = max_model_len or 0
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.stream_interval = stream_interval
        self.min_loras = min_loras
        self.max_loras: dict[str, int | None] = {}  # replica -> its --max-loras (None: not reported), once checked
        self._requested_max_model_len = max_model_len
        self._session: aiohttp.ClientSession | None = None
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._max_connections = max_connections
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # None until an abort was tried: whether the server has the abort endpoint (see the module docstring).
        self.abort_supported: bool | None = None
        self.aborts_sent = 0
        self._aborts: set[asyncio.Task[None]] = set()
        self._replicas = Replicas(self.replicas, self._request, model)

    # ---- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=KEEPALIVE_S),
                # sock_read bounds the gap between two pieces of an answer; a refused or hanging connect fails
                # fast; waiting for a free connection of the pool counts against the timeout as a whole.
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=self._timeout, sock_connect=self._connect_timeout, sock_read=self._timeout
                ),
                # The ids are the answer: vLLM's bodies are never compressed, and nothing reads a cookie.
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        try:
            if self._requested_max_model_len is None:
                self.max_model_len = await self._served_max_model_len()
            if self.min_loras > 1:
                self.max_loras = await self._replicas.check_max_loras(self.min_loras)
        except BaseException:  # nothing will close an engine that did not start
            await self.close()
            raise

    async def close(self) -> None:
        if self._aborts:
            await asyncio.wait(set(self._aborts), timeout=5.0)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def lora_slots(self) -> dict[str, int | None]:
        """Each replica's ``--max-loras`` (None: not reported), read once (the policy follower asks before it serves
        another tenant's own policy beside the others)."""
        if not self.max_loras:
            self.max_loras = await self._replicas.check_max_loras(1)
        return self.max_loras

    async def health(self) -> bool:
        if self._session is None:
            return False
        try:
            async with self._session.get(
                f"{self.base_url}/health", headers=self._headers, timeout=CONTROL_TIMEOUT
            ) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    # ---- generation --------------------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationEvent, None]:
        if not request.stream:
            async for event in self._generate_whole(request):
                yield event
            return
        data = self._completion_body(request)
        stream = StreamReader(request.params.top_logprobs, len(request.prompt_ids))
        vllm_id, headers = self._request_id(request)
        running = False  # vLLM accepted the request and has not reported its end
        try:
            async with self._http.post(f"{self.base_url}/v1/completions", data=data, headers=headers) as response:
                if response.status >= 400:
                    raise error_from_response(response.status, await response.read(), response.url.path)
                running = True
                # Read to the end of the body (past [DONE]): a response closed early also closes its connection,
                # and the next request would pay for a new one.
                async for piece in response.content.iter_any():
                    arrived, failure = stream.feed(piece)
                    running = stream.finish is None
                    if arrived is not None:
                        yield arrived
                    if failure is not None:
                        raise failure
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._transport_error(exc) from exc
        finally:
            if running:  # closed, cancelled or failed before vLLM finished: it may still be generating
                self._abort_later(vllm_id)
        yield stream.end()

    def _request_id(self, request: GenerationRequest) -> tuple[str, dict[str, str]]:
        """vLLM's id for this request (``cmpl-<X-Request-Id>-<prompt index>``) and the headers that set it.

        A random suffix keeps it unique when one gateway id is generated twice (a retry, several choices).
        """
        sent = f"{request.request_id}-{secrets.token_hex(4)}"
        headers = {**self._headers, **JSON_HEADERS, "X-Request-Id": sent}
        if request.session_id is not None:
            # The router's first hash key; without it, it would hash X-Request-Id and scatter a rollout.
            headers[SESSION_HEADER] = request.session_id
        return f"cmpl-{sent}-0", headers

    def _abort_later(self, vllm_id: str) -> None:
        """Ask vLLM to stop ``vllm_id`` without making the caller wait (it may be closing or cancelled)."""
        if self.abort_supported is False or self._session is None:
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
        status, text = next((r for r in responses if r[0] < 400), responses[0])
        if status in (403, 404, 405):
            if self.abort_supported is not False:
                logger.info(
                    "vLLM at %s has no abort endpoint (start it with --enable-scale-out); a closed stream "
                    "then relies on vLLM noticing the disconnect",
                    self.base_url,
                )
            self.abort_supported = False
        elif status < 400:
            self.abort_supported = True
            self.aborts_sent += 1
        else:
            logger.debug("vLLM refused to abort %s: %s %s", vllm_id, status, text[:200])

    async def _abort_on(self, url: str, vllm_id: str) -> tuple[int, str] | None:
        try:
            status, body = await self._request(
                "POST", "/inference/v1/abort_requests", base=url, body={"request_ids": [vllm_id]}, brief=True
            )
        except (APIError, RuntimeError) as exc:  # RuntimeError: the session was closed
            logger.debug("could not abort vLLM request %s at %s: %r", vllm_id, url, exc)
            return None
        return status, body.decode(errors="replace")

    def _transport_error(self, exc: aiohttp.ClientError | TimeoutError) -> APIError:
        return transport_error(self.base_url, exc)

    async def _generate_whole(self, request: GenerationRequest) -> AsyncGenerator[GenerationEvent, None]:
        """One unstreamed completion: the same events, in one piece."""
        data = self._completion_body(request, stream=False)
        vllm_id, headers = self._request_id(request)
        try:
            async with self._http.post(f"{self.base_url}/v1/completions", data=data, headers=headers) as response:
                status, body, path = response.status, await response.read(), response.url.path
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._transport_error(exc) from exc
        except asyncio.CancelledError:
            self._abort_later(vllm_id)
            raise
        if status >= 400:
            raise error_from_response(status, body, path)
        answer = StreamReader(request.params.top_logprobs, len(request.prompt_ids))
        try:
            payload = orjson.loads(body)
            if not payload["choices"]:
                raise ValueError("no choice")
            delta = answer.read(payload)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise EngineError(f"vLLM sent an unreadable completion: {body[:200]!r}") from exc
        if delta is not None:
            yield delta
        yield answer.end()

    def _completion_body(self, request: GenerationRequest, *, stream: bool = True) -> bytes:
        body = completion_body(
            request, model=self.model, max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids
        )
        if not stream:
            body["stream"] = False
            del body["stream_options"]
        elif self.stream_interval > 1:
            body["stream_interval"] = self.stream_interval
        return orjson.dumps(body)

    # ---- adapters (on every replica: gateway/engines/vllm_replicas.py) ------------------------------------

    async def load_adapter(self, name: str, path: str) -> None:
        await self._replicas.load_adapter(name, path)

    async def unload_adapter(self, name: str) -> None:
        await self._replicas.unload_adapter(name)

    async def adapters(self) -> list[str]:
        """The adapters loaded on every reachable replica (on the one server)."""
        return await self._replicas.adapters()

    async def verify_adapter(self, name: str, prompt_ids: list[int]) -> None:
        await self._replicas.verify_adapter(name, prompt_ids)

    # ---- helpers -----------------------------------------------------------------------------------------

    @property
    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise EngineUnavailable("the vLLM engine is not started")
        return self._session

    async def _request(
        self, method: str, path: str, base: str | None = None, body: Any = None, *, brief: bool = False
    ) -> tuple[int, bytes]:
        """One control-plane request: its status and body. A ``brief`` one (an abort) waits 5 s at most."""
        base = base or self.base_url
        kwargs: dict[str, Any] = {"headers": self._headers}
        if body is not None:
            kwargs["json"] = body
        if brief:
            kwargs["timeout"] = CONTROL_TIMEOUT
        try:
            async with self._http.request(method, f"{base}{path}", **kwargs) as response:
                return response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise transport_error(base, exc, path) from exc

    async def _served_max_model_len(self) -> int:
        for card in await self._replicas.model_cards(self.base_url):
            if card.get("id") == self.model and card.get("max_model_len"):
                return int(card["max_model_len"])
        raise NotFound(f"vLLM at {self.base_url} serves no base model named {self.model!r}", param="model")
