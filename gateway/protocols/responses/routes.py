"""The OpenAI Responses API route, `POST /v1/responses`; ``gateway.protocols.responses.serving`` does the work."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.protocols.common.routes import add_serving_route
from gateway.protocols.responses.serving import ResponsesServing
from gateway.protocols.responses.wire import ResponseObject

router = APIRouter()
add_serving_route(router, "/v1/responses", ResponsesServing, ResponseObject, name="create_response")
