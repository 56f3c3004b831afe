"""How a protocol's serving class becomes routes: one POST handler, at the API's own path and under a rollout's
base URL (``/rollouts/{rollout_id}/…``), authenticated as a client and documented with its response model."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from gateway.deps import ClientAuth, RolloutScope
from gateway.protocols.common.serving import ProtocolServing
from gateway.protocols.common.wire import ErrorResponse
from gateway.state import State

ROLLOUT_PREFIX = "/rollouts/{rollout_id}"
REF_TEMPLATE = "#/components/schemas/{model}"
# An operation key carrying schemas to move into the document's components (see gateway/api/docs.py).
HOISTED = "x-clawgate-schemas"
# The statuses a serving route answers with an error body (see gateway/errors.py).
ERROR_STATUSES = (400, 401, 403, 404, 429, 502, 503, 504)


def documented_responses(error_model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI responses of a serving route besides its JSON body: the event stream, and the errors."""
    stream = {"content": {"text/event-stream": {"schema": {"type": "string"}}}}
    return {200: stream, **{status: {"model": error_model} for status in ERROR_STATUSES}}


def add_serving_route(
    router: APIRouter,
    path: str,
    serving: type[ProtocolServing[Any]],
    response_model: type[BaseModel],
    *,
    name: str,
    error_model: type[BaseModel] = ErrorResponse,
) -> None:
    """The body is ``response_model``, or with ``stream: true`` Server-Sent Events; errors are ``error_model``."""

    async def route(request: Request, state: State, rollout: RolloutScope) -> Response:
        return await serving(state).handle(request, rollout)

    # The body is read and validated by the serving class itself (so unknown fields are logged, not refused), so
    # FastAPI cannot see the request model: it is documented here, its nested models hoisted into the components by
    # gateway/api/docs.py.
    # Component names carry the protocol (``openai.ToolDef`` and ``anthropic.ToolDef`` are different models).
    prefix = serving.request_model.__module__.rsplit(".", 1)[-1] + "."
    template = REF_TEMPLATE.replace("{model}", prefix + "{model}")
    schema = serving.request_model.model_json_schema(ref_template=template)
    defs = {prefix + name: value for name, value in schema.pop("$defs", {}).items()}
    model = prefix + serving.request_model.__name__
    ref = {"$ref": REF_TEMPLATE.format(model=model)}
    request_body = {"required": True, "content": {"application/json": {"schema": ref}}}
    extra = {"requestBody": request_body, HOISTED: {model: schema, **defs}}

    route.__name__ = name
    for prefix in ("", ROLLOUT_PREFIX):
        router.add_api_route(
            prefix + path,
            route,
            methods=["POST"],
            dependencies=[ClientAuth],
            response_model=response_model,
            responses=documented_responses(error_model),
            name=name if not prefix else f"{name}_in_rollout",
            openapi_extra=extra,
        )
