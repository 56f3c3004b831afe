"""Assembles the gateway: the FastAPI app, its lifespan (engine, tokenizer, capture writer) and error shape.

``build_app(settings)`` is the only place where serving objects are created; they live on
``app.state.clawgate`` (an ``AppState``). Tests pass their own engine to exercise edge cases.

Any number of gateway processes may share one database (and one engine): what a call needs to find its
conversation is in the database with this process's memory as a cache (``continuity.py``, ``response_store.py``),
and what runs per process is made safe to run N times: each process has its own spool directory (``spool.claim_dir``),
every process's idle-close loop closes through a locking update and learns the closes of the others, each reports
the adapters it uses so no other unloads them (``adapter_leases``), and each serves its own /metrics (scrape every
process).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import IO, Any

import sqlalchemy as sa
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import __version__
from gateway.api import admin as admin_api
from gateway.api import docs as docs_api
from gateway.api import keys as keys_api
from gateway.api import policy as policy_api
from gateway.api import rollouts as rollouts_api
from gateway.api import system as system_api
from gateway.core.counterfactuals import Counterfactuals
from gateway.core.render import Renderer
from gateway.core.response_store import ResponseStore
from gateway.core.service import ChatService
from gateway.core.sessions import SessionIndex
from gateway.credentials.tokens import AnswerScanner, RecordScanner
from gateway.dashboard import routes as console_routes
from gateway.end_of_turn import end_token_ids, generation_eos_ids
from gateway.engines.base import Engine
from gateway.errors import APIError, BadRequest, EngineUnavailable, NotFound
from gateway.faults import describe
from gateway.limits import BodyLimit
from gateway.logs import setup_logging
from gateway.loops import start_loops
from gateway.metrics import Metrics
from gateway.model_files import load_tokenizer
from gateway.policy import PolicyFollower
from gateway.promotion.promoter import Promoter
from gateway.protocols.anthropic import routes as anthropic_routes
from gateway.protocols.openai import routes as openai_routes
from gateway.protocols.responses import routes as responses_routes
from gateway.settings import Settings
from gateway.state import AppState
from gateway.store import adapter_leases, db, promotion, spool
from gateway.store.errors import InvalidInput, RecordNotFound, is_transient
from gateway.store.writer import CallWriter
from gateway.tenants.cache import KeyCache
from gateway.tenants.quotas import QuotaBook

log = logging.getLogger("clawgate")


def make_engine(settings: Settings, tokenizer: Any) -> Engine:
    if settings.engine == "local":
        from gateway.engines.local import LocalEngine

        if settings.vllm_stream_interval > 1:
            log.warning("CLAWGATE_VLLM_STREAM_INTERVAL applies to --engine vllm: the local engine streams every token")
        return LocalEngine(settings.model, dtype=settings.local_dtype)
    from gateway.engines.vllm import VLLMEngine

    end_ids = end_token_ids(tokenizer, generation_eos_ids(settings.model))
    return VLLMEngine(
        settings.vllm_url,
        model=settings.vllm_model or settings.model,
        timeout=settings.vllm_timeout,
        eos_token_ids=sorted(end_ids),
        replicas=settings.vllm_replicas,
        stream_interval=settings.vllm_stream_interval,
        # Guarded promotion serves the incumbent and a candidate side by side: vLLM must batch both adapters.
        min_loras=2 if settings.policy_follow and settings.promotion_mode == "guarded" else 1,
    )


# Query parameters that carry a password (libpq reads both from a URL's query too).
SECRET_QUERY_KEYS = ("password", "sslpassword")


def redact_url(url: str) -> str:
    """The URL without its password (in its user part or its query), for logs and error messages."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
        hidden = {key: "***" for key in parsed.query if key.lower() in SECRET_QUERY_KEYS}
        return (parsed.update_query_dict(hidden) if hidden else parsed).render_as_string(hide_password=True)
    except Exception:
        return "<unparsable url>"


def app_from_environment() -> FastAPI:
    """The app of one worker process of `clawgate serve --workers N` (uvicorn calls it in each worker)."""
    settings = Settings()
    setup_logging(settings.log_level)
    return build_app(settings)


def check_database(settings: Settings) -> None:
    """Refuse to start on a database whose schema is not at this gateway's head revision."""
    current = db.current_revision(settings.database_url)
    head = db.head_revision()
    if current != head:
        raise RuntimeError(
            f"database schema is at {current or 'nothing'}, expected {head}: run `clawgate db upgrade` "
            f"(database {redact_url(settings.database_url)})"
        )


def warn_if_open(settings: Settings) -> None:
    if not settings.api_keys:
        log.warning(
            "CLAWGATE_API_KEYS is not set: the API is open to anyone who can reach %s:%s",
            settings.host,
            settings.port,
        )


async def start_writer(settings: Settings, database: sa.Engine, spool_dir: Path, tok: Any) -> CallWriter:
    """The capture writer, started (it spools to ``spool_dir`` while the database is down); it looks for credentials
    in each call with ``tok`` unless ``secrets`` is "off"."""
    writer = CallWriter(
        database,
        spool_dir=spool_dir,
        batch_size=settings.capture_batch_size,
        flush_interval=settings.capture_flush_interval,
        max_queue=settings.capture_max_queue,
        synchronous_commit=settings.capture_synchronous_commit,
        scanner=None if settings.secrets == "off" else RecordScanner(tok, drop=settings.secrets == "drop"),
    )
    await writer.start()
    return writer


def serving_state(
    settings: Settings, eng: Engine, tok: Any, database: sa.Engine, writer: CallWriter, metrics: Metrics
) -> AppState:
    """The chat service and everything routes need, around a started engine and writer."""
    renderer = Renderer(tok)
    cache_idle = min(settings.session_cache_idle, settings.session_idle_timeout)
    index = SessionIndex(max_tokens=settings.session_index_tokens, max_idle_s=cache_idle)
    service = ChatService(
        engine=eng,
        tokenizer=tok,
        renderer=renderer,
        index=index,
        writer=writer,
        metrics=metrics,
        max_tokens_cap=settings.max_tokens,
        max_in_flight=settings.max_concurrent_calls,
        parser=settings.parser,
        db=database,
        durable_capture=settings.capture_durable,
        tool_error_reward=settings.tool_error_reward,
        session_idle_timeout=settings.session_idle_timeout,
    )
    if settings.counterfactuals:
        service.counterfactuals = Counterfactuals(
            engine=eng,
            writer=writer,
            db=database,
            metrics=metrics,
            k=settings.counterfactuals,
            share=settings.counterfactual_share,
            max_pending=settings.counterfactual_max_pending,
            priority=settings.counterfactual_priority,
            live=lambda: service.in_flight,
            adapters_in_use=service.adapter_in_flight,
            parse=service.parse_answer,
            scan=None if settings.secrets == "off" else AnswerScanner(tok, drop=settings.secrets == "drop"),
        )
    names = {settings.model_name, *(a for a in settings.model_aliases if a != "*")}
    return AppState(
        settings=settings,
        engine=eng,
        tokenizer=tok,
        renderer=renderer,
        index=index,
        writer=writer,
        metrics=metrics,
        service=service,
        model_names=frozenset(names),
        accept_any_model="*" in settings.model_aliases,
        started_at=time.time(),
        db=database,
        responses=ResponseStore(
            max_responses=settings.responses_store_size,
            db=database,
            # Without durable capture another process commits a response within its flush interval.
            miss_wait_s=0.0 if settings.capture_durable else 1.0,
        ),
        keys=KeyCache(database, settings.key_secret_bytes, ttl=settings.key_cache_ttl),
        quotas=QuotaBook(database, interval=settings.quota_sync_interval),
    )


async def start_follower(state: AppState, gateway_id: str) -> asyncio.Task[None]:
    """Follow the trainer's published versions (``state.policy``): synced once now, then its loop, running."""
    settings, database, metrics = state.settings, state.db, state.metrics
    promoter = Promoter(settings, database, gateway_id, metrics)
    try:
        before = await asyncio.to_thread(promotion.set_mode, database, settings.promotion_mode)
        if before is not None and before != settings.promotion_mode:
            log.warning(
                "promotion was %s on this database and is now %s: every gateway on one database should use "
                "the same CLAWGATE_PROMOTION",
                before,
                settings.promotion_mode,
            )
    except Exception as exc:  # the database is down: the follower keeps trying and says so
        log.warning("could not record the promotion mode: %s", describe(exc))
    follower = PolicyFollower(
        settings,
        state.engine,
        state.service,
        database,
        metrics,
        probe_ids=state.tokenizer.encode("Hello"),
        gateway_id=gateway_id,
        promoter=promoter,
    )
    state.policy = follower
    try:  # serve the newest published version from the first call on
        await follower.sync()
    except Exception as exc:  # the follower keeps trying (and says when it recovers)
        follower.fault.failed(f"at start-up: {describe(exc)}", exc)
    return asyncio.create_task(follower.run())


async def shut_down(state: AppState, tasks: list[asyncio.Task[None]], gateway_id: str, spool_lock: IO[bytes]) -> None:
    """Stop the loops, then the engine, then the writer (it drains), release the adapter lease and the database."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with suppress(asyncio.CancelledError):
            await task
    if state.service.counterfactuals is not None:
        await state.service.counterfactuals.close()
    await state.engine.close()
    await state.writer.close(timeout=30.0)
    with suppress(Exception):  # best effort (the database may be down): the lease expires anyway
        await asyncio.wait_for(asyncio.to_thread(adapter_leases.forget, state.db, gateway_id), 2.0)
    state.db.dispose()
    spool_lock.close()


def build_app(settings: Settings, *, engine: Engine | None = None, tokenizer: Any = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tok = tokenizer if tokenizer is not None else load_tokenizer(settings.model)
        eng = engine if engine is not None else make_engine(settings, tok)
        check_database(settings)
        warn_if_open(settings)
        metrics = Metrics()
        database = db.connect(settings.database_url)
        spool_dir, spool_lock = spool.claim_dir(settings.data_dir / "spool")
        writer = await start_writer(settings, database, spool_dir, tok)
        await eng.start()
        state = app.state.clawgate = serving_state(settings, eng, tok, database, writer, metrics)
        log.info(
            "clawgate %s serving %s (engine %s, context %d tokens)",
            __version__,
            settings.model_name,
            eng.name,
            eng.max_model_len,
        )
        gateway_id = adapter_leases.new_gateway_id()
        tasks = start_loops(state, gateway_id)
        if settings.policy_follow:
            tasks.append(await start_follower(state, gateway_id))
        try:
            yield
        finally:
            await shut_down(state, tasks, gateway_id, spool_lock)

    # The schema and documentation pages are served by gateway/api/docs.py (admin-only in production).
    app = FastAPI(
        title="clawgate", version=__version__, lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None
    )
    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(rollouts_api.router)
    app.include_router(system_api.router)
    app.include_router(policy_api.router)
    app.include_router(admin_api.router)
    app.include_router(keys_api.router)
    app.include_router(console_routes.router)
    app.include_router(docs_api.router)
    app.openapi = lambda: docs_api.openapi_schema(app)  # type: ignore[method-assign]
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes, anthropic_path=is_anthropic_path)
    return app


def install_error_handlers(app: FastAPI) -> None:
    def respond(request: Request, exc: APIError) -> JSONResponse:
        with suppress(AttributeError):
            app.state.clawgate.metrics.errors.labels(exc.type).inc()
        # Each protocol answers errors in its own shape: the Anthropic SDK cannot read OpenAI's, and vice versa.
        body = exc.to_anthropic() if is_anthropic_path(request.url.path) else exc.to_dict()
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc)

    async def store_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, (RecordNotFound, InvalidInput))
        return respond(request, from_store(exc))

    app.add_exception_handler(RecordNotFound, store_error)
    app.add_exception_handler(InvalidInput, store_error)

    @app.exception_handler(ValidationError)
    async def model_validation_error(request: Request, exc: ValidationError) -> JSONResponse:
        return respond(request, _validation_to_bad_request(exc.errors()))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, _validation_to_bad_request(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return respond(request, _from_http(request, exc))

    @app.exception_handler(sa_exc.DBAPIError)
    async def database_error(request: Request, exc: sa_exc.DBAPIError) -> JSONResponse:
        if is_transient(exc):  # the database is down, locked or restarting: worth retrying, not a server bug
            log.warning("%s %s: database unavailable: %s", request.method, request.url.path, describe(exc))
            return respond(
                request,
                EngineUnavailable(
                    "the database is unavailable: try again shortly", code="store_unavailable", retry_after=5
                ),
            )
        log.exception("database error on %s %s", request.method, request.url.path)
        return respond(request, APIError("internal server error"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return respond(request, APIError("internal server error"))


def _from_http(request: Request, exc: StarletteHTTPException) -> APIError:
    """Starlette's own refusals (no such route, method not allowed) in the gateway's error shape."""
    from gateway import errors

    cls = {
        400: errors.BadRequest,
        401: errors.Unauthorized,
        403: errors.Forbidden,
        404: errors.NotFound,
        429: errors.RateLimited,
    }.get(exc.status_code)
    if cls is None:
        err = APIError(str(exc.detail))
        err.status_code = exc.status_code
        return err
    message = f"{request.method} {request.url.path} not found" if exc.status_code == 404 else str(exc.detail)
    return cls(message)


def from_store(exc: RecordNotFound | InvalidInput) -> APIError:
    """The store's own errors (it knows nothing about HTTP) as the API answers them: a record named that does not
    exist is a 404, an argument the store refuses a 400, each with the store's message and param."""
    error = NotFound if isinstance(exc, RecordNotFound) else BadRequest
    return error(exc.message, param=exc.param)


def is_anthropic_path(path: str) -> bool:
    return path.endswith(("/v1/messages", "/v1/messages/count_tokens"))


def _validation_to_bad_request(errors: Any) -> BadRequest:
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    return BadRequest(f"{param or 'request'}: {first.get('msg', 'invalid request')}", param=param)
